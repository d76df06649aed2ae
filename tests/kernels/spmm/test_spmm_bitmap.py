"""Compressed skinny SpMM, bitmap format and the spmm_infer dispatch, against the plain-torch reference.

CPU runs go through the Triton interpreter (conftest sets TRITON_INTERPRET=1) in fp16/fp32 at small shapes;
bf16 and real shapes are the `gpu`-marked tests.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from spmm_testing import _nan_tail_view, _rel_err, _sparse

from sparsetrain.kernels import use_kernel_options
from sparsetrain.kernels._runtime import cuda_build
from sparsetrain.kernels.spmm import _launch, bitmap, compress, spmm_infer, spmm_reference, spmm_triton


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,block_m",
                         [((64, 64), 64), ((100, 150), 32), ((37, 200), 16), ((130, 70), 128)])
@pytest.mark.parametrize("sparsity", [0.0, 0.6, 0.95, 1.0])
def test_compress_to_dense_round_trip_is_exact(dtype, shape, block_m, sparsity):
    w = _sparse(*shape, sparsity, dtype)
    cw = compress(w, block_m=block_m)
    assert torch.equal(cw.to_dense(use_kernel=False), w)
    assert cw.nnz == int((w != 0).sum())
    assert cw.sparsity == pytest.approx(float((w == 0).float().mean()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_kernel_matches_torch_decode(dtype):
    w = _sparse(100, 200, 0.7, dtype)
    cw = compress(w, block_m=32)
    assert torch.equal(cw.to_dense(use_kernel=True), w)


def test_nbytes_formula():
    m, k, bm, bk = 256, 384, 64, 64
    w = _sparse(m, k, 0.8, torch.float16)
    cw = compress(w, block_m=bm)
    tm, tk = m // bm, k // bk
    nnz = int((w != 0).sum())
    # bitmap + values + one zero slot and one int16 offset per tile row + one int32 per tile
    assert cw.nbytes() == m * k // 8 + 2 * nnz + 2 * m * tk + 2 * m * tk + 4 * tm * tk
    per_elem = cw.nbytes() / (m * k)
    s = 1 - nnz / (m * k)
    assert per_elem == pytest.approx(0.125 + 2 * (1 - s) + 4 / bk + 4 / (bm * bk))


# (M, K, N, sparsity, dtype, block_m, split_k): N not a multiple of 8, odd K, partial row tiles, fully
# dense (0.0) and empty (1.0) weights, one and several split-K programs (one to many K tiles each).
CASES = [
    (64, 64, 16, 0.8, torch.float16, 64, 1),
    (100, 150, 5, 0.7, torch.float32, 32, 2),
    (48, 200, 13, 0.5, torch.float16, 16, 2),
    (64, 320, 1, 0.9, torch.float16, 64, None),
    (32, 96, 3, 0.0, torch.float16, 16, 1),
    (32, 64, 7, 1.0, torch.float32, 32, 1),
    (70, 330, 33, 0.75, torch.float32, 64, 3),
    (16, 256, 64, 0.6, torch.float16, 16, 1),
    (128, 200, 2, 0.85, torch.float16, 128, 1),
]


@pytest.mark.parametrize("m,k,n,sparsity,dtype,block_m,split_k", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_reference(m, k, n, sparsity, dtype, block_m, split_k, with_bias):
    w = _sparse(m, k, sparsity, dtype)
    cw = compress(w, block_m=block_m)
    x = torch.randn(n, k).to(dtype)
    bias = torch.randn(m).to(dtype) if with_bias else None
    y = spmm_triton(x, cw, bias, split_k=split_k)
    ref = spmm_reference(x, cw, bias)
    assert y.shape == (n, m) and y.dtype == dtype
    assert not torch.isnan(y).any()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    if ref.abs().max() == 0:
        assert torch.equal(y, ref)
    else:
        torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * float(ref.abs().max()))
    # the split-K workspace and counters are left at zero for the next launch
    for ws, locks in _launch._WORKSPACE.values():
        assert not ws.any() and not locks.any()


def test_empty_and_dense_tiles_in_one_weight():
    w = _sparse(64, 256, 0.5, torch.float16)
    w[:32, :64] = 0                                   # empty tiles
    w[32:, 64:128] = torch.randn(32, 64).half() + 3   # fully dense tiles (no zeros)
    cw = compress(w, block_m=32)
    x = torch.randn(9, 256).half()
    y = spmm_triton(x, cw, split_k=2)
    assert _rel_err(y, spmm_reference(x, cw)) < 2e-3


def test_spmm_infer_leading_dims_and_large_n_dispatch():
    w = _sparse(48, 64, 0.8)
    cw = compress(w, block_m=16)
    x = torch.randn(2, 3, 64)
    y = spmm_infer(x, cw)
    assert y.shape == (2, 3, 48)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
    # N = 80 > 64: transient dense weight + F.linear
    x_big = torch.randn(80, 64)
    torch.testing.assert_close(spmm_infer(x_big, cw), F.linear(x_big, w), rtol=1e-5, atol=1e-5)


def test_backward_gives_input_gradient():
    w = _sparse(32, 64, 0.7)
    cw = compress(w, block_m=16)
    bias = torch.randn(32, requires_grad=True)
    x = torch.randn(4, 64, requires_grad=True)
    spmm_infer(x, cw, bias).square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    b2 = bias.detach().clone().requires_grad_()
    F.linear(x2, w, b2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(bias.grad, b2.grad, rtol=1e-4, atol=1e-4)


def test_bad_inputs_raise_before_work():
    cw = compress(_sparse(32, 64, 0.5), block_m=16)
    with pytest.raises(TypeError, match="dtype"):
        spmm_infer(torch.randn(2, 64).half(), cw)
    with pytest.raises(ValueError, match="K=64"):
        spmm_infer(torch.randn(2, 63), cw)
    with pytest.raises(TypeError, match="SparseInferenceWeight"):
        spmm_infer(torch.randn(2, 64), torch.randn(32, 64))
    with pytest.raises(ValueError, match="bias"):
        spmm_infer(torch.randn(2, 64), cw, torch.randn(31))
    with pytest.raises(ValueError, match="block_m"):
        compress(torch.randn(8, 8), block_m=48)
    with pytest.raises(ValueError, match="2-D"):
        compress(torch.randn(8))
    with pytest.raises(TypeError, match="dtype"):
        compress(torch.ones(8, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="split_k"):
        spmm_triton(torch.randn(2, 64), cw, split_k=5)


# ---------------------------------------------------------------- GPU (pytest -m gpu on the device machine)
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 13, 16, 64])
@pytest.mark.parametrize("sparsity", [0.5, 0.8, 0.9])
def test_gpu_kernel_matches_reference(dtype, n, sparsity):
    m, k = 4096, 4096 + 64  # K not a power of two; several split-K programs per row tile
    w = _sparse(m, k, sparsity, dtype, "cuda")
    cw = compress(w)
    x = torch.randn(n, k, device="cuda").to(dtype)
    bias = torch.randn(m, device="cuda").to(dtype)
    for _ in range(2):  # second call checks that the split-K workspace came back to zero
        y = spmm_infer(x, cw, bias)
        ref = spmm_reference(x, cw, bias)
        assert _rel_err(y, ref) < (2e-3 if dtype == torch.float16 else 1e-2)
    assert torch.equal(cw.to_dense(), w)


@pytest.mark.gpu
def test_gpu_split_k_is_deterministic_enough_and_complete():
    w = _sparse(1024, 8192, 0.8, torch.float16, "cuda")
    cw = compress(w)
    x = torch.randn(16, 8192, device="cuda").half()
    ref = spmm_reference(x, cw)
    for split in (1, 2, 7, math.ceil(8192 / 64)):
        assert _rel_err(spmm_triton(x, cw, split_k=split), ref) < 2e-3


# ---------------------------------------------------------------- CUDA C++ kernel (csrc/spmm_bitmap.cu)
def test_cuda_kernel_is_off_without_cuda_or_nvcc():
    x = torch.randn(4, 64)
    cw = compress(torch.randn(32, 64))
    assert not bitmap.cuda_kernel_usable(x, cw)  # CPU tensors never take the CUDA kernel
    assert cuda_build.load(_launch.CSRC / "spmm_bitmap.cu", torch.device("cpu")) is None
    with use_kernel_options(cuda_kernels=False):
        assert cuda_build.load(_launch.CSRC / "spmm_bitmap.cu", torch.device("cuda", 0)) is None
    assert (_launch.CSRC / "spmm_bitmap.cu").is_file()  # shipped with the package


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(4096, 4160), (1000, 3001), (384, 200)])
@pytest.mark.parametrize("sparsity", [0.5, 0.9])
def test_gpu_cuda_kernel_matches_reference(dtype, m, k, sparsity):
    w = _sparse(m, k, sparsity, dtype, "cuda")
    cw = compress(w)
    assert bitmap.cuda_kernel_usable(torch.zeros(1, k, device="cuda", dtype=dtype), cw)
    with use_kernel_options(spmm_backend="triton"):  # the option forces the Triton kernel
        assert not bitmap.cuda_kernel_usable(torch.zeros(1, k, device="cuda", dtype=dtype), cw)
    bias = torch.randn(m, device="cuda").to(dtype)
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    for n in (1, 5, 16, 33, 64):
        x = torch.randn(n, k, device="cuda").to(dtype)
        ref = spmm_reference(x, cw, bias)
        for split in (None, 1, 3):
            for _ in range(2):  # the second call checks the split-K workspace came back to zero
                y = bitmap.spmm_cuda(x, cw, bias, split_k=split)
                assert _rel_err(y, ref) < tol, (n, split)
        xv = torch.randn(n, k + 3, device="cuda").to(dtype)[:, 1:k + 1]  # misaligned, strided view
        assert _rel_err(bitmap.spmm_cuda(xv, cw), spmm_reference(xv, cw)) < tol
        xt = _nan_tail_view(n, k, dtype)
        assert _rel_err(bitmap.spmm_cuda(xt, cw), spmm_reference(xt, cw)) < tol


@pytest.mark.gpu
def test_gpu_cuda_kernel_empty_and_dense_tiles():
    w = _sparse(1024, 1024, 0.9, torch.float16, "cuda")
    w[:128] = 0
    w[:, -64:] = 0
    w[128:256, :64] = torch.randn(128, 64, device="cuda").half()
    cw = compress(w)
    x = torch.randn(7, 1024, device="cuda").half()
    assert _rel_err(bitmap.spmm_cuda(x, cw), spmm_reference(x, cw)) < 2e-3
    assert _rel_err(spmm_infer(x, cw), spmm_reference(x, cw)) < 2e-3  # spmm_infer dispatches to it
