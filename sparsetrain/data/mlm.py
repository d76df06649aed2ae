"""Masked-language-model batches: packed fixed-length sequences and BERT's 80/10/10 masking collator.

Packing (one choice, used everywhere): the token ids of each document are joined into one stream per
split with ``[SEP]`` after every document, the stream is cut into chunks of ``seq_len - 2`` tokens and
each chunk is framed as ``[CLS] chunk [SEP]``. The tail shorter than a chunk is dropped, so no
sequence needs padding and every position carries a real token.
"""

from __future__ import annotations

import math
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


# ---- a counter-based hash: random draws without generator objects ---------------------------------------
# splitmix64 (Steele, Lea & Flood 2014) in int64 torch ops: multiplication and addition wrap like uint64,
# and >> is arithmetic on int64, so a logical shift masks the sign bits off. Draw d at position p of the
# example keyed k is mix(k + (3p + d + 1) * GOLDEN): the p-th values of one splitmix64 stream per example.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # the constants as signed int64
_MUL1 = 0xBF58476D1CE4E5B9 - 2**64
_MUL2 = 0x94D049BB133111EB - 2**64
_DRAWS = 3  # per position: 0 selects it, 1 picks [MASK] / random / keep, 2 picks the random token
_TOP24 = 1 << 24
_MASK_BELOW, _RANDOM_BELOW = round(0.8 * _TOP24), round(0.9 * _TOP24)  # the 80/10/10 rule on 24 bits


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def _int64(value: int) -> int:
    return (int(value) + 2**63) % 2**64 - 2**63


def example_keys(seed: int, epoch: int, index: torch.Tensor) -> torch.Tensor:
    """One int64 key per example, a hash of ``(seed, epoch, index)`` and of nothing else (no global RNG,
    worker id or batch composition)."""
    key = _mix(torch.tensor(_int64(seed + _GOLDEN)))
    key = _mix(key ^ _mix(torch.tensor(_int64(epoch + _GOLDEN))))
    return _mix(key ^ _mix(index.long() + _GOLDEN))


def _draw(keys: torch.Tensor, positions: torch.Tensor, draw: int) -> torch.Tensor:
    """Draw ``draw`` at ``positions`` ([S] or [B, P]) of the examples keyed ``keys`` [B]: int64 [B, S or P]."""
    return _mix(keys[:, None] + (positions * _DRAWS + (draw + 1)) * _GOLDEN)


def default_max_predictions(mlm_probability: float, seq_len: int) -> int:
    """P = ceil(mlm_probability * seq_len), BERT's ``max_predictions_per_seq`` (20 at 128 tokens, 77 at 512).

    >>> default_max_predictions(0.15, 128), default_max_predictions(0.15, 512)
    (20, 77)
    """
    return max(1, math.ceil(mlm_probability * seq_len - 1e-9))  # 0.15 * 100 is 15.000000000000002


def check_max_predictions(max_predictions: int | None, seq_len: int | None = None) -> None:
    """``max_predictions`` is None (the default P) or an integer in [1, seq_len]."""
    if max_predictions is None:
        return
    if not isinstance(max_predictions, int) or isinstance(max_predictions, bool) or max_predictions < 1:
        raise ValueError(f"max_predictions must be an integer >= 1 or null, got {max_predictions!r}")
    if seq_len is not None and max_predictions > seq_len:
        raise ValueError(f"max_predictions must be <= seq_len={seq_len}, got {max_predictions}")


