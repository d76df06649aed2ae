"""Whole training steps replayed from a CUDA graph (``trainer.cuda_graph``) train the same model as eager steps:
the same losses (to float tolerance) and the same masks through mask updates, re-captured after each update;
RigL's dense-gradient steps replayed from a graph of their own (block format) or run eagerly (a Python hook). The graph-mode decision itself is tested on the CPU."""
import pytest
import torch

from sparsetrain.kernels import KernelOptions
from sparsetrain.models.builders import build_model
from sparsetrain.sparsity.policies import SET, RigL
from sparsetrain.sparsity.schedulers import PruneRegrow, Static
from sparsetrain.training.loop import mask_signature
from sparsetrain.training.metrics import read_metrics
from sparsetrain.training.setup import TrainArgs
from sparsetrain.training.step import TrainStep, graph_mode
from tests.training.test_loop import _spec


def test_graph_mode_auto_and_true():
    assert graph_mode("auto", True, 1, "bf16", None)
    assert not graph_mode("auto", False, 1, "bf16", None)                  # CPU: eager
    assert graph_mode("auto", True, 2, "bf16", None)                       # several processes, whole model each
    assert not graph_mode("auto", True, 2, "bf16", None, sharded=True)     # FSDP: eager
    assert not graph_mode("auto", True, 2, "bf16", None, running_stats=True)
    assert graph_mode("auto", True, 1, "bf16", None, running_stats=True)   # one process: nothing to keep equal
    assert not graph_mode("auto", True, 1, "fp16", None)                   # loss scaling syncs
    assert not graph_mode("auto", True, 1, "bf16", "reduce-overhead")      # compile's own graphs
    assert not graph_mode("auto", True, 1, "no", None, optimizer_capturable=False)
    assert graph_mode("auto", True, 1, "no", "default")
    assert not graph_mode(False, True, 1, "bf16", None)
    assert graph_mode(True, True, 2, "bf16", None)
    with pytest.raises(ValueError, match="trainer.cuda_graph: is true but the run shards the model over 2 "
                                         "processes"):
        graph_mode(True, True, 2, "bf16", None, sharded=True)
    with pytest.raises(ValueError, match="trainer.cuda_graph: is true but the run is not on a CUDA device"):
        graph_mode(True, False, 2, "no", None)                             # several CPU processes (gloo)


def test_eager_step_runs_the_body_once_and_clears_gradients():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    seen = []

    class Out:
        def __init__(self, loss):
            self.loss = loss

    step = TrainStep(lambda b: Out(lin(b["x"]).pow(2).mean()), lambda loss: loss.backward(), opt,
                     clip=lambda: None, observe=lambda loss, norm: seen.append(float(loss)),
                     autocast=lambda: torch.autocast("cpu", enabled=False))
    x = torch.randn(4, 4)
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    loss = step([{"x": x[:2]}, {"x": x[2:]}])       # two micro-batches: the mean of their losses
    ref = torch.nn.Linear(4, 2)
    with torch.no_grad():
        ref.weight.copy_(w0)
        ref.bias.copy_(b0)
    want = (ref(x[:2]).pow(2).mean() + ref(x[2:]).pow(2).mean()) / 2
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    torch.testing.assert_close(lin.weight.detach(), w0 - 0.1 * ref.weight.grad)   # one SGD step on the mean
    assert all(p.grad is None for p in lin.parameters())
    assert step.eager_steps == 1 and seen == [float(loss)]


