"""CPU tests for nvfp4lab.capabilities (nvfp4lab.probe()): the compute-capability rules (TE 2.20's, with TE's strings),
the mode and recommendation logic, probe() on this machine and on faked machines, the CLI."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import types
import warnings

import pytest

P = importlib.import_module("nvfp4lab.capabilities")

NVFP4_REASON = "Device compute capability 10.0 or higher required for NVFP4 execution."
FP8_REASON = "Device compute capability 8.9 or higher required for FP8 execution."
BLOCK_REASON = "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."
MXFP8_REASON = "Device compute capability 10.0 or higher required for MXFP8 execution."
MXFP8_SM120_REASON = "MXFP8 (for all gemm layouts) is not supported on 12.0+ architectures yet."


def native(support):
    return {k: v.native for k, v in support.items()}


# --------------------------------------------------------------------------- format_support


# (cc, cuda) -> expected native flags, in FORMAT_KEYS order: bf16, fp8-delayed, fp8-current, fp8-block, mxfp8, nvfp4
CASES = {
    "ampere": ((8, 0), "12.8", (True, False, False, False, False, False)),
    "ada": ((8, 9), "12.8", (True, True, True, False, False, False)),
    "hopper-cuda12.8": ((9, 0), "12.8", (True, True, True, False, False, False)),
    "hopper-cuda13.0": ((9, 0), "13.0", (True, True, True, True, False, False)),
    "blackwell-cuda12.8": ((10, 0), "12.8", (True, True, True, False, True, True)),
    "blackwell-cuda13.0": ((10, 0), "13.0", (True, True, True, True, True, True)),
    "sm103": ((10, 3), "12.9", (True, True, True, True, True, True)),
    "sm120": ((12, 0), "13.0", (True, True, True, True, False, True)),
    "no-gpu": (None, None, (False,) * 6),
}


@pytest.mark.parametrize("case", list(CASES))
def test_format_support_native_flags(case):
    cc, cuda, expected = CASES[case]
    support = P.format_support(cc, cuda)
    assert list(support) == list(P.FORMAT_KEYS)
    assert tuple(native(support).values()) == expected
    for f in support.values():
        assert (f.reason == "") == f.native, f
        assert f.source == P.SOURCE_RULES


def test_format_support_exact_te_strings_below_blackwell():
    for cc in [(8, 0), (8, 6), (8, 9), (9, 0)]:
        s = P.format_support(cc, "13.0")
        assert s["nvfp4"].reason == NVFP4_REASON
        assert s["mxfp8"].reason == MXFP8_REASON
    amp = P.format_support((8, 0), "12.8")
    assert amp["fp8-delayed"].reason == FP8_REASON
    assert amp["fp8-current"].reason == FP8_REASON
    assert amp["fp8-block"].reason == BLOCK_REASON
    assert P.format_support((9, 0), "12.8")["fp8-block"].reason == BLOCK_REASON
    assert P.format_support((12, 0), "13.0")["mxfp8"].reason == MXFP8_SM120_REASON
    assert P.format_support((7, 5), "12.8")["bf16"].reason == P.REASON_BF16_CC


def test_format_support_ada_needs_cuda_12_1():
    s = P.format_support((8, 9), "12.0")
    assert not s["fp8-current"].native
    assert s["fp8-current"].reason == "Cuda version 12.1 or higher required for FP8 execution on Ada."
    # Hopper does not depend on the CUDA version for per-tensor FP8 (TE checks only the SM).
    assert P.format_support((9, 0), "12.0")["fp8-current"].native


def test_format_support_no_gpu_reasons():
    s = P.format_support(None, None)
    for f in s.values():
        assert not f.native
        assert f.reason.startswith(P.REASON_NO_GPU)
    assert "compute capability 10.0 or higher" in s["nvfp4"].reason


def test_format_support_cuda_version_parsed_as_numbers():
    # "12.10" must not be read as 12.1 (and "13.0.1"/"12.9+local" must parse).
    assert P.format_support((9, 0), "12.10")["fp8-block"].native
    assert P.format_support((9, 0), "12.9.1")["fp8-block"].native
    assert not P.format_support((9, 0), "12.1")["fp8-block"].native
    assert not P.format_support((9, 0), None)["fp8-block"].native
    assert P._parse_version("13.0") == (13, 0)
    assert P._parse_version("12.9+local") == (12, 9)
    assert P._parse_version("") is None


def test_format_support_prefers_te_answers():
    # TE on Ada may refuse FP8 for a reason the rules cannot see (cuBLASLt version).
    te = P.TEInfo(
        version="2.20.2",
        importable=True,
        checks={
            "fp8": (False, "CublasLt version 12.1.3.x or higher required for FP8 execution on Ada."),
            "fp8_block_scaling": (False, BLOCK_REASON),
            "mxfp8": (False, MXFP8_REASON),
            "nvfp4": (False, NVFP4_REASON),
        },
    )
    s = P.format_support((8, 9), "12.8", te)
    assert not s["fp8-delayed"].native and not s["fp8-current"].native
    assert s["fp8-current"].reason.startswith("CublasLt")
    assert s["fp8-current"].source == P.SOURCE_TE
    assert s["bf16"].source == P.SOURCE_RULES  # TE has no BF16 check here
    # A partial answer: missing checks fall back to the rules.
    s2 = P.format_support((10, 0), "13.0", P.TEInfo(importable=True, checks={"nvfp4": (True, "")}))
    assert s2["nvfp4"].source == P.SOURCE_TE and s2["nvfp4"].native
    assert s2["mxfp8"].source == P.SOURCE_RULES and s2["mxfp8"].native
    # Without a GPU TE is never consulted (its checks need a CUDA device).
    s3 = P.format_support(None, None, te)
    assert all(f.source == P.SOURCE_RULES for f in s3.values())


def test_teinfo_is_frozen_hashable_and_validates():
    te = P.TEInfo(version="2.20.2", importable=True, checks={"nvfp4": (False, NVFP4_REASON), "fp8": (True, "")})
    assert te.checks == (("fp8", True, ""), ("nvfp4", False, NVFP4_REASON))
    assert te.check("nvfp4") == (False, NVFP4_REASON)
    assert te.check("mxfp8") is None
    hash(te)
    with pytest.raises(Exception):
        te.version = "x"
    with pytest.raises(ValueError, match="unknown TE check"):
        P.TEInfo(checks={"fp4": (True, "")})
    assert te.to_dict()["checks"]["nvfp4"] == {"available": False, "reason": NVFP4_REASON}


# --------------------------------------------------------------------------- mode, recommendation


def test_choose_mode():
    assert P.choose_mode(True, True, True, "3.6.0")[0] == "native-te"
    mode, why = P.choose_mode(True, True, False, "3.6.0")
    assert mode == "fast-emulation" and "Triton 3.6.0" in why and "10.0" in why
    mode, why = P.choose_mode(True, False, True, "3.6.0")  # Blackwell without TE
    assert mode == "fast-emulation" and P.TE_INSTALL_COMMAND in why
    mode, why = P.choose_mode(True, True, False, None, "ModuleNotFoundError: No module named 'triton'")
    assert mode == "fast-emulation" and "does not import" in why and "triton" in why
    assert P.choose_mode(False, False, False)[0] == "cpu-emulation"
    assert P.choose_mode(False, True, False)[0] == "cpu-emulation"


@pytest.mark.parametrize(
    "cc,cuda,te,must,must_not",
    [
        (None, None, False, ["CPU emulation", "numerics"], ["--backend te"]),
        ((8, 0), "12.8", True, ["BF16", "neither FP8"], ["NVFP4 through TE"]),
        ((9, 0), "13.0", True, ["FP8 through TE", "Float8BlockScaling", "emulated"], ["NVFP4 through TE", "pip install"]),
        ((9, 0), "12.8", False, ["FP8 through TE", "pip install"], ["Float8BlockScaling"]),
        ((8, 9), "12.8", True, ["FP8 through TE"], []),
        ((10, 0), "13.0", True, ["NVFP4 through TE", "memory", "BF16", "MXFP8"], ["RTX 50"]),
        ((12, 0), "13.0", True, ["NVFP4 through TE", "RTX 50", "current scaling"], ["MXFP8"]),
        ((10, 0), "13.0", False, ["NVFP4 through TE", "pip install"], []),
    ],
)
def test_recommendation(cc, cuda, te, must, must_not):
    text = P.recommend(cc, 80 * 2**30 if cc else None, P.format_support(cc, cuda), te)
    for s in must:
        assert s in text, (s, text)
    for s in must_not:
        assert s not in text, (s, text)
    if cc:
        assert "80 GiB" in text


# --------------------------------------------------------------------------- probe() on this machine


def test_probe_on_this_machine_is_quiet_and_serializable():
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        caps = P.probe()
    assert caught == [], [str(w.message) for w in caught]
    assert isinstance(caps, P.Capabilities)
    assert caps.torch_version == torch.__version__
    assert tuple(f.key for f in caps.formats) == P.FORMAT_KEYS
    d = json.loads(json.dumps(caps.to_dict()))
    assert set(d["formats"]) == set(P.FORMAT_KEYS)
    assert d["mode"] in P.MODES
    with pytest.raises(Exception):
        caps.mode = "native-te"  # frozen
    if not torch.cuda.is_available():
        assert caps.mode == "cpu-emulation"
        assert caps.compute_capability is None and caps.total_memory_gib is None
        assert not caps.format("nvfp4").native
    if "transformer_engine" not in sys.modules and importlib.util.find_spec("transformer_engine") is None:
        assert not caps.transformer_engine.importable
        assert P.TE_INSTALL_COMMAND in caps.transformer_engine.error
        assert 'pip install --no-build-isolation "transformer-engine[pytorch]==2.20.2"' in P.format_table(caps)


def test_format_table_lists_every_format():
    caps = P.probe()
    table = P.format_table(caps)
    for f in caps.formats:
        assert f.label in table
    for word in ("device", "torch", "CUDA", "cuDNN", "Triton", "Transformer Engine", "mode:", "recommendation:"):
        assert word in table
    with pytest.raises(KeyError):
        caps.format("fp6")


# --------------------------------------------------------------------------- probe() on faked machines


def _fake_te_pytorch(cc):
    """A stand-in for transformer_engine.pytorch whose checks follow TE 2.20's code."""

    def check(ok, reason):
        def fn(return_reason=False):
            return (ok, "" if ok else reason) if return_reason else ok

        return fn

    m = types.ModuleType("transformer_engine.pytorch")
    m.is_fp8_available = check(cc >= (8, 9), FP8_REASON)
    m.is_fp8_block_scaling_available = check(cc >= (9, 0), BLOCK_REASON)
    m.is_mxfp8_available = check((10, 0) <= cc < (12, 0), MXFP8_REASON)
    m.is_nvfp4_available = check(cc >= (10, 0), NVFP4_REASON)
    return m