class MLMCollator:
    """Stack packed sequences and apply BERT's 80/10/10 masking, deterministic per example.

    Each sequence masks exactly ``k = min(P, max(1, round(mlm_probability * n)))`` of its ``n`` maskable
    positions (not special, not padding, not position 0), chosen uniformly; ``P = max_predictions``
    (default ``ceil(mlm_probability * seq_len)``) is the same for every batch. A chosen position becomes
    ``[MASK]`` 80% of the time, a random non-special token 10%, and stays 10%. The batch holds
    ``input_ids`` and ``labels`` [B, S] (-100 where not masked) and, with ``emit_positions``,
    ``masked_positions`` [B, P] int64: the chosen positions sorted, then padding entries pointing at
    position 0, which is never masked, so its label is always -100 (BERT's ``max_predictions_per_seq``
    format: a static shape the MLM head can run on). ``attention_mask`` is there only when sequences can
    hold padding (``pad_token_id``): an all-ones mask changes nothing but the attention kernel's path.

    The mask of an example is a pure function of ``(seed, epoch, example index)``: a resumed run (or a
    different batch size, or another number of workers) masks every example exactly as before. The random
    draws are a counter-based hash of (seed, epoch, index, position), computed for the whole batch at once.
    ``epoch`` is 0 unless the training loop calls :meth:`set_epoch` to draw fresh masks each epoch.

    >>> c = MLMCollator(mask_token_id=4, vocab_size=100, special_ids=[0, 1, 2, 3, 4])
    >>> batch = c([{"input_ids": torch.arange(5, 69), "index": 7}])
    >>> sorted(batch), tuple(batch["masked_positions"].shape)
    (['input_ids', 'labels', 'masked_positions'], (1, 10))
    >>> int((batch["labels"] != -100).sum())  # round(0.15 * 63 maskable positions)
    9
    """

    def __init__(
        self,
        mask_token_id: int,
        vocab_size: int,
        special_ids: Sequence[int],
        mlm_probability: float = 0.15,
        seed: int = 0,
        pad_token_id: int | None = None,
        max_predictions: int | None = None,
        emit_positions: bool = True,
    ) -> None:
        if not 0.0 < mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {mlm_probability}")
        if not 0 <= mask_token_id < vocab_size:
            raise ValueError(f"mask_token_id={mask_token_id} is outside the vocabulary [0, {vocab_size})")
        check_max_predictions(max_predictions)
        self.mask_token_id = int(mask_token_id)
        self.vocab_size = int(vocab_size)
        self.special_ids = torch.tensor(sorted({int(i) for i in special_ids}), dtype=torch.long)
        self.mlm_probability = float(mlm_probability)
        self.seed = int(seed)
        self.epoch = 0
        self.pad_token_id = pad_token_id
        self.max_predictions = max_predictions
        self.emit_positions = bool(emit_positions)
        self._maskable = torch.ones(vocab_size, dtype=torch.bool)  # token id -> may be masked
        self._maskable[self.special_ids[self.special_ids < vocab_size]] = False
        self._replacement_ids = torch.arange(vocab_size)[self._maskable]  # random tokens are never special
        if len(self._replacement_ids) == 0:
            raise ValueError("special_ids cover the whole vocabulary; nothing is left to mask with")

    def set_epoch(self, epoch: int) -> None:
        """Make masks depend on ``epoch`` too (dynamic masking); call before iterating that epoch."""
        self.epoch = int(epoch)

    def predictions(self, seq_len: int) -> int:
        """P, the number of ``masked_positions`` per sequence of ``seq_len`` tokens."""
        if self.max_predictions is None:
            return default_max_predictions(self.mlm_probability, seq_len)
        check_max_predictions(self.max_predictions, seq_len)
        return self.max_predictions

    def mask(self, input_ids: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Mask a batch ``input_ids`` [B, S] of examples ``index`` [B]: ``(masked input_ids, labels,
        masked_positions)``."""
        batch, length = input_ids.shape
        p = self.predictions(length)
        keys = example_keys(self.seed, self.epoch, index)
        maskable = self._maskable[input_ids]
        if self.pad_token_id is not None:
            maskable &= input_ids != self.pad_token_id
        maskable[:, 0] = False  # padding entries of masked_positions point here
        n = maskable.sum(1)
        k = torch.minimum((self.mlm_probability * n).round().long().clamp(min=1), n).clamp(max=p)
        # k uniform picks = the k smallest of iid random keys over the maskable positions
        order = _shr(_draw(keys, torch.arange(length), 0), 1).masked_fill_(~maskable, torch.iinfo(torch.long).max)
        picked = order.topk(p, dim=1, largest=False, sorted=True).indices  # smallest first
        positions = picked.masked_fill_(torch.arange(p) >= k[:, None], length).sort(dim=1).values
        chosen = positions < length
        positions.masked_fill_(~chosen, 0)
        original = input_ids.gather(1, positions)
        how = _shr(_draw(keys, positions, 1), 40)  # 24 uniform bits
        random_ids = self._replacement_ids[_shr(_draw(keys, positions, 2), 1) % len(self._replacement_ids)]
        new = torch.where(how < _MASK_BELOW, self.mask_token_id, torch.where(how < _RANDOM_BELOW, random_ids, original))
        # padding entries write position 0's own value (and label -100) back: duplicates agree
        masked = input_ids.clone().scatter_(1, positions, torch.where(chosen, new, original))
        labels = torch.full_like(input_ids, -100).scatter_(1, positions, original.masked_fill(~chosen, -100))
        return masked, labels, positions

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        if not examples or "index" not in examples[0]:
            raise ValueError("MLMCollator needs items with 'input_ids' and 'index' (see PackedSequences)")
        input_ids = torch.stack([torch.as_tensor(ex["input_ids"]) for ex in examples]).long()
        index = torch.tensor([int(ex["index"]) for ex in examples], dtype=torch.long)
        masked, labels, positions = self.mask(input_ids, index)
        batch = {"input_ids": masked, "labels": labels}
        if self.emit_positions:
            batch["masked_positions"] = positions
        if self.pad_token_id is not None:
            batch["attention_mask"] = (input_ids != self.pad_token_id).long()
        return batch


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
