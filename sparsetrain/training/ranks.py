"""Every process must hold the same sparsity masks: each rank applies the same mask update from the same
seeds, and a rank that drifts (a policy reading rank-local state, a tie broken differently) would silently
train a different model. The loop compares the masks after every mask update and once at the end of the run.

Cost: one integer hash per sparse layer, computed on the device where the masks live (no host sync per
layer), one all-gather of ``1 + layers`` int64 values and one read of the result; with one process, nothing.

>>> from torch import nn
>>> compare_masks(nn.Linear(4, 4), processes=1).row   # one process: nothing compared, no key logged
{}
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sparsetrain.sparsity.protocol import sparse_layers
from sparsetrain.training.guard import RunStopped

# splitmix64 (Steele et al. 2014) as signed int64: torch multiplies int64 modulo 2**64
_GOLDEN, _MIX1, _MIX2 = (c - 2**64 for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


class RanksDiverged(RunStopped):
    """The processes of a run hold different masks."""

    exit_code = 1


def _shift_right(x: Tensor, bits: int) -> Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)  # logical shift: int64 ``>>`` copies the sign bit


def _mix(x: Tensor) -> Tensor:
    x = x * _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def layer_signatures(model: nn.Module) -> tuple[list[str], Tensor]:
    """``(names, hashes)``: one int64 per sparse layer, on the masks' device, no host sync.

    A layer's hash is the sum (modulo 2**64) of a splitmix64 hash of the position of each active entry, the
    positions numbered across all layers in order: integer sums do not depend on the reduction order, so equal
    masks give equal hashes on any device, and different masks collide with probability about 2**-64.
    """
    layers = sparse_layers(model)
    hashes, offset = [], 0
    for layer in layers.values():
        mask = (layer.current_mask() if hasattr(layer, "current_mask") else layer.mask).detach().flatten()
        position = torch.arange(offset, offset + mask.numel(), dtype=torch.int64, device=mask.device)
        hashes.append(torch.where(mask.bool(), _mix(position + 1), 0).sum())
        offset += mask.numel()
    return list(layers), torch.stack(hashes) if hashes else torch.zeros(0, dtype=torch.int64)


def mask_signature(model: nn.Module) -> Tensor:
    """An int64 (0-dim, on the masks' device) that changes when any active position of any sparse layer does."""
    return layer_signatures(model)[1].sum()


@dataclass(frozen=True)
class MaskAgreement:
    """What :func:`compare_masks` found. ``identical`` is None with one process (nothing was compared)."""

    identical: bool | None
    differing_ranks: tuple[int, ...] = ()   # ranks whose masks differ from rank 0's
    first_layer: str | None = None          # the first sparse layer (in model order) that differs

    @property
    def row(self) -> dict[str, bool]:
        """The key the loop adds to its mask_update row: none with one process."""
        return {} if self.identical is None else {"ranks_masks_identical": self.identical}

    def raise_if_diverged(self, step: int | None = None) -> None:
        """Stop the run when the masks differ: after the update at ``step``, or at the end of the run (None)."""
        if self.identical is not False:
            return
        when = "at the end of the run" if step is None else f"after the mask update at step {step}"
        ranks = ", ".join(map(str, self.differing_ranks))
        who = f"rank {ranks} differs" if len(self.differing_ranks) == 1 else f"ranks {ranks} differ"
        stopped = "" if step is None else "; the run stopped before the next optimizer step and saved nothing of it"
        raise RanksDiverged(f"sparsity masks differ between ranks {when}: {who} from rank 0, first in layer "
                            f"{self.first_layer}{stopped}. A policy must score identically on every rank (use "
                            f"its grad argument and self.generator, never rank-local state)")


def collective_device() -> torch.device:
    """Where the tensors of a collective live: NCCL takes this process's GPU only (whatever device the model or
    its masks are on, e.g. CPU zeros for a model without sparse layers), gloo the CPU."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def compare_masks(model: nn.Module, processes: int) -> MaskAgreement:
    """Compare every rank's masks with rank 0's: a collective when ``processes > 1`` (every rank must call it
    at the same step), nothing otherwise."""
    if processes <= 1:
        return MaskAgreement(identical=None)
    import torch.distributed as dist

    names, hashes = layer_signatures(model)
    local = torch.cat([hashes.sum().reshape(1), hashes]).to(collective_device())  # [model, layer 0, layer 1, ...]
    gathered = [torch.empty_like(local) for _ in range(processes)]
    dist.all_gather(gathered, local)
    table = torch.stack(gathered).tolist()                               # the one host sync
    differing = tuple(r for r, row in enumerate(table) if row != table[0])
    if not differing:
        return MaskAgreement(identical=True)
    first = next((names[i] for i in range(len(names)) if any(row[1 + i] != table[0][1 + i] for row in table)),
                 None)
    return MaskAgreement(identical=False, differing_ranks=differing, first_layer=first)