def _fake_gpu(cc, name="NVIDIA H100 80GB HBM3", mem=80 * 2**30):
    return lambda: {
        "gpu_available": True,
        "device_name": name,
        "device_count": 1,
        "compute_capability": cc,
        "total_memory_bytes": mem,
    }


def test_probe_fake_hopper_with_te(monkeypatch):
    monkeypatch.setattr(P, "_gpu_info", _fake_gpu((9, 0)))
    monkeypatch.setattr(P, "_cuda_version", lambda: "13.0")
    monkeypatch.setattr(P, "import_transformer_engine", lambda: (_fake_te_pytorch((9, 0)), "2.20.2", None))
    caps = P.probe()
    assert caps.compute_capability == (9, 0) and caps.gpu_available
    assert caps.transformer_engine.importable and caps.transformer_engine.version == "2.20.2"
    assert caps.format("nvfp4").reason == NVFP4_REASON
    assert caps.format("nvfp4").source == P.SOURCE_TE
    assert caps.format("fp8-current").native and caps.format("fp8-block").native
    assert caps.mode == "fast-emulation"
    assert "FP8 through TE" in caps.recommendation
    table = P.format_table(caps)
    assert "SM 9.0" in table and "80.0 GiB" in table and "2.20.2" in table


def test_probe_fake_blackwell_with_te_is_native(monkeypatch):
    monkeypatch.setattr(P, "_gpu_info", _fake_gpu((10, 0), "NVIDIA B200", 180 * 2**30))
    monkeypatch.setattr(P, "_cuda_version", lambda: "13.0")
    monkeypatch.setattr(P, "import_transformer_engine", lambda: (_fake_te_pytorch((10, 0)), "2.20.2", None))
    caps = P.probe()
    assert caps.mode == "native-te"
    assert caps.format("nvfp4").native and caps.format("mxfp8").native
    assert "NVFP4 through TE" in caps.recommendation


