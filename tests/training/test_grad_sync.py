"""The step's own gradient sync (CUDA-graph runs of several processes, no DDP wrapper) computes what DDP computes:
the same averaged gradients, unused parameters as under find_unused_parameters=True, rank 0's weights at the start,
and, through the whole loop on two gloo processes, the same parameters and masks after mask updates (SET, RigL,
grad_accum=2) on every rank. The graph capture itself needs two GPUs: the ``gpu`` tests at the end."""
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sparsetrain.sparsity.schedulers import Dense, PruneRegrow, Static
from sparsetrain.training import checkpoint as ckpt
from sparsetrain.training.grad_sync import GradSync, _buckets, broadcast_from_rank0
from sparsetrain.training.metrics import read_metrics
from tests.training.test_ranks import _spawn, spawn_pair


class _Branches(nn.Module):
    """``a`` is used on every rank, ``b`` on rank 0 only, ``c`` nowhere."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(4, 3)
        self.register_buffer("scale", torch.rand(3))

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        y = self.a(x) * self.scale
        if rank == 0:
            y = y + self.b(x)
        return y.pow(2).sum()


def _made(seed: int) -> _Branches:
    torch.manual_seed(seed)
    return _Branches()


def _sync_worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = _made(seed=rank)                       # different weights and buffer on each rank
        broadcast_from_rank0(model)
        reference = _made(seed=0)
        assert all(a.equal(b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))

        ddp = nn.parallel.DistributedDataParallel(_made(seed=0), find_unused_parameters=True)
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 + rank))   # each rank its own batch
        ddp(x, rank).backward()
        model(x, rank).backward()
        GradSync(lambda: list(model.parameters()), processes=2)()
        for (name, p), q in zip(model.named_parameters(), ddp.module.parameters()):
            if name.startswith("c."):                  # no gradient on any rank: stays None, as under DDP
                assert p.grad is None and q.grad is None, name
            else:                                      # b: rank 1 holds half of rank 0's gradient, as under DDP
                assert q.grad is not None and p.grad.equal(q.grad), name

        # under capture (faked here: no host sync allowed) the set agreed at the eager step is reused
        from sparsetrain.training import grad_sync

        sync, want = GradSync(lambda: list(model.parameters()), processes=2), [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        model(x, rank).backward()
        sync()                                         # eager: agrees on the set
        grad_sync._capturing = lambda: True
        model.zero_grad(set_to_none=True)
        model(x, rank).backward()
        sync()
        assert all((g is None and p.grad is None) or p.grad.equal(g) for p, g in zip(model.parameters(), want))
        model.zero_grad(set_to_none=True)
        model(x, 1 - rank).backward()                  # b used on the other rank now: only an eager step agrees
        with pytest.raises(RuntimeError, match="differ from those of the eager step before the capture"):
            sync()
    finally:
        dist.barrier()   # both ranks reach teardown together (a gloo peer that exits first can abort the other)
        dist.destroy_process_group()


def test_grad_sync_averages_like_ddp_with_unused_parameters_and_starts_from_rank0():
    _spawn(_sync_worker)


def test_buckets_keep_dtypes_apart_and_stay_under_the_limit():
    f32 = [torch.zeros(10), torch.zeros(20), torch.zeros(5), torch.zeros(30)]
    f16 = [torch.zeros(8, dtype=torch.float16)]
    runs = _buckets([f32[0], f16[0], f32[1], f32[2], f32[3]], limit=35 * 4)
    assert [[t.numel() for t in run] for run in runs] == [[10, 20, 5], [30], [8]]
    assert [[t.numel() for t in run] for run in _buckets([torch.zeros(50)], limit=4)] == [[50]]   # too big alone


# -- the whole loop on two gloo processes: DDP against the step's own sync -----------------------------------
def _schedulers():
    """The CPU runs' schedulers (updates at steps 3 and 6) and the GPU runs' (three updates in 12 steps)."""
    return {"dense": Dense(), "set": PruneRegrow(policy="set", drop_fraction=0.3, interval=3),
            "rigl": PruneRegrow(policy="rigl", drop_fraction=0.3, interval=3),
            "gpu_static": Static(), "gpu_set": PruneRegrow(policy="set", drop_fraction=0.3, num_updates=3, seed=1),
            "gpu_rigl": PruneRegrow(policy="rigl", drop_fraction=0.3, num_updates=3, seed=1)}


def _cpu_spec(scheduler: str, kw: dict):
    """test_world_size's tiny BERT (no dropout, 8x8 blocks of the block format) on the CPU."""
    from tests.training.test_world_size import _spec

    spec = _spec(**kw)
    spec.scheduler = _schedulers()[scheduler]
    return spec


