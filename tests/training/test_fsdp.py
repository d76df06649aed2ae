"""FSDP2 (``fully_shard``, full shard) with the block format, two gloo processes on the CPU: a mask update moves the
sharded compressed values and Adam moments exactly as one process moves the whole tensors, training runs through
the loop under accelerate's own FSDP2 preparation like one process, and checkpoints move between FSDP and one
process either way. Refusals of FSDP setups the sparse layers cannot train under."""
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from sparsetrain.nn import sparsify
from sparsetrain.nn.formats.base import is_sharded, whole
from sparsetrain.sparsity import criteria
from sparsetrain.sparsity.protocol import sparse_layers
from sparsetrain.sparsity.update import update_mask
from sparsetrain.training import checkpoint as ckpt
from sparsetrain.training.loop import train
from sparsetrain.training.sharded import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
    prepare_fsdp,
)
from tests.training.test_ranks import _spawn
from tests.training.test_world_size import _load, _rows, _spec

BATCH = 8


def _mlp() -> torch.nn.Sequential:
    """Two block-format layers, 8x8 blocks, half active: 13 and 16 blocks (13 shards unevenly: 7 + 6)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 24))
    sparsify(model, targets=["0"], exclude=[], density=0.55, block=8, seed=0, format="block")
    sparsify(model, targets=["2"], exclude=[], density=0.5, block=8, seed=0, format="block")
    return model


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in sparse_layers(model).values():
        fully_shard(layer)
    fully_shard(model)
    return model


def _batch() -> torch.Tensor:
    return torch.randn(BATCH, 24, generator=torch.Generator().manual_seed(1))


def _train(model, optimizer, x, steps: int) -> None:
    for _ in range(steps):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _update(model, optimizer, step: int) -> None:
    """One prune-and-regrow: drop a third of each layer's blocks by magnitude, regrow at random (seeded)."""
    for i, layer in enumerate(sparse_layers(model).values()):
        weight = layer.dense_weight()
        drop = criteria.magnitude(weight).reshape(layer.mask.shape[0], 8, layer.mask.shape[1], 8).sum((1, 3))
        grow = torch.rand(layer.mask.shape, generator=torch.Generator().manual_seed(step * 100 + i))
        layer.set_mask(update_mask(layer.mask, drop, grow, layer.n_active // 3).mask, optimizer)


def _whole_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every layer's values, moments and mask, whole."""
    out = {}
    for name, layer in sparse_layers(model).items():
        out[f"{name}.values"] = whole(layer.values.detach()).clone()
        out[f"{name}.mask"] = layer.mask.clone()
        for k, v in optimizer.state[layer.values].items():
            if k != "step":
                out[f"{name}.{k}"] = whole(v).clone()
    return out


def _fsdp_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = _shard(_mlp())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        assert all(is_sharded(layer.values) for layer in sparse_layers(model).values())
        x = _batch()[rank * BATCH // 2:(rank + 1) * BATCH // 2]                  # each rank half of the batch
        _train(model, optimizer, x, steps=3)
        before = _whole_state(model, optimizer)
        _update(model, optimizer, step=3)
        after = _whole_state(model, optimizer)
        _train(model, optimizer, x, steps=2)
        model_state, optimizer_state = full_model_state(model), full_optimizer_state(optimizer)
        if rank == 0:
            torch.save({"before": before, "after": after, "model": model_state, "optimizer": optimizer_state},
                       os.path.join(out_dir, "fsdp.pt"))
        # a one-process checkpoint loads into the sharded model: each rank takes its shard of it
        dist.barrier()
        one = torch.load(os.path.join(out_dir, "one.pt"), weights_only=True)
        load_full_model_state(model, one["model"])
        load_full_optimizer_state(optimizer, one["optimizer"])
        assert all(is_sharded(v) for s in optimizer.state.values() for k, v in s.items() if k != "step")
        reloaded = full_model_state(model), full_optimizer_state(optimizer)
        if rank == 0:
            torch.save({"model": reloaded[0], "optimizer": reloaded[1]}, os.path.join(out_dir, "reloaded.pt"))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _one_process_run():
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, _batch(), steps=3)
    before = _whole_state(model, optimizer)
    _update(model, optimizer, step=3)
    after = _whole_state(model, optimizer)
    _train(model, optimizer, _batch(), steps=2)
    return model, optimizer, before, after


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k].float(), b[k].float(), rtol=1e-5, atol=1e-6)
                                        for k in a)


@pytest.fixture(scope="module")
def sharded_mlp(tmp_path_factory):
    """The one-process run, its state saved for the sharded run to load, and what the sharded run wrote."""
    d = tmp_path_factory.mktemp("fsdp_mlp")
    model, optimizer, before, after = _one_process_run()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, d / "one.pt")
    _spawn(_fsdp_worker, str(d))
    return SimpleNamespace(model=model, optimizer=optimizer, before=before, after=after,
                           one=torch.load(d / "one.pt", weights_only=True),
                           fsdp=torch.load(d / "fsdp.pt", weights_only=True),
                           reloaded=torch.load(d / "reloaded.pt", weights_only=True))


