"""Static SASS instruction counts of the quantize kernels for sm_90, compiled without a GPU.

    python benchmarks/kernel_sass.py [--json OUT]      # the book reads results/kernel_sass_sm90.json

Triton compiles each kernel configuration for an H100/H200 target (``GPUTarget("cuda", 90, 32)``,
its bundled ``ptxas``) and its bundled ``cuobjdump`` disassembles the cubin. The table gives the
instructions of the kernel's main body (up to its final ``EXIT``; the out-of-line IEEE-division
slow path is left out) per input element, grouped by the pipe that issues them: ``alu`` (integer
and logic ops, float compare/min/max/select: 16 lanes per scheduler and clock on Hopper, half the
FP32 rate), ``imad`` (integer multiply-add, on the FMA-heavy pipe, also half rate), ``fp32``
(FADD/FMUL/FFMA, full rate), ``conv/fp64`` (conversions, FP64 and MUFU) and the rest. These are
static counts of an unrolled body, so they approximate the executed instructions per element; what
the GPU does with them is measured by ``nvfp4lab bench``. The amax pass's count includes its FP64
fallback loop, which runs in about one tile in a hundred; the row "its FP32 path alone" compiles it
without (``RHT_F64=False``); the row "grid-stride loop" is the form that takes several tiles per
program (``STRIDED``), its loop body counted once per tile. A column stride of 1 is compiled as the constant Triton makes of it
(it specialises integer arguments equal to 1), as in the dispatcher's launches on contiguous
inputs. Registers per thread come from ``cuobjdump -res-usage``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nvfp4lab.kernels import options  # noqa: E402
from nvfp4lab.provenance import environment  # noqa: E402
from nvfp4lab.kernels import triton_kernels as tk  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
TARGET = GPUTarget("cuda", 90, 32)
PIPES = {
    "alu": ("LOP3", "SHF", "IADD3", "ISETP", "FSETP", "FMNMX", "SEL", "FSEL", "PRMT", "IMNMX", "LEA", "VIMNMX",
            "VIMNMX3", "SGXT", "PLOP3", "VIADD", "IABS", "DSETP", "F2FP"),
    "imad": ("IMAD",),
    "fp32": ("FFMA", "FADD", "FMUL", "HFMA2", "HADD2", "HMUL2"),
    "conv/fp64": ("F2F", "F2I", "I2F", "FRND", "MUFU", "DADD", "DMUL", "DFMA"),
    "memory": ("LDG", "STG", "LDS", "STS", "ATOMG", "RED", "LDC", "ULDC"),
}


def _pipe(op: str) -> str:
    base = op.split(".")[0]
    for name, ops in PIPES.items():
        if base in ops:
            return name
    return "other"


def compile_sass(fn, args: dict, num_warps: int) -> tuple[str, int]:
    """``args``: parameter name -> a type string (``'*bf16'``, ``'i32'``...; ``':D'`` appended marks
    a value divisible by 16) or a constexpr value. Returns (main-body SASS, registers per thread)."""
    sig, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        v = args[p.name]
        if isinstance(v, str):
            sig[p.name], _, mark = v.partition(":")
            if mark == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p.name] = "constexpr"
            constexprs[(i,)] = v
    k = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=TARGET,
                       options=dict(num_warps=num_warps, enable_fp_fusion=False))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    exits = [i for i, ln in enumerate(lines) if re.search(r"\bEXIT\b", ln)]
    # the main body ends at the first EXIT followed by the trailing self-branch, else at the last EXIT
    end = next((i for i in exits if i + 1 < len(lines) and "BRA" in lines[i + 1]), exits[-1])
    regs = re.search(r"REG:(\d+)", res)
    return "\n".join(lines[: end + 1]), int(regs.group(1)) if regs else -1


def counts(sass: str) -> collections.Counter:
    c: collections.Counter = collections.Counter()
    for ln in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", ln)
        if m:
            c[_pipe(m.group(2))] += 1
    return c


def cases():
    """name -> (kernel, args, num_warps, elements per thread): the configurations the dispatcher
    uses for 8192x8192 BF16 inputs (``nvfp4lab.kernels.options().config``)."""
    rows = dict(x_ptr="*bf16:D", M="i32:D", K="i32:D", sxm="i32:D", amax_ptr="*fp32:D", seed_ptr="*i64:D",
                d32_ptr="*i32:D", s_ptr="*u8:D", v32_ptr="*i32:D", obs_ptr="*i32:D", d32_rs="i32:D", s_rs="i32:D", v32_rs="i32:D",
                inv6="fp32", WORDS=True, REVERSE=False, EVEN=True, I64=False, CODES=True, OBSERVE=False)
    sl = dict(x_ptr="*bf16:D", M="i32:D", K="i32:D", sxm="i32:D", sxk=1, amax_ptr="*fp32:D",
              amaxt_ptr="*fp32:D", seed_ptr="*i64:D", d_ptr="*u8:D", s_ptr="*u8:D", dt32_ptr="*i32:D", st_ptr="*u8:D",
              v_ptr="*i16:D", vt_ptr="*i16:D", d_rs="i32:D", s_rs="i32:D", dt32_rs="i32:D", st_rs="i32:D",
              v_rs="i32:D", vt_rs="i32:D", inv6="fp32", p0_ptr="*fp32:D", o0_ptr="*fp32:D", c0_ptr="*fp32:D",
              p1_ptr="*fp32:D", o1_ptr="*fp32:D", c1_ptr="*fp32:D", gemm_factor="fp32", N_COEF=0,
              SIGN_MASK=0x8C9A, RHT_F64=True, ROUND_BF16=True,
              REVERSE=False, E2M1_BITS=True, EVEN=True, I64=False, COL_CODES=True)
    out = {}
    for name, key, kw in [("rowwise 1x16 RNE", "rows", dict(SR=False, VALUES=False)),
                          ("rowwise 1x16 SR", "rows", dict(SR=True, VALUES=False)),
                          ("rowwise 1x16 RNE + values", "rows_values", dict(SR=False, VALUES=True)),
                          ("rowwise 1x16 SR + values", "rows_values", dict(SR=True, VALUES=True)),
                          ("rowwise 1x16 RNE values only", "rows_values", dict(SR=False, VALUES=True, CODES=False)),
                          ("rowwise 1x16 SR values only", "rows_values", dict(SR=True, VALUES=True, CODES=False))]:
        c = options().config[key]
        out[name] = (tk.quantize_rows_kernel, dict(rows, BM=c["BM"], NB=c["NB"], **kw), c["num_warps"],
                     c["BM"] * c["NB"] * 16 / (32 * c["num_warps"]))
    col = dict(VALUES_ROW=False, ROW=False, COL=True, COL_RHT=True, BLOCK2D=False)
    for name, key, kw in [("columnwise RHT RNE", "slices_col", dict(col, VALUES_COL=False, SR=False)),
                          ("columnwise RHT RNE + values", "slices_col", dict(col, VALUES_COL=True, SR=False)),
                          ("columnwise RHT SR + values", "slices_col_sr", dict(col, VALUES_COL=True, SR=True)),
                          ("columnwise RHT SR values only", "slices_col_sr",
                           dict(col, VALUES_COL=True, SR=True, COL_CODES=False)),
                          ("2D 16x16 row+col + values", "slices2d",
                           dict(VALUES_ROW=True, VALUES_COL=False, ROW=True, COL=True, COL_RHT=False, BLOCK2D=True,
                                SR=False))]:
        c = options().config[key]
        out[name] = (tk.quantize_slices_kernel, dict(sl, G=c["G"], BK=c["BK"], **kw), c["num_warps"],
                     16 * c["G"] * c["BK"] / (32 * c["num_warps"]))
    c = options().config["amax_slices"]
    amax = dict(x_ptr="*bf16:D", amax_ptr="*i32:D", M="i32:D", K="i32:D", sxm="i32:D", sxk=1, ROW=True, COL_RHT=True,
                SIGN_MASK=0x8C9A, RHT_F64=True, ROUND_BF16=True, G=c["G"], BK=c["BK"], FB=c["FB"], EVEN=True, I64=False,
                STRIDED=False)
    for name, kw in [("amax pass (rowwise + columnwise RHT)", {}),
                     ("amax pass: its FP32 path alone", dict(RHT_F64=False)),
                     ("amax pass: grid-stride loop", dict(STRIDED=True))]:
        out[name] = (tk.amax_slices_kernel, dict(amax, **kw), c["num_warps"], 16 * c["G"] * c["BK"] / (32 * c["num_warps"]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="also write the table as JSON")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("unset TRITON_INTERPRET: this compiles the kernels for sm_90")
    rows = {}
    cols = ["total", "alu", "imad", "fp32", "conv/fp64", "memory", "other"]
    print(f"{'kernel (sm_90 SASS per element)':40s} " + " ".join(f"{c:>9s}" for c in cols) + "   regs")
    for name, (fn, kw, warps, per_thread) in cases().items():
        sass, regs = compile_sass(fn, kw, warps)
        c = counts(sass)
        row = {k: round(c.get(k, 0) / per_thread, 2) for k in cols[1:]}
        row["total"] = round(sum(c.values()) / per_thread, 2)
        row["registers"] = regs
        rows[name] = row
        print(f"{name:40s} " + " ".join(f"{row[k]:9.2f}" for k in cols) + f"   {regs:4d}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"target": "sm_90", "triton": triton.__version__,
                                         "command": "python benchmarks/kernel_sass.py --json " + str(args.json),
                                         "columns": cols, "environment": environment(), "per_element": rows},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
