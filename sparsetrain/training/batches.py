"""Deterministic, resumable batches: the data position of a run is one integer."""
from __future__ import annotations

import torch


class Batches:
    """Deterministic, resumable batches: epoch ``e`` is a permutation seeded by (seed, e); global micro-batch
    ``b`` holds ``batch_size x world`` samples and this rank takes its slice. The position is ``b``."""

    def __init__(self, dataset, collator, batch_size: int, world: int, rank: int, seed: int) -> None:
        self.dataset, self.collator = dataset, collator
        self.batch_size, self.world, self.rank, self.seed = batch_size, world, rank, seed
        self.per_epoch = len(dataset) // (batch_size * world)
        if self.per_epoch < 1:
            raise ValueError(f"trainer.batch_size: {batch_size} x {world} process(es) is larger than the "
                             f"training set ({len(dataset)} examples)")
        self._perm_epoch, self._perm = -1, None

    def indices(self, b: int) -> list[int]:
        epoch, i = divmod(b, self.per_epoch)
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 7_919 + epoch)
            self._perm, self._perm_epoch = torch.randperm(len(self.dataset), generator=gen), epoch
        g = self.batch_size * self.world
        start = i * g + self.rank * self.batch_size
        return self._perm[start:start + self.batch_size].tolist()

    def get(self, b: int) -> dict[str, torch.Tensor]:
        epoch = b // self.per_epoch
        if hasattr(self.collator, "set_epoch"):
            self.collator.set_epoch(epoch)
        return self.collator([self.dataset[i] for i in self.indices(b)])
