"""Gradient averaging done by the training step itself, for a run of several processes whose steps are replayed
from a CUDA graph. DistributedDataParallel's reducer (autograd hooks that launch bucket all-reduces during the
backward) cannot be captured, so such a run does not wrap the model in DDP: :class:`GradSync` averages the
gradients after the last micro-batch's backward, one all-reduce per bucket (per dtype, up to ``bucket_bytes``).
NCCL collectives can be captured, so one graph holds the whole step, the all-reduce included; the run's eager
steps call the same code, so both compute the same thing.

What it keeps of DDP (the loop still wraps the model in DDP for every other run of several processes):

* the average: each gradient multiplied by ``1 / processes`` and summed over the ranks, as DDP's reducer does;
* unused parameters as under ``find_unused_parameters=True``: a parameter without a gradient on some ranks gets
  the average with zeros for those ranks; one without a gradient on every rank keeps ``grad=None`` (the optimizer
  skips it). Eager steps agree on that set with one small all-reduce; a capture reuses the set of the eager step
  before it, and fails (:class:`~sparsetrain.training.step.GraphCaptureError`) if this rank's parameters with a
  gradient changed since;
* the start: :func:`broadcast_from_rank0` gives every rank rank 0's parameters and buffers, as DDP does when it
  wraps a model.

Not kept: DDP's broadcast of the buffers before every training forward. The buffers of the models here are
constants and masks, and masks are compared across ranks after every mask update (:mod:`.ranks`); a model with
BatchNorm running statistics trains under DDP (``graph_mode``).

>>> sync = GradSync(lambda: [], processes=1)
>>> sync()   # nothing to average
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

#: Bucket size of the all-reduce: a sparse BERT-base's gradients fit in one, a dense one in two.
BUCKET_BYTES = 256 * 2**20


class GradSync:
    """``sync()``: average the gradients of ``params()`` (every trainable Parameter, the same order on every rank)
    over ``processes`` ranks, in place. Every rank must call it at the same point of the step."""

    def __init__(self, params: Callable[[], list[nn.Parameter]], processes: int,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.params, self.processes, self.bucket_bytes = params, int(processes), int(bucket_bytes)
        self._seen: tuple[tuple[bool, ...], tuple[bool, ...]] | None = None  # (this rank's, any rank's) of the last eager call

    def __call__(self) -> None:
        params = self.params()
        mine = tuple(p.grad is not None for p in params)
        if _capturing():   # no host sync possible: the set agreed at the eager step before the capture
            if self._seen is None or self._seen[0] != mine:
                raise RuntimeError("the parameters that received a gradient differ from those of the eager step "
                                   "before the capture (the ranks agree on them only in eager steps)")
            used = self._seen[1]
        else:
            used = self._agree(mine)
            self._seen = (mine, used)
        grads = []
        for p, here, anywhere in zip(params, mine, used, strict=True):
            if anywhere and not here:
                p.grad = torch.zeros_like(p)    # this rank's share of the average
            if anywhere:
                grads.append(p.grad)
        for bucket in _buckets(grads, self.bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket]).mul_(1.0 / self.processes)
            dist.all_reduce(flat)
            torch._foreach_copy_(bucket, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in bucket]),
                                                                          bucket, strict=True)])

    def _agree(self, mine: tuple[bool, ...]) -> tuple[bool, ...]:
        """Which parameters have a gradient on some rank (one all-reduce of a flag per parameter, one host read)."""
        if not mine:
            return ()
        from sparsetrain.training.ranks import collective_device

        counts = torch.tensor(mine, dtype=torch.int32, device=collective_device())
        dist.all_reduce(counts)
        return tuple(bool(c) for c in counts.tolist())


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _buckets(grads: list[Tensor], limit: int) -> list[list[Tensor]]:
    """``grads`` grouped by device and dtype (in order of first appearance), each group cut into runs of at most
    ``limit`` bytes (a single larger gradient gets a bucket of its own)."""
    groups: dict[tuple[torch.device, torch.dtype], list[list[Tensor]]] = {}
    filled: dict[tuple[torch.device, torch.dtype], int] = {}   # bytes in each group's last run
    for g in grads:
        key, size = (g.device, g.dtype), g.numel() * g.element_size()
        runs = groups.setdefault(key, [[]])
        if runs[-1] and filled[key] + size > limit:
            runs.append([])
            filled[key] = 0
        runs[-1].append(g)
        filled[key] = filled.get(key, 0) + size
    return [run for runs in groups.values() for run in runs if run]


def broadcast_from_rank0(model: nn.Module) -> None:
    """Copy rank 0's parameters and buffers into every rank's ``model`` (a collective), as DistributedDataParallel
    does when it wraps a model; the same call DDP makes, so the same tensors in the same buckets."""
    from torch.distributed.utils import _sync_module_states

    _sync_module_states(model, dist.group.WORLD, broadcast_bucket_size=250 * 2**20, src=0,
                        params_and_buffers_to_ignore=(), broadcast_buffers=True)
