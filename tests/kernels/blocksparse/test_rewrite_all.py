"""rewrite_all_: the new topologies of several metadata of one grid, count and kept tables, built together under
vmap, against each metadata's own rewrite_; BlockFormat.set_masks against set_mask one layer at a time."""
from __future__ import annotations

import copy

import pytest
import torch

from sparsetrain.kernels.blocksparse import _cuda_tables as ct
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta, rewrite_all_
from sparsetrain.kernels.blocksparse.reference import block_index


def _random_mask(grid: tuple[int, int], n: int, gen: torch.Generator) -> torch.Tensor:
    flat = torch.zeros(grid[0] * grid[1], dtype=torch.bool)
    flat[torch.randperm(flat.numel(), generator=gen)[:n]] = True
    return flat.view(grid)


def _keep_every_table(meta: BlockSparseMeta, cap: int = 16) -> None:
    """Every kind of table a kernel keeps on a metadata: the CUDA kernels' entry lists, warp ranges, both
    weight-gradient CTA layouts with and without bias and the K-streamed lists; the Triton kernels' fixed lists;
    the reference's block index."""
    for forward in (True, False):
        ct.entry_info(meta, forward)
        ct.warp_ranges(meta, forward, 8)
        ct.ks_table(meta, forward, 2, 64)
        meta.padded_entries(forward, 4, fixed=True)
    for layout in ("strips", "tiles"):
        for bias in (True, False):
            ct.dw_table(meta, bias, cap, layout)
    meta.dw_groups(4, fixed=True)
    block_index(meta)
    assert meta.rewrites_in_place()


@pytest.mark.parametrize("grid,n,layers", [((6, 4), 9, 3), ((4, 12), 20, 2), ((12, 4), 7, 4), ((40, 3), 33, 2),
                                           ((5, 5), 25, 2), ((5, 5), 0, 3), ((1, 9), 4, 5)])
def test_rewrite_all_writes_what_each_rewrite_writes(grid, n, layers):
    """Random topologies of a grid and count (rectangular, tall, full, empty): every index tensor and kept table of
    each metadata after one rewrite_all_ equals, in value and dtype, what its own rewrite_ writes, in the same
    storage; the vmap fallback setting is as it was."""
    gen = torch.Generator().manual_seed(sum(grid) + n)
    metas = [BlockSparseMeta.from_mask(_random_mask(grid, n, gen), 16) for _ in range(layers)]
    for meta in metas:
        _keep_every_table(meta)
    twins = [copy.deepcopy(m) for m in metas]
    new = torch.stack([_random_mask(grid, n, gen) for _ in range(layers)])
    storage = [[t.data_ptr() for t in m.kept_tensors()] for m in metas]
    fallback = torch._C._functorch._is_vmap_fallback_enabled()
    assert rewrite_all_(metas, new)
    assert torch._C._functorch._is_vmap_fallback_enabled() == fallback
    for meta, twin, mask, ptrs in zip(metas, twins, new, storage):
        assert twin.rewrite_(mask)
        got, want = meta.kept_tensors(), twin.kept_tensors()
        assert [t.data_ptr() for t in got] == ptrs and len(got) == len(want) > 20
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w)


def test_rewrite_all_refuses_what_cannot_follow_and_changes_nothing():
    gen = torch.Generator().manual_seed(5)
    metas = [BlockSparseMeta.from_mask(_random_mask((6, 6), 10, gen), 16) for _ in range(2)]
    for meta in metas:
        ct.entry_info(meta, True)
        meta._groups["plans"] = {"not stable": object()}   # a launch plan that cannot follow a new topology
    before = [[t.clone() for t in m.kept_tensors()] for m in metas]
    fallback = torch._C._functorch._is_vmap_fallback_enabled()
    assert not rewrite_all_(metas, torch.stack([_random_mask((6, 6), 10, gen) for _ in range(2)]))
    assert torch._C._functorch._is_vmap_fallback_enabled() == fallback
    for meta, old in zip(metas, before):
        assert all(torch.equal(a, b) for a, b in zip(meta.kept_tensors(), old))
    ct.warp_ranges(metas[0], True, 4)                # a table the other does not keep
    with pytest.raises(ValueError, match="one batch_key"):
        rewrite_all_(metas, torch.stack([_random_mask((6, 6), 10, gen) for _ in range(2)]))