def _loop_worker(rank: int, port: int, root: str, build, runs: list[tuple[str, str, bool, bool, dict]]) -> None:
    """Each run ``(name, scheduler, force_step_sync, wraps_in_ddp, train_args)`` of ``build(scheduler, args)`` in
    turn on the same two processes (accelerate's state reset between them); every rank saves its final weights
    and its summary."""
    import json

    from accelerate.state import AcceleratorState, GradientState

    from sparsetrain.training import loop

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # NVLink multicast off (GPU machines that have it)
    torch.set_num_threads(1)
    wraps = []
    ddp_init = nn.parallel.DistributedDataParallel.__init__

    def counted(self, *a, **k):
        wraps.append(1)
        ddp_init(self, *a, **k)

    nn.parallel.DistributedDataParallel.__init__ = counted
    for i, (name, scheduler, step_sync, wraps_in_ddp, kw) in enumerate(runs):
        os.environ["MASTER_PORT"] = str(port + i)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        loop._STEP_SYNC_WITHOUT_GRAPH = step_sync
        spec = build(scheduler, kw)
        attach, seen = spec.scheduler.attach, {}

        def keep(model, *a, attach=attach, seen=seen, **k):
            seen["model"] = model
            return attach(model, *a, **k)

        spec.scheduler.attach = keep
        del wraps[:]
        summary = loop.train(spec, os.path.join(root, name))
        assert len(wraps) == int(wraps_in_ddp), (name, wraps)   # the step's own sync: no DDP wrapper
        assert summary["ranks_masks_identical"] is not False
        torch.save({k: v.detach().cpu() for k, v in seen["model"].state_dict().items()},   # ranks compare on CPU
                   os.path.join(root, f"{name}.rank{rank}.pt"))
        with open(os.path.join(root, f"{name}.rank{rank}.json"), "w") as f:
            json.dump(summary, f)


def _spawn_runs(root, build, runs) -> None:
    """The runs on two processes. A port another process on the machine took between the check and the bind
    (EADDRINUSE, seen once when two test sessions ran at once) is tried again on other ports, from a clean root."""
    import shutil
    from pathlib import Path

    import torch.multiprocessing as mp

    for attempt in range(3):
        try:
            spawn_pair(_loop_worker, _free_ports(len(runs)), str(root), build, runs)
            return
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise
            for child in Path(root).iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()


def _free_ports(n: int) -> int:
    """A port ``p`` with ``p + 1 .. p + n - 1`` free as well (one process group per run)."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


CASES = {   # name: (scheduler, TrainArgs overrides)
    "dense": ("dense", dict(max_steps=4, grad_accum=1)),
    "set": ("set", dict(max_steps=7, grad_accum=2)),
    "rigl": ("rigl", dict(max_steps=7, grad_accum=2)),
}


@pytest.fixture(scope="module")
def loop_runs(tmp_path_factory):
    """Every case twice on two gloo processes: under DDP and with the step's own sync."""
    root = tmp_path_factory.mktemp("grad_sync")
    runs = [(f"{case}_{mode}", scheduler, mode == "step", mode == "ddp", {**kw, "checkpoint_every": 0})
            for case, (scheduler, kw) in CASES.items() for mode in ("ddp", "step")]
    _spawn_runs(root, _cpu_spec, runs)
    return root


@pytest.mark.parametrize("case", list(CASES))
def test_the_step_own_sync_trains_like_ddp_on_every_rank(loop_runs, case):
    root = loop_runs
    weights = {(mode, r): torch.load(root / f"{case}_{mode}.rank{r}.pt", weights_only=True)
               for mode in ("ddp", "step") for r in (0, 1)}
    ddp = weights["ddp", 0]
    for key, w in weights.items():
        assert w.keys() == ddp.keys()
        for k in w:                          # every rank, either sync: the same weights and masks, to the bit
            assert w[k].equal(ddp[k]), (key, k)
    rows = {mode: read_metrics(root / f"{case}_{mode}") for mode in ("ddp", "step")}
    losses = {mode: [r["loss"] for r in rows[mode] if "loss" in r] for mode in rows}
    assert len(losses["step"]) == CASES[case][1]["max_steps"]
    assert losses["step"] == losses["ddp"]
    updates = {mode: [(r["step"], r["pruned"], r["ranks_masks_identical"]) for r in rows[mode]
                      if r.get("event") == "mask_update"] for mode in rows}
    assert updates["step"] == updates["ddp"]
    if case != "dense":
        assert [(s, ok) for s, _, ok in updates["step"]] == [(3, True), (6, True)]
        assert all(pruned > 0 for _, pruned, _ in updates["step"])
    saved = {mode: torch.load(root / f"{case}_{mode}" / "checkpoints" / f"step_{len(losses[mode]):08d}" /
                              ckpt.MODEL_FILE, weights_only=True) for mode in ("ddp", "step")}
    assert saved["step"].keys() == saved["ddp"].keys()     # the checkpoint finds the model as under DDP
    assert all(saved["step"][k].equal(weights["step", 0][k]) for k in saved["step"])