def test_fsdp_mask_update_moves_values_and_moments_like_one_process(sharded_mlp):
    fsdp, one = sharded_mlp.fsdp, sharded_mlp.one
    # the same training up to the update (gradients averaged over the two halves of the batch)
    assert _close(fsdp["before"], sharded_mlp.before)
    # the update moves the gathered values and moments exactly as one process moves the same tensors
    replica = _mlp()
    replica_opt = torch.optim.AdamW(replica.parameters(), lr=1e-2)
    for name, layer in sparse_layers(replica).items():
        layer.load_state_dict({"weight": torch.zeros(layer.out_features, layer.in_features),
                               "mask": fsdp["before"][f"{name}.mask"], "bias": layer.bias.detach()})
        with torch.no_grad():
            layer.values.copy_(fsdp["before"][f"{name}.values"])
        replica_opt.state[layer.values] = {"step": torch.tensor(3.0),
                                           "exp_avg": fsdp["before"][f"{name}.exp_avg"].clone(),
                                           "exp_avg_sq": fsdp["before"][f"{name}.exp_avg_sq"].clone()}
    _update(replica, replica_opt, step=3)
    moved = _whole_state(replica, replica_opt)
    assert moved.keys() == fsdp["after"].keys()
    assert all(moved[k].equal(fsdp["after"][k]) for k in moved)
    for name in sparse_layers(replica):                       # the update did move blocks and zero moments
        assert not fsdp["after"][f"{name}.mask"].equal(fsdp["before"][f"{name}.mask"])
    assert _close(fsdp["after"], sharded_mlp.after)
    # and two more steps: the whole checkpoint of the sharded run is the one-process state
    assert _close(fsdp["model"], one["model"])
    mask_keys = [k for k in one["model"] if k.endswith(".mask")]
    assert mask_keys and all(fsdp["model"][k].equal(one["model"][k]) for k in mask_keys)


def test_fsdp_state_loads_in_one_process_and_a_one_process_state_in_fsdp(sharded_mlp):
    fsdp, one = sharded_mlp.fsdp, sharded_mlp.one
    loaded = _mlp()
    loaded_opt = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
    loaded.load_state_dict(fsdp["model"])
    loaded_opt.load_state_dict(fsdp["optimizer"])
    assert _close(loaded.state_dict(), sharded_mlp.model.state_dict())
    assert _close(_whole_state(loaded, loaded_opt), _whole_state(sharded_mlp.model, sharded_mlp.optimizer))
    # the one-process state loaded into the sharded model comes back bit for bit
    reloaded = sharded_mlp.reloaded
    assert reloaded["model"].keys() == one["model"].keys()
    assert all(reloaded["model"][k].equal(one["model"][k]) for k in one["model"])
    state, one_state = reloaded["optimizer"]["state"], one["optimizer"]["state"]
    assert state.keys() == one_state.keys()
    assert all(state[i][k].equal(one_state[i][k]) for i in one_state for k in one_state[i])


# ---- the training loop under accelerate's FSDP2 ---------------------------------------------------------------
def _as_on_gpus() -> None:
    """accelerate turns FSDP on only for GPU (and other accelerator) process groups; on the CPU it would train
    with DDP. Here every Accelerator gets the distributed type and plugin that ``accelerate launch --use_fsdp
    --fsdp_version 2`` gives it on GPUs, so accelerate's own FSDP2 preparation (fully_shard per BertLayer, the
    embedding groups, the optimizer's switch to the sharded Parameters) runs under gloo."""
    import accelerate
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    init = accelerate.Accelerator.__init__

    def fsdp_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.state.distributed_type = DistributedType.FSDP
        self.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)

    accelerate.Accelerator.__init__ = fsdp_init
    prepare = accelerate.Accelerator.prepare

    def sharded_prepare(self, *args):
        prepared = prepare(self, *args)
        assert all(is_sharded(layer.values) for layer in sparse_layers(prepared[0]).values())  # truly sharded
        return prepared

    accelerate.Accelerator.prepare = sharded_prepare