@pytest.mark.parametrize("fmt", ["block", "masked"])
def test_a_grow_step_runs_the_compiled_model_where_every_layer_takes_a_probe(fmt):
    """RigL's grow step: block-format layers hand their dense gradient over as a probe's gradient, so the step
    runs the model the other steps run (compiled, replayable); a layer with a Python hook (the masked format)
    makes it run the uncompiled model. Either way the dense gradient is the same."""
    from sparsetrain.nn import SparseLinear
    from sparsetrain.training.step import probes_of

    torch.manual_seed(0)
    model = torch.nn.Sequential(SparseLinear.from_dense(torch.nn.Linear(32, 48), density=0.5, block=16,
                                                        format=fmt))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    used = []

    class Out:
        def __init__(self, loss):
            self.loss = loss

    def fwd(name):
        def run(b):
            used.append(name)
            return Out(model(b["x"]).square().mean())
        return run

    step = TrainStep(fwd("forward"), lambda loss: loss.backward(), opt, clip=lambda: None,
                     observe=lambda loss, norm: None, autocast=lambda: torch.autocast("cpu", enabled=False),
                     plain_forward=fwd("plain"), probes=lambda: probes_of(model))
    layer = model[0]
    assert probes_of(model) is None                      # nothing captures yet
    layer.arm_dense_grad(True)
    x = torch.randn(6, 32)
    want = (2 * model(x) / model(x).numel()).t() @ x     # d mean(y^2) / dW, dense
    step([{"x": x}], grow=True)
    assert used == (["forward"] if fmt == "block" else ["plain"])
    assert (probes_of(model) is None) == (fmt == "masked")
    torch.testing.assert_close(layer.dense_gradient(), want.detach(), rtol=1e-5, atol=1e-5)
    step([{"x": x}], grow=True, eager=True)              # the loop's fallback after a failed capture: plain
    assert used[-1] == "plain"


def _args(**kw) -> TrainArgs:
    base = dict(max_steps=12, batch_size=8, eval_every=0, log_every=2, device="cuda", progress=False, plot=False,
                recipe="graph", checkpoint_every=0, mixed_precision="no")
    base.update(kw)
    return TrainArgs(**base)


def _run(tmp_path, name, scheduler, cuda_graph, fmt="block", models=None, **args):
    spec = _spec(scheduler, _args(cuda_graph=cuda_graph, **args))
    spec.sparsify_kwargs["format"] = fmt
    spec.build_model = lambda: _no_dropout(build_model("bert", "tiny", vocab_size=64, seq_len=16,
                                                       num_hidden_layers=1, attn_implementation="sdpa"))
    captured = {}
    original = spec.scheduler.attach

    def attach(model, *a, **k):
        captured["model"] = model
        return original(model, *a, **k)

    spec.scheduler.attach = attach
    summary = train_spec(spec, tmp_path / name)
    if models is not None:
        models.append(captured["model"])
    losses = [r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r]
    return summary, losses, mask_signature(captured["model"])


