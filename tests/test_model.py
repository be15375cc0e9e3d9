"""The small GPT, its presets, and the byte-level data pipeline."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from nvfp4lab.data import (
    BUILTIN_CORPUS,
    ByteTokenizer,
    get_batch,
    load_corpus,
    split_tokens,
    validation_batches,
)
from nvfp4lab.model import GPT, PRESETS, GPTConfig, get_preset


# ----------------------------------------------------------------------------- model
def linear_dims(cfg: GPTConfig):
    return {cfg.n_embd, 3 * cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, cfg.vocab_size}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_have_nvfp4_friendly_shapes(name):
    cfg = get_preset(name)
    assert all(d % 16 == 0 for d in linear_dims(cfg)), linear_dims(cfg)
    assert cfg.n_embd % cfg.n_head == 0
    assert cfg.n_layer >= 3  # the default recipe keeps first and last block in BF16, quantizes >= 1


def test_gpt2_small_shapes():
    cfg = get_preset("gpt2-small")
    assert (cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.block_size) == (768, 12, 12, 1024)
    with torch.device("meta"):
        model = GPT(cfg)
    # 12 blocks x (12 d^2 weights + 2 LayerNorm weights) + ln_f + bytes + positions (tied head)
    expected = 12 * (12 * 768 ** 2 + 2 * 768) + 768 + 256 * 768 + 1024 * 768
    assert model.num_parameters() == expected
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset("gpt3")


def test_forward_shapes_initial_loss_and_tying():
    torch.manual_seed(0)
    model = GPT(get_preset("ci"))
    assert model.lm_head.weight is model.wte.weight
    idx = torch.randint(0, 256, (2, 16))
    targets = torch.randint(0, 256, (2, 16))
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 16, 256) and loss.dtype == torch.float32
    # small init: the model starts close to the uniform distribution over 256 bytes
    assert abs(loss.item() - math.log(256)) < 0.1
    assert model(idx)[1] is None
    untied = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=8, tie_weights=False))
    assert untied.lm_head.weight is not untied.wte.weight


def test_attention_is_causal():
    torch.manual_seed(1)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)).eval()
    a = torch.randint(0, 256, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256          # change only the future
    with torch.no_grad():
        la, lb = model(a)[0], model(b)[0]
    assert torch.equal(la[:, :10], lb[:, :10])
    assert not torch.equal(la[:, 10:], lb[:, 10:])


def test_attention_precision_option():
    torch.manual_seed(2)
    cfg = GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=8)
    m32 = GPT(cfg)
    mac = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=8, attn_precision="autocast"))
    mac.load_state_dict(m32.state_dict())
    idx = torch.randint(0, 256, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = m32(idx)[0], mac(idx)[0]
    assert a.shape == b.shape and not torch.equal(a, b)   # FP32 vs BF16 attention core differ


@pytest.mark.parametrize("kwargs", [dict(n_embd=30, n_head=4), dict(n_layer=0), dict(dropout=1.0),
                                    dict(attn_precision="fp8"), dict(block_size=True)])
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        GPTConfig(**kwargs)


def test_forward_errors():
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=8))
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model(torch.zeros(9, dtype=torch.long))


def test_residual_projections_scaled_init():
    torch.manual_seed(3)
    cfg = GPTConfig(n_layer=8, n_embd=128, n_head=4)
    model = GPT(cfg)
    std_proj = model.blocks[0].mlp.proj.weight.std().item()
    std_fc = model.blocks[0].mlp.fc.weight.std().item()
    assert abs(std_fc - 0.02) < 0.002
    assert abs(std_proj - 0.02 / math.sqrt(16)) < 0.001


# ----------------------------------------------------------------------------- data
@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_builtin_corpus_is_pydoc_topics(corpus):
    assert corpus.source == BUILTIN_CORPUS
    assert 300_000 < corpus.num_bytes < 1_000_000          # ~460 KB on CPython 3.11
    assert "assert" in corpus.text and "**********" in corpus.text
    assert load_corpus().sha256 == corpus.sha256           # deterministic
    d = corpus.describe()
    assert d["bytes"] == corpus.num_bytes and "python" in d


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "NVFP4: 4 bits, E2M1 — ±6 · 2⁻¹⁰"
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and int(ids.max()) < 256
    assert ids.numel() == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.describe() == {"name": "bytes-utf8", "vocab_size": 256}


def test_split_is_deterministic_disjoint_and_complete(corpus):
    tokens = ByteTokenizer().encode(corpus.text)
    s1 = split_tokens(tokens)
    s2 = split_tokens(tokens)
    assert torch.equal(s1.train, s2.train) and torch.equal(s1.val, s2.val)
    assert s1.train.numel() + s1.val.numel() == tokens.numel()
    # chunk 9 (the 10th) is the first validation chunk
    assert torch.equal(s1.val[:4096], tokens[9 * 4096:10 * 4096])
    assert torch.equal(s1.train[:9 * 4096], tokens[:9 * 4096])
    assert 0.09 < s1.val.numel() / tokens.numel() < 0.11
    small = torch.arange(100) % 256
    sp = split_tokens(small, chunk_bytes=10, val_every=5)
    assert sp.val.tolist() == [t for i, t in enumerate(small.tolist()) if (i // 10) % 5 == 4]
    with pytest.raises(ValueError, match="too small"):
        split_tokens(torch.arange(10), chunk_bytes=16)
    with pytest.raises(ValueError):
        split_tokens(small, val_every=1)


def test_batches():
    tokens = torch.arange(1000) % 256
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    x, y = get_batch(tokens, 4, 16, g1)
    x2, y2 = get_batch(tokens, 4, 16, g2)
    assert torch.equal(x, x2) and torch.equal(y, y2)        # reproducible from the generator
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])                 # targets are the next tokens
    assert torch.equal((x + 1) % 256, y)                    # (for this arithmetic stream)
    vb = validation_batches(tokens, 4, 16, 3)
    assert len(vb) == 3 and all(b[0].shape == (4, 16) for b in vb)
    assert torch.equal(vb[0][0], validation_batches(tokens, 4, 16, 3)[0][0])
    starts = torch.cat([b[0][:, 0] for b in vb])
    assert starts[0] == 0 and starts[-1] == (1000 - 17) % 256
    with pytest.raises(ValueError, match="shorter"):
        get_batch(torch.arange(10), 2, 16, g1)


def test_text_file_and_folder(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("hello world\n", encoding="utf-8")
    c = load_corpus(f)
    assert c.text == "hello world\n" and c.files == 1 and c.source == str(f)
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "b.md").write_text("second", encoding="utf-8")
    (d / "a.md").write_text("first", encoding="utf-8")
    (d / "sub" / "c.txt").write_text("third", encoding="utf-8")
    (d / ".hidden").write_text("skip me", encoding="utf-8")
    c = load_corpus(d)
    assert c.text == "first\n\nsecond\n\nthird" and c.files == 3
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"ok \xff\xfe")
    with pytest.raises(ValueError, match="bad.bin is not valid UTF-8"):
        load_corpus(bad)
    with pytest.raises(FileNotFoundError):
        load_corpus(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no"):
        load_corpus(tmp_path / "empty")
