"""Tiled CSL with byte locations (sparsetrain.kernels.spmm.csl) against the plain-torch reference; the CUDA
kernel on the device (``pytest -m gpu``)."""
import pytest
import torch
from spmm_testing import _nan_tail_view, _rel_err, _sparse

from sparsetrain.kernels.spmm import bitmap, compress, spmm_infer, spmm_reference
from sparsetrain.kernels.spmm import csl as sc


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
    assert isinstance(compress(dense_ish, fmt="auto"), bitmap.SparseInferenceWeight)
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
