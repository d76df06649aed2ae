"""The tuner: backends in one registry, the per-shape choice among their candidates, the dense-fallback margin
and the options that steer it (CPU: a timer hook stands in for GPU timing)."""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from blocksparse_cases import make_mask, rel

from sparsetrain.kernels import use_kernel_options
from sparsetrain.kernels.blocksparse import (
    Backend,
    Product,
    dense,
    register_backend,
    tma,
    tuner,
    unregister_backend,
)
from sparsetrain.kernels.blocksparse.dense import DenseConfig
from sparsetrain.kernels.blocksparse.gather import INTERP_DDS, INTERP_DW, DdsConfig
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.op import block_sparse_linear
from sparsetrain.kernels.blocksparse.reference import dense_to_values, reference_grads, values_to_dense
from sparsetrain.kernels.blocksparse.testing import use_timer


class ReferenceConfig(NamedTuple):
    """A backend with no tiles: its plans compute the products in plain torch."""


class _ReferenceDds:
    def __init__(self, p: Product, calls: list):
        self.meta, self.forward, self.calls = p.meta, p.forward, calls
        self.out_width = (p.meta.grid[0] if p.forward else p.meta.grid[1]) * p.meta.block

    def __call__(self, a, values, bias, out):
        self.calls.append("fwd" if self.forward else "dx")
        w = values_to_dense(values.to(a.dtype), self.meta)
        out.copy_(a @ w.t() + bias if self.forward and bias is not a else a @ (w.t() if self.forward else w))


class _ReferenceDw:
    atomic = False

    def __init__(self, p: Product, calls: list):
        self.meta, self.bias, self.calls = p.meta, p.bias, calls

    def __call__(self, x, dy, dv, db):
        self.calls.append("dw")
        dv.copy_(dense_to_values(dy.t() @ x, self.meta))
        if self.bias:
            db.copy_(dy.sum(0))


def _reference_backend(calls: list, fallback: bool = False) -> Backend:
    return Backend("reference", (ReferenceConfig,), candidates=lambda p: [ReferenceConfig()],
                   make_plan=lambda cfg, p: (_ReferenceDw if p.kind == "dw" else _ReferenceDds)(p, calls),
                   fallback=fallback)


def _layer(seed: int, T: int = 21):
    gen = torch.Generator().manual_seed(seed)
    meta = BlockSparseMeta.from_mask(make_mask("random", (6, 4), gen), 16)
    values = (torch.randn(meta.n_blocks, 16, 16, generator=gen) / 16).requires_grad_()
    bias = torch.randn(96, generator=gen, requires_grad=True)
    return meta, values, bias, torch.randn(T, 64, generator=gen, requires_grad=True)


def test_a_registered_backend_is_timed_and_chosen():
    """A backend registered through the public function is listed beside the built-in ones, timed (here by a
    timer hook, on the CPU) and chosen where it is fastest: its plans then compute the layer."""
    calls, timed = [], []

    def timer(cfg, launch):
        timed.append(cfg)
        return 0.5 if isinstance(cfg, ReferenceConfig) else 1.0

    register_backend(_reference_backend(calls))
    try:
        assert [b.name for b in tuner.backends()][-1] == "reference"
        meta, values, bias, x = _layer(seed=1)
        with use_timer(timer):
            y = block_sparse_linear(x, values, meta, bias)
            dy = torch.randn_like(y)
            y.backward(dy)
        assert timed == [INTERP_DDS[16], ReferenceConfig(), INTERP_DDS[16], ReferenceConfig(),
                         INTERP_DW[16], ReferenceConfig()]  # fwd, dx, dw: the interpreter's tile and ours
        assert calls == ["fwd", "dx", "dw"] and len(tuner.tuned_configs()) == 3
        assert tuner.choice_counts() == {"reference": 3}   # what a run's summary reports (kernel_choices)
        w = values_to_dense(values.detach().double(), meta)
        assert rel(y, x.detach().double() @ w.t() + bias.detach().double()) < 1e-6
        dx, dv, db = reference_grads(x.detach().double(), dy.double(), values.detach().double(), meta)
        assert rel(x.grad, dx) < 1e-6 and rel(values.grad, dv) < 1e-6 and rel(bias.grad, db) < 1e-6
    finally:
        unregister_backend("reference")
    assert "reference" not in [b.name for b in tuner.backends()] and not tuner.tuned_configs()


