"""The Triton span backend: forward and input gradient with output tiles several blocks wide
(:func:`~._triton.dense_x_blocksparse_span_kernel`), for 16x16 and 32x32 blocks.

The gather kernels give a program one ``B``-wide output column block, so at ``B = 16`` every tile of ``A`` read
from L2 feeds a ``[BLOCK_T, 16]`` product: the tensor cores see N = 16, and an ``A`` column block is read
once per output block that uses it, so the L2 traffic, not the tensor cores, bounds those kernels at 10%.
Here a program owns ``span`` consecutive output blocks, walks the union of the input blocks they use, reads
each ``A`` tile there once for all of them and multiplies it by the ``[B, span * B]`` strip of the weight,
inactive blocks as zeros. At density 0.1 a span of 4 visits 34% of the input blocks (1 - 0.9^4) and so
multiplies 3.4x the active blocks' work, in exchange for N = 64 and fewer ``A`` reads: whether that is faster
depends on the shape and the GPU, so these are candidates the tuner times beside the gather and CUDA
kernels. Its candidates come after the gather backend's, never the untimed default; under the Triton
interpreter it offers none (tests force its configs).
"""
from __future__ import annotations

from typing import NamedTuple

from sparsetrain.kernels.blocksparse.gather import TritonPlan, cdiv
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.tuner import Backend, Product, interpreting


class SpanConfig(NamedTuple):
    """Tiles of the span kernel (forward and input gradient)."""

    block_t: int
    span: int      # output blocks per program (a power of two)
    group_k: int   # entries per tl.dot (a power of two; K = group_k * block)
    num_warps: int
    num_stages: int


_S = SpanConfig
CANDIDATES = {
    16: [_S(128, 4, 4, 4, 3), _S(128, 8, 4, 8, 3), _S(128, 2, 4, 4, 3), _S(64, 8, 4, 4, 3), _S(256, 4, 4, 8, 3),
         _S(128, 4, 2, 4, 4)],
    32: [_S(128, 2, 2, 4, 3), _S(128, 4, 2, 8, 3), _S(128, 2, 1, 4, 4), _S(64, 4, 2, 4, 3)],
}


def span_plan(meta: BlockSparseMeta, cfg: SpanConfig, forward: bool, has_bias: bool, T: int,
              a_strides: tuple[int, int]) -> TritonPlan:
    """The launch plan of the span kernel for one tile (from integers and the metadata only)."""
    from sparsetrain.kernels.blocksparse._triton import dense_x_blocksparse_span_kernel

    B = meta.block
    n_out = meta.grid[0] if forward else meta.grid[1]
    gptr, kidx, slots, n_groups = meta.span_entries(forward, cfg.span, cfg.group_k)
    grid = (cdiv(T, cfg.block_t) * n_groups,)
    args = [None, None, gptr, kidx, slots, None, None, T, a_strides[0], a_strides[1], n_out * B, n_groups]
    opts = dict(FORWARD=forward, HAS_BIAS=has_bias, BLOCK=B, SPAN=cfg.span, GROUP_K=cfg.group_k,
                BLOCK_T=cfg.block_t, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return TritonPlan(dense_x_blocksparse_span_kernel, grid, args, (0, 1, 5, 6), opts, out_width=n_out * B,
                      stable=True)


def _candidates(p: Product) -> list:
    if p.kind == "dw" or interpreting() or not p.a.is_cuda:
        return []
    return list(CANDIDATES.get(p.block, ()))


def _make_plan(cfg: SpanConfig, p: Product) -> TritonPlan:
    if p.kind == "dw":
        raise ValueError("the span kernel computes the forward and the input gradient only")
    return span_plan(p.meta, cfg, p.forward, p.bias, p.a.shape[0], p.a.stride())


BACKEND = Backend("span", (SpanConfig,), _candidates, _make_plan)
