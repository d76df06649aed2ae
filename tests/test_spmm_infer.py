"""Compressed skinny SpMM (sparsetrain.kernels.spmm_infer) against its plain-torch reference.

CPU runs go through the Triton interpreter (conftest sets TRITON_INTERPRET=1) in fp16/fp32 at small shapes;
bf16 and real shapes are the `gpu`-marked tests at the bottom.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from sparsetrain.kernels import spmm_infer as si
from sparsetrain.kernels.spmm_infer import compress, spmm_infer, spmm_reference, spmm_triton


def _sparse(m, k, sparsity, dtype=torch.float32, device="cpu"):
    w = torch.randn(m, k, device=device).to(dtype)
    w[torch.rand(m, k, device=device) < sparsity] = 0
    return w


def _nan_tail_view(n, k, dtype):
    """X [n, k] whose rows continue with NaN past column k (row stride a multiple of 8, 16-byte aligned, so the
    kernels take it without a padded copy): a kernel that reads past K returns NaN."""
    full = torch.full((n, -(-k // 8) * 8 + 8), float("nan"), device="cuda", dtype=dtype)
    full[:, :k] = torch.randn(n, k, device="cuda").to(dtype)
    return full[:, :k]


def _rel_err(y, ref):
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


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
    from sparsetrain.kernels import _launch
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
def test_cuda_kernel_is_off_without_cuda_or_nvcc(monkeypatch):
    from sparsetrain.kernels import _launch, use_kernel_options
    from sparsetrain.kernels._runtime import cuda_build as _cuda
    x = torch.randn(4, 64)
    cw = compress(torch.randn(32, 64))
    assert not si.cuda_kernel_usable(x, cw)  # CPU tensors never take the CUDA kernel
    assert _cuda.load(_launch.CSRC / "spmm_bitmap.cu", torch.device("cpu")) is None
    with use_kernel_options(cuda_kernels=False):
        assert _cuda.load(_launch.CSRC / "spmm_bitmap.cu", torch.device("cuda", 0)) is None
    assert (_launch.CSRC / "spmm_bitmap.cu").is_file()  # shipped with the package


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(4096, 4160), (1000, 3001), (384, 200)])
@pytest.mark.parametrize("sparsity", [0.5, 0.9])
def test_gpu_cuda_kernel_matches_reference(dtype, m, k, sparsity):
    w = _sparse(m, k, sparsity, dtype, "cuda")
    cw = compress(w)
    assert si.cuda_kernel_usable(torch.zeros(1, k, device="cuda", dtype=dtype), cw)
    bias = torch.randn(m, device="cuda").to(dtype)
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    for n in (1, 5, 16, 33, 64):
        x = torch.randn(n, k, device="cuda").to(dtype)
        ref = spmm_reference(x, cw, bias)
        for split in (None, 1, 3):
            for _ in range(2):  # the second call checks the split-K workspace came back to zero
                y = si.spmm_cuda(x, cw, bias, split_k=split)
                assert _rel_err(y, ref) < tol, (n, split)
        xv = torch.randn(n, k + 3, device="cuda").to(dtype)[:, 1:k + 1]  # misaligned, strided view
        assert _rel_err(si.spmm_cuda(xv, cw), spmm_reference(xv, cw)) < tol
        xt = _nan_tail_view(n, k, dtype)
        assert _rel_err(si.spmm_cuda(xt, cw), spmm_reference(xt, cw)) < tol


@pytest.mark.gpu
def test_gpu_cuda_kernel_empty_and_dense_tiles():
    w = _sparse(1024, 1024, 0.9, torch.float16, "cuda")
    w[:128] = 0
    w[:, -64:] = 0
    w[128:256, :64] = torch.randn(128, 64, device="cuda").half()
    cw = compress(w)
    x = torch.randn(7, 1024, device="cuda").half()
    assert _rel_err(si.spmm_cuda(x, cw), spmm_reference(x, cw)) < 2e-3
    assert _rel_err(spmm_infer(x, cw), spmm_reference(x, cw)) < 2e-3  # spmm_infer dispatches to it


# ---------------------------------------------------------------- tiled CSL with byte locations (spmm_csl)
from sparsetrain.kernels import spmm_csl as sc  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(130, 70), (128, 64), (37, 200), (300, 129)])
@pytest.mark.parametrize("sparsity", [0.0, 0.9, 1.0])
def test_csl_round_trip_is_exact_and_bytes_match_formula(dtype, shape, sparsity):
    w = _sparse(*shape, sparsity, dtype)
    c = sc.compress_csl(w)
    assert torch.equal(c.to_dense(), w)
    assert c.nnz == int((w != 0).sum())
    assert c.nbytes() == sc.csl_bytes(*shape, c.nnz, w.element_size())
    assert c.locs.dtype == torch.uint8 and c.sub_offsets.dtype == torch.int16
    again = sc.CslWeight.from_tensors(c.tensors(), c.shape)
    assert torch.equal(again.to_dense(), w)


def test_compress_auto_picks_the_smaller_format():
    dense_ish, sparse = _sparse(256, 256, 0.5, torch.float16), _sparse(256, 256, 0.95, torch.float16)
    assert isinstance(compress(dense_ish, fmt="auto"), si.SparseInferenceWeight)
    c = compress(sparse, fmt="auto")
    assert isinstance(c, sc.CslWeight)
    assert c.nbytes() < compress(sparse).nbytes()
    assert c.nbytes() / sparse.numel() < 0.125 + 2 * 0.05 + 0.01  # the brief's bound at 95% (+ metadata)
    with pytest.raises(ValueError, match="fmt"):
        compress(sparse, fmt="coo")


def test_spmm_infer_with_csl_weight_matches_reference():
    w = _sparse(200, 300, 0.9, torch.float16)
    c = sc.compress_csl(w)
    x = torch.randn(5, 300).half()
    b = torch.randn(200).half()
    assert _rel_err(spmm_infer(x, c, b), sc.spmm_csl_reference(x, c, b)) < 1e-3
    assert _rel_err(sc.spmm_csl_reference(x, c, b), spmm_reference(x, compress(w), b)) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(4096, 4160), (1000, 3001), (384, 200)])
@pytest.mark.parametrize("sparsity", [0.5, 0.95])
def test_gpu_csl_kernel_matches_reference(dtype, m, k, sparsity):
    w = _sparse(m, k, sparsity, dtype, "cuda")
    c = sc.compress_csl(w)
    assert sc.cuda_usable(torch.zeros(1, k, device="cuda", dtype=dtype), c)
    bias = torch.randn(m, device="cuda").to(dtype)
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    for n in (1, 5, 16, 33, 64):
        x = torch.randn(n, k, device="cuda").to(dtype)
        ref = sc.spmm_csl_reference(x, c, bias)
        for split in (None, 1, 3):
            for _ in range(2):  # the second call checks the split-K workspace came back to zero
                assert _rel_err(sc.spmm_csl_cuda(x, c, bias, split_k=split), ref) < tol, (n, split)
        xv = torch.randn(n, k + 3, device="cuda").to(dtype)[:, 1:k + 1]
        assert _rel_err(sc.spmm_csl_cuda(xv, c), sc.spmm_csl_reference(xv, c)) < tol
        xt = _nan_tail_view(n, k, dtype)
        assert _rel_err(sc.spmm_csl_cuda(xt, c), sc.spmm_csl_reference(xt, c)) < tol
    assert _rel_err(spmm_infer(x, c, bias), ref) < tol  # spmm_infer dispatches CslWeight to it


@pytest.mark.gpu
def test_gpu_csl_kernel_empty_and_dense_tiles():
    w = _sparse(1024, 1024, 0.95, torch.float16, "cuda")
    w[:128] = 0
    w[:, -64:] = 0
    w[128:256, :64] = torch.randn(128, 64, device="cuda").half()
    c = sc.compress_csl(w)
    x = torch.randn(7, 1024, device="cuda").half()
    assert _rel_err(sc.spmm_csl_cuda(x, c), sc.spmm_csl_reference(x, c)) < 2e-3


# ---------------------------------------------------------------- pair bitmap (spmm_pair)
from sparsetrain.kernels import spmm_pair as sp  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(130, 70), (128, 64), (37, 201), (300, 129)])
@pytest.mark.parametrize("sparsity", [0.0, 0.9, 1.0])
def test_pair_round_trip_is_exact_and_bytes_match_formula(dtype, shape, sparsity):
    w = _sparse(*shape, sparsity, dtype)
    c = compress(w, fmt="pair")
    assert isinstance(c, sp.PairWeight) and c.fmt == "pair"
    assert torch.equal(c.to_dense(), w)
    assert c.nnz == int((w != 0).sum())
    n_pairs = sp.nonzero_pairs(w)
    assert c.values.numel() == 2 * n_pairs
    assert c.nbytes() == sp.pair_bytes(*shape, n_pairs, w.element_size())
    assert c.bitmap.dtype == torch.int32 and c.row_offsets.dtype == torch.int16
    again = sp.PairWeight.from_tensors(c.tensors(), c.shape)
    assert torch.equal(again.to_dense(), w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(130, 70), (256, 128), (37, 201)])
def test_pair_decode_kernel_matches_torch_decode(dtype, shape):
    w = _sparse(*shape, 0.8, dtype)
    w[0, 62] = 1.5  # pair 31 (the int32 sign bit)
    c = sp.compress_pair(w)
    assert torch.equal(c.to_dense(use_kernel=True), w)  # Triton interpreter on a CPU
    assert torch.equal(c.to_dense(use_kernel=False), w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape,sparsity", [((130, 70), 0.8), ((256, 128), 0.95), ((37, 201), 0.5),
                                            ((128, 64), 0.0)])
def test_csl_decode_kernel_matches_torch_decode(dtype, shape, sparsity):
    """The Triton CSL expansion (prefill path) under the interpreter: partial edge tiles, a fully dense tile
    (more values than one chunk), empty tiles, against the plain-torch expansion and the original."""
    w = _sparse(*shape, sparsity, dtype)
    if shape == (256, 128):
        w[:128, :64] = 0  # an empty tile
    c = sc.compress_csl(w)
    assert torch.equal(c.to_dense(use_kernel=True), w)  # Triton interpreter on a CPU
    assert torch.equal(c.to_dense(use_kernel=False), w)


def test_pair_bitmap_bits_and_offsets_by_hand():
    w = torch.zeros(128, 64)
    w[0, 1] = 1.0    # pair 0 of row 0
    w[0, 62] = 2.0   # pair 31 of row 0: the sign bit of the int32 word
    w[1, 4] = 3.0    # pair 2 of row 1
    w[1, 5] = 4.0
    c = sp.compress_pair(w)
    assert c.values.tolist() == [0.0, 1.0, 2.0, 0.0, 3.0, 4.0]
    assert int(c.bitmap[0, 0, 0]) == 1 - 2**31  # bits 0 and 31
    assert int(c.bitmap[0, 0, 1]) == 4
    assert c.row_offsets[0, 0, :3].tolist() == [0, 4, 6]


def test_spmm_infer_with_pair_weight_matches_reference():
    w = _sparse(200, 300, 0.8, torch.float16)
    c = compress(w, fmt="pair")
    x = torch.randn(5, 300).half()
    b = torch.randn(200).half()
    assert _rel_err(spmm_infer(x, c, b), spmm_reference(x, c, b)) < 1e-3
    assert _rel_err(spmm_reference(x, c, b), spmm_reference(x, compress(w), b)) < 1e-6


def test_pair_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="weight"):
        sp.compress_pair(torch.zeros(3))
    with pytest.raises(TypeError, match="dtype"):
        sp.compress_pair(torch.zeros(4, 4, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(4096, 4160), (1000, 3001), (384, 200)])
@pytest.mark.parametrize("sparsity", [0.5, 0.95])
def test_gpu_pair_kernel_matches_reference(dtype, m, k, sparsity):
    w = _sparse(m, k, sparsity, dtype, "cuda")
    c = sp.compress_pair(w)
    assert sp.cuda_usable(torch.zeros(1, k, device="cuda", dtype=dtype), c)
    bias = torch.randn(m, device="cuda").to(dtype)
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    for n in (1, 5, 13, 16, 33, 64):
        x = torch.randn(n, k, device="cuda").to(dtype)
        ref = spmm_reference(x, c, bias)
        for split in (None, 1, 3):
            for _ in range(2):  # the second call checks the split-K workspace came back to zero
                assert _rel_err(sp.spmm_pair_cuda(x, c, bias, split_k=split), ref) < tol, (n, split)
        xv = torch.randn(n, k + 3, device="cuda").to(dtype)[:, 1:k + 1]
        assert _rel_err(sp.spmm_pair_cuda(xv, c), spmm_reference(xv, c)) < tol
        xt = _nan_tail_view(n, k, dtype)
        assert _rel_err(sp.spmm_pair_cuda(xt, c), spmm_reference(xt, c)) < tol
    assert _rel_err(spmm_infer(x, c, bias), ref) < tol  # spmm_infer dispatches PairWeight to it


@pytest.mark.gpu
def test_gpu_pair_kernel_empty_and_dense_tiles():
    w = _sparse(1024, 1024, 0.95, torch.float16, "cuda")
    w[:128] = 0
    w[:, -64:] = 0
    w[128:256, :64] = torch.randn(128, 64, device="cuda").half()
    w[512:544, 256:320] = torch.randn(32, 64, device="cuda").half()  # one warp's rows of a tile fully dense
    c = sp.compress_pair(w)
    x = torch.randn(7, 1024, device="cuda").half()
    assert _rel_err(sp.spmm_pair_cuda(x, c), spmm_reference(x, c)) < 2e-3
    for dtype in (torch.float16, torch.bfloat16):  # the Triton decode (prefill path) on the device
        wd = w.to(dtype)
        assert torch.equal(sp.compress_pair(wd).to_dense(), wd)
    x = torch.randn(100, 1024, device="cuda").half()  # > 64 tokens: decode + cuBLAS
    assert _rel_err(spmm_infer(x, c), spmm_reference(x, c)) < 2e-3