def test_a_changed_margin_is_not_served_a_stale_choice():
    """A fallback backend 10% faster than the best kernel loses at the default margin (0.85) and wins at 1.0:
    the margin is part of the kept choice's key, and of the cached plans'."""
    calls = []
    register_backend(_reference_backend(calls, fallback=True))
    try:
        meta, values, bias, x = _layer(seed=2)
        with use_timer(lambda cfg, launch: 0.9 if isinstance(cfg, ReferenceConfig) else 1.0):
            with torch.no_grad():
                block_sparse_linear(x, values, meta, bias)
                assert calls == []
                with use_kernel_options(dense_margin=1.0):
                    block_sparse_linear(x, values, meta, bias)
                assert calls == ["fwd"]
                block_sparse_linear(x, values, meta, bias)
        assert calls == ["fwd"] and len(meta._groups["plans"]) == 2
    finally:
        unregister_backend("reference")


def test_register_backend_places_and_replaces():
    names = [b.name for b in tuner.backends()]
    assert names == ["cuda", "tma", "gather", "dense"]  # the first candidate is the untimed choice
    try:
        register_backend(_reference_backend([]), before="gather")
        assert [b.name for b in tuner.backends()] == ["cuda", "tma", "reference", "gather", "dense"]
        register_backend(_reference_backend([]))  # same name: replaced, now last
        assert [b.name for b in tuner.backends()] == [*names, "reference"]
        assert tuner.backend_of(ReferenceConfig()).name == "reference"
        with pytest.raises(KeyError, match="nope"):
            register_backend(_reference_backend([]), before="nope")
    finally:
        unregister_backend("reference")
    with pytest.raises(TypeError, match="ReferenceConfig"):
        tuner.backend_of(ReferenceConfig())


def test_dense_fallback_is_offered_on_cuda_unless_turned_off(monkeypatch):
    """The dense fallback is a candidate for CUDA tensors only, and not with ``dense_fallback=False``."""
    meta = BlockSparseMeta.from_mask(torch.ones(2, 2, dtype=torch.bool), 16)
    cpu = torch.empty(2, 32)
    cuda_like = torch.empty(2, 32, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t.device.type in ("cuda", "meta")))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    offered = dense.BACKEND.candidates
    assert offered(Product("fwd", meta, cpu, cpu, False)) == []
    assert offered(Product("fwd", meta, cuda_like, cuda_like, False)) == [DenseConfig()]
    with use_kernel_options(dense_fallback=False):
        assert offered(Product("dw", meta, cuda_like, cuda_like, False)) == []


def test_tuner_takes_the_dense_fallback_only_by_a_margin():
    """The tuner times GPU time only; the dense fallback also costs host work, so it must beat the best block
    kernel by ``dense_margin`` to be chosen. Among block kernels the fastest wins."""
    a, b = DdsConfig(64, 1, 1, 4, 2), DdsConfig(128, 1, 1, 4, 2)
    fb = DenseConfig()
    margin = 0.85
    near = margin + 0.01  # dense a little faster than the best kernel, not by the margin
    assert tuner.choose([(a, 1.2), (b, 1.0), (fb, near)]) == b
    assert tuner.choose([(fb, near), (a, 1.0)]) == a
    assert tuner.choose([(a, 1.0), (fb, margin - 0.01)]) == fb
    assert tuner.choose([(fb, 5.0)]) == fb
    assert tuner.choose([(a, 0.9), (b, 1.0)]) == a
    with use_kernel_options(dense_margin=1.0):  # the plain fastest
        assert tuner.choose([(a, 1.0), (fb, near)]) == fb
    assert tuner.choose([(a, 1.0), (fb, 0.5)], margin=0.4) == a


