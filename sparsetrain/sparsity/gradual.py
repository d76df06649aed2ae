"""Gradual magnitude pruning (Zhu & Gupta 2017): the active count shrinks along a cubic schedule."""
from __future__ import annotations

import torch

from sparsetrain.sparsity.layout import check_density, n_active_blocks, to_scores_grid
from sparsetrain.sparsity.policies import Magnitude
from sparsetrain.sparsity.schedulers import SparsityScheduler, _check_fraction
from sparsetrain.sparsity.schedules import CubicDensity, UpdateSchedule
from sparsetrain.sparsity.update import prune_to


class GradualMagnitude(SparsityScheduler):
    """Zhu & Gupta (2017): prune by magnitude from ``initial_density`` to each layer's target density along
    a cubic schedule, at ``num_updates`` evenly spaced steps in ``[start, end)`` of training."""

    shrinks_count = True
    name = "gradual_magnitude"

    def __init__(self, initial_density: float = 1.0, num_updates: int = 100, start: float = 0.0,
                 end: float = 0.75, seed: int = 0) -> None:
        super().__init__(seed)
        self.initial = check_density(initial_density, "initial_density")
        if int(num_updates) < 1:
            raise ValueError(f"num_updates must be >= 1, got {num_updates}")
        self.num_updates = int(num_updates)
        self.start, self.end = _check_fraction(start, "start"), _check_fraction(end, "end")
        if self.end <= self.start:
            raise ValueError(f"end ({end}) must be after start ({start})")
        self.targets: dict[str, float] = {}
        self.policy = Magnitude()

    def initial_density(self, target: float) -> float:
        return max(self.initial, target)

    def set_targets(self, targets: dict[str, float]) -> None:
        """Final density per layer name (from the distribution); set before ``attach``."""
        self.targets = dict(targets)

    def _on_attach(self) -> None:
        for name, layer in self.layers.items():
            caps = layer.caps
            if (caps.keeps_count and not caps.can_shrink) or caps.straight_through or caps.needs_nm:
                raise ValueError(f"gradual_magnitude needs a format whose active count can shrink and whose pruned "
                                 f"weights stay zero, such as sparsity.format=masked (layer {name} uses "
                                 f"{layer.format_name!r})")
            self.targets.setdefault(name, layer.density)
        if any(layer.caps.keeps_count for layer in self.layers.values()):
            # the block format rebuilds its storage at each new count: under torch.compile the count must be able
            # to become a dynamic size (module parameter and buffer shapes are static by default, and each count
            # would recompile, past dynamo's limit running uncompiled). Set before the model is compiled.
            torch._dynamo.config.force_parameter_static_shapes = False
            torch._dynamo.config.force_nn_module_property_static_shapes = False
        self.schedule = self.update_schedule(self.total_steps)
        s, e = self.schedule.start, self.schedule.end
        self.cubic = {name: CubicDensity(self.initial_density(t), t, s, e) for name, t in self.targets.items()}

    def update_schedule(self, total_steps: int) -> UpdateSchedule:
        s, e = int(self.start * total_steps), max(1, int(round(self.end * total_steps)))
        n = min(self.num_updates, max(1, e - s - 1))
        return UpdateSchedule.from_num_updates(n, s, e) if e - s >= 2 else UpdateSchedule(s, e, 1)

    def is_update_step(self, step: int) -> bool:
        return self.schedule.is_update_step(step) or step == self.schedule.end

    def _update(self, step):
        if not self.is_update_step(step):
            return None
        pruned = 0
        for name, layer in self.layers.items():
            k = n_active_blocks(layer.dense_weight().shape, layer.block, self.cubic[name](step))
            if k >= layer.n_active:
                continue
            w = layer.dense_weight()
            scores = to_scores_grid(self.policy.drop_scores(w, None, layer.mask), w.shape, layer.block)
            u = prune_to(layer.mask, scores.to(layer.mask.device), k)
            layer.shrink_to(u.mask, self.optimizer)
            pruned += u.n_dropped
        return {"event": "mask_update", "pruned": pruned, "regrown": 0, "drop_fraction": 0.0}
