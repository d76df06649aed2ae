"""BlockSparseMeta: the index arrays of a topology and the entry lists derived from it."""
from __future__ import annotations

import pytest
import torch
from blocksparse_cases import make_mask

from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.reference import block_index


def test_meta_matches_mask():
    mask = make_mask("empty_rows_cols", (6, 5), torch.Generator().manual_seed(1))
    meta = BlockSparseMeta.from_mask(mask, 16)
    pos = [(r, c) for r in range(6) for c in range(5) if mask[r, c]]  # row-major = slot order
    assert meta.n_blocks == len(pos) and (meta.out_features, meta.in_features) == (96, 80)
    assert [(int(r), int(c)) for r, c in zip(meta.row_idx, meta.col_idx)] == pos
    assert meta.row_ptr.tolist() == [0] + torch.cumsum(mask.sum(1), 0).tolist()
    # transpose metadata: per block column, rows ascending, each entry naming the slot of (row, col)
    for c in range(5):
        entries = range(int(meta.col_ptr[c]), int(meta.col_ptr[c + 1]))
        rows = [int(meta.t_row_idx[e]) for e in entries]
        assert rows == [r for r in range(6) if mask[r, c]]
        for e, r in zip(entries, rows):
            assert pos[int(meta.t_slot[e])] == (r, c)
    assert all(t.dtype == torch.int32 for t in (meta.row_ptr, meta.col_idx, meta.col_ptr, meta.t_slot))


@pytest.mark.parametrize("group", [1, 3, 4])
def test_dw_groups_cover_every_slot_once(group):
    mask = make_mask("empty_rows_cols", (7, 9), torch.Generator().manual_seed(2))
    meta = BlockSparseMeta.from_mask(mask, 16)
    grow, gstart, gcount, gfirst, n = meta.dw_groups(group)
    assert grow.numel() == n
    covered = []
    for r, s, k in zip(grow.tolist(), gstart.tolist(), gcount.tolist()):
        assert 0 <= k <= group
        covered += list(range(s, s + k))
        assert all(int(meta.row_idx[i]) == r for i in range(s, s + k))
    assert sorted(covered) == list(range(meta.n_blocks))
    assert sorted(grow[gfirst.bool()].tolist()) == list(range(7))  # one first group per row, empty rows too


@pytest.mark.parametrize("forward", [True, False])
@pytest.mark.parametrize("group_k", [1, 4])
def test_padded_entries(forward, group_k):
    mask = make_mask("empty_rows_cols", (7, 9), torch.Generator().manual_seed(9))
    meta = BlockSparseMeta.from_mask(mask, 16)
    ptr, kidx, slot, out = meta.padded_entries(forward, group_k)
    grid = mask if forward else mask.t()
    for j in range(grid.shape[0]):
        lo, hi = int(ptr[j]), int(ptr[j + 1])
        assert hi - lo >= group_k and (hi - lo) % group_k == 0 and bool((out[lo:hi] == j).all())
        real = [(int(k), int(s)) for k, s in zip(kidx[lo:hi], slot[lo:hi]) if s >= 0]
        assert [k for k, _ in real] == grid[j].nonzero().flatten().tolist()
        for k, s in real:  # the slot holds block (j, k) of W (forward) or (k, j) (transpose)
            r, c = (j, k) if forward else (k, j)
            assert (int(meta.row_idx[s]), int(meta.col_idx[s])) == (r, c)


def test_meta_rejects_bad_mask():
    with pytest.raises(TypeError, match="mask"):
        BlockSparseMeta.from_mask(torch.ones(2, 2), 16)
    with pytest.raises(ValueError, match="mask"):
        BlockSparseMeta.from_mask(torch.ones(2, dtype=torch.bool), 16)



