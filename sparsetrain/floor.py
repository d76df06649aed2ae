"""The counted floor of one training step: per category of GPU work, the FLOPs and DRAM bytes it must move and the
time that takes at a card's bf16 tensor rate or DRAM bandwidth, whichever binds (``sparsetrain flops ... --floor``).

The categories are those of ``sparsetrain bench e2e --breakdown`` (:mod:`sparsetrain.bench._e2e_breakdown`), so a
floor can stand next to a measured step. What each must move, per step (T tokens, H hidden, I intermediate, L
layers, d a layer's density, elements of 2 bytes unless said):

- **block-sparse** and **linears** (a layer of I -> O features seeing T rows, from :class:`~sparsetrain.flops.
  LayerFlops`): its FLOPs; bytes: the forward reads X and writes Y, the input gradient reads dY and writes dX, the
  weight gradient reads X and dY: 3·T·(I+O) activations; the weight's d·I·O entries: an fp32 read and a bf16 write
  (the autocast copy), two bf16 reads, an fp32 gradient write: 14 bytes each. Sparse layers (d < 1) are
  block-sparse, the rest (the MLM head, the pooler) linears.
- **attention** (fused): the FLOPs of :func:`~sparsetrain.flops.count_step_flops` (no recompute); bytes: Q, K, V
  read and O written forward, Q, K, V, O, dO read and dQ, dK, dV written backward: 12·T·H per layer.
- **elementwise**, everything fused as far as it can be: per layer forward, the two dropout + residual + LayerNorm
  (read the branch and the residual, write the output: 3·T·H each) and GELU (read and write T·I); backward, the
  two LayerNorm + dropout backwards (4·T·H each) and GELU's (read dY and its input, write dX: 3·T·I); the four
  dropout masks, 1 byte per element each. The embeddings: 8·T·H (gathers, sum, LayerNorm; its backward and the
  scatter-add). A masked-LM loss: 3·B·P·V (log-softmax reads the logits, its backward reads them again and writes
  their gradient). Bias gradients and bias adds are taken as fused into the products. No FLOPs counted.
- **optimizer** (fused AdamW with the gradient-norm clip): per trained parameter an fp32 read of the parameter,
  gradient (twice: clip and step) and both moments, and writes of the parameter and both moments: 32 bytes.

A floor is a lower bound: a step at it would move nothing twice and wait for nothing. Where a measured category is
several times its floor, the time is in re-reads, unfused passes, launch gaps or a kernel below its rate.
"""
from __future__ import annotations

from dataclasses import dataclass

from sparsetrain.flops import FlopReport

BF16 = 2          # bytes per activation element
WEIGHT_BYTES = 14  # per active weight entry per step: fp32 read + bf16 write (the cast), 2 bf16 reads, fp32 dW
PARAM_BYTES = 32   # per trained parameter per optimizer step: fp32 param, grad x2, exp_avg, exp_avg_sq; 3 writes
MASK_BYTES = 1     # per element of a dropout mask


@dataclass(frozen=True)
class Card:
    """A GPU's dense bf16 tensor rate (TFLOP/s, the data sheet's, without sparsity) and DRAM bandwidth (TB/s)."""

    name: str
    bf16_tflops: float
    dram_tbps: float


CARDS = {
    "h100": Card("NVIDIA H100 SXM", 989.0, 3.35),
    "h200": Card("NVIDIA H200", 989.0, 4.8),
}


def card_for(device_name: str) -> Card | None:
    """The :data:`CARDS` entry of a CUDA device name (``torch.cuda.get_device_name()``), None for another card.

    >>> card_for("NVIDIA H200").name, card_for("NVIDIA H100 80GB HBM3").name, card_for("NVIDIA A100-SXM4-80GB")
    ('NVIDIA H200', 'NVIDIA H100 SXM', None)
    """
    low = device_name.lower()
    return next((card for key, card in CARDS.items() if key in low), None)


@dataclass(frozen=True)
class FloorRow:
    """One category: what it must compute and move, and the time at the card's rates."""

    category: str
    flops: float
    bytes: float
    math_ms: float
    dram_ms: float

    @property
    def ms(self) -> float:
        return max(self.math_ms, self.dram_ms)

    @property
    def bound(self) -> str:
        return "math" if self.math_ms >= self.dram_ms else "DRAM"


