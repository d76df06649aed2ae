"""Config checks that depend on how the run is launched: the number of processes (``accelerate launch`` sets
``WORLD_SIZE``), FSDP, the GPU. Raised before anything is loaded or written."""
from __future__ import annotations

from omegaconf import DictConfig

from sparsetrain.preflight import ConfigError


def check_dense_phase(cfg: DictConfig, scheduler) -> None:
    """``sparsity.scheduler.dense_from`` replaces the sparse layers by dense ones with new Parameters mid-run: with
    several processes that needs the CUDA-graph step's own gradient sync (DDP's reducer and FSDP's shards are built
    for the Parameters the run started with)."""
    import os

    import torch

    from sparsetrain.training.step import graph_mode

    processes = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if getattr(scheduler, "dense_from", None) is None or processes <= 1:
        return
    t = cfg.trainer
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    try:
        graph = not fsdp and graph_mode(t.get("cuda_graph", False), t.device != "cpu" and torch.cuda.is_available(),
                                        processes, str(t.mixed_precision),
                                        t.get("compile_mode") if t.get("compile") else None)
    except ValueError:
        graph = False
    if not graph:
        raise ConfigError("sparsity.scheduler.dense_from", f"with {processes} processes the dense phase needs the "
                          f"CUDA-graph step and its own gradient sync (trainer.cuda_graph=auto or true on GPUs, "
                          f"bf16, no FSDP): DDP and FSDP keep the Parameters the run started with")
