"""``benchmarks/train_profile.py`` refuses a two-run difference that is not one of steady steps."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.train_profile import difference_problems  # noqa: E402

STEADY = {"GEMM (cuBLAS)": 11.5, "attention": 3.6, "copies": 2.9, "host transfers": -20.7, "other": 10.4}


def kernel(name, calls, ms=1.0):
    return {"name": name, "calls_per_step": calls, "ms_per_step": ms}


def test_a_steady_difference_passes():
    """Host transfers may come out negative (their time depends on the host) and copies may vary
    in count (the layer graphs copy an input only when it moved): neither is a problem."""
    kernels = [kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 49.0), kernel("quantize_rows_kernel", 80.0),
               kernel("Memcpy DtoD (Device -> Device)", 48.7), kernel("Memcpy DtoH (Device -> Pageable)", 0.4)]
    assert difference_problems(STEADY, kernels) == []


def test_negative_time_and_fractional_compute_launches_are_problems():
    per_step = dict(STEADY, other=-12.14)
    kernels = [kernel("triton_poi_fused__unsafe_view_gelu_gelu_backward_view_4", 8.4),
               kernel("quantize_slices_kernel", 119.5), kernel("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", 12.0)]
    problems = difference_problems(per_step, kernels)
    assert problems == ["other: -12.14 ms per step (negative)",
                        "triton_poi_fused__unsafe_view_gelu_gelu_backward_view_4: 8.4 calls per step",
                        "quantize_slices_kernel: 119.5 calls per step"]
    # a small negative time within the tolerance is noise, not a problem
    assert difference_problems(dict(STEADY, attention=-0.01), []) == []