# -- two GPUs (NCCL): the graph step with its all-reduce captured, against DDP's eager steps ----------------------
def _gpu_spec(scheduler: str, kw: dict):
    """test_cuda_graph's tiny BERT (sdpa attention, no dropout, 16x16 blocks of the block format) on the GPU."""
    from sparsetrain.models.builders import build_model
    from tests.training.test_cuda_graph import _args, _no_dropout
    from tests.training.test_loop import _spec

    spec = _spec(_schedulers()[scheduler], _args(**kw))
    spec.sparsify_kwargs["format"] = "block"
    spec.build_model = lambda: _no_dropout(build_model("bert", "tiny", vocab_size=64, seq_len=16,
                                                       num_hidden_layers=1, attn_implementation="sdpa"))
    return spec


GPU_CASES = {   # name: (scheduler, mask updates, TrainArgs overrides of the graph run)
    "static": ("gpu_static", 0, {}),
    "set": ("gpu_set", 3, {}),
    "rigl": ("gpu_rigl", 3, {}),
    "static_compiled": ("gpu_static", 0, {"compile": True}),
}


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (NCCL)")
    root = tmp_path_factory.mktemp("grad_sync_gpu")
    runs = [run for case, (scheduler, _, kw) in GPU_CASES.items() for run in (
        (f"{case}_ddp", scheduler, False, True, {"cuda_graph": False}),
        (f"{case}_graph", scheduler, False, False, {"cuda_graph": True, **kw}))]
    _spawn_runs(root, _gpu_spec, runs)
    return root


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_two_gpu_graph_steps_train_like_ddp_eager_steps(gpu_runs, case):
    """Two NCCL processes replaying one graph each (forward, backward, the gradient all-reduce, clip, AdamW) train
    like DDP's eager steps: the same losses to float tolerance, the same masks after the same updates, and both
    ranks end with the very same weights."""
    import json

    root, (_, updates, _) = gpu_runs, GPU_CASES[case]
    summary = {mode: json.loads((root / f"{case}_{mode}.rank0.json").read_text()) for mode in ("ddp", "graph")}
    assert summary["ddp"]["step_mode"] == "eager" and summary["graph"]["step_mode"] == "cuda_graph"
    # every mask update either keeps the graph (its tables rewritten in place) or captures it again
    assert summary["graph"]["graph_captures"] >= 1
    # (and each capture of RigL's grow graph, in a pool of its own, is followed by one of the step graph in it)
    g = summary["graph"]
    assert g["graph_captures"] - g.get("grow_captures", 0) + g["graphs_kept"] == 1 + updates
    assert summary["graph"]["graph_replays"] + summary["graph"]["eager_steps"] == 12
    assert summary["graph"]["graph_replays"] >= 12 - 2 * (1 + updates) - 1
    assert summary["graph"]["ranks_masks_identical"] is not False
    weights = {(mode, r): torch.load(root / f"{case}_{mode}.rank{r}.pt", weights_only=True)
               for mode in ("ddp", "graph") for r in (0, 1)}
    for mode in ("ddp", "graph"):                                     # both ranks: the same weights, to the bit
        assert all(weights[mode, 0][k].equal(weights[mode, 1][k]) for k in weights[mode, 0]), mode
    masks = [k for k in weights["ddp", 0] if k.endswith(".mask")]
    assert masks and all(weights["ddp", 0][k].equal(weights["graph", 0][k]) for k in masks)
    losses = {mode: [r["loss"] for r in read_metrics(root / f"{case}_{mode}") if "loss" in r]
              for mode in ("ddp", "graph")}
    assert len(losses["graph"]) == len(losses["ddp"]) == 6
    tol = 1e-3 if "compiled" in case else 2e-4
    torch.testing.assert_close(torch.tensor(losses["graph"]), torch.tensor(losses["ddp"]), rtol=tol, atol=tol)