def test_dense_fallback_report_pairs_best_kernel_and_dense_times():
    a, b, fb = DdsConfig(64, 1, 1, 4, 2), DdsConfig(128, 1, 1, 4, 2), DenseConfig()
    timed = {("k1",): [(a, 0.3), (b, 0.2), (fb, 0.25)], ("k2",): [(a, 0.4)], ("k3",): [(a, 0.5), (fb, 0.1)]}
    tuned = {("k1",): b, ("k2",): a, ("k3",): fb}
    assert tuner.dense_fallback_report(tuned, timed) == [
        {"key": "('k1',)", "kernel_ms": 0.2, "dense_ms": 0.25, "chosen": "kernel"},
        {"key": "('k3',)", "kernel_ms": 0.5, "dense_ms": 0.1, "chosen": "dense"}]


def test_tma_descriptor_kind_follows_graph_capture(monkeypatch):
    """Host-made TMA descriptors only on a CUDA device while a graph is being captured; CPU tensors (the
    interpreter) never ask CUDA."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert not tma.host_desc(cuda) and not tma.host_desc(cpu)
    capturing[0] = True
    assert tma.host_desc(cuda) and not tma.host_desc(cpu)


class _ListingConfig(NamedTuple):
    """A losing candidate whose plan leaves a list of its own on the metadata."""


def test_lists_of_candidates_not_chosen_leave_the_metadata(poison):
    """Timing builds every candidate's plan; what the losers left on the metadata goes (an in-place mask update
    would refill it at every update for nothing) and the winner's plan is built again with its own lists."""
    from sparsetrain.kernels.blocksparse import plans

    def listing_plan(cfg, p):
        p.meta.padded_entries(True, 8, fixed=True)          # a list no other plan here uses
        return _ReferenceDw(p, []) if p.kind == "dw" else _ReferenceDds(p, [])

    register_backend(Backend("listing", (_ListingConfig,), lambda p: [_ListingConfig()], listing_plan))
    try:
        meta = BlockSparseMeta.from_mask(make_mask("random", (6, 4), torch.Generator().manual_seed(1)), 16)
        x = torch.randn(37, 64)
        values = torch.randn(meta.n_blocks, 16, 16)
        def timer(slow):   # runs each candidate, as timing does: every candidate's plan is built
            return lambda cfg, launch: (launch(), slow if isinstance(cfg, _ListingConfig) else 1.0)[1]

        with use_timer(timer(2.0)):
            y = plans.dds(x, values, meta, None, forward=True)
        assert ("dds", True, 8, True) not in meta._groups   # the loser's list is gone
        assert ("dds", True, INTERP_DDS[16].group_k, True) in meta._groups   # the winner's (gather) is there
        kept = meta._groups["plans"]
        assert len(kept) == 1 and type(next(iter(kept.values()))).__name__ == "TritonPlan"
        assert rel(y, x.double() @ values_to_dense(values.double(), meta).t()) < 1e-5
        with use_timer(timer(0.5)):
            meta2 = BlockSparseMeta.from_mask(meta.row_ptr.new_ones(6, 4).bool(), 16)
            plans.dds(torch.randn(37, 64), torch.randn(24, 16, 16), meta2, None, forward=True)
        assert ("dds", True, 8, True) in meta2._groups      # the winner's list stays
    finally:
        unregister_backend("listing")


def test_a_candidate_whose_result_disagrees_is_never_chosen():
    """Tuning times candidates for speed only; a fast candidate whose result differs from the first candidate's
    (a wrong product, or outputs it leaves unwritten: they are NaN-filled first) is left out, with a warning."""
    from sparsetrain.kernels.blocksparse.testing import HOOKS

    ref, out = torch.randn(8, 8), torch.empty(8, 8)

    def launch(cfg):
        if HOOKS.poison:
            out.fill_(float("nan"))
        if cfg in ("right", "close"):
            out.copy_(ref * (1.001 if cfg == "close" else 1.0))   # summation order, rounding: the same product
        elif cfg == "wrong":
            out.copy_(ref.flip(0))
        else:                                                    # "partial": half the output never written
            out[:4] = ref[:4]
        return out, None

    ms = {"right": 2.0, "close": 3.0, "wrong": 1.0, "partial": 0.5}
    timer = lambda cfg, run: (run(), ms[cfg])[1]   # noqa: E731
    cands = ["right", "wrong", "close", "partial"]
    with pytest.warns(UserWarning) as caught:
        timed = tuner.time_candidates("fwd", ("k",), cands, launch, timer)
    assert timed == [("right", 2.0), ("close", 3.0)]
    assert sorted(str(w.message).split("'")[1] for w in caught) == ["partial", "wrong"]
    assert [c for c, _ in tuner.time_candidates("fwd", ("k",), cands, launch, timer, check=False)] == cands


