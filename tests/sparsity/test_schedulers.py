"""Schedulers on real optimizers: exact densities, constant counts, zeroed regrowth, determinism, ranks."""
import os
import sys
import textwrap

import pytest
import torch
from torch import nn

from sparsetrain.nn import SparseLinear, sparsify
from sparsetrain.sparsity import (
    SET,
    Dense,
    GradualMagnitude,
    PruneRegrow,
    RigL,
    SparseThenDense,
    Static,
)
from sparsetrain.sparsity.layout import n_active_blocks
from sparsetrain.sparsity.nm import is_transposable_nm
from sparsetrain.training.guard import mask_update_due


class MLP(nn.Module):
    def __init__(self, d=64, h=128):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


def _setup(sched, density=0.25, block=8, fmt="masked", steps=40, seed=0, opt="adamw"):
    torch.manual_seed(seed)
    model = MLP()
    layers = sparsify(model, targets=["up", "down"], density=sched.initial_density(density), block=block,
                      format=fmt, seed=seed)
    sched.set_targets({n: density for n in layers})  # every scheduler takes them; gradual pruning uses them
    optim = (torch.optim.AdamW(model.parameters(), lr=1e-2) if opt == "adamw"
             else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    sched.attach(model, optim, total_steps=steps)
    return model, layers, optim


def _train_step(model, optim, gen):
    x = torch.randn(16, 64, generator=gen)
    y = torch.randint(0, 4, (16,), generator=gen)
    loss = nn.functional.cross_entropy(model(x), y)
    optim.zero_grad()
    loss.backward()
    optim.step()
    return loss.item()


def _run(sched, steps=40, **kw):
    model, layers, optim = _setup(sched, steps=steps, **kw)
    gen = torch.Generator().manual_seed(123)
    records = []
    for step in range(1, steps + 1):
        before = {n: l.mask.clone() for n, l in layers.items()}
        _train_step(model, optim, gen)
        rec = sched.step(step)
        records.append((step, rec, before))
    return model, layers, optim, records


@pytest.mark.parametrize("policy", [SET(), RigL()])
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_prune_regrow_invariants(policy, opt):
    sched = PruneRegrow(policy=policy, drop_fraction=0.3, drop_schedule="cosine", num_updates=5)
    model, layers, optim = _setup(sched, opt=opt)
    expect = {n: n_active_blocks(l.mask.shape, l.block, 0.25) * 0 + l.n_active for n, l in layers.items()}
    for n, l in layers.items():
        assert l.n_active == n_active_blocks((l.out_features, l.in_features), l.block, 0.25)
    gen = torch.Generator().manual_seed(5)
    updates = 0
    for step in range(1, 41):
        before = {n: l.mask.clone() for n, l in layers.items()}
        armed = {n: l.capture_dense_grad for n, l in layers.items()}
        _train_step(model, optim, gen)
        rec = sched.step(step)
        is_update = sched.schedule.is_update_step(step)
        assert (rec is not None) == is_update
        assert all(a == (is_update and policy.needs_grad) for a in armed.values())
        for n, l in layers.items():
            assert l.n_active == expect[n]                      # exact count after every step
            em = l.element_mask()
            assert (l.weight.detach()[~em] == 0).all()         # pruned weights are zero
            for v in optim.state[l.weight].values():
                if torch.is_tensor(v) and v.shape == l.weight.shape:
                    assert (v[~em] == 0).all()                  # ...and so are their moments
        if not is_update:
            assert all(l.mask.equal(before[n]) for n, l in layers.items())
            continue
        updates += 1
        frac = sched.drop_fn(step)
        total = 0
        for n, l in layers.items():
            k = int(round(frac * expect[n]))
            grown = l.mask & ~before[n]
            assert int(grown.sum()) == k and int((before[n] & ~l.mask).sum()) == k   # changes by expected count
            eg = grown.repeat_interleave(8, 0).repeat_interleave(8, 1)
            assert (l.weight.detach()[eg] == 0).all()            # regrown start at zero
            for v in optim.state[l.weight].values():
                if torch.is_tensor(v) and v.shape == l.weight.shape:
                    assert (v[eg] == 0).all()                     # with zeroed moments
            total += k
        assert rec["pruned"] == rec["regrown"] == total
    assert updates == 5


def test_rigl_grows_where_gradient_is_largest():
    sched = PruneRegrow(policy=RigL(), drop_fraction=0.2, drop_schedule="constant", interval=3)
    model, layers, optim = _setup(sched, steps=10)
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 3):
        _train_step(model, optim, gen)
        sched.step(step)
    before = {n: l.mask.clone() for n, l in layers.items()}
    _train_step(model, optim, gen)                       # step 3 is an update step: dense grads captured
    grads = {n: l.dense_grad.clone() for n, l in layers.items()}
    sched.step(3)
    for n, l in layers.items():
        g = grads[n].abs().reshape(l.mask.shape[0], 8, l.mask.shape[1], 8).sum((1, 3))
        grown = l.mask & ~before[n]
        k = int(grown.sum())
        assert k > 0
        cand = g.masked_fill(before[n], float("-inf")).flatten()
        assert set(cand.topk(k).indices.tolist()) == set(grown.flatten().nonzero().flatten().tolist())
        assert l.dense_grad is None and not l.capture_dense_grad


