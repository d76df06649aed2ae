"""Pair bitmap (sparsetrain.kernels.spmm.pair) against the plain-torch reference; the CUDA kernel and the
Triton decode on the device (``pytest -m gpu``)."""
import pytest
import torch
from spmm_testing import _nan_tail_view, _rel_err, _sparse

from sparsetrain.kernels.spmm import compress, spmm_infer, spmm_reference
from sparsetrain.kernels.spmm import csl as sc
from sparsetrain.kernels.spmm import pair as sp


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
