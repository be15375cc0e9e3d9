"""SRStream: the device-resident SR random source (the kernels' Philox keys, capturable)."""

import pytest
import torch

from nvfp4lab.linear import NVFP4Linear, capture_gemm_operands
from nvfp4lab.quantize import quantize
from nvfp4lab.rounding import SRStream
from nvfp4lab.testing import assert_nvfp4_equal


def test_keys_advance_by_two_per_call_and_state_round_trips():
    s = SRStream(5)
    k0, k1 = s.seeds().tolist()
    assert k1 == k0 + 1 and 0 <= k0 < 2**62
    assert s.seeds().tolist() == [k0 + 2, k0 + 3]
    state = s.get_state()
    assert state.tolist() == [k0, 2] and state.dtype == torch.int64
    again = SRStream(99).set_state(state)
    assert again.seeds().tolist() == s.seeds().tolist()       # same state, same keys
    assert SRStream(6).seeds()[0] != SRStream(5).seeds()[0]   # another seed, another key
    copy = s.to("cpu")
    assert copy.seeds().tolist() == s.seeds().tolist() and copy is not s


def test_bad_seed_and_state_are_refused():
    with pytest.raises(TypeError, match="int"):
        SRStream(1.5)
    with pytest.raises(ValueError, match=r"int64 tensor \[key, counter\]"):
        SRStream().set_state(torch.zeros(3, dtype=torch.int64))


def test_reference_sr_from_a_stream_is_reproducible_and_fresh_per_call():
    x = torch.randn(32, 64)
    a = quantize(x, rounding="stochastic", generator=SRStream(1))
    b = quantize(x, rounding="stochastic", generator=SRStream(1))
    assert_nvfp4_equal(a, b)
    s = SRStream(1)
    first, second = (quantize(x, rounding="stochastic", generator=s) for _ in range(2))
    assert_nvfp4_equal(first, a)
    assert not torch.equal(first.data, second.data)


def test_layer_default_stream_replays_every_sr_operand():
    """A layer's default SR source is an SRStream; each recorded operand replays from op.rng()."""
    torch.manual_seed(0)
    layer = NVFP4Linear(64, 48)
    x = torch.randn(32, 64, requires_grad=True)
    with capture_gemm_operands() as ops:
        layer(x).square().sum().backward()
    sr = [o for o in ops if o.options["rounding"] == "stochastic"]
    assert len(sr) == 2 and all(o.rng_state.dtype == torch.int64 for o in sr)
    for o in ops:
        assert_nvfp4_equal(o.tensor, quantize(o.source, generator=o.rng(), **o.options))


def test_copy_takes_the_state_and_refuses_other_objects():
    a, b = SRStream(5), SRStream(9)
    a.seeds()
    b.copy_(a)
    assert torch.equal(b.get_state(), a.get_state())
    assert torch.equal(b.seeds(), a.seeds())      # then they draw the same keys
    with pytest.raises(ValueError, match="SRStream.copy_"):
        b.copy_(torch.zeros(2, dtype=torch.int64))


def test_graphed_calls_validates_its_limits():
    from nvfp4lab.cuda_graphs import GraphedCalls

    with pytest.raises(ValueError, match="max_entries"):
        GraphedCalls(max_entries=0)
    with pytest.raises(ValueError, match="capture_after"):
        GraphedCalls(capture_after=0)