def test_prune_regrow_is_deterministic():
    def masks():
        _, layers, _, _ = _run(PruneRegrow(policy=SET(), drop_fraction=0.5, num_updates=6), seed=7)
        return {n: l.mask.clone() for n, l in layers.items()}
    a, b = masks(), masks()
    assert all(a[n].equal(b[n]) for n in a)


def test_static_and_dense():
    _, layers, _, records = _run(Static())
    assert all(r is None for _, r, _ in records)
    assert all(l.mask.equal(records[0][2][n]) for n, l in layers.items())
    d = Dense()
    assert d.initial_density(0.1) == 0.1 and not d.sparse
    d.attach(MLP(), None, total_steps=5)
    assert d.step(1) is None and d.density == 1.0


def test_gradual_magnitude_reaches_target():
    sched = GradualMagnitude(initial_density=1.0, num_updates=8, start=0.0, end=0.5)
    model, layers, optim, records = _run(sched, steps=40, density=0.1)
    for n, l in layers.items():
        assert l.n_active == n_active_blocks((l.out_features, l.in_features), l.block, 0.1)
    counts = [sum(b.sum().item() for b in before.values()) for _, _, before in records]
    assert all(a >= b for a, b in zip(counts, counts[1:]))  # density never increases
    assert sched.density == pytest.approx(0.1, abs=0.01)


def test_gradual_magnitude_on_the_block_format_follows_the_masked_format():
    """The block format shrinks its storage with the count (values and Adam moments gathered at the new count, the
    metadata rebuilt): the same masks at every update as the masked format, the same weights, and after the last
    update values, moments and metadata sized for the final count."""
    runs = {}
    # (attaching to the block format lets torch.compile treat changing counts as dynamic: process-wide, undone here)
    with torch._dynamo.config.patch(force_parameter_static_shapes=True, force_nn_module_property_static_shapes=True):
        for fmt in ("masked", "block"):
            sched = GradualMagnitude(initial_density=1.0, num_updates=6, start=0.0, end=0.5)
            runs[fmt] = _run(sched, steps=20, density=0.25, block=16, fmt=fmt)
        assert not torch._dynamo.config.force_parameter_static_shapes
    (_, m_layers, _, m_records), (_, b_layers, b_optim, b_records) = runs["masked"], runs["block"]
    assert [(s, r) for s, r, _ in b_records if r] == [(s, r) for s, r, _ in m_records if r]   # same pruned counts
    for (_, _, mb), (_, _, bb) in zip(m_records, b_records, strict=True):
        assert all(torch.equal(mb[n], bb[n]) for n in mb)                                    # same masks each step
    for n, layer in b_layers.items():
        k = n_active_blocks((layer.out_features, layer.in_features), layer.block, 0.25)
        assert layer.n_active == k and layer.values.shape == (k, 16, 16) and layer.storage.meta(layer).n_blocks == k
        state = b_optim.state[layer.values]
        assert state["exp_avg"].shape == state["exp_avg_sq"].shape == layer.values.shape
        torch.testing.assert_close(layer.dense_weight(), m_layers[n].dense_weight(), rtol=1e-4, atol=1e-5)


