"""One cuBLAS call for the emulated NVFP4 GEMM: the per-tensor factor applied in the GEMM's epilogue.

The emulated GEMM multiplies the BF16 block values (``code × E4M3 block scale``, exact in BF16)
with FP32 accumulation and then scales the FP32 sum by the per-tensor factor
``alpha = RN(RN(amax_a · amax_b) / (6²·448²))`` (:func:`nvfp4lab.quantize.nvfp4_matmul`). alpha
lives on the GPU (it comes from the amax kernels), and ``torch.mm`` only takes a host alpha, so
the product used to go through an FP32 [M, N] buffer and a second kernel. cuBLAS itself takes
alpha by device pointer (``CUBLAS_POINTER_MODE_DEVICE``): ``cublasGemmEx`` with
``CUBLAS_COMPUTE_32F`` computes ``D = RN_out(alpha · acc + beta · C)`` with FP32 ``alpha · acc``;
with ``beta = 0`` (C is not read) that is ``RN_out(RN32(alpha · acc))``, the reference's
epilogue without a bias, and the FP32 round trip disappears.

The call runs on PyTorch's own cuBLAS handle (``torch.cuda.current_blas_handle()``: the
current stream and PyTorch's workspace, so it is captured by CUDA graphs like ``torch.mm``),
through ``ctypes`` on the libcublas that PyTorch has loaded. :func:`available` says whether
that library and its symbols were found; callers fall back to ``torch.mm`` + epilogue kernel.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

import torch

__all__ = ["available", "gemm_device_alpha"]

_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUDA_R_32F, _CUDA_R_16BF = 0, 14  # cudaDataType_t (library_types.h)
_CUBLAS_COMPUTE_32F = 68  # cublasComputeType_t
_CUBLAS_GEMM_DEFAULT = -1
_POINTER_MODE_HOST, _POINTER_MODE_DEVICE = 0, 1
_DTYPES = {torch.bfloat16: _CUDA_R_16BF, torch.float32: _CUDA_R_32F}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_error: str | None = None


def _find_loaded_cublas() -> str | None:
    """Path of the libcublas mapped into this process (PyTorch's), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                name = path.rsplit("/", 1)[-1]
                if name.startswith("libcublas.so"):
                    return path
    except OSError:
        return None
    return None


def _load() -> ctypes.CDLL | None:
    global _lib, _load_error
    with _lock:
        if _lib is not None or _load_error is not None:
            return _lib
        try:
            torch.cuda.current_blas_handle()  # initialises cuBLAS, so PyTorch's libcublas is mapped
            path = _find_loaded_cublas()
            lib = ctypes.CDLL(path or "libcublas.so")
            lib.cublasGemmEx.restype = ctypes.c_int
            lib.cublasGemmEx.argtypes = [
                ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
            lib.cublasSetPointerMode_v2.restype = ctypes.c_int
            lib.cublasSetPointerMode_v2.argtypes = [ctypes.c_void_p, ctypes.c_int]
            _lib = lib
        except Exception as exc:  # no CUDA, no libcublas, a missing symbol
            _load_error = repr(exc)
        return _lib


def available() -> bool:
    """True when CUDA is up and PyTorch's libcublas exposes ``cublasGemmEx`` (loaded lazily)."""
    return torch.cuda.is_available() and _load() is not None


def _operand(t: torch.Tensor) -> tuple[int, int] | None:
    """(cuBLAS op, leading dimension) presenting ``t`` [R, K] as a column-major K x R matrix
    (op N: row-major rows) or R x K matrix (op T target: column-major), or None if neither."""
    R, K = t.shape
    sr, sk = t.stride()
    if sk == 1 and sr >= max(K, 1):
        return _CUBLAS_OP_N, sr
    if sr == 1 and sk >= max(R, 1):
        return _CUBLAS_OP_T, sk
    return None


def gemm_device_alpha(a: torch.Tensor, b: torch.Tensor, alpha_zero: torch.Tensor,
                      out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``RN_out(RN32(alpha · (a @ bᵀ)))`` in one cuBLAS call, or ``None`` where it does not apply.

    Args:
        a: BF16 [M, K], b: BF16 [N, K] on one CUDA device, each with a unit stride along one
            axis (row-major or a transposed view) and 16-byte aligned.
        alpha_zero: contiguous FP32 [2] on that device holding ``(alpha, 0.0)``: alpha and the
            GEMM's beta, read by the GEMM (no host sync). beta must be 0: C is the output buffer.
        out_dtype: ``torch.bfloat16`` or ``torch.float32``.
        out: where to write the product (a contiguous [M, N] tensor of ``out_dtype`` on that
            device, 16-byte aligned), or None for a new tensor.
    Returns:
        The [M, N] product (``out``, or a new contiguous tensor of ``out_dtype``), or ``None`` (the
        caller falls back) when cuBLAS was not found, the dtypes, devices, layouts or alignment
        (of ``out`` too) do not fit, or a size exceeds 32-bit cuBLAS arguments.
    Raises:
        RuntimeError: cuBLAS returned an error status.
    """
    if out_dtype not in _DTYPES or a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        return None
    if not (a.is_cuda and b.is_cuda and alpha_zero.is_cuda) or len({a.device, b.device, alpha_zero.device}) != 1:
        return None
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        return None
    if alpha_zero.shape != (2,) or alpha_zero.dtype != torch.float32 or not alpha_zero.is_contiguous():
        raise ValueError(f"alpha_zero must be a contiguous float32 tensor of shape (2,), got "
                         f"{alpha_zero.dtype} {tuple(alpha_zero.shape)}")
    M, K = a.shape
    N = b.shape[0]
    if min(M, N, K) == 0 or max(M, N, K, *a.stride(), *b.stride()) >= 2**31:
        return None
    oa, ob = _operand(b), _operand(a)  # C (col-major N x M) = op(b-view) (N x K) · op(a-view) (K x M)
    if oa is None or ob is None or (a.data_ptr() | b.data_ptr()) % 16:
        return None
    if out is not None and (out.shape != (M, N) or out.dtype != out_dtype or out.device != a.device
                            or not out.is_contiguous() or out.data_ptr() % 16):
        return None
    lib = _load() if torch.cuda.is_available() else None
    if lib is None:
        return None
    # switching devices costs a context manager per call: only when a lives on another GPU
    here = a.device.index is None or a.device.index == torch.cuda.current_device()
    with contextlib.nullcontext() if here else torch.cuda.device(a.device):
        if out is None:
            out = torch.empty(M, N, dtype=out_dtype, device=a.device)
        handle = torch.cuda.current_blas_handle()  # bound to the current stream by PyTorch
        # b row-major [N, K] is a col-major K x N matrix: op T gives N x K; a transposed view is
        # N x K already (op N). a row-major [M, K] is col-major K x M: op N; a transposed view: op T.
        op_b = _CUBLAS_OP_T if oa[0] == _CUBLAS_OP_N else _CUBLAS_OP_N
        op_a = _CUBLAS_OP_N if ob[0] == _CUBLAS_OP_N else _CUBLAS_OP_T
        st = lib.cublasSetPointerMode_v2(handle, _POINTER_MODE_DEVICE)
        if st != 0:
            raise RuntimeError(f"cublasSetPointerMode failed with status {st}")
        try:
            st = lib.cublasGemmEx(
                handle, op_b, op_a, N, M, K, alpha_zero.data_ptr(),
                b.data_ptr(), _CUDA_R_16BF, oa[1], a.data_ptr(), _CUDA_R_16BF, ob[1],
                alpha_zero.data_ptr() + 4, out.data_ptr(), _DTYPES[out_dtype], N, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)
        finally:
            lib.cublasSetPointerMode_v2(handle, _POINTER_MODE_HOST)
        if st != 0:
            raise RuntimeError(f"cublasGemmEx failed with status {st} (M={M}, N={N}, K={K})")
    return out
