"""The custom ops' metadata registry: the ``torch.library`` ops of :mod:`.op`, :mod:`.parts` and :mod:`.gelu` take
a :class:`~.meta.BlockSparseMeta` as its six index tensors (:func:`op_meta_args`) and find the metadata again by
their data pointers (:func:`_meta_for`); :func:`register_meta` installs a layer's own metadata there.
"""
from __future__ import annotations

from torch import Tensor

from sparsetrain.kernels.blocksparse.meta import REWRITTEN, BlockSparseMeta

# The metadata travels as its six index tensors; the BlockSparseMeta (with its derived
# entry lists and launch plans) is looked up by their data pointers, so it is built once per topology. The
# registry's metas hold their tensors, so no other tensor can be allocated at those addresses while an entry
# lives: a pointer match is the same tensors. BlockSparseMeta.rewrite_ may give them a new topology in place,
# together with the lists and plans kept on the metadata it was called on; another metadata the ops built over
# the same tensors (after the registry's bound cleared it, say) keeps the old lists, so a rewrite makes its
# tensors lead to the rewritten metadata (_follow_rewrite).
_OP_METAS: dict[tuple, BlockSparseMeta] = {}
OP_META_BUILDS = [0]  # how many metas the ops built (tests and benchmarks read it)


def _registry_key(meta: BlockSparseMeta) -> tuple:
    return tuple(getattr(meta, n).data_ptr() for n in BlockSparseMeta.TENSORS) + (
        meta.out_features, meta.in_features, meta.block_rows)


def register_meta(meta: BlockSparseMeta, replaces: BlockSparseMeta | None = None) -> None:
    """Makes ``meta`` (and the entry lists and launch plans it caches) the one the custom ops use for its
    tensors: an eager step before ``torch.compile(mode="reduce-overhead")`` then builds them outside the
    CUDA-graph memory pool. The block format registers every meta it installs, and passes the one it replaces
    (a mask update, a move): that entry goes, so an old topology's index tensors and plans are not kept alive
    (160 updates x 72 layers of a BERT-base run would otherwise pile up to the registry's bound of 4096)."""
    if replaces is not None:
        old = _registry_key(replaces)
        if _OP_METAS.get(old) is replaces:
            del _OP_METAS[old]
    key = _registry_key(meta)
    if len(_OP_METAS) >= 4096:
        _OP_METAS.clear()
    _OP_METAS[key] = meta


def _follow_rewrite(meta: BlockSparseMeta) -> None:
    key = _registry_key(meta)
    if key in _OP_METAS:
        _OP_METAS[key] = meta


REWRITTEN.append(_follow_rewrite)


def _meta_for(tensors: tuple[Tensor, ...], out_features: int, in_features: int, block: int) -> BlockSparseMeta:
    key = tuple(t.data_ptr() for t in tensors) + (out_features, in_features, block)
    meta = _OP_METAS.get(key)
    if meta is None:
        if len(_OP_METAS) >= 4096:  # mostly replaced topologies: drop them all (live ones are rebuilt once)
            _OP_METAS.clear()
        meta = BlockSparseMeta(out_features, in_features, block, block, int(tensors[1].numel()), *tensors)
        _OP_METAS[key] = meta
        OP_META_BUILDS[0] += 1
    return meta


def op_meta_args(meta: BlockSparseMeta) -> tuple:
    """The metadata as the custom ops take it: its six index tensors, out_features, in_features, block."""
    return (*(getattr(meta, n) for n in BlockSparseMeta.TENSORS), meta.out_features, meta.in_features, meta.block)