def test_probe_te_checks_that_raise_become_reasons(monkeypatch):
    te = _fake_te_pytorch((9, 0))

    def boom(return_reason=False):
        raise RuntimeError("CUDA driver exploded")

    te.is_nvfp4_available = boom
    monkeypatch.setattr(P, "_gpu_info", _fake_gpu((9, 0)))
    monkeypatch.setattr(P, "import_transformer_engine", lambda: (te, "2.20.2", None))
    caps = P.probe()
    assert not caps.format("nvfp4").native
    assert "CUDA driver exploded" in caps.format("nvfp4").reason


def test_import_transformer_engine_reports_a_broken_install(monkeypatch):
    """TE installed but its import raising (e.g. mismatched wheel versions) is reported, not raised."""

    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name == "transformer_engine" or name.startswith("transformer_engine."):
                return importlib.util.spec_from_loader(name, Loader())
            return None

    class Loader:
        def create_module(self, spec):
            return None

        def exec_module(self, module):
            warnings.warn("TE import-time warning", UserWarning)
            raise AssertionError("transformer_engine_torch 2.19.0 != transformer-engine 2.20.2")

    for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module, _version, error = P.import_transformer_engine()
    assert module is None
    assert "does not import" in error and "AssertionError" in error and "2.19.0" in error
    assert P.TE_INSTALL_COMMAND in error
    assert caught == []