def _no_dropout(model):
    """Dropout draws differ between a graph's replays and eager steps; without it the two must agree."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model.config.attention_probs_dropout_prob = 0.0
    return model


def train_spec(spec, run_dir):
    from sparsetrain.training.loop import train

    return train(spec, run_dir)


@pytest.mark.gpu
@pytest.mark.parametrize("make_scheduler,updates", [
    (lambda: Static(), 0),
    (lambda: PruneRegrow(SET(), drop_fraction=0.3, num_updates=3, seed=1), 3),
    (lambda: PruneRegrow(RigL(), drop_fraction=0.3, num_updates=3, seed=1), 3),
])
@pytest.mark.parametrize("fmt", ["block", "masked"])
def test_graph_steps_train_like_eager_steps(tmp_path, make_scheduler, updates, fmt):
    rigl = isinstance(getattr(make_scheduler(), "policy", None), RigL)
    eager, eager_losses, eager_sig = _run(tmp_path, "eager", make_scheduler(), False, fmt)
    graph, graph_losses, graph_sig = _run(tmp_path, "graph", make_scheduler(), True, fmt)
    assert eager["step_mode"] == "eager" and graph["step_mode"] == "cuda_graph"
    # after each update the graph is kept (the update wrote in place: the masked formats, and the block format
    # where every plan it keeps can follow) or captured again (a CUDA-kernel plan, which the tuner may pick);
    # a kept graph replays the new topology: the same losses and masks as eager steps, below
    # (each capture of RigL's grow graph, in a pool of its own, is followed by one of the step graph in it)
    recaptures = graph["graph_captures"] - 1 - graph["grow_captures"]
    assert graph["graphs_kept"] + recaptures == updates
    if fmt == "masked":
        assert recaptures == 0
    assert graph["graph_replays"] + graph["eager_steps"] == 12
    # RigL: an eager step before each update
    assert graph["graph_replays"] >= 12 - 2 * (1 + recaptures) - updates - graph["grow_captures"]
    # RigL's grow steps with the block format: the first after a capture eager, the next captured, then replayed
    if recaptures == 0:   # (a re-capture drops the grow graph too: the next grow steps start over)
        assert graph["grow_captures"] == (1 if rigl and fmt == "block" else 0)
    assert eager_sig == graph_sig                                   # the same masks after the same updates
    assert len(eager_losses) == len(graph_losses) == 6
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses), rtol=2e-4, atol=2e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,make_scheduler", [
    ("gather", lambda: PruneRegrow(SET(), drop_fraction=0.3, num_updates=3, seed=1)),
    ("gather", lambda: PruneRegrow(RigL(), drop_fraction=0.3, num_updates=3, seed=1)),
    ("cuda", lambda: PruneRegrow(SET(), drop_fraction=0.3, num_updates=3, seed=1)),
])
def test_block_graph_kept_across_updates_replays_the_new_topology(tmp_path, make_scheduler, backend):
    """With one backend's tiles forced (the Triton gather tiles, fp32; the CUDA kernels, bf16) the block format's
    graph is captured once and kept across every mask update (the plans follow the in-place rewrite), and trains
    like eager steps on the same tiles.

    The CUDA weight gradient adds fp32 partials atomically, so two runs' gradients differ in their last bits and
    magnitude pruning may keep another of two near-equal blocks: there the masks are not compared across runs.
    Instead every layer's kept plans, at the end of the graph run, compute its final topology (fresh inputs against
    the float32 reference), and the losses agree to bf16 tolerance."""
    from sparsetrain.kernels.blocksparse import _cuda, gather
    from sparsetrain.kernels.blocksparse.testing import forced_config

    if backend == "gather":
        tiles, args, tol = dict(fwd=gather.DDS_CANDIDATES[16][0], dx=gather.DDS_CANDIDATES[16][0],
                                dw=gather.DW_CANDIDATES[16][0]), {}, 2e-4
    else:
        tiles, args, tol = dict(fwd=_cuda.CANDIDATES[0], dx=_cuda.CANDIDATES[0], dw=_cuda.DW_CANDIDATES[0]), \
            dict(mixed_precision="bf16"), 2e-2
    models = []
    with forced_config(**tiles):
        eager, eager_losses, eager_sig = _run(tmp_path, "eager", make_scheduler(), False, "block", **args)
        graph, graph_losses, graph_sig = _run(tmp_path, "graph", make_scheduler(), True, "block", models=models,
                                              **args)
        if backend == "cuda":
            _check_layers_compute_their_topology(models[0])
    # RigL: the grow graph captured once (at start-up, then replayed), the step graph again after it, in its pool
    assert graph["grow_captures"] == int(isinstance(make_scheduler().policy, RigL))
    assert graph["graph_captures"] == 1 + graph["grow_captures"] and graph["graphs_kept"] == 3
    if backend == "gather":
        assert eager_sig == graph_sig
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses), rtol=tol, atol=tol)


@pytest.mark.gpu
def test_gradual_pruning_on_the_block_format_captures_again_after_each_shrink(tmp_path):
    """Each shrink rebuilds the block format's storage (new values storage, new index tensors): the graph is
    captured again after it, never kept, and the run trains like eager steps (the same masks, the same losses)."""
    from sparsetrain.sparsity import GradualMagnitude

    def make():  # 24 steps: shrinks at steps 6, 12, 18 (and 24), each followed by room for a capture
        return GradualMagnitude(initial_density=1.0, num_updates=3, start=0.0, end=1.0)

    # the block kernels only: at density 1.0 the tuner may give a product to cuBLAS, whose eager and captured
    # calls round differently (~1e-6 in the loss), and magnitude pruning turns that into other masks (H200)
    kernels = KernelOptions(dense_fallback=False)
    eager, eager_losses, eager_sig = _run(tmp_path, "eager", make(), False, "block", max_steps=24, kernels=kernels)
    graph, graph_losses, graph_sig = _run(tmp_path, "graph", make(), True, "block", max_steps=24, kernels=kernels)
    shrinks = [r for r in read_metrics(tmp_path / "graph") if r.get("event") == "mask_update" and r["pruned"]]
    assert len(shrinks) >= 2
    # captured again after every shrink (one before the first capture, in the warm-up steps, needs none)
    assert len(shrinks) <= graph["graph_captures"] <= 1 + len(shrinks) and graph["graphs_kept"] == 0
    assert eager_sig == graph_sig
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses), rtol=2e-4, atol=2e-4)


def _check_layers_compute_their_topology(model) -> None:
    """Each block layer's metadata, with the plans kept on it through the run's in-place rewrites, computes the
    layer's current topology: one fwd+bwd on fresh random inputs against the float32 reference."""
    from sparsetrain.nn import SparseLinear
    from tests.kernels.blocksparse.blocksparse_cases import check_fwd_bwd

    layers = [m for m in model.modules() if isinstance(m, SparseLinear) and hasattr(m, "_bs_meta")]
    assert layers
    for layer in layers:
        meta = layer.storage.meta(layer)
        assert meta._groups.get("plans"), "the graph run kept no plans on the layer"
        b = meta.block
        x = torch.randn(37, layer.in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        values = (torch.randn(meta.n_blocks, b, b, device="cuda") / b).to(torch.bfloat16).requires_grad_()
        bias = torch.randn(layer.out_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        check_fwd_bwd(x, values, bias, meta)


@pytest.mark.parametrize("fused", [False, True])
def test_an_optimizer_made_graph_safe_steps_eagerly_again_after_make_eager_safe(fused):
    """A checkpoint of a graph run carries capturable=True and a tensor lr; an eager run (here on the CPU, where
    capturable is refused) undoes both and then steps exactly like an optimizer that never was graph-safe."""
    from sparsetrain.training.optim_capture import make_eager_safe, make_graph_safe

    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.AdamW(a.parameters(), lr=2**-7, fused=fused)
    opt_b = torch.optim.AdamW(b.parameters(), lr=2**-7, fused=fused)
    x = torch.randn(5, 4)
    for m, o in ((a, opt_a), (b, opt_b)):
        m(x).sum().backward()
        o.step()
        o.zero_grad()
    make_graph_safe(opt_a, torch.device("cpu"))
    assert opt_a.param_groups[0]["capturable"] and torch.is_tensor(opt_a.param_groups[0]["lr"])
    state = opt_a.state_dict()               # what a graph run's checkpoint holds
    opt_a.load_state_dict(state)
    make_eager_safe(opt_a)
    assert opt_a.param_groups[0]["lr"] == 2**-7 and not opt_a.param_groups[0]["capturable"]
    for m, o in ((a, opt_a), (b, opt_b)):
        m(x).pow(2).sum().backward()
        o.step()
    torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)


def _step_reading(module: torch.nn.Module, opt: torch.optim.Optimizer, with_reads: bool = True) -> TrainStep:
    return TrainStep(lambda b: None, lambda loss: None, opt, clip=lambda: None, observe=lambda loss, norm: None,
                     autocast=lambda: torch.autocast("cpu", enabled=False),
                     reads=(lambda: [*module.parameters(), *module.buffers(),
                                     *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))])
                     if with_reads else None)