def _row(category: str, flops: float, nbytes: float, card: Card) -> FloorRow:
    return FloorRow(category, flops, nbytes, 1e3 * flops / (card.bf16_tflops * 1e12),
                    1e3 * nbytes / (card.dram_tbps * 1e12))


def _layer_bytes(r) -> float:
    activations = BF16 * 3 * r.tokens * (r.in_features + r.out_features)
    return activations + WEIGHT_BYTES * r.in_features * r.out_features * r.density


def step_floor(report: FlopReport, config, parameters: int, card: Card) -> list[FloorRow]:
    """The floor of one training step of the model that ``report`` counted: its HF ``config`` gives H, I, L and
    the vocabulary (a model with ``vocab_size`` has a masked-LM loss, on B·P rows or on every token),
    ``parameters`` is its dense parameter count (the sparse layers' inactive entries are taken off). One
    :class:`FloorRow` per category, in the breakdown's order.

    >>> from sparsetrain.flops import count_step_flops
    >>> from sparsetrain.models.builders import build_model
    >>> bert = build_model("bert", "tiny", vocab_size=1000, seq_len=128)
    >>> n = sum(p.numel() for p in bert.parameters())
    >>> rows = step_floor(count_step_flops(bert, batch_size=8, seq_len=128), bert.config, n, CARDS["h200"])
    >>> [r.category for r in rows]
    ['block-sparse', 'attention', 'linears', 'optimizer', 'elementwise']
    """
    sparse = [r for r in report.rows if r.density < 1.0]
    dense = [r for r in report.rows if r.density >= 1.0]
    T, H = report.batch_size * report.seq_tokens, config.hidden_size
    I, L = config.intermediate_size, config.num_hidden_layers
    per_layer = BF16 * (2 * 3 * T * H + 2 * T * I + 2 * 4 * T * H + 3 * T * I) + MASK_BYTES * 4 * T * H
    mlm_rows = report.batch_size * report.predictions_per_seq if report.predictions_per_seq else T
    loss = BF16 * 3 * mlm_rows * getattr(config, "vocab_size", 0)
    elementwise = L * per_layer + BF16 * 8 * T * H + loss
    trained = parameters - sum(r.in_features * r.out_features * (1.0 - r.density) for r in sparse)
    return [
        _row("block-sparse", sum(r.sparse_flops for r in sparse), sum(_layer_bytes(r) for r in sparse), card),
        _row("attention", report.attention_flops, BF16 * 12 * T * H * L, card),
        _row("linears", sum(r.dense_flops for r in dense), sum(_layer_bytes(r) for r in dense), card),
        _row("optimizer", 0.0, PARAM_BYTES * trained, card),
        _row("elementwise", 0.0, elementwise, card),
    ]


def format_floor(rows: list[FloorRow], card: Card, measured: dict[str, float] | None = None) -> str:
    """The floor as a table, with the total; ``measured`` (ms per category, e.g. a breakdown's) adds a measured
    column and measured / floor."""
    head = f"{'category':<14}{'GFLOP':>10}{'GB moved':>10}{'floor ms':>10}  bound"
    head += f"{'measured ms':>13}{'x floor':>9}" if measured else ""
    lines = [f"step floor on {card.name} ({card.bf16_tflops:.0f} TFLOP/s bf16, {card.dram_tbps} TB/s DRAM)",
             head, "-" * len(head)]
    for r in rows:
        line = f"{r.category:<14}{r.flops / 1e9:>10.0f}{r.bytes / 1e9:>10.2f}{r.ms:>10.2f}  {r.bound:<5}"
        if measured and r.category in measured:
            line += f"{measured[r.category]:>13.2f}{measured[r.category] / max(r.ms, 1e-9):>9.1f}"
        lines.append(line)
    total = sum(r.ms for r in rows)
    lines.append("-" * len(head))
    line = f"{'total':<14}{sum(r.flops for r in rows) / 1e9:>10.0f}{sum(r.bytes for r in rows) / 1e9:>10.2f}{total:>10.2f}"
    if measured:
        got = sum(measured.get(r.category, 0.0) for r in rows)
        line += f"{'':7}{got:>13.2f}{got / max(total, 1e-9):>9.1f}"
    lines.append(line)
    return "\n".join(lines)


__all__ = ["CARDS", "Card", "FloorRow", "card_for", "format_floor", "step_floor"]
