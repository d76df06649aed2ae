"""Layouts, distributions, schedules, mask updates and N:M masks (pure logic)."""
import math

import pytest
import torch

from sparsetrain.sparsity.distributions import erdos_renyi, erk, layer_densities, uniform
from sparsetrain.sparsity.layout import (
    Block,
    block_reduce,
    grid_shape,
    n_active_blocks,
    to_element_mask,
    topk_mask,
)
from sparsetrain.sparsity.nm import NM, _patterns, is_transposable_nm, nm_mask, transposable_nm_mask
from sparsetrain.sparsity.schedules import (
    Constant,
    CosineDecay,
    CubicDensity,
    LinearDecay,
    UpdateSchedule,
    make_drop_schedule,
)
from sparsetrain.sparsity.update import prune_to, update_mask


@pytest.mark.parametrize("spec,expect", [(16, Block(16, 16)), ("8x4", Block(8, 4)), ((1, 1), Block(1, 1)),
                                         ([64, 64], Block(64, 64)), ("32", Block(32, 32))])
def test_block_parse(spec, expect):
    assert Block.parse(spec) == expect


@pytest.mark.parametrize("bad", ["16by16", 0, -4, (0, 4), "x"])
def test_block_parse_rejects(bad):
    with pytest.raises(ValueError, match="block"):
        Block.parse(bad)


def test_block_must_divide_weight():
    with pytest.raises(ValueError, match=r"block 16x16 does not divide weight of shape \(100, 64\)"):
        grid_shape((100, 64), Block(16, 16))


@pytest.mark.parametrize("d", [0.0, -0.1, 1.5, float("nan")])
def test_density_range(d):
    with pytest.raises(ValueError, match="density"):
        n_active_blocks((64, 64), Block(8, 8), d)


@pytest.mark.parametrize("block", [Block(1, 1), Block(4, 4), Block(16, 16), Block(8, 32)])
@pytest.mark.parametrize("density", [0.1, 0.25, 0.5, 1.0])
def test_exact_active_count(block, density):
    shape = (128, 256)
    r, c = grid_shape(shape, block)
    k = n_active_blocks(shape, block, density)
    assert k == max(1, round(density * r * c))
    m = topk_mask(torch.rand(r, c), k)
    assert int(m.sum()) == k
    em = to_element_mask(m, block)
    assert em.shape == shape and int(em.sum()) == k * block.numel


def test_block_reduce_is_block_l1():
    w = torch.randn(8, 12)
    b = Block(4, 3)
    ref = torch.stack([torch.stack([w[i * 4:(i + 1) * 4, j * 3:(j + 1) * 3].abs().sum() for j in range(4)])
                       for i in range(2)])
    torch.testing.assert_close(block_reduce(w.abs(), b), ref)


def test_update_mask_counts():
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        mask = torch.rand(12, 10, generator=gen) < 0.3
        n_act = int(mask.sum())
        n = int(torch.randint(0, n_act + 1, (1,), generator=gen))
        drop, grow = torch.rand(12, 10, generator=gen), torch.rand(12, 10, generator=gen)
        u = update_mask(mask, drop, grow, n)
        n_eff = min(n, n_act, mask.numel() - n_act)
        assert int(u.mask.sum()) == n_act
        assert u.n_dropped == u.n_grown == n_eff
        assert (u.n_dropped, u.n_grown) == (int(u.dropped.sum()), int(u.grown.sum()))  # host counts = the masks
        told = update_mask(mask, drop, grow, n, n_active=n_act)      # a caller that knows the count
        assert torch.equal(told.mask, u.mask) and told.counts == u.counts
        assert int((u.mask ^ mask).sum()) == 2 * n_eff
        assert not (u.dropped & u.mask).any() and (u.grown & ~mask).equal(u.grown)


def test_update_mask_picks_by_score():
    mask = torch.tensor([True, True, True, False, False, False])
    drop = torch.tensor([3.0, 1.0, 2.0, 9.0, 9.0, 9.0])   # inactive drop scores are ignored
    grow = torch.tensor([9.0, 9.0, 9.0, 1.0, 5.0, 3.0])   # active grow scores are ignored
    u = update_mask(mask, drop, grow, 2)
    assert u.dropped.tolist() == [False, True, True, False, False, False]
    assert u.grown.tolist() == [False, False, False, False, True, True]


def test_prune_to_keeps_top_active():
    mask = torch.tensor([True, True, True, True, False])
    u = prune_to(mask, torch.tensor([4.0, 1.0, 3.0, 2.0, 100.0]), 2)
    assert u.mask.tolist() == [True, False, True, False, False]