def test_the_candidates_are_compared_in_chunks_as_whole_float32_norms(monkeypatch):
    """The comparison works through the outputs a chunk at a time (the first step tunes while its activations are
    held: whole float32 copies of a large output were ~2 GB) and gives the relative difference of whole float32
    norms; an element left NaN, in any chunk, or an inf is no agreement."""
    monkeypatch.setattr(tuner, "_CHUNK", 7)
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float16):
        y = torch.randn(13, 11, generator=g).to(dtype)
        x = (y.float() + 0.01 * torch.randn(13, 11, generator=g)).to(dtype)
        want = float((x.float() - y.float()).norm() / y.float().norm())
        assert tuner._disagreement([x, None], [y, None]) == pytest.approx(want, rel=1e-5)
        assert tuner._disagreement([y], [y]) == 0.0
        for bad in (float("nan"), float("inf")):
            z = y.clone()
            z[12, 10] = bad          # the last, partial chunk
            assert tuner._disagreement([x, z], [y, y]) == float("inf")


def test_a_shrunk_topology_is_planned_from_the_timings_of_another_density():
    """Gradual pruning's new counts (metadata with ``estimate_plans``) time nothing: the choice comes from the same
    product's timings at the nearest density timed, block kernels scaled by the density ratio, the dense fallback
    kept. At full density the fallback wins by the margin; at a quarter the scaled block kernel does. Without the
    flag (or with nothing timed yet) the new density is timed as before."""
    calls, timed = [], []

    def timer(cfg, launch):
        timed.append(cfg)
        return 1.0 if isinstance(cfg, ReferenceConfig) else 2.0

    def layer(mask):
        meta = BlockSparseMeta.from_mask(mask, 16)
        values = torch.randn(meta.n_blocks, 16, 16) / 16
        return meta, values

    full = torch.ones(6, 4, dtype=torch.bool)
    quarter = torch.zeros(6, 4, dtype=torch.bool)
    quarter.view(-1)[torch.randperm(24)[:6]] = True
    x, bias = torch.randn(21, 64), torch.randn(96)
    register_backend(_reference_backend(calls, fallback=True))
    try:
        with use_timer(timer), torch.no_grad():
            shrunk, shrunk_values = layer(quarter)
            shrunk.estimate_plans = True
            block_sparse_linear(x, shrunk_values, shrunk, bias)   # nothing timed at any density yet: timed
            assert len(timed) == 2 and tuner.estimated_count() == 0
            tuner._forget()
            timed.clear(), calls.clear()
            meta, values = layer(full)
            block_sparse_linear(x, values, meta, bias)
            assert len(timed) == 2 and calls == ["fwd"]           # dense 1.0 beats the kernel's 2.0 x 0.85
            shrunk, shrunk_values = layer(quarter)
            shrunk.estimate_plans = True
            y = block_sparse_linear(x, shrunk_values, shrunk, bias)
            assert len(timed) == 2 and tuner.estimated_count() == 1   # 2.0 x 1/4 = 0.5 < 1.0: the block kernel
            assert calls == ["fwd"] and tuner.choice_counts() == {"reference": 1, "gather": 1}
            w = values_to_dense(shrunk_values.double(), shrunk)
            assert rel(y, x.double() @ w.t() + bias.double()) < 1e-3
            assert [r["chosen"] for r in tuner.dense_fallback_report()] == ["dense"]   # measured rows only
            tuner._forget()
            block_sparse_linear(x, values, meta, bias)
            again, again_values = layer(quarter)                   # not flagged: the new density is timed
            block_sparse_linear(x, again_values, again, bias)
            assert len(timed) == 6 and tuner.estimated_count() == 0
    finally:
        unregister_backend("reference")
