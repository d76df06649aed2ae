"""Masked-language-model batches: packed fixed-length sequences and BERT's 80/10/10 masking collator.

Packing (one choice, used everywhere): the token ids of each document are joined into one stream per
split with ``[SEP]`` after every document, the stream is cut into chunks of ``seq_len - 2`` tokens and
each chunk is framed as ``[CLS] chunk [SEP]``. The tail shorter than a chunk is dropped, so no
sequence needs padding and every position carries a real token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset


class PackedSequences(Dataset):
    """Fixed-length token sequences; item ``i`` is ``{"input_ids": LongTensor[seq_len], "index": i}``."""

    def __init__(self, input_ids: torch.Tensor) -> None:
        if input_ids.ndim != 2:
            raise ValueError(
                f"input_ids must be 2-D (num_sequences, seq_len), got shape {tuple(input_ids.shape)}"
            )
        self.input_ids = input_ids

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.input_ids[index].long(), "index": int(index)}


def _example_seed(seed: int, epoch: int, index: int) -> int:
    # A hash rather than seed * K + index: distinct (seed, epoch, index) never collide in practice,
    # and the result depends on nothing else (no global RNG, no worker id, no batch composition).
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class MLMCollator:
    """Stack packed sequences and apply BERT's 80/10/10 masking, deterministic per example.

    Each position that is not special is selected with probability ``mlm_probability``; a selected
    position becomes ``[MASK]`` 80% of the time, a random non-special token 10%, and stays 10%.
    The mask of an example is a pure function of ``(seed, epoch, example index)``: a resumed run (or a
    different batch size, or another number of workers) masks every example exactly as before.
    ``epoch`` is 0 unless the training loop calls :meth:`set_epoch` to draw fresh masks each epoch.

    >>> c = MLMCollator(mask_token_id=4, vocab_size=100, special_ids=[0, 1, 2, 3, 4])
    >>> batch = c([{"input_ids": torch.arange(5, 69), "index": 7}])
    >>> sorted(batch)
    ['attention_mask', 'input_ids', 'labels']
    """

    def __init__(
        self,
        mask_token_id: int,
        vocab_size: int,
        special_ids: Sequence[int],
        mlm_probability: float = 0.15,
        seed: int = 0,
        pad_token_id: int | None = None,
    ) -> None:
        if not 0.0 < mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {mlm_probability}")
        if not 0 <= mask_token_id < vocab_size:
            raise ValueError(f"mask_token_id={mask_token_id} is outside the vocabulary [0, {vocab_size})")
        self.mask_token_id = int(mask_token_id)
        self.vocab_size = int(vocab_size)
        self.special_ids = torch.tensor(sorted({int(i) for i in special_ids}), dtype=torch.long)
        self.mlm_probability = float(mlm_probability)
        self.seed = int(seed)
        self.epoch = 0
        self.pad_token_id = pad_token_id
        is_special = torch.zeros(vocab_size, dtype=torch.bool)
        is_special[self.special_ids] = True
        self._replacement_ids = torch.arange(vocab_size)[~is_special]  # random tokens are never special
        if len(self._replacement_ids) == 0:
            raise ValueError("special_ids cover the whole vocabulary; nothing is left to mask with")

    def set_epoch(self, epoch: int) -> None:
        """Make masks depend on ``epoch`` too (dynamic masking); call before iterating that epoch."""
        self.epoch = int(epoch)

    def mask_example(self, input_ids: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(masked input_ids, labels)`` for one example; labels are -100 where not masked."""
        generator = torch.Generator().manual_seed(_example_seed(self.seed, self.epoch, index))
        length = input_ids.shape[0]
        select = torch.rand(length, generator=generator) < self.mlm_probability
        select &= ~torch.isin(input_ids, self.special_ids)
        how = torch.rand(length, generator=generator)  # < 0.8: [MASK]; 0.8..0.9: random; else keep
        random_ids = self._replacement_ids[
            torch.randint(len(self._replacement_ids), (length,), generator=generator)
        ]
        labels = torch.where(select, input_ids, torch.full_like(input_ids, -100))
        masked = torch.where(select & (how < 0.8), torch.full_like(input_ids, self.mask_token_id), input_ids)
        masked = torch.where(select & (how >= 0.8) & (how < 0.9), random_ids, masked)
        return masked, labels

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        if not examples or "index" not in examples[0]:
            raise ValueError("MLMCollator needs items with 'input_ids' and 'index' (see PackedSequences)")
        masked, labels = zip(
            *(
                self.mask_example(torch.as_tensor(ex["input_ids"]).long(), int(ex["index"]))
                for ex in examples
            ),
            strict=True,
        )
        input_ids = torch.stack(masked)
        if self.pad_token_id is None:
            attention_mask = torch.ones_like(input_ids)
        else:
            attention_mask = (
                torch.stack([torch.as_tensor(ex["input_ids"]) for ex in examples]) != self.pad_token_id
            ).long()
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": torch.stack(labels)}


def pack_documents(token_ids: list[list[int]], seq_len: int, cls_id: int, sep_id: int) -> torch.Tensor:
    """Pack documents into ``[CLS] chunk [SEP]`` rows of length ``seq_len`` (tail dropped).

    >>> pack_documents([[5, 6, 7], [8, 9]], seq_len=4, cls_id=2, sep_id=3).tolist()
    [[2, 5, 6, 3], [2, 7, 3, 3], [2, 8, 9, 3]]
    """
    if seq_len < 3:
        raise ValueError(f"seq_len must be >= 3 to hold [CLS] x [SEP], got {seq_len}")
    stream = torch.tensor([i for ids in token_ids for i in (*ids, sep_id)], dtype=torch.int32)
    chunk = seq_len - 2
    rows = stream[: len(stream) // chunk * chunk].view(-1, chunk)
    framed = torch.empty(rows.shape[0], seq_len, dtype=torch.int32)
    framed[:, 0], framed[:, -1], framed[:, 1:-1] = cls_id, sep_id, rows
    return framed
