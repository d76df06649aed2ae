"""Accelerate for one run: the Accelerator, the model and optimizer wrapped for the run's processes, the end.

One process, or DDP (gradients averaged during the last backward), or ``step_sync`` (the step averages them
itself, grad_sync.py: a CUDA-graph run's reducer cannot be captured), or FSDP2 (sharded.py).
"""
from __future__ import annotations

from pathlib import Path

import torch

from sparsetrain.training.grad_sync import broadcast_from_rank0
from sparsetrain.training.sharded import prepare_fsdp


def start_accelerator(mixed_precision: str, cpu: bool, wandb: bool, run_dir: Path, model: torch.nn.Module):
    """The run's Accelerator; FSDP: a setup the sparse layers cannot train under is refused here."""
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=cpu, log_with="wandb" if wandb else None,
                              project_dir=str(run_dir))
    prepare_fsdp(accelerator, model)
    return accelerator


def wrap(accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step_sync: bool, scheduler=None):
    """``(model, optimizer)`` prepared by Accelerate. ``step_sync``: DDP's reducer cannot be captured, so the
    model is placed and given autocast as prepare() does, without the DDP wrapper (accelerate calls that
    evaluation_mode), and starts from rank 0's weights as under DDP. A ``scheduler`` with a dense phase
    (``dense_from``) needs ``step_sync`` with several processes (config validation says so first)."""
    if getattr(scheduler, "dense_from", None) is not None and accelerator.num_processes > 1 and not step_sync:
        raise ValueError("sparsity.scheduler.dense_from: with several processes the dense phase needs the CUDA-graph "
                         "step's own gradient sync (DDP and FSDP keep the Parameters the run started with)")
    if step_sync:
        model = accelerator.prepare_model(model, evaluation_mode=True)
        optimizer = accelerator.prepare_optimizer(optimizer)
        broadcast_from_rank0(model)
        return model, optimizer
    return accelerator.prepare(model, optimizer)


def end_accelerator(accelerator) -> None:
    """The end of a run, once its step, model and optimizer are gone: what still refers to them goes too
    (accelerate's lists, reference cycles), so a DDP reducer is not torn down after its process group (gloo's was
    seen to hang there), then every rank meets, the process group goes, and accelerate's process-wide state."""
    import gc

    accelerator.free_memory()
    gc.collect()
    accelerator.wait_for_everyone()   # no rank tears the process group down while another still uses it
    accelerator.end_training()
    # accelerate keeps one process-wide state (mixed precision, the process group just destroyed): the next run in
    # this process (a Hydra sweep's next job, a test) starts its own, e.g. with another precision.
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
