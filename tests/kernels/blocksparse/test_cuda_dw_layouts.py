"""The CTA tables of the CUDA weight-gradient kernel (csrc/bs_dw.cu) in both layouts, "strips" and "tiles" (plain
torch, so here): every block in one CTA at offsets inside its staged ranges, the bias columns summed once, a
plain-torch emulation of the kernel reading the table equal to the reference gradient, the rectangle rule, and
the refill after a mask update."""
from __future__ import annotations

import pytest
import torch

from sparsetrain.kernels.blocksparse._cuda import dw_smem, dw_splits
from sparsetrain.kernels.blocksparse._cuda_tables import (
    DW_LAYOUTS,
    TILE_FILL,
    TILE_SIDE,
    _refill_dw_table,
    dw_ctas_used,
    dw_table,
    dw_tiles,
    dw_widths,
)
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.reference import reference_grads

CAP = 128            # blocks per CTA of the kernel (WARPS * MAXB)
SMEM_SM90 = 232448   # opt-in shared memory of one block on sm_90
LAYOUTS = tuple(DW_LAYOUTS)


def _clustered(grid: tuple[int, int], n: int) -> torch.Tensor:
    """``n`` active blocks packed row by row into the top-left corner: one rectangle far over the cap."""
    R, C = grid
    width = min(C, max(int(n**0.5) + 1, -(-n // R)))
    mask = torch.zeros(grid, dtype=torch.bool)
    k = torch.arange(n)
    mask[k // width, k % width] = True
    return mask


def _over_every_rectangle(grid: tuple[int, int], n: int) -> torch.Tensor:
    """``n`` blocks spread to take the most CTAs of the tiles layout: one block in every rectangle, then ``CAP``
    more (two CTAs) in as many rectangles as they fill, the rest anywhere."""
    R, C = grid
    nr, nc = dw_tiles(grid, n, CAP)
    cells = [[(r, c) for r in range(i * R // nr, (i + 1) * R // nr) for c in range(j * C // nc, (j + 1) * C // nc)]
             for i in range(nr) for j in range(nc)]
    take = [1] * len(cells)
    left = n - len(cells)
    assert left >= 0
    for k, rect in enumerate(cells):
        take[k] += min(CAP, left, len(rect) - 1)
        left -= take[k] - 1
    mask = torch.zeros(grid, dtype=torch.bool)
    chosen = [cell for rect, t in zip(cells, take) for cell in rect[:t]]
    rest = [cell for rect, t in zip(cells, take) for cell in rect[t:]]
    for r, c in chosen + rest[:left]:
        mask[r, c] = True
    return mask


def _cases() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    cases = []
    for grid in ((192, 48), (48, 192), (48, 48), (8, 8), (13, 70)):
        for d in (0.05, 0.1, 0.3, 0.5):
            cases.append((f"{grid} d={d}", torch.rand(grid, generator=gen) < d))
    holes = torch.rand(96, 40, generator=gen) < 0.2
    holes[:30] = False        # a run of empty block rows: whole row bands without blocks
    holes[50:53] = False
    holes[:, 10:25] = False   # empty block columns
    cases.append(("empty rows and columns", holes))
    cases.append(("one dense corner", _clustered((96, 96), 900)))
    cases.append(("one rectangle just over the cap", _clustered((96, 96), CAP + 1)))
    cases.append(("dense", torch.ones(40, 24, dtype=torch.bool)))
    cases.append(("no block", torch.zeros(20, 30, dtype=torch.bool)))
    return cases


CASES = _cases()


def _check_table(meta: BlockSparseMeta, layout: str, with_bias: bool) -> None:
    cta, blk, aw, bw = dw_table(meta, with_bias, CAP, layout)
    used = dw_ctas_used(meta, with_bias, CAP, layout)
    O, I, n = meta.out_features, meta.in_features, meta.n_blocks
    assert (aw, bw) == dw_widths(meta, CAP, layout) and aw % 16 == 0 and bw % 16 == 0
    rows, spare = cta[:used].tolist(), cta[used:]
    assert not spare.any() and spare.shape[0] >= 8               # room for later topologies, no work
    assert blk.shape == (max(n, 1), 4)
    seen = []
    for first, cnt, a0, an, b0, bn, c0, c1 in rows:
        # no empty row among the used ones (but the one placeholder row of a table without work)
        assert cnt > 0 or c1 > c0 or rows == [[0] * 8]
        assert 0 <= cnt <= CAP
        for v in (a0, an, b0, bn, c0, c1):
            assert v % 16 == 0
        assert 0 <= a0 and a0 + an <= O and an <= aw              # staged ranges inside the grid and the widths
        assert 0 <= b0 and b0 + bn <= I and bn <= bw
        for slot, ao, bo, zero in blk[first:first + cnt].tolist():
            r, c = int(meta.row_idx[slot]), int(meta.col_idx[slot])
            assert (a0 + ao, b0 + bo) == (r * 16, c * 16) and zero == 0
            assert 0 <= ao and ao + 16 <= an and 0 <= bo and bo + 16 <= bn
            seen.append(slot)
        if with_bias and c1 > c0:
            assert a0 <= c0 and c1 <= a0 + an                     # the bias columns are staged
            assert c1 - c0 <= 2 * 512                             # two columns per thread of the CTA
    assert sorted(seen) == list(range(n))                         # every block once
    if with_bias:
        pos = 0
        for lo, hi in sorted((r[6], r[7]) for r in rows if r[7] > r[6]):
            assert lo == pos                                      # disjoint, no gap
            pos = hi
        assert pos == O
    else:
        assert all(r[7] <= r[6] for r in rows)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_block_once_inside_its_ctas_staged_ranges(layout, with_bias):
    """Every active block in exactly one CTA (at most CAP blocks each) with its slot and its dY / X offsets inside
    that CTA's staged ranges; staged ranges inside the grid and no wider than dw_widths; with bias, the bias
    column ranges partition the output features and lie inside their CTA's staged dY range; the spare rows
    hold no work. Random masks of several grids and densities, empty rows and columns, a dense corner, no
    block at all."""
    for name, mask in CASES:
        try:
            _check_table(BlockSparseMeta.from_mask(mask, 16), layout, with_bias)
        except AssertionError as e:
            raise AssertionError(f"{layout}, {name}, bias={with_bias}") from e


def _emulate(meta: BlockSparseMeta, layout: str, with_bias: bool, x: torch.Tensor, dy: torch.Tensor):
    """What bs_dw computes from its table, in plain torch: per CTA the staged dY and X columns (zero past the
    staged widths, as in shared memory), each block's ``dY[:, A]ᵀ · X[:, B]`` added into its slot, and the CTA's
    bias columns summed from the staged dY."""
    cta, blk, aw, bw = dw_table(meta, with_bias, CAP, layout)
    T = x.shape[0]
    dv = torch.zeros(max(meta.n_blocks, 1), 16, 16)
    db = torch.zeros(meta.out_features)
    for first, cnt, a0, an, b0, bn, c0, c1 in cta.tolist():
        if cnt == 0 and c1 <= c0:
            continue   # a spare row returns at once
        a = torch.zeros(T, aw + 8)
        b = torch.zeros(T, bw + 8)
        a[:, :an], b[:, :bn] = dy[:, a0:a0 + an], x[:, b0:b0 + bn]
        for slot, ao, bo, _ in blk[first:first + cnt].tolist():
            dv[slot] += a[:, ao:ao + 16].t() @ b[:, bo:bo + 16]
        if with_bias and c1 > c0:
            db[c0:c1] += a[:, c0 - a0:c1 - a0].sum(0)
    return dv[:meta.n_blocks], db


@pytest.mark.parametrize("layout", LAYOUTS)
def test_emulated_kernel_equals_the_reference_gradient(layout):
    """The kernel's arithmetic emulated from the table (plain torch, fp32) equals the reference weight and bias
    gradients on fresh random inputs."""
    gen = torch.Generator().manual_seed(5)
    for name, mask in CASES:
        meta = BlockSparseMeta.from_mask(mask, 16)
        x = torch.randn(24, meta.in_features, generator=gen)
        dy = torch.randn(24, meta.out_features, generator=gen)
        _, dv_ref, db_ref = reference_grads(x, dy, torch.zeros(meta.n_blocks, 16, 16), meta)
        for with_bias in (True, False):
            dv, db = _emulate(meta, layout, with_bias, x, dy)
            torch.testing.assert_close(dv, dv_ref, msg=f"{layout}, {name}, bias={with_bias}")
            if with_bias:
                torch.testing.assert_close(db, db_ref, msg=f"{layout}, {name}")


def test_the_tile_rule():
    """dw_tiles: the largest rectangle expects at most TILE_FILL * cap blocks, its sides are at most TILE_SIDE
    (so 32-token chunks fit sm_90's shared memory), and no other cut within those limits stages fewer block
    columns (then: fewer rectangles, more row bands)."""
    for (R, C) in ((192, 48), (48, 192), (48, 48), (8, 8), (256, 64), (256, 256), (400, 100), (1, 300), (300, 1)):
        for d in (0.01, 0.05, 0.1, 0.3, 0.5, 1.0):
            n = max(1, round(d * R * C))
            nr, nc = dw_tiles((R, C), n, CAP)
            r, c = -(-R // nr), -(-C // nc)
            assert r <= TILE_SIDE and c <= TILE_SIDE and 1 <= nr <= R and 1 <= nc <= C
            assert r * c * n <= TILE_FILL * CAP * R * C or (r, c) == (1, 1)
            assert dw_smem(32, r * 16, c * 16) <= SMEM_SM90
            fits = [(kc * R + kr * C, kr * kc, -kr) for kr in range(1, R + 1) for kc in range(1, C + 1)
                    if -(-R // kr) <= TILE_SIDE and -(-C // kc) <= TILE_SIDE
                    and -(-R // kr) * -(-C // kc) * n <= TILE_FILL * CAP * R * C]
            assert (nc * R + nr * C, nr * nc, -nr) == min(fits), ((R, C), d)
    assert dw_tiles((192, 48), 922, CAP) == (5, 2)      # BERT-base 768 -> 3072 at density 0.1


def _staged_per_block(meta: BlockSparseMeta, layout: str) -> float:
    cta = dw_table(meta, True, CAP, layout)[0]
    return float((cta[:, 3] + cta[:, 5]).sum()) / 16 / meta.n_blocks


def test_tiles_stage_fewer_columns_where_the_narrower_operand_is_wide():
    """Where the narrower operand is wide (4096 -> 4096) or the density high, a tile CTA stages fewer block
    columns per block than a strip CTA, which stages that whole operand."""
    gen = torch.Generator().manual_seed(2)
    wide = BlockSparseMeta.from_mask(torch.rand(256, 256, generator=gen) < 0.1, 16)
    assert _staged_per_block(wide, "tiles") < 0.5 * _staged_per_block(wide, "strips")
    dense = BlockSparseMeta.from_mask(torch.rand(192, 48, generator=gen) < 0.5, 16)
    assert _staged_per_block(dense, "tiles") < 0.8 * _staged_per_block(dense, "strips")


def _refill_matches_a_fresh_build(meta: BlockSparseMeta, new_mask: torch.Tensor, layout: str, with_bias: bool):
    key = ("bs_dw_table", with_bias, CAP, layout)
    kept = dw_table(meta, with_bias, CAP, layout)
    new = BlockSparseMeta.from_mask(new_mask, 16)
    pairs = _refill_dw_table(new, key, kept)
    fresh = dw_table(new, with_bias, CAP, layout)
    used = dw_ctas_used(new, with_bias, CAP, layout)
    if pairs is None:
        assert used > kept[0].shape[0]     # refused only where the new table outgrows the kept rows
        return None
    (cta, new_cta), (blk, new_blk) = pairs
    assert cta is kept[0] and blk is kept[1] and new_cta.shape == cta.shape and new_blk.shape == blk.shape
    assert torch.equal(new_cta[:used], fresh[0][:used]) and not new_cta[used:].any()
    assert torch.equal(new_blk, fresh[1]) and fresh[2:] == kept[2:]
    return pairs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_refill_after_a_topology_change_equals_a_fresh_build(layout):
    """_refill_dw_table for a new topology of the same grid and active count (a shuffle; the blocks packed into
    one corner; spread to take the most tile CTAs) gives the rows a fresh build gives, in the kept tensors'
    shapes; the tiles layout keeps rows for any topology, so it always refills; where the kept rows are too few
    (taken away here) it returns None, and BlockSparseMeta.rewrite_ refills in place or refuses."""
    gen = torch.Generator().manual_seed(9)
    for grid, d in (((192, 48), 0.1), ((48, 192), 0.3), ((96, 96), 0.1), ((30, 20), 0.5), ((256, 256), 0.1)):
        mask = torch.rand(grid, generator=gen) < d
        n = int(mask.sum())
        shuffled = mask.flatten()[torch.randperm(mask.numel(), generator=gen)].view(grid)
        for with_bias in (True, False):
            for new in (shuffled, _clustered(grid, n), _over_every_rectangle(grid, n)):
                meta = BlockSparseMeta.from_mask(mask, 16)
                pairs = _refill_matches_a_fresh_build(meta, new, layout, with_bias)
                if layout == "tiles":
                    assert pairs is not None, (grid, d, with_bias)
            # too few rows kept: the new table does not fit, nothing to copy
            meta = BlockSparseMeta.from_mask(mask, 16)
            cta, blk, aw, bw = dw_table(meta, with_bias, CAP, layout)
            need = dw_ctas_used(BlockSparseMeta.from_mask(shuffled, 16), with_bias, CAP, layout)
            key = ("bs_dw_table", with_bias, CAP, layout)
            assert _refill_dw_table(BlockSparseMeta.from_mask(shuffled, 16), key,
                                    (cta[:need - 1], blk, aw, bw)) is None
    # through rewrite_: the kept tensors hold the new topology's table, or nothing changes
    mask = torch.rand(96, 96, generator=gen) < 0.1
    meta = BlockSparseMeta.from_mask(mask, 16)
    cta, blk, _, _ = dw_table(meta, True, CAP, layout)
    before = cta.clone()
    corner = _clustered((96, 96), int(mask.sum()))
    new_meta = BlockSparseMeta.from_mask(corner, 16)
    fresh, used = dw_table(new_meta, True, CAP, layout), dw_ctas_used(new_meta, True, CAP, layout)
    fits = used <= cta.shape[0]
    assert fits or layout != "tiles"
    assert meta.rewrite_(corner) is fits
    if fits:
        assert meta._groups[("bs_dw_table", True, CAP, layout)][0] is cta
        assert torch.equal(cta[:used], fresh[0][:used]) and not cta[used:].any() and torch.equal(blk, fresh[1])
    else:
        assert torch.equal(cta, before)


def test_dw_splits_fill_one_wave():
    """The weight-gradient kernel runs one CTA per multiprocessor: its token splits fill one wave (no second,
    partial wave), keep at least 4 chunks per split, and a table of more CTAs than multiprocessors is not split."""
    for n_cta in (1, 2, 3, 8, 10, 64, 132):
        s = dw_splits(32768, 32, n_cta, 132)
        assert n_cta * s <= 132 < n_cta * (s + 1), n_cta
    assert dw_splits(32768, 32, 200, 132) == 1
    assert dw_splits(256, 32, 1, 132) == 2          # 8 chunks: 4 each
    assert dw_splits(5, 16, 1, 132) == 1


@pytest.mark.parametrize("cap", [CAP, 16, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_fixed_size_build_gives_the_host_builds_rows(layout, cap):
    """The CTA table built in whole-tensor ops (``_dw_fixed``: no host sync on a GPU, what a mask update runs)
    holds exactly the host build's rows, then zeros, in the kept table's size, and the same block rows: every case
    above, both bias settings, caps that cut rectangles and strips into many CTAs."""
    from sparsetrain.kernels.blocksparse import _dw_fixed
    from sparsetrain.kernels.blocksparse._cuda_tables import STRIP_BLOCKS, _x_whole

    for name, mask in CASES:
        meta = BlockSparseMeta.from_mask(mask, 16)
        for with_bias in (True, False):
            cta, blk, _, _ = dw_table(meta, with_bias, cap, layout)
            used = dw_ctas_used(meta, with_bias, cap, layout)
            assert cta.shape[0] >= DW_LAYOUTS[layout].most(meta, cap)      # room for any topology
            if layout == "tiles":
                got, got_blk = _dw_fixed.tile_rows(meta, with_bias, cap, cta.shape[0],
                                                   dw_tiles(meta.grid, meta.n_blocks, cap))
            else:
                got, got_blk = _dw_fixed.strip_rows(meta, with_bias, cap, cta.shape[0], STRIP_BLOCKS,
                                                    _x_whole(meta))
            assert got.dtype == cta.dtype and got_blk.dtype == blk.dtype
            assert torch.equal(got[:used], cta[:used]), (name, with_bias)
            assert not got[used:].any(), (name, with_bias)
            assert torch.equal(got_blk, blk), (name, with_bias)