@pytest.mark.parametrize("forward", [True, False])
@pytest.mark.parametrize("group_k", [1, 4])
def test_fixed_padded_entries_hold_the_exact_lists_then_padding(forward, group_k):
    """The fixed-size entry lists (what the Triton plans use) are the exact lists, then padding up to the size
    any topology of the active count needs."""
    mask = make_mask("empty_rows_cols", (7, 9), torch.Generator().manual_seed(9))
    meta = BlockSparseMeta.from_mask(mask, 16)
    exact = meta.padded_entries(forward, group_k)
    fixed = meta.padded_entries(forward, group_k, fixed=True)
    n_out = 7 if forward else 9
    assert torch.equal(exact[0], fixed[0])
    used = int(exact[0][-1])
    for e, f in zip(exact[1:], fixed[1:]):
        assert f.numel() == meta.n_blocks + n_out * group_k and torch.equal(e, f[:used])
    assert bool((fixed[2][used:] == -1).all()) and bool((fixed[3][used:] == n_out).all())


@pytest.mark.parametrize("group", [1, 3])
def test_fixed_dw_groups_pad_with_groups_that_do_nothing(group):
    mask = make_mask("empty_rows_cols", (7, 9), torch.Generator().manual_seed(2))
    meta = BlockSparseMeta.from_mask(mask, 16)
    grow, gstart, gcount, gfirst, n = meta.dw_groups(group)
    fgrow, fgstart, fgcount, fgfirst, fn = meta.dw_groups(group, fixed=True)
    assert fn == 7 + meta.n_blocks // group >= n and fgcount.numel() == fn
    for a, b in ((grow, fgrow), (gstart, fgstart), (gcount, fgcount), (gfirst, fgfirst)):
        assert torch.equal(a, b[:n])
    assert bool((fgcount[n:] == -1).all()) and bool((fgfirst[n:] == 0).all())
    assert meta.dw_groups_used(group) == n          # the plans choose their token split for these


def test_rewrite_installs_a_topology_in_place_and_refills_derived_lists():
    """The new topology is built on the host and copied into the kept tensors, per dtype in one transfer: the int32
    lists and the int64 block index (the reference path's) both hold what a fresh build of the new mask holds."""
    gen = torch.Generator().manual_seed(5)
    mask = torch.rand(6, 8, generator=gen) < 0.3
    meta = BlockSparseMeta.from_mask(mask, 16)
    lists = [meta.padded_entries(True, 4, fixed=True), meta.padded_entries(False, 1, fixed=True),
             meta.dw_groups(2, fixed=True), block_index(meta)]
    ids = [id(t) for group in lists for t in group if torch.is_tensor(t)] + [id(getattr(meta, n))
                                                                             for n in meta.TENSORS]
    flat = mask.flatten()
    new = flat[torch.randperm(flat.numel(), generator=gen)].view(6, 8)   # same count, another topology
    assert not torch.equal(new, mask)
    assert meta.rewrite_(new) is True
    fresh = BlockSparseMeta.from_mask(new, 16)
    for name in meta.TENSORS:
        assert torch.equal(getattr(meta, name), getattr(fresh, name)), name
    want = [fresh.padded_entries(True, 4, fixed=True), fresh.padded_entries(False, 1, fixed=True),
            fresh.dw_groups(2, fixed=True), block_index(fresh)]
    for got, ref in zip(lists, want):
        for g, r in zip(got, ref, strict=True):
            assert (torch.equal(g, r) and g.dtype == r.dtype) if torch.is_tensor(g) else g == r
    assert ids == [id(t) for group in lists for t in group if torch.is_tensor(t)] + [id(getattr(meta, n))
                                                                                     for n in meta.TENSORS]


def test_rewrite_refuses_what_cannot_follow_and_changes_nothing():
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[0, :2] = True
    meta = BlockSparseMeta.from_mask(mask, 16)
    before = [getattr(meta, n).clone() for n in meta.TENSORS]
    meta.padded_entries(True, 1)                                    # the exact lists (the CUDA tables' input)
    assert meta.rewrite_(mask.flip(1)) is False
    assert all(torch.equal(getattr(meta, n), b) for n, b in zip(meta.TENSORS, before))
    meta._groups.clear()
    meta._groups["plans"] = {"k": object()}                         # a plan that does not say it is stable
    assert meta.rewrite_(mask.flip(1)) is False
    meta._groups.clear()
    with pytest.raises(ValueError, match="keeps the grid"):
        meta.rewrite_(torch.ones(4, 4, dtype=torch.bool))
