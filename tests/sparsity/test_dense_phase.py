"""Sparse-then-dense for any scheduler (``dense_from``): the layers become dense ``nn.Linear`` at a fraction of the
run, their weights kept, the newly trainable positions starting at zero with zero moments; the optimizer trains the
new Parameters; a checkpoint of the dense phase resumes exactly; the FLOP count follows."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from sparsetrain.kernels.blocksparse.reference import values_to_dense
from sparsetrain.nn import SparseLinear, sparsify
from sparsetrain.nn.formats import BlockFormat
from sparsetrain.sparsity import PruneRegrow, Static


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 4))


def _train(model, opt, sched, steps, start=1):
    gen = torch.Generator().manual_seed(start)
    records = []
    for step in range(start, start + steps):
        x = torch.randn(16, 32, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        records.append(sched.step(step))
    return records


def test_densify_keeps_the_weight_and_moves_the_moments_into_the_dense_layout():
    torch.manual_seed(0)
    layer = SparseLinear.from_dense(nn.Linear(64, 96), density=0.25, block=16, format="block")
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    layer(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    meta, values = BlockFormat.meta(layer), layer.values
    want_w = layer.dense_weight().clone()
    want_m = {k: values_to_dense(v, meta).clone() for k, v in opt.state[values].items() if v.shape == values.shape}
    step = opt.state[values]["step"].clone()
    lin = layer.densify(opt)
    assert type(lin) is nn.Linear and lin.bias is layer.bias and torch.equal(lin.weight, want_w)
    assert values not in opt.state and all(p is not values for g in opt.param_groups for p in g["params"])
    assert any(p is lin.weight for g in opt.param_groups for p in g["params"])
    state = opt.state[lin.weight]
    assert torch.equal(state["step"], step) and state.keys() == opt.state.get(lin.weight, {}).keys()
    outside = ~torch.repeat_interleave(torch.repeat_interleave(layer.mask, 16, 0), 16, 1)
    for k, v in want_m.items():
        assert torch.equal(state[k][~outside], v[~outside]), k
    assert not want_w[outside].any() and not state["exp_avg"][outside].any()
    # the new positions' second moment: the mean of the active ones' (their first steps lr-sized, not 3-6x lr)
    assert torch.allclose(state["exp_avg_sq"][outside], want_m["exp_avg_sq"][~outside].mean().expand(int(outside.sum())))
    lin(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    assert lin.weight[outside].abs().sum() > 0      # the positions outside the old mask train now


def test_the_dense_phases_new_weights_step_like_the_old_ones():
    """The first Adam steps of the positions a switch adds are at most about the learning rate (a zero second
    moment 200 steps on gave 3x and more: the BERT-base collapse in settle_new_moments' docstring)."""
    torch.manual_seed(0)
    layer = SparseLinear.from_dense(nn.Linear(64, 64), density=0.1, block=16, format="masked")
    lr = 1e-3
    opt = torch.optim.Adam(layer.parameters(), lr=lr)
    for _ in range(200):
        layer(torch.randn(16, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    lin = layer.densify(opt)
    outside = ~layer.element_mask()
    before = lin.weight.detach().clone()
    for _ in range(5):
        lin(torch.randn(16, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    moved = (lin.weight.detach() - before)[outside].abs()
    assert moved.max() <= 5 * lr * 1.5 and moved.mean() > 0


@pytest.mark.parametrize("fmt,block", [("block", 16), ("masked", 8)])
def test_static_becomes_dense_at_its_fraction_and_resumes_there(fmt, block):
    model = _model()
    layers = sparsify(model, targets=["0", "2"], density=0.25, block=block, format=fmt, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = Static(dense_from=0.5).attach(model, opt, total_steps=10)
    assert sched.sparse_fraction == 0.5 and not sched.static_topology
    assert [sched.is_update_step(s) for s in range(1, 6)] == [False] * 4 + [True]
    records = _train(model, opt, sched, 6)
    assert [r and r["event"] for r in records] == [None] * 4 + ["phase_switch", None]
    assert not any(isinstance(m, SparseLinear) for m in model.modules()) and sched.density == 1.0
    assert sched.state_dict()["switched"] is True and len(layers) == 2 and not sched.is_update_step(7)

    # a checkpoint of the dense phase: a fresh sparse model + optimizer + scheduler load it, then train alike
    again = _model()
    sparsify(again, targets=["0", "2"], density=0.25, block=block, format=fmt, seed=0)
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-2)
    sched2 = Static(dense_from=0.5).attach(again, opt2, total_steps=10)
    sched2.load_state_dict(sched.state_dict())
    again.load_state_dict(model.state_dict())
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))   # (as from a file: no tensor shared, e.g. the step)
    _train(model, opt, sched, 4, start=7)
    _train(again, opt2, sched2, 4, start=7)
    for (k, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k


def test_prune_regrow_updates_until_the_dense_phase_only():
    model = _model()
    sparsify(model, targets=["0", "2"], density=0.25, block=16, format="block", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = PruneRegrow(policy="set", interval=2, drop_fraction=0.5, dense_from=0.6).attach(model, opt, 10)
    events = [(i + 1, r["event"]) for i, r in enumerate(_train(model, opt, sched, 10)) if r]
    assert events == [(2, "mask_update"), (4, "mask_update"), (6, "phase_switch")]


def test_dense_from_1_keeps_the_run_sparse_to_its_end():
    model = _model()
    sparsify(model, targets=["0", "2"], density=0.25, block=16, format="block", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = Static(dense_from=1.0).attach(model, opt, 6)
    assert _train(model, opt, sched, 6) == [None] * 6 and not sched.switched
    assert isinstance(model[0], SparseLinear) and isinstance(model[2], SparseLinear)


@pytest.mark.parametrize("bad", [0, 1.5, -0.1])
def test_dense_from_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="dense_from"):
        Static(dense_from=bad)


@pytest.mark.slow
def test_cli_block_sparse_then_dense_resumes_exactly_and_counts_flops(tmp_path):
    """Through the CLI (tiny quickstart, 16x16 blocks, dense from half of 24 steps): a phase_switch row at step
    12; the FLOPs per step rise to the dense ones there; a run resumed from the checkpoint of step 16, in the dense
    phase, logs the uninterrupted run's losses after it exactly."""
    from test_cli import TINY, cli, rows

    common = ["recipe=quickstart", "sparsity=static", "sparsity.format=block", "sparsity.block=16",
              "sparsity.scheduler.dense_from=0.5", "trainer.max_steps=24", "trainer.checkpoint_every=8",
              "trainer.log_every=4", "trainer.eval_every=12", "logger=quiet", *TINY]
    a, b = tmp_path / "a", tmp_path / "b"
    plain = {"TRITON_INTERPRET": "0"}   # the plain-torch block path (the interpreter ran the kernels for minutes)
    cli("train", *common, f"hydra.run.dir={a}", env=plain)
    events = rows(a, "event")
    assert [(e["step"], e["event"]) for e in events if e["event"] == "phase_switch"] == [(12, "phase_switch")]
    flops = [x["train_flops"] for x in rows(a, "loss")]
    per_step = [(y - x) / 4 for x, y in zip(flops, flops[1:])]
    assert per_step[-1] > 2 * per_step[0]            # dense steps after the switch, 10% blocks before
    # the window after the switch (recompile, capture) is charged like the first one: at the next window's rate
    assert [x["step"] for x in rows(a, "loss") if x.get("startup")] == [4, 16]
    cli("train", *common, f"hydra.run.dir={b}", f"trainer.resume={a / 'checkpoints' / 'step_00000016'}", env=plain)
    after = [x["loss"] for x in rows(b, "loss") if x["step"] > 16]
    assert len(after) == 2 and after == [x["loss"] for x in rows(a, "loss") if x["step"] > 16]
    summary = json.loads(Path(a, "summary.json").read_text())
    assert summary["status"] == "finished" and summary["final_eval_loss"] is not None


@pytest.mark.slow
def test_cli_gradual_pruning_on_the_block_format_shrinks_and_resumes_exactly(tmp_path):
    """Through the CLI (tiny quickstart, 16x16 blocks, gradual pruning from dense to 10% in 6 updates over the
    first 75% of 24 steps): the block format's storage shrinks with the count (the final checkpoint's values hold
    the final count), and a run resumed from the checkpoint of step 16, between two shrinks, logs the uninterrupted
    run's losses after it exactly and ends with the same weights."""
    import torch
    from test_cli import TINY, cli, rows

    common = ["recipe=quickstart", "sparsity=gradual", "sparsity.format=block", "sparsity.block=16",
              "sparsity.scheduler.num_updates=6", "trainer.max_steps=24", "trainer.checkpoint_every=8",
              "trainer.log_every=4", "trainer.eval_every=12", "logger=quiet", *TINY]
    a, b = tmp_path / "a", tmp_path / "b"
    plain = {"TRITON_INTERPRET": "0"}   # the plain-torch block path
    cli("train", *common, f"hydra.run.dir={a}", env=plain)
    pruned = [e["pruned"] for e in rows(a, "event") if e["event"] == "mask_update"]
    assert len(pruned) >= 5 and all(p > 0 for p in pruned)
    cli("train", *common, f"hydra.run.dir={b}", f"trainer.resume={a / 'checkpoints' / 'step_00000016'}", env=plain)
    after = [x["loss"] for x in rows(b, "loss") if x["step"] > 16]
    assert len(after) == 2 and after == [x["loss"] for x in rows(a, "loss") if x["step"] > 16]
    ma = torch.load(a / "checkpoints/step_00000024/pytorch_model.bin", map_location="cpu")
    mb = torch.load(b / "checkpoints/step_00000024/pytorch_model.bin", map_location="cpu")
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    def counts(step: int) -> tuple[list[int], list[int]]:
        """(active blocks per mask, first dimensions of the Adam moments of block values) in a checkpoint (the
        model file holds dense weights; the optimizer file keeps the block format's state)"""
        d = a / "checkpoints" / f"step_{step:08d}"
        model = torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
        state = torch.load(d / "optimizer.bin", map_location="cpu", weights_only=True)["state"]
        return (sorted(int(v.sum()) for k, v in model.items() if k.endswith(".mask")),
                sorted(s["exp_avg"].shape[0] for s in state.values() if s["exp_avg"].dim() == 3))

    (masks16, moments16), (masks24, moments24) = counts(16), counts(24)
    assert masks24 == moments24 and masks16 == moments16       # the storage holds the current count
    assert sum(masks24) < sum(masks16)                          # and it shrank after step 16 too


def test_a_dense_phase_with_several_processes_needs_the_graph_steps_own_sync(monkeypatch):
    """DDP's reducer and FSDP's shards keep the Parameters a run started with: with several processes a dense phase
    is refused before any work, naming the key, unless the step replays a graph (its own gradient sync)."""
    from sparsetrain.config import ConfigError, build_run, compose

    args = ["recipe=quickstart", "sparsity=static", "sparsity.scheduler.dense_from=0.5"]
    build_run(compose(args))                                   # one process: fine
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as e:
        build_run(compose(args))                               # the CPU: DDP
    assert e.value.key == "sparsity.scheduler.dense_from" and "2 processes" in str(e.value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    build_run(compose([*args, "trainer=gpu"]))                 # GPUs, bf16: graph steps with their own sync
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError):
        build_run(compose([*args, "trainer=gpu"]))


def test_a_dense_phase_is_part_of_the_method_label_in_the_summary_and_from_the_config():
    from sparsetrain.pareto.runs import _method_from_scheduler

    assert Static(dense_from=0.7).describe() == "static+dense@0.7" and Static().describe() == "static"
    assert PruneRegrow(policy="set", dense_from=0.5).describe() == "prune_regrow/random+dense@0.5"
    sched = {"_target_": "sparsetrain.sparsity.PruneRegrow", "policy": {"_target_": "sparsetrain.sparsity.RigL"},
             "dense_from": 0.5}
    assert _method_from_scheduler({"sparsity": {"scheduler": sched}}) == "prune_regrow/gradient+dense@0.5"
    for target, label in (("sparsetrain.sparsity.Static", "static"), ("sparsetrain.sparsity.GradualMagnitude",
                                                                     "gradual_magnitude"),
                          ("sparsetrain.sparsity.SparseThenDense", "sparse_then_dense")):
        assert _method_from_scheduler({"sparsity": {"scheduler": {"_target_": target, "dense_from": None}}}) == label


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_cli_dense_phase_recompiles_and_captures_again(tmp_path):
    """On a GPU through the CLI (tiny quickstart, `trainer=gpu`: compiled, graphed steps, block kernels): the switch
    at step 20 of 40 is logged, the step is captured again for the dense layers, and the run finishes with finite
    losses whose FLOPs count the dense phase."""
    from test_cli import TINY, cli, rows

    d = tmp_path / "run"
    cli("train", "recipe=quickstart", "trainer=gpu", "sparsity=static", "sparsity.format=block", "sparsity.block=16",
        "sparsity.scheduler.dense_from=0.5", "trainer.max_steps=40", "trainer.log_every=10", "trainer.eval_every=20",
        "trainer.checkpoint_every=0", "logger=quiet", *TINY, f"hydra.run.dir={d}")
    assert [(e["step"], e["event"]) for e in rows(d, "event") if e["event"] == "phase_switch"] == [(20, "phase_switch")]
    losses = [x["loss"] for x in rows(d, "loss")]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    summary = json.loads((d / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["graph_captures"] >= 2, summary
    assert summary["method"] == "static+dense@0.5"


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_cli_24_sparse_then_dense_compiled_switches_and_captures_again(tmp_path):
    """The 2:4 sparse-then-dense method as its recipe runs it since 2026-11-29 (compiled, graphed steps; the mask
    recomputed every step, the dispatch per layer), through the CLI on the tiny quickstart: the switch at step 20 of
    40 is logged, the step is captured again for the dense layers, and the losses are finite."""
    from test_cli import TINY, cli, rows

    d = tmp_path / "run"
    cli("train", "recipe=quickstart", "trainer=gpu", "sparsity=sparse_then_dense", "sparsity.block=1",
        "sparsity.density=0.5", "sparsity.scheduler.sparse_fraction=0.5", "trainer.max_steps=40", "trainer.log_every=10", "trainer.eval_every=20", "trainer.checkpoint_every=0",
        "logger=quiet", *TINY, f"hydra.run.dir={d}")
    assert [(e["step"], e["event"]) for e in rows(d, "event") if e["event"] == "phase_switch"] == [(20, "phase_switch")]
    losses = [x["loss"] for x in rows(d, "loss")]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    summary = json.loads((d / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["graph_captures"] >= 2, summary
