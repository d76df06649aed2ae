"""2:4 sparse-then-dense: a transposable 2:4 phase recomputed from the dense weights, then plain dense layers."""
from __future__ import annotations

from sparsetrain.sparsity.nm import NM
from sparsetrain.sparsity.protocol import SparseLayer
from sparsetrain.sparsity.schedulers import SparsityScheduler, _check_fraction


class SparseThenDense(SparsityScheduler):
    """2:4 phase for the first ``sparse_fraction`` of training: the transposable 2:4 mask is recomputed from
    the current dense weights every step while the dense weights keep receiving the (straight-through)
    gradient; then every layer becomes a plain ``nn.Linear`` reusing the same Parameters, so the optimizer
    is untouched. ``sparse_fraction=1.0``: 2:4 to the end, no switch."""

    produces_nm = True
    name = "sparse_then_dense"

    def __init__(self, sparse_fraction: float = 0.7, n: int = 2, m: int = 4, seed: int = 0) -> None:
        super().__init__(seed)
        self.sparse_fraction = _check_fraction(sparse_fraction, "sparse_fraction")
        self.nm = NM(n, m, transposable=True)

    def initial_density(self, target: float) -> float:
        return 1.0

    def _on_attach(self) -> None:
        for name, layer in self.layers.items():
            if layer.block.numel != 1:
                raise ValueError(f"sparse_then_dense needs sparsity.block=1 (layer {name} has {layer.block})")
            if not layer.caps.straight_through:
                raise ValueError(f"sparse_then_dense needs a straight-through format (sparsity.format=2:4 or "
                                 f"masked_st); layer {name} uses {layer.format_name!r}")
        # layers that derive their mask in their own forward (the CUDA 2:4 format) need no update step (see
        # is_update_step); the formats do not change before the switch, so this is read once
        self._derive_masks = all(layer.caps.derives_mask for layer in self.layers.values())
        # a sparse phase as long as the run (sparse_fraction 1.0) never switches: the run ends with its 2:4 model (a
        # switch at the last step would hand over the straight-through dense weights, unmasked, and cost a step)
        end = int(round(self.sparse_fraction * self.total_steps))
        self.phase_end = end if end < self.total_steps else None
        if self.phase_end is None or self.step_count < self.phase_end:
            self._recompute()
        else:
            self._densify()   # straight-through layers hand over their dense Parameters

    def prepare_flop_count(self, layers: dict[str, SparseLayer]) -> None:
        """The 2:4 phase: straight-through layers with the transposable 2:4 mask of their weight."""
        for layer in layers.values():
            if not layer.caps.straight_through:
                layer.set_format("masked_st")
            if not layer.caps.derives_mask:
                layer.set_mask(self.nm.mask(layer.weight_parameter().detach()))

    def _recompute(self) -> None:
        for layer in self.layers.values():
            if layer.caps.derives_mask:
                continue  # the format derives the mask inside its forward (the 2:4 kernel format)
            layer.set_mask(self.nm.mask(layer.weight_parameter().detach()), self.optimizer)

    @property
    def density(self) -> float:
        return 1.0 if self.switched else self.nm.density

    def is_update_step(self, step: int) -> bool:
        """The switch to dense; before it, every step where a layer takes its mask from the scheduler. A format that
        derives the mask in its own forward (the CUDA 2:4 kernel, ``caps.derives_mask``) needs no update step: the
        loop's finite-weights check before an update is a host sync, which every step would pay (ViT-B/16 on a busy
        H200 host: 4.2 ms of host gaps a step against dense's 1.6, and a step at the mercy of the CPU)."""
        if self.switched:
            return False
        if not self.layers:
            return True
        return self._switch_due(step) or not self._derive_masks

    def _switch_due(self, step: int) -> bool:
        return self.phase_end is not None and step >= self.phase_end

    def _update(self, step):
        if self.switched:
            return None
        if self._switch_due(step):
            self._densify()   # straight-through layers hand over their dense Parameters
            return {"event": "phase_switch", "phase": "dense", "pruned": 0, "regrown": 0}
        self._recompute()
        return None

    def state_dict(self):
        return {**super().state_dict(), "switched": self.switched}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        if state.get("switched") and not self.switched and self.layers:
            self._densify()   # straight-through layers hand over their dense Parameters
