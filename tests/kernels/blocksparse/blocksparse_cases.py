"""Shared cases of the block-sparse tests: masks of known shapes, a relative error, a check against dense."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsetrain.kernels.blocksparse import plans
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.op import block_sparse_linear, uses_kernels
from sparsetrain.kernels.blocksparse.reference import dense_to_values, reference_grads, values_to_dense
from sparsetrain.kernels.blocksparse.testing import forced_config
from sparsetrain.sparsity.layout import Block, to_element_mask


def make_mask(pattern: str, grid: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    R, C = grid
    if pattern == "random":
        m = torch.rand(R, C, generator=gen) < 0.5
        m[R // 2, C // 2] = True
    elif pattern == "empty_rows_cols":  # block row 0 and block column 1 hold nothing
        m = torch.rand(R, C, generator=gen) < 0.7
        m[0] = False
        m[:, 1] = False
        m[R - 1, 0] = True
    elif pattern == "dense":
        m = torch.ones(R, C, dtype=torch.bool)
    elif pattern == "single":
        m = torch.zeros(R, C, dtype=torch.bool)
        m[R - 1, C - 1] = True
    else:
        raise ValueError(pattern)
    return m


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "non-finite values (an output element was not written?)"
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def run_against_dense(T, I, O, b, pattern, dtype, with_bias, seed=0):
    """Our forward/backward vs F.linear on the dense masked weight (float64 autograd), fresh inputs."""
    gen = torch.Generator().manual_seed(seed)
    mask = make_mask(pattern, (O // b, I // b), gen)
    meta = BlockSparseMeta.from_mask(mask, b)
    w = torch.randn(O, I, generator=gen) / I**0.5
    values = dense_to_values(w, meta).to(dtype).requires_grad_()
    x = torch.randn(T, I, generator=gen).to(dtype).requires_grad_()
    bias = torch.randn(O, generator=gen).to(dtype).requires_grad_() if with_bias else None
    assert uses_kernels(x, meta)
    y = block_sparse_linear(x, values, meta, bias)
    dy = torch.randn(T, O, generator=gen).to(dtype)
    y.backward(dy)

    em = to_element_mask(mask, Block(b, b)).double()
    w64 = (values_to_dense(values.detach(), meta).double() * em).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_() if with_bias else None
    y64 = F.linear(x64, w64, b64)
    y64.backward(dy.double())
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert rel(y, y64) < tol
    assert rel(x.grad, x64.grad) < tol
    assert rel(values.grad, dense_to_values(w64.grad, meta)) < tol
    if with_bias:
        assert rel(bias.grad, b64.grad) < tol


def check_dds_tiles(meta, tiles, I, O, b, dtype):
    """Forward and input gradient through each forced tile vs the fp32 reference: T = 1037 and 5, no bias /
    bias in the activation dtype / fp32 bias, values in the activation dtype and fp32 master values."""
    for T in (1000 + 37, 5):
        x = torch.randn(T, I, device="cuda", dtype=dtype)
        g = torch.randn(T, O, device="cuda", dtype=dtype)
        for cfg in tiles:
            for vdt in (dtype, torch.float32):
                values = (torch.randn(meta.n_blocks, b, b, device="cuda") / b**0.5).to(vdt)
                w = values_to_dense(values.float(), meta)
                for bdt in (None, dtype, torch.float32):
                    bias = None if bdt is None else torch.randn(O, device="cuda").to(bdt)
                    with forced_config(fwd=cfg, dx=cfg):
                        y = plans.dds(x, values, meta, bias, forward=True)
                        dx = plans.dds(g, values, meta, None, forward=False)
                    y_ref = x.float() @ w.t() + (0 if bias is None else bias.float())
                    assert rel(y, y_ref) < 1e-2, (cfg, T, vdt, bdt)
                    assert rel(dx, g.float() @ w) < 1e-2, (cfg, T, vdt)


def check_fwd_bwd(x, values, bias, meta) -> None:
    """One fwd+bwd of ``block_sparse_linear`` against the float32 reference (output and the three gradients)."""
    y = block_sparse_linear(x, values, meta, bias)
    dy = torch.randn_like(y)
    y.backward(dy)
    x32, v32 = x.detach().float(), values.detach().float()
    y_ref = x32 @ values_to_dense(v32, meta).t() + bias.detach().float()
    dx, dv, db = reference_grads(x32, dy.float(), v32, meta)
    for name, got, ref in (("y", y, y_ref), ("dx", x.grad, dx), ("dv", values.grad, dv), ("db", bias.grad, db)):
        assert rel(got, ref) < 1e-2, name