def test_sparse_then_dense_switches_without_rebuilding_optimizer():
    sched = SparseThenDense(sparse_fraction=0.5)
    model, layers, optim = _setup(sched, density=1.0, block=1, fmt="masked_st", steps=10)
    params = {n: l.weight_parameter() for n, l in layers.items()}
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 11):
        _train_step(model, optim, gen)
        rec = sched.step(step)
        if step < 5:
            for n, l in layers.items():
                assert is_transposable_nm(l.mask)
                assert l.mask.equal(sched.nm.mask(l.weight_parameter().detach()))  # recomputed every step
        if step == 5:
            assert rec["event"] == "phase_switch"
    for n, p in params.items():
        mod = model.get_submodule(n)
        assert type(mod) is nn.Linear and mod.weight is p and p in optim.state   # same Parameter, same state
    assert sched.density == 1.0


@pytest.mark.parametrize("fmt", ["masked_st", "2:4"])
def test_sparse_then_dense_asks_for_update_steps_only_where_the_scheduler_sets_masks(fmt):
    # masked_st takes its mask from the scheduler every step (the loop checks the weights are finite first, a host
    # sync); the 2:4 format derives it in its forward, so only the switch is an update step and no step syncs for it
    sched = SparseThenDense(sparse_fraction=0.5)
    model, layers, optim = _setup(sched, density=1.0, block=1, fmt=fmt, steps=10)
    assert all(layer.caps.derives_mask == (fmt == "2:4") for layer in layers.values())
    gen = torch.Generator().manual_seed(0)
    due, events = [], []
    for step in range(1, 11):
        due.append(mask_update_due(sched, step))
        _train_step(model, optim, gen)
        rec = sched.step(step)
        events.append(rec and rec["event"])
        if step < 5:
            assert all(is_transposable_nm(layer.mask) for layer in layers.values())
    assert due == ([True] * 5 if fmt == "masked_st" else [False] * 4 + [True]) + [False] * 5
    assert events == [None] * 4 + ["phase_switch"] + [None] * 5


@pytest.mark.parametrize("fmt", ["masked_st", "2:4"])
def test_a_sparse_phase_as_long_as_the_run_never_switches(fmt):
    # sparse_fraction 1.0: the run ends with its 2:4 layers (a switch at the last step would hand over the
    # straight-through dense weights, unmasked, as the final model)
    sched = SparseThenDense(sparse_fraction=1.0)
    model, layers, optim = _setup(sched, density=1.0, block=1, fmt=fmt, steps=6)
    gen = torch.Generator().manual_seed(0)
    records = []
    for step in range(1, 7):
        _train_step(model, optim, gen)
        records.append(sched.step(step))
    assert records == [None] * 6 and not sched.switched and sched.density == 0.5
    assert all(isinstance(model.get_submodule(n), SparseLinear) and is_transposable_nm(layer.mask)
               for n, layer in layers.items())


def test_scheduler_validation():
    with pytest.raises(ValueError, match="drop_fraction"):
        PruneRegrow(drop_fraction=1.5)
    with pytest.raises(ValueError, match="drop_schedule"):
        PruneRegrow(drop_schedule="sawtooth")
    with pytest.raises(ValueError, match="unknown policy 'lottery'"):
        PruneRegrow(policy="lottery")
    with pytest.raises(ValueError, match="sparse_then_dense needs a straight-through format"):
        _setup(SparseThenDense(), density=1.0, block=1, fmt="masked")
    with pytest.raises(ValueError, match="found no SparseLinear"):
        Static().attach(MLP(), None, total_steps=3)