def test_rewrite_all_leaves_to_each_rewrite_what_vmap_cannot_batch(monkeypatch):
    """A kept table whose rule uses an op with no batch rule (``nonzero``): rewrite_all_ writes nothing and says so
    (the caller then rewrites one by one), and each rewrite_ still refills it; a real error is not swallowed."""
    from sparsetrain.kernels.blocksparse import meta as meta_module

    monkeypatch.setitem(meta_module.REFILL, "mine", lambda new, key, value: [
        (value, torch.nonzero(new.row_ptr >= 0).view(-1)[:value.numel()].to(value.dtype))])
    gen = torch.Generator().manual_seed(6)
    metas = [BlockSparseMeta.from_mask(_random_mask((5, 7), 9, gen), 16) for _ in range(2)]
    for meta in metas:
        meta._groups[("mine",)] = torch.zeros(4, dtype=torch.long)
    new = torch.stack([_random_mask((5, 7), 9, gen) for _ in range(2)])
    before = [[t.clone() for t in m.kept_tensors()] for m in metas]
    assert not rewrite_all_(metas, new)
    assert all(torch.equal(a, b) for m, old in zip(metas, before) for a, b in zip(m.kept_tensors(), old))
    assert metas[0].rewrite_(new[0]) and metas[0]._groups[("mine",)].tolist() == [0, 1, 2, 3]

    def broken(new, key, value):
        raise RuntimeError("a bug in a rule")
    monkeypatch.setitem(meta_module.REFILL, "mine", broken)
    with pytest.raises(RuntimeError, match="a bug in a rule"):
        rewrite_all_(metas, new)


def _layers(seed: int, count: int = 3):
    from sparsetrain.nn import SparseLinear

    torch.manual_seed(seed)
    layers = [SparseLinear.from_dense(torch.nn.Linear(96, 160), density=0.2, block=16, format="block")
              for _ in range(count)]
    opt = torch.optim.Adam([p for m in layers for p in m.parameters()], lr=1e-2)
    for m in layers:
        _keep_every_table(m.storage.meta(m), cap=8)
        m(torch.randn(5, 96)).square().sum().backward()
    opt.step()
    return layers, opt


def test_set_masks_leaves_each_layer_as_set_mask_does(monkeypatch):
    """BlockFormat.set_masks of three layers of one shape: values, Adam moments, masks and every kept table equal
    those of set_mask one layer at a time, bit for bit, and the tables were written by one rewrite_all_ (no
    layer's own rewrite_ ran)."""
    a, opt_a = _layers(0)
    b, opt_b = _layers(0)
    assert len({m.storage.graph_batch_key(m, opt_a) for m in a}) == 1
    gen = torch.Generator().manual_seed(1)
    n = a[0].storage.meta(a[0]).n_blocks
    new = torch.stack([_random_mask(tuple(a[0].mask.shape), n, gen) for _ in a])
    for layer, mask in zip(b, new):
        layer.set_mask(mask, opt_b)
    monkeypatch.setattr(BlockSparseMeta, "rewrite_", lambda self, mask: pytest.fail("rewrite_ one by one"))
    a[0].storage.set_masks(a, new, opt_a)
    for la, lb in zip(a, b):
        assert torch.equal(la.mask, lb.mask) and torch.equal(la.values, lb.values)
        for k, v in opt_a.state[la.values].items():
            assert torch.equal(v, opt_b.state[lb.values][k]), k
        ka, kb = la.storage.meta(la).kept_tensors(), lb.storage.meta(lb).kept_tensors()
        assert len(ka) == len(kb) and all(torch.equal(x, y) for x, y in zip(ka, kb))


def test_set_masks_checks_every_count():
    a, opt = _layers(0, count=2)
    new = torch.stack([m.mask.clone() for m in a])
    new[1].view(-1)[new[1].view(-1).logical_not().nonzero()[0]] = True      # one block too many
    with pytest.raises(ValueError, match="active blocks in every layer"):
        a[0].storage.set_masks(a, new, opt)
