"""Block-sparse linear layer with compressed storage: only the active ``b x b`` blocks of ``W`` exist.

- :mod:`.meta`: :class:`BlockSparseMeta`, the index arrays of a topology;
- :mod:`.op`: :func:`block_sparse_linear` (autograd function, ``torch.library`` ops for ``torch.compile``);
  :mod:`.parts`: its three-piece form (a fused query/key/value projection); :mod:`.registry`: the metadata the
  custom ops find by their index tensors (:func:`register_meta`);
- :mod:`.plans`: the three products as cached launch plans; :mod:`.tuner`: backends and the per-shape choice
  among their candidates (:func:`register_backend` adds one);
- backends: :mod:`.gather` and :mod:`.tma` (Triton, kernels in :mod:`._triton`), :mod:`._cuda` (``csrc/``),
  :mod:`.dense` (the cuBLAS fallback);
- :mod:`.reference`: the plain-torch reference; :mod:`.testing`: hooks for tests and benchmarks.

Measurements and the variants tried: docs/history/blocksparse.md.
"""
from sparsetrain.kernels.blocksparse import flops as _flops
from sparsetrain.kernels.blocksparse import parts as _parts  # noqa: F401  (registers the three-piece custom ops)
from sparsetrain.kernels.blocksparse.meta import KERNEL_BLOCKS, BlockSparseMeta
from sparsetrain.kernels.blocksparse.op import block_sparse_linear, uses_kernels
from sparsetrain.kernels.blocksparse.reference import (
    dense_to_values,
    reference_grads,
    reference_linear,
    values_to_dense,
)
from sparsetrain.kernels.blocksparse.registry import register_meta
from sparsetrain.kernels.blocksparse.tuner import Backend, Product, register_backend, unregister_backend

_flops.register()   # the ops' FLOPs for torch's FlopCounterMode and torch.compile's recompute choices

__all__ = [
    "KERNEL_BLOCKS", "Backend", "BlockSparseMeta", "Product", "block_sparse_linear", "dense_to_values",
    "reference_grads", "reference_linear", "register_backend", "register_meta", "unregister_backend",
    "uses_kernels", "values_to_dense",
]