def test_state_dict_round_trip_continues_identically():
    def run(split):
        sched = PruneRegrow(policy=SET(), drop_fraction=0.5, num_updates=6, seed=3)
        model, layers, optim = _setup(sched, seed=1)
        gen = torch.Generator().manual_seed(9)
        for step in range(1, 41):
            _train_step(model, optim, gen)
            sched.step(step)
            if step == split:
                state = (sched.state_dict(), {k: v.clone() for k, v in model.state_dict().items()},
                         optim.state_dict())
                sched = PruneRegrow(policy=SET(), drop_fraction=0.5, num_updates=6, seed=0)
                model = MLP()
                sparsify(model, targets=["up", "down"], density=0.25, block=8, seed=99)  # other masks
                model.load_state_dict(state[1])
                optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
                optim.load_state_dict(state[2])
                sched.attach(model, optim, total_steps=40)
                sched.load_state_dict(state[0])
        return {n: m.mask.clone() for n, m in model.named_modules() if isinstance(m, SparseLinear)}
    a, b = run(split=-1), run(split=17)
    assert all(a[n].equal(b[n]) for n in a)


def test_custom_policy_from_outside_package_via_yaml(tmp_path, monkeypatch):
    (tmp_path / "my_policies.py").write_text(textwrap.dedent("""
        import torch
        from sparsetrain.sparsity import RigL

        class GradEMA(RigL):
            def grow_scores(self, weight, grad, mask):
                self.ema = getattr(self, "ema", {})
                self.ema[self.layer] = 0.9 * self.ema.get(self.layer, 0.0) + grad.abs()
                self.calls = getattr(self, "calls", 0) + 1
                return self.ema[self.layer]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(textwrap.dedent("""
        _target_: sparsetrain.sparsity.PruneRegrow
        drop_fraction: 0.3
        num_updates: 3
        policy:
          _target_: my_policies.GradEMA
    """))
    sched = instantiate(cfg)
    assert type(sched.policy).__name__ == "GradEMA" and sched.policy.needs_grad
    _run(sched, steps=20)
    assert sched.policy.calls == 3 * 2  # 3 updates x 2 layers


_WORKER = r'''
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from torch.nn.parallel import DistributedDataParallel as DDP
from test_schedulers import MLP
from sparsetrain.nn import sparsify
from sparsetrain.sparsity import PruneRegrow, SET, RigL
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://{store}", rank=rank, world_size=2)
out = {{}}
for pol, fmt, block in ((SET(), "masked", 8), (RigL(), "masked", 8), (SET(), "block", 16), (RigL(), "block", 16)):
    torch.manual_seed(0)
    model = MLP()
    layers = sparsify(model, targets=["up", "down"], density=0.25, block=block, format=fmt, seed=0)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sched = PruneRegrow(policy=pol, drop_fraction=0.4, num_updates=4).attach(model, opt, 20)
    gen = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    for step in range(1, 21):
        x = torch.randn(8, 64, generator=gen); y = torch.randint(0, 4, (8,), generator=gen)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(); loss.backward(); opt.step(); sched.step(step)
    out[type(pol).__name__ + fmt] = {{n: l.mask.clone() for n, l in layers.items()}}
    if fmt == "block":   # the values the kernels read follow the mask, on every rank alike
        out[type(pol).__name__ + fmt + "values"] = {{n: l.dense_weight().clone() for n, l in layers.items()}}
torch.save(out, {outdir!r} + f"/rank{{rank}}.pt")
# both ranks reach teardown together, and skip interpreter shutdown: a gloo peer that exits first can make the
# other abort in its destructors ("terminate called without an active exception", seen once in CI)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
'''


def test_two_rank_masks_identical(tmp_path):
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    script = tmp_path / "worker.py"
    script.write_text(_WORKER.format(root=root, tests=here, store=str(tmp_path / "store"),
                                     outdir=str(tmp_path)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r)], env=env) for r in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    a, b = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert len(a) == len(b) == 6
    for key in a:
        for n in a[key]:
            assert a[key][n].equal(b[key][n]), (key, n)
    for pol in ("SET", "RigL"):
        for fmt, block in (("masked", 8), ("block", 16)):
            # and the masks really moved during training (not a trivially static run)
            torch.manual_seed(0)
            init = sparsify(MLP(), targets=["up", "down"], density=0.25, block=block, format=fmt, seed=0)
            assert any(not init[n].mask.equal(a[pol + fmt][n]) for n in init), (pol, fmt)


def test_a_run_too_short_for_its_updates_is_told_before_it_starts():
    """bert_rigl's 160 updates over 60 steps would update the masks at every step: said in one line naming the
    key; the recipes' own lengths say nothing."""
    from sparsetrain.sparsity import GradualMagnitude, PruneRegrow, Static

    note = PruneRegrow(policy="rigl", num_updates=160).schedule_warning(60)
    assert "sparsity.scheduler.num_updates=160 over trainer.max_steps=60 gives 59 mask updates, every step" in note
    assert "\n" not in note and "lower sparsity.scheduler.num_updates" in note
    assert "raise sparsity.scheduler.interval" in PruneRegrow(interval=4).schedule_warning(1000)
    assert PruneRegrow(num_updates=160).schedule_warning(10_000) is None       # one every 62 steps
    assert PruneRegrow(num_updates=10).schedule_warning(200) is None           # quickstart: one every 18
    assert "gives 100 mask updates" in GradualMagnitude(num_updates=100).schedule_warning(200)
    assert Static().schedule_warning(5) is None
    schedule = PruneRegrow(num_updates=7, start=0.1, end=0.8).update_schedule(1000)   # steps (100, 800): 7 updates
    assert [s for s in range(1, 1001) if schedule.is_update_step(s)] == [187, 274, 361, 448, 535, 622, 709]


def _regrow_once(fmt: str, moments: str, lr: float = 1e-3, steps: int = 600):
    """One 64x64 layer at density 0.25 (16x16 blocks) trained ``steps`` Adam steps, then one SET update that drops
    and regrows half its blocks; returns the layer, the optimizer, the element masks before and after, and lr."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64))
    sparsify(model, density=0.25, block=16, format=fmt, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = PruneRegrow(policy="set", drop_fraction=0.5, drop_schedule="constant", interval=steps, start=0.0,
                        end=0.99, seed=0, regrow_moments=moments).attach(model, opt, total_steps=2000)
    layer = model[0]
    for _ in range(steps):
        model(torch.randn(16, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    before = layer.element_mask().clone()
    assert sched.step(steps)["regrown"] > 0
    return model, layer, opt, before, layer.element_mask().clone(), lr


@pytest.mark.parametrize("fmt", ["masked", "block"])
def test_regrow_moments_mean_starts_regrown_weights_at_the_mean_second_moment(fmt):
    model, layer, opt, old, new, lr = _regrow_once(fmt, "mean", steps=40)   # any moments will do: few steps
    state = opt.state[layer.weight_parameter()]
    v, m = (layer.storage.dense_layout(layer, state[k]) for k in ("exp_avg_sq", "exp_avg"))
    grown, kept = new & ~old, new & old
    assert grown.any() and kept.any()
    assert torch.allclose(v[grown], v[kept].mean().expand(int(grown.sum())))   # the mean of the survivors'
    assert not m[grown].any() and not layer.dense_weight()[grown].any()          # first moment, weight: zero
    assert not v[~new].any()                                                      # pruned: nothing kept


@pytest.mark.parametrize("moments,bound", [("zero", None), ("mean", 1.5)])
def test_regrown_weights_first_steps_against_the_learning_rate(moments, bound):
    """Zero moments (as published) make a regrown weight's first Adam steps several times lr; ``mean`` keeps them
    about lr-sized (the dense switch's collapse, in small, at every update)."""
    model, layer, opt, old, new, lr = _regrow_once("masked", moments)
    grown = new & ~old
    steps = []
    for _ in range(10):
        start = layer.dense_weight().clone()
        model(torch.randn(16, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        steps.append((layer.dense_weight() - start)[grown].abs())
    largest = torch.stack(steps).max()
    if bound is None:
        assert largest > 2.5 * lr            # the failure the option exists for
    else:
        assert largest <= bound * lr and torch.stack(steps).mean() > 0


def test_regrow_moments_must_be_a_known_name():
    with pytest.raises(ValueError, match="regrow_moments must be one of zero, mean"):
        PruneRegrow(regrow_moments="ones")
