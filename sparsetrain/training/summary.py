"""The run's ``summary.json``: what ran, its cost (FLOPs, seconds, rate) and how its steps ran, from a finished
:class:`~sparsetrain.training.loop.Trainer`."""
from __future__ import annotations

from typing import Any

import torch

from sparsetrain.kernels.blocksparse import tuner as blocksparse_tuner
from sparsetrain.training import metrics


def run_summary(trainer: Any, masks_identical: bool | None) -> dict[str, Any]:
    """The summary of ``trainer`` (the loop's ``Trainer``, after its last step)."""
    acc, main, step = trainer.accelerator, trainer.main, trainer.step
    rows = metrics.read_metrics(trainer.run_dir) if main else []   # train_s: start-up windows at the next's rate
    return {
        "status": "finished", "method": trainer.spec.method, "recipe": trainer.args.recipe,
        "density": trainer.scheduler.density, "block": trainer.spec.block_label if trainer.scheduler.sparse else "-",
        "steps": step, "final_eval_loss": trainer.last_eval["eval_loss"] if trainer.last_eval else None,
        "total_train_flops": trainer.train_flops, "wall_s": trainer.elapsed,
        "train_s": metrics.train_seconds(rows, step) if main else None,
        **(metrics.update_cost_fields(rows, trainer.rate_key) if main else {}),   # one mask update: s, steps
        "device": torch.cuda.get_device_name(acc.device) if acc.device.type == "cuda" else "cpu",
        trainer.rate_key: metrics.window_rate(trainer.run_dir, trainer.rate_key) if main else None,
        "hook_share_non_update_steps": trainer.hook_time / trainer.step_time if trainer.step_time else None,
        "processes": acc.num_processes, "ranks_masks_identical": masks_identical,
        "flops_per_step_dense": trainer.flops.dense_total, "flops_per_step_sparse": trainer.flops.sparse_total,
        "step_mode": "cuda_graph" if trainer.run_step.graph_mode else "eager", **trainer.run_step.stats(),
        "kernel_choices": blocksparse_tuner.choice_counts(),   # tuned block-sparse products per backend
        "kernel_choices_estimated": blocksparse_tuner.estimated_count(),   # of them, not timed (gradual pruning)
    }