def _loop_worker(rank: int, port: int, run_dir: str, kw: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    _as_on_gpus()
    train(_spec(**kw), run_dir)


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """Eight steps of the tiny block-format BERT (SET updates at 3 and 6) under FSDP on two processes x 4
    samples, and on one process x 8."""
    root = tmp_path_factory.mktemp("fsdp_loop")
    _spawn(_loop_worker, str(root / "fsdp"), {})
    train(_spec(batch_size=8), root / "one")
    return root / "fsdp", root / "one"


def _assert_like(a, b) -> None:
    """``b`` (whole, or resumed at step 4) trains like ``a``."""
    la, lb = _rows(a, "loss"), _rows(b, "loss")
    assert [lb[s]["loss"] for s in lb] == pytest.approx([la[s]["loss"] for s in lb], rel=1e-5, abs=1e-6)
    ua, ub = _rows(a, "event"), _rows(b, "event")
    assert {s: ub[s]["pruned"] for s in ub} == {s: ua[s]["pruned"] for s in ua if s >= min(lb)}
    for name in (ckpt.MODEL_FILE, ckpt.OPTIMIZER_FILE):
        sa, sb = _load(a, 8, name), _load(b, 8, name)
        if name == ckpt.OPTIMIZER_FILE:
            sa, sb = ({f"{i}.{k}": v for i, s in d["state"].items() for k, v in s.items()} for d in (sa, sb))
        assert sa.keys() == sb.keys()
        assert all(torch.allclose(sa[k].float(), sb[k].float(), rtol=1e-4, atol=1e-6) for k in sa)
        assert all(sa[k].equal(sb[k]) for k in sa if k.endswith(".mask"))


def test_fsdp_training_updates_masks_and_saves_like_one_process(fsdp_runs):
    fsdp, one = fsdp_runs
    updates = _rows(fsdp, "event")
    assert list(updates) == [3, 6] and all(u["ranks_masks_identical"] and u["pruned"] > 0 for u in updates.values())
    assert list(_rows(fsdp, "loss")) == list(range(1, 9))
    _assert_like(one, fsdp)


def test_an_fsdp_checkpoint_loads_and_continues_in_one_process(fsdp_runs, tmp_path):
    fsdp, _ = fsdp_runs
    step4 = str(fsdp / "checkpoints/step_00000004")
    train(_spec(max_steps=4, grad_accum=2, resume=step4), tmp_path / "loaded")   # saves what it loaded
    model, saved = _load(tmp_path / "loaded", 4, ckpt.MODEL_FILE), _load(fsdp, 4, ckpt.MODEL_FILE)
    assert model.keys() == saved.keys() and all(model[k].equal(saved[k]) for k in model)
    opt, saved_opt = _load(tmp_path / "loaded", 4, ckpt.OPTIMIZER_FILE)["state"], _load(fsdp, 4, ckpt.OPTIMIZER_FILE)["state"]
    assert opt.keys() == saved_opt.keys()
    assert all(opt[i][k].equal(saved_opt[i][k]) for i in opt for k in opt[i])
    train(_spec(grad_accum=2, resume=step4), tmp_path / "resumed")
    _assert_like(fsdp, tmp_path / "resumed")


def test_a_one_process_checkpoint_continues_under_fsdp(fsdp_runs, tmp_path):
    _, one = fsdp_runs
    _spawn(_loop_worker, str(tmp_path / "resumed"), {"resume": str(one / "checkpoints/step_00000004")})
    _assert_like(one, tmp_path / "resumed")
    assert all(u["ranks_masks_identical"] for u in _rows(tmp_path / "resumed", "event").values())


# ---- refusals ---------------------------------------------------------------------------------------------------
def _accelerator(**plugin):
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import OffloadPolicy

    settings = {"fsdp_version": 2, "cpu_ram_efficient_loading": False, "cpu_offload": OffloadPolicy(), **plugin}
    state = SimpleNamespace(distributed_type=DistributedType.FSDP, fsdp_plugin=SimpleNamespace(**settings))
    return SimpleNamespace(state=state, device=torch.device("cuda"))


@pytest.mark.parametrize("plugin, fmt, message", [
    ({"fsdp_version": 1}, "block", "accelerate config fsdp_config.fsdp_version: 1 flattens"),
    ({"cpu_ram_efficient_loading": True}, "block", "fsdp_config.fsdp_cpu_ram_efficient_loading: true reloads"),
    ({"cpu_offload": "offload"}, "block", "fsdp_config.fsdp_offload_params: true keeps the sparse values"),
    ({}, "masked", "sparsity.format: 'masked' (layer 0) cannot be sharded by FSDP; use sparsity.format=block"),
])
def test_fsdp_setups_the_sparse_layers_cannot_train_under_are_refused(plugin, fmt, message):
    if plugin.get("cpu_offload") == "offload":
        from torch.distributed.fsdp import CPUOffloadPolicy

        plugin = {"cpu_offload": CPUOffloadPolicy()}
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    sparsify(model, targets=["*"], exclude=[], density=0.5, block=8, format=fmt)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        prepare_fsdp(_accelerator(**plugin), model)


def test_fsdp_on_the_cpu_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")     # what `accelerate launch --use_fsdp` sets
    with pytest.raises(ValueError, match="accelerate config distributed_type: FSDP runs on GPUs only; this run is "
                                         "on cpu, where accelerate would train with DDP instead"):
        train(_spec(), tmp_path / "run")
    assert not (tmp_path / "run").exists()