def test_cosine_and_linear_schedules():
    c = CosineDecay(init=0.5, end_step=100)
    assert c(0) == pytest.approx(0.5)
    assert c(50) == pytest.approx(0.25)
    assert c(25) == pytest.approx(0.25 * (1 + math.cos(math.pi / 4)))
    assert c(100) == pytest.approx(0.0) and c(1000) == pytest.approx(0.0)
    lin = LinearDecay(init=0.4, end_step=10)
    assert [round(lin(t), 4) for t in (0, 5, 10)] == [0.4, 0.2, 0.0]
    assert Constant(0.3)(12345) == 0.3
    with pytest.raises(ValueError, match="drop_schedule"):
        make_drop_schedule("exponential", 0.5, 10)


def test_update_schedule_num_updates():
    s = UpdateSchedule.from_num_updates(160, 0, 10_000)
    steps = [t for t in range(10_001) if s.is_update_step(t)]
    assert len(steps) == 160 == s.num_updates()
    assert steps[0] == s.interval and steps[-1] < 10_000
    with pytest.raises(ValueError, match="num_updates"):
        UpdateSchedule.from_num_updates(50, 0, 20)


def test_cubic_density():
    c = CubicDensity(initial=1.0, final=0.1, start=0, end=100)
    assert c(0) == 1.0 and c(100) == pytest.approx(0.1)
    vals = [c(t) for t in range(0, 101, 10)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    assert c(50) == pytest.approx(1 - 0.9 * (1 - 0.5**3))


SHAPES = {"q": (256, 256), "ffn_in": (1024, 256), "ffn_out": (256, 1024), "tiny": (8, 256)}


def _global(dens, shapes=SHAPES):
    return sum(dens[n] * math.prod(s) for n, s in shapes.items()) / sum(math.prod(s) for s in shapes.values())


@pytest.mark.parametrize("fn", [uniform, erdos_renyi, erk])
@pytest.mark.parametrize("density", [0.05, 0.1, 0.3, 0.8])
def test_distributions_meet_budget(fn, density):
    d = fn(SHAPES, density)
    assert _global(d) == pytest.approx(density, rel=1e-9)
    assert all(0 < v <= 1 for v in d.values())


def test_erk_makes_small_layers_dense_and_rebalances():
    d = erk(SHAPES, 0.3)
    assert d["tiny"] == 1.0              # raw ERK density > 1 -> dense
    assert d["q"] > d["ffn_in"]          # smaller layers denser
    assert _global(d) == pytest.approx(0.3)


def test_overrides_and_errors():
    d = layer_densities(SHAPES, 0.2, "uniform", {"ffn_*": 0.1})
    assert d["ffn_in"] == d["ffn_out"] == 0.1 and _global(d) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="distribution"):
        layer_densities(SHAPES, 0.2, "gaussian")
    with pytest.raises(ValueError, match="density_overrides"):
        layer_densities(SHAPES, 0.2, "uniform", {"nothere*": 0.1})


def test_nm_mask():
    w = torch.randn(16, 32)
    m = nm_mask(w, 2, 4)
    g = m.reshape(16, 8, 4)
    assert (g.sum(-1) == 2).all()
    kept = (w.abs().reshape(16, 8, 4) * g).sum(-1)
    top2 = w.abs().reshape(16, 8, 4).topk(2, -1).values.sum(-1)
    torch.testing.assert_close(kept, top2)


def test_pattern_table():
    p = _patterns(2, 4)
    assert p.shape == (90, 16)
    t = p.reshape(90, 4, 4)
    assert (t.sum(1) == 2).all() and (t.sum(2) == 2).all()


@pytest.mark.parametrize("shape", [(4, 4), (64, 128), (96, 32)])
def test_transposable_24(shape):
    w = torch.randn(shape)
    m = transposable_nm_mask(w)
    assert is_transposable_nm(m)
    tiles = m.reshape(shape[0] // 4, 4, shape[1] // 4, 4)
    assert (tiles.sum(3) == 2).all() and (tiles.sum(1) == 2).all()
    kept = (w.abs() * m).sum()
    # beats random valid transposable masks, and is optimal per tile (brute force on a few tiles)
    pats = _patterns(2, 4)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, 90, (tiles.shape[0] * tiles.shape[2],), generator=g)
        rnd = pats[idx].bool().reshape(shape[0] // 4, shape[1] // 4, 4, 4).permute(0, 2, 1, 3).reshape(shape)
        assert is_transposable_nm(rnd)
        assert kept >= (w.abs() * rnd).sum()
    tile = w[:4, :4].abs().flatten()
    assert (tile * m[:4, :4].flatten()).sum() == pytest.approx(float((pats @ tile).max()), rel=1e-6)
    assert NM(2, 4).mask(w).equal(m)


def test_nm_errors():
    with pytest.raises(ValueError, match="4x4 tiles"):
        transposable_nm_mask(torch.randn(6, 8))
    with pytest.raises(ValueError, match="n <= m"):
        NM(5, 4)