def test_import_of_probe_does_not_import_te_or_triton():
    import subprocess

    code = (
        "import sys, nvfp4lab.capabilities, nvfp4lab.te; "
        "bad = [m for m in ('transformer_engine', 'triton') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=_repo_root())


def _repo_root():
    import pathlib

    return str(pathlib.Path(__file__).resolve().parents[1])


# --------------------------------------------------------------------------- CLI


def test_main_probe_json_and_table(capsys):
    assert P.main_probe(["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["mode"] in P.MODES and "nvfp4" in d["formats"]
    assert P.main_probe([]) == 0
    out = capsys.readouterr().out
    assert "recommendation:" in out and "NVFP4" in out


def test_add_probe_subcommand(capsys):
    parser = argparse.ArgumentParser(prog="nvfp4lab")
    sub = parser.add_subparsers(dest="command", required=True)
    P.add_probe_subcommand(sub)
    args = parser.parse_args(["probe", "--json"])
    assert args.command == "probe" and args.json
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["formats"]["bf16"]["label"] == "BF16"


def test_nvfp4lab_cli_probe(capsys):
    cli = pytest.importorskip("nvfp4lab.cli")
    assert cli.main(["probe", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mode"] in P.MODES


def test_the_module_is_reachable_under_its_name():
    """``nvfp4lab.probe`` is the function; the module is ``nvfp4lab.capabilities`` (not shadowed)."""
    import nvfp4lab
    import nvfp4lab.capabilities as caps

    assert callable(nvfp4lab.probe) and nvfp4lab.probe is caps.probe
    assert caps.format_support is P.format_support and nvfp4lab.capabilities is caps
