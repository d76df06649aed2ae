"""A mask update does not recompile a ``torch.compile``'d model: the compiled graphs read a layer's topology as
tensors (the block format's index buffers, the masked format's element mask), so installing a new topology of the
same active count changes no guard. A recompile per update would cost seconds to minutes each and, after
``torch._dynamo.config.recompile_limit`` of them, leave the rest of the run eager.

Compiled with ``backend="aot_eager"`` (dynamo and AOT autograd, which decide the recompiles, without inductor's
C++ build): the forward and backward graphs are counted by the backend.
"""
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop

from sparsetrain.data.mlm import MLMCollator, PackedSequences
from sparsetrain.kernels.blocksparse import uses_kernels
from sparsetrain.models.builders import build_model
from sparsetrain.nn import DEFAULT_EXCLUDE, sparsify
from sparsetrain.nn.formats.block import BlockFormat
from sparsetrain.sparsity.layout import Block
from sparsetrain.sparsity.schedulers import PruneRegrow
from sparsetrain.sparsity.update import update_mask
from sparsetrain.training.loop import train
from sparsetrain.training.metrics import read_metrics
from sparsetrain.training.setup import RunSpec, TrainArgs, optimizer_factory

# (format, kernels): the block format on the plain-torch reference (any CPU, small or rectangular blocks on a GPU)
# and on its kernels as the custom op (what a GPU runs; the Triton interpreter here); the masked format
PATHS = [("block", False), ("block", True), ("masked", False)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    # a recompile fails, with its reason (dynamo's own patch: monkeypatch's undo lost the key on a clean install)
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


def _counting_backend():
    """``(backend, counts)``: aot_eager whose forward and backward graph compilations are counted."""
    counts = {"forward": 0, "backward": 0}

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            counts[kind] += 1
            return boxed_nop(gm, example_inputs)
        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward")), counts


def _move_blocks(layer, opt, gen: torch.Generator, n: int = 2) -> None:
    """What a SET update does to a layer: drop ``n`` active blocks and grow ``n`` others (the count is kept)."""
    u = update_mask(layer.mask, torch.rand(layer.mask.shape, generator=gen),
                    torch.rand(layer.mask.shape, generator=gen), n)
    assert u.n_dropped == n
    layer.set_mask(u.mask, opt)


def _grads(model, x):
    y = model(x)
    y.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return y.detach(), grads


@pytest.mark.parametrize("fmt,kernels", PATHS, ids=[f"{f}-{'kernels' if k else 'reference'}" for f, k in PATHS])
def test_mask_updates_reuse_the_compiled_graphs_and_match_eager(fmt, kernels, monkeypatch):
    """Three updates (every layer, then the first only, then the second only, each after an eager step, as the
    scheduler skips a layer with nothing to drop and evaluation runs the uncompiled module): no new forward or
    backward graph, and the compiled outputs and gradients equal eager on fresh inputs after each."""
    if not kernels:
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU without the interpreter: the reference path
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 64))
    layers = list(sparsify(model, targets=["*"], exclude=[], density=0.5, block=16, format=fmt).values())
    assert len(layers) == 2
    if fmt == "block":
        assert uses_kernels(torch.randn(20, 64), BlockFormat.meta(layers[0])) == kernels
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backend, counts = _counting_backend()
    compiled = torch.compile(model, backend=backend)
    gen = torch.Generator().manual_seed(1)
    compiled_step = None
    for update in range(4):
        if update:
            for layer in (layers, layers[:1], layers[1:])[update - 1]:
                _move_blocks(layer, opt, gen)
        x = torch.randn(20, 64)
        y, grads = _grads(compiled, x)
        if compiled_step is None:
            compiled_step = dict(counts)
            assert compiled_step == {"forward": 1, "backward": 1}
        y_eager, grads_eager = _grads(model, x)
        torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-5)
        for got, want in zip(grads, grads_eager, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        opt.step()
        opt.zero_grad()
        assert counts == compiled_step, f"update {update} compiled new graphs"


def _run_spec(fmt: str, args: TrainArgs, policy: str = "set") -> RunSpec:
    """A one-layer tiny BERT on random tokens, half of its linears' 16x16 blocks active in ``fmt``, with SET
    (or ``policy``)."""
    ids = torch.randint(5, 64, (48, 16), generator=torch.Generator().manual_seed(0))
    ids[:, 0], ids[:, -1] = 2, 3
    data = SimpleNamespace(train=PackedSequences(ids[:40]), eval=PackedSequences(ids[40:]), vocab_size=64,
                           seq_len=16, collator=MLMCollator(mask_token_id=4, vocab_size=64, special_ids=[0, 1, 2, 3, 4]))
    return RunSpec(
        build_model=lambda: build_model("bert", "tiny", vocab_size=64, seq_len=16, num_hidden_layers=1),
        build_data=lambda: data,
        build_optimizer=optimizer_factory(torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
        scheduler=PruneRegrow(policy, drop_fraction=0.3, drop_schedule="constant", num_updates=3),
        sparsify_kwargs=dict(targets=["*"], exclude=list(DEFAULT_EXCLUDE), density=0.5, distribution="uniform",
                             density_overrides=None, block=Block(16, 16), format=fmt, init="random", seed=0),
        train_args=args, method=policy, block_label="16",
    )


def _compile_with_aot_eager(monkeypatch) -> None:
    """The loop's torch.compile with the aot_eager backend, and the block format on its plain-torch path."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, mode=None: compile_(model, mode=mode, backend="aot_eager"))


@pytest.mark.parametrize("fmt,policy", [("block", "set"), ("masked", "set"), ("block", "rigl")])
def test_a_compiled_training_run_with_updates_recompiles_nothing_and_tracks_eager(fmt, policy, tmp_path,
                                                                                  monkeypatch):
    """trainer.compile=true with SET or RigL updates through the real loop: updates after steps 2, 4 and 6, the
    eager evaluation after steps 3 and 6 (the block format on the reference path). No recompile, a compiled
    forward from step 2 on, the same masks (pruned counts per update) and the losses of the uncompiled run
    (aot_eager draws dropout as eager does). RigL's grow steps read dense gradients through the compiled
    forward (the block format: a second graph, one recompile in the run; the masked format: a graph break)."""
    _compile_with_aot_eager(monkeypatch)

    def run(name: str, compiled: bool) -> list[dict]:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        args = TrainArgs(max_steps=8, batch_size=4, eval_every=3, eval_batches=1, log_every=1, device="cpu",
                         progress=False, plot=False, compile=compiled)
        # RigL's grow steps run the compiled model with every layer capturing (the dense gradient as a probe's,
        # kernels/blocksparse/probe.py): one more graph, compiled once at the first and cached for the others
        with torch._dynamo.config.patch(error_on_recompile=policy != "rigl" or fmt != "block"):
            train(_run_spec(fmt, args, policy), tmp_path / name)
        return read_metrics(tmp_path / name)

    compiled = run("compiled", True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    if policy == "rigl" and fmt == "block":
        failures = [f for fs in torch._dynamo.utils.guard_failures.values() for f in fs]
        assert len(failures) == 1 and ".capture_dense_grad == " in failures[0], failures
    eager = run("eager", False)
    updates = [r["step"] for r in compiled if r.get("event") == "mask_update"]
    assert len(updates) == 3 and updates == [r["step"] for r in eager if r.get("event") == "mask_update"]
    moved = [(r["pruned"], r["regrown"]) for r in compiled if r.get("event") == "mask_update"]
    assert moved == [(r["pruned"], r["regrown"]) for r in eager if r.get("event") == "mask_update"]
    losses = [(r["step"], r["loss"]) for r in compiled if "loss" in r]
    want = [(r["step"], r["loss"]) for r in eager if "loss" in r]
    assert [s for s, _ in losses] == list(range(1, 9))
    for (_, got), (_, ref) in zip(losses, want, strict=True):
        assert got == pytest.approx(ref, rel=1e-4, abs=1e-4)


def test_gradual_pruning_on_the_block_format_compiles_at_most_once_more_and_tracks_eager(tmp_path, monkeypatch):
    """Gradual pruning shrinks the block format's storage at each update (new sizes for the values and the index
    tensors): the compiled model recompiles once, with the count a dynamic size, not once per count (past dynamo's
    recompile limit the step would run uncompiled), and its losses follow the uncompiled run's."""
    from sparsetrain.sparsity import GradualMagnitude

    _compile_with_aot_eager(monkeypatch)

    def run(name: str, compiled: bool) -> list[dict]:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        args = TrainArgs(max_steps=10, batch_size=4, eval_every=0, log_every=1, device="cpu", progress=False,
                         plot=False, compile=compiled)
        spec = _run_spec("block", args)
        spec.scheduler = GradualMagnitude(initial_density=1.0, num_updates=5, start=0.0, end=0.8)
        with torch._dynamo.config.patch(error_on_recompile=False, force_parameter_static_shapes=True,
                                        force_nn_module_property_static_shapes=True):
            train(spec, tmp_path / name)
        return read_metrics(tmp_path / name)

    compiled = run("compiled", True)
    frames = torch._dynamo.utils.counters["frames"]["total"]
    eager = run("eager", False)
    shrinks = [r["step"] for r in compiled if r.get("event") == "mask_update" and r["pruned"]]
    assert len(shrinks) >= 4 and shrinks == [r["step"] for r in eager if r.get("event") == "mask_update" and r["pruned"]]
    assert frames <= 2, f"{frames} compiled frames for {len(shrinks)} counts"
    for got, ref in zip([r["loss"] for r in compiled if "loss" in r], [r["loss"] for r in eager if "loss" in r],
                        strict=True):
        assert got == pytest.approx(ref, rel=1e-4, abs=1e-4)


def test_a_lower_activation_memory_budget_keeps_less_for_the_backward_and_computes_the_same(monkeypatch):
    """``trainer.activation_memory_budget`` (:func:`compile_settings`): at 0.5 the compiled step of a sparse
    tiny BERT (block format, bf16 autocast) keeps under 80% of the bytes it keeps at 1.0 for its backward (the
    partitioner recomputes GELU's output, casts and the like there: AOTAutograd's min-cut partitioner, as
    inductor uses), and the loss and gradients are those of the budget 1.0 run."""
    from sparsetrain.training.setup import compile_settings

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(0)
    model = build_model("bert", "tiny", vocab_size=300, seq_len=64, num_hidden_layers=2)
    sparsify(model, targets=["*encoder*"], density=0.5, block=16, format="block")
    model.eval()   # no dropout: both runs compute the same function
    ids = torch.randint(5, 300, (4, 64), generator=torch.Generator().manual_seed(1))
    kept, results = {}, {}
    for budget in (1.0, 0.5):
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
        sizes = []

        def pack(t, sizes=sizes):
            sizes.append(t.numel() * t.element_size())
            return t

        with compile_settings(TrainArgs(activation_memory_budget=budget)):
            compiled = torch.compile(model, backend="aot_eager_decomp_partition")
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    torch.autocast("cpu", dtype=torch.bfloat16):
                loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
        kept[budget] = sum(sizes)
        results[budget] = [loss.detach().float()] + [p.grad.float().clone() for p in model.parameters()
                                                     if p.grad is not None]
    assert torch._functorch.config.activation_memory_budget == 1.0   # released with the context
    assert 0 < kept[0.5] < 0.8 * kept[1.0], kept
    for a, b in zip(results[0.5], results[1.0], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_the_run_compiles_under_its_activation_memory_budget(tmp_path, monkeypatch):
    """The loop holds ``trainer.activation_memory_budget`` while the model compiles (at its first compiled step)
    and releases it when the run ends."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    seen = []
    compile_ = torch.compile

    def spy(gm, example_inputs):
        seen.append(torch._functorch.config.activation_memory_budget)
        return aot_autograd(fw_compiler=boxed_nop)(gm, example_inputs)

    monkeypatch.setattr(torch, "compile", lambda model, mode=None: compile_(model, mode=mode, backend=spy))
    torch._dynamo.reset()
    args = TrainArgs(max_steps=3, batch_size=4, eval_every=0, log_every=1, device="cpu", progress=False,
                     plot=False, compile=True, activation_memory_budget=0.6)
    train(_run_spec("block", args), tmp_path / "run")
    assert seen and set(seen) == {0.6}
    assert torch._functorch.config.activation_memory_budget == 1.0