@pytest.mark.parametrize("change,kept", [
    ("buffer_in_place", True), ("moments_in_place", True), ("buffer_replaced", False),
    ("param_data_swapped", False), ("no_reads", False),
])
def test_a_mask_update_keeps_the_graph_only_when_written_in_place(change, kept):
    """After a mask update the step keeps its graph only if every parameter, buffer and optimizer state tensor
    is the one captured, at the same address (the graph's kernels read those addresses); the CPU stands in for
    the capture here (the graph object is a placeholder), the GPU test above replays a kept graph."""
    lin = torch.nn.Linear(4, 3)
    lin.register_buffer("mask", torch.ones(3, 4))
    opt = torch.optim.Adam(lin.parameters())
    lin(torch.randn(2, 4)).sum().backward()
    opt.step()                                                   # moments exist, as after the warm-up steps
    step = _step_reading(lin, opt, with_reads=change != "no_reads")
    step._graph = object()
    step._remember_reads()
    if change == "buffer_in_place":
        lin.mask[0].zero_()
    elif change == "moments_in_place":
        opt.state[lin.weight]["exp_avg"].zero_()
    elif change == "buffer_replaced":
        lin.register_buffer("mask", lin.mask.clone())
    elif change == "param_data_swapped":
        lin.weight.data = lin.weight.data.clone()
    step.topology_changed()
    assert (step._graph is not None) == kept and step.graphs_kept == int(kept)
    assert step.stats()["graphs_kept"] == int(kept)
