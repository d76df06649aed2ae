"""The prune-and-regrow sequence a CUDA graph replays (sparsity/graphed.py) against the per-layer update: the same
masks, weights and Adam moments for the same seeds, on the block format; the rank test against topk_mask."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from sparsetrain.nn import sparsify
from sparsetrain.sparsity import PruneRegrow
from sparsetrain.sparsity.graphed import GraphedUpdate, ranked, why_not_graphed
from sparsetrain.sparsity.layout import topk_mask
from sparsetrain.sparsity.policies import SET, RigL


def _setup(policy: str, seed: int = 0, regrow_moments: str = "zero"):
    """Four block-sparse linears of two shapes after two Adam steps, a PruneRegrow scheduler attached, and the
    all-position gradient of each layer (what RigL scores) from one more backward. The second and the fourth keep
    the same tables (the first, whose input needs no gradient, keeps no input-gradient lists)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64), nn.GELU(), nn.Linear(64, 96), nn.GELU(),
                          nn.Linear(96, 64))
    sparsify(model, density=0.25, block=16, format="block", seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = PruneRegrow(policy=policy, drop_fraction=0.5, drop_schedule="cosine", interval=2, seed=seed,
                        regrow_moments=regrow_moments)
    sched.attach(model, opt, total_steps=20)
    x = torch.randn(32, 64)
    for step in (1, 2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for layer in sched.layers.values():
        layer.capture_dense_grad = True
    model(x).square().mean().backward()
    return model, opt, sched


def _state(model, opt):
    out = {k: v.clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        out.update({f"opt{i}.{k}": v.clone() for k, v in st.items() if torch.is_tensor(v)})
    return out


@pytest.mark.parametrize("policy,moments,batch", [("set", "zero", True), ("rigl", "zero", True),
                                                  ("set", "mean", True), ("rigl", "mean", True),
                                                  ("set", "mean", False), ("rigl", "zero", False)])
def test_the_graphed_sequence_gives_the_per_layer_update_exactly(policy, moments, batch):
    """The sequence, with two layers of one shape and tables updated together over their stack (batch) or each alone,
    gives the per-layer update's masks, weights and Adam moments bit for bit."""
    model_a, opt_a, sched_a = _setup(policy, regrow_moments=moments)
    model_b, opt_b, sched_b = _setup(policy, regrow_moments=moments)
    assert why_not_graphed(sched_b) is not None   # on the CPU the scheduler updates layer by layer
    for step in (4, 6, 8):
        record = sched_a.step(step)               # the per-layer path
        frac = sched_b.drop_fn(step)
        grads = sched_b._reduced_grads() if sched_b.policy.needs_grad else {}
        graphed = GraphedUpdate(sched_b, batch=batch)
        graphed.eager_update(step, frac, grads)
        assert [len(u.index) for u in graphed._units if not isinstance(u, int)] == ([2] if batch else [])
        sched_b.step_count = step
        assert record["pruned"] == sum(graphed.counts(frac)) > 0
        a, b = _state(model_a, opt_a), _state(model_b, opt_b)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (step, k)
        for m in (*sched_a.layers.values(), *sched_b.layers.values()):   # RigL: a fresh gradient for the next
            m.dense_grad, m.capture_dense_grad = None, True
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        for model in (model_a, model_b):
            model(x).square().mean().backward()


@pytest.mark.parametrize("policy,moments", [("set", "mean"), ("rigl", "zero")])
def test_a_false_gate_moves_nothing(policy, moments):
    """The loop's gate (every loss finite so far, read on the device): False leaves masks, weights, moments and every
    kept table as they were; True gives the ungated update."""
    model_a, opt_a, sched_a = _setup(policy, regrow_moments=moments)
    model_b, opt_b, sched_b = _setup(policy, regrow_moments=moments)
    grads = sched_b._reduced_grads() if sched_b.policy.needs_grad else {}
    graphed = GraphedUpdate(sched_b)
    before, kept = _state(model_b, opt_b), _kept(sched_b)
    graphed.eager_update(4, sched_b.drop_fn(4), grads, gate=torch.tensor(False))
    after, now = _state(model_b, opt_b), _kept(sched_b)
    assert all(torch.equal(before[k], after[k]) for k in before) and all(torch.equal(kept[k], now[k]) for k in kept)
    sched_a.step(4)
    graphed.eager_update(4, sched_b.drop_fn(4), grads, gate=torch.tensor(True))
    a, b = _state(model_a, opt_a), _state(model_b, opt_b)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ranked_picks_the_blocks_topk_mask_picks_ties_by_index():
    gen = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 5, (12, 9), generator=gen).float()     # many ties
    for k in (0, 1, 7, 50, 108):
        assert torch.equal(ranked(scores, torch.tensor(k)), topk_mask(scores, k)), k


def test_only_built_in_policies_and_graph_safe_layers_are_graphed():
    class Mine(SET):
        pass

    _, _, sched = _setup("set")
    assert "cannot be updated without the host" in why_not_graphed(sched)   # CPU layers
    sched.policy = Mine()
    assert "not a built-in" in why_not_graphed(sched)
    sched.policy = RigL()
    assert "cannot be updated without the host" in why_not_graphed(sched)


def _gpu_setup(policy: str):
    """Four block-sparse linears (256 <-> 512, 16x16 at 10%) in bf16 on the GPU, Adam, a PruneRegrow scheduler
    updating every 2 steps; the second and the fourth keep the same tables."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.GELU(), nn.Linear(256, 512),
                          nn.GELU(), nn.Linear(512, 256))
    sparsify(model, density=0.1, block=16, format="block", seed=0)
    model = model.to("cuda", torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = PruneRegrow(policy=policy, drop_fraction=0.5, interval=2, seed=0).attach(model, opt, total_steps=40)
    return model, opt, sched


@pytest.mark.gpu
@pytest.mark.parametrize("policy,dw,streams,prepare,batch", [
    ("set", "triton", 8, False, True), ("rigl", "triton", 8, True, True), ("set", "cuda", 8, True, True),
    ("rigl", "cuda", 8, False, True), ("set", "cuda", 1, False, True), ("rigl", "cuda", 2, True, True),
    ("set", "cuda", 8, True, False)])
def test_gpu_graphed_updates_replay_the_per_layer_update(policy, dw, streams, prepare, batch, monkeypatch):
    """On the GPU a PruneRegrow scheduler updates from one CUDA graph, captured at the first update and replayed
    at every one; after each, the masks, values and Adam moments equal those of the same scheduler updating layer
    by layer, and the layers compute the new topology, with the Triton or the CUDA weight-gradient kernel forced
    (its groups, or its CTA table, rebuilt in the graph), whether the graph runs the layers as one chain
    (streams=1) or as parallel branches (2: two units share a branch; 8: one branch each), whether the second and
    fourth layers (one shape, the same tables) are updated together (batch) or each alone, and whether the graph
    is captured at the first update or ahead of it (`prepare_updates` after step 1: the first update replays)."""
    monkeypatch.setattr(GraphedUpdate, "STREAMS", streams)
    monkeypatch.setattr(GraphedUpdate, "BATCH", batch)
    from sparsetrain.kernels.blocksparse import _cuda, gather
    from sparsetrain.kernels.blocksparse.testing import forced_config

    forced = dict(fwd=gather.DDS_CANDIDATES[16][0], dx=gather.DDS_CANDIDATES[16][0],
                  dw=gather.DW_CANDIDATES[16][0] if dw == "triton" else _cuda.DW_CANDIDATES[0])
    runs = [_gpu_setup(policy), _gpu_setup(policy)]
    runs[0][2]._graphed = False                     # layer by layer
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    with forced_config(**forced):
        for step in range(1, 13):
            for model, opt, sched in runs:
                model(x).float().square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step(step)
            if prepare and step == 1:
                assert runs[1][2].prepare_updates() and not runs[0][2].prepare_updates()
            if step % 2 == 0:
                (a, oa, _), (b, ob, _) = runs
                for k, v in a.state_dict().items():
                    assert torch.equal(v, b.state_dict()[k]), (step, k)
                for pa, pb in zip(a.parameters(), b.parameters()):
                    for k, v in oa.state[pa].items():
                        assert torch.equal(v, ob.state[pb][k]), (step, k)
    graphed = runs[1][2]._graphed
    assert graphed and graphed.eager == 0 and graphed.captures == 1 and graphed.replays == 6 + prepare
    assert graphed.streams == streams and len(graphed._units) == (3 if batch else 4)
    assert all(m.graph_update_key() is not None for m in runs[1][2].layers.values())   # every table on the GPU
    for layer in runs[1][2].layers.values():
        xi = torch.randn(64, layer.in_features, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(layer(xi).float(), (xi @ layer.dense_weight().t() + layer.bias).float(),
                                   rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_a_false_gate_replays_and_moves_nothing():
    """The replayed graph reads the gate on the device: a false one leaves masks, values and Adam moments bit for
    bit (the replay count goes up); the next ungated update is the per-layer one."""
    runs = [_gpu_setup("set"), _gpu_setup("set")]
    runs[0][2]._graphed = False
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    for step in range(1, 7):
        for model, opt, sched in runs:
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == 6:
                continue
            sched.step(step)
    (a, oa, sa), (b, ob, sb) = runs
    graphed, replays = sb._graphed, sb._graphed.replays
    before = _state(b, ob)
    assert sb.gate_update(6, torch.zeros((), dtype=torch.bool, device="cuda")) and sb.step(6)["pruned"] > 0
    assert graphed.replays == replays + 1 and all(torch.equal(v, _state(b, ob)[k]) for k, v in before.items())
    sa.step(6)
    sb.step(6)
    assert all(torch.equal(v, _state(b, ob)[k]) for k, v in _state(a, oa).items())


def test_the_branch_count_must_be_a_positive_int():
    model = nn.Sequential(nn.Linear(32, 32))
    sparsify(model, density=0.25, block=8, format="block", seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = PruneRegrow(policy="set", drop_fraction=0.5, interval=2, seed=0).attach(model, opt, total_steps=10)
    assert GraphedUpdate(sched).streams == GraphedUpdate.STREAMS
    for bad in (0, -1, 2.0, "8"):
        with pytest.raises(ValueError, match="streams must be a positive int"):
            GraphedUpdate(sched, streams=bad)


def _kept(sched) -> dict:
    """Every tensor a layer's update rewrites besides the weights: its metadata's tensors and kept tables."""
    out = {}
    for name, layer in sched.layers.items():
        meta = layer.storage.meta(layer)
        out.update({f"{name}.{n}": getattr(meta, n).clone() for n in meta.TENSORS})
        for key, value in meta._groups.items():
            for j, t in enumerate(value if isinstance(value, (tuple, list)) else (value,)):
                if torch.is_tensor(t):
                    out[f"{name}.{key}.{j}"] = t.clone()
    return out


@pytest.mark.parametrize("policy,moments", [("set", "zero"), ("rigl", "mean")])
def test_the_sequence_with_no_block_to_move_changes_nothing(policy, moments):
    """What `GraphedUpdate.prepare` replays once at start-up: k = 0 for every layer drops and grows nothing, and
    leaves masks, weights, Adam moments and every metadata tensor and kept table bit for bit as they were; the
    next real update is then the per-layer one."""
    model_a, opt_a, sched_a = _setup(policy, regrow_moments=moments)
    model_b, opt_b, sched_b = _setup(policy, regrow_moments=moments)
    graphed = GraphedUpdate(sched_b)
    before, kept = _state(model_b, opt_b), _kept(sched_b)
    graphed.k.zero_()
    graphed.grow.uniform_()                       # scores are there, but no block may grow
    graphed._plan()
    assert len(graphed._units) == 3               # two layers of one shape and tables together, two alone
    graphed._body()
    after = _state(model_b, opt_b)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    now = _kept(sched_b)
    assert kept.keys() == now.keys() and len(kept) > 3 and all(torch.equal(kept[k], now[k]) for k in kept)
    record = sched_a.step(4)
    grads = sched_b._reduced_grads() if sched_b.policy.needs_grad else {}
    graphed.eager_update(4, sched_b.drop_fn(4), grads)
    assert record["pruned"] > 0
    a, b = _state(model_a, opt_a), _state(model_b, opt_b)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("policy", ["set", "rigl"])
def test_prepare_updates_runs_the_grow_steps_start_up_with_every_layer_armed(policy):
    """RigL: the training step's start-up work for its grow step (``grow``) sees every layer capturing, with a
    probe; afterwards each layer is armed as it was. SET needs no gradient: ``grow`` is not called."""
    _, _, sched = _setup(policy)
    layers = list(sched.layers.values())
    for i, layer in enumerate(layers):
        layer.arm_dense_grad(i == 0)                    # as if the next step were a grow step for the first
    seen = []
    sched.prepare_updates(grow=lambda: seen.append([(m.capture_dense_grad, m.grad_probe is not None)
                                                    for m in layers]))
    assert seen == ([[(True, True)] * len(layers)] if policy == "rigl" else [])
    assert [m.capture_dense_grad for m in layers] == [True] + [False] * (len(layers) - 1)
