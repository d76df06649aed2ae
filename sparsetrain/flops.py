"""Training FLOPs per step, dense and sparse, for transformer models (BERT, ViT).

Derivation (T = tokens a layer sees in one step, I/O = its input/output features, d = its density,
B = batch, L = sequence length, h = heads, k = head dim, H = h*k):

1. A matmul of a (T x I) by an (I x O) matrix costs 2*T*I*O FLOPs (one multiply and one add per term).
2. A linear layer y = x W^T costs 2*T*I*O forward. Backward computes dX = dY W and dW = dY^T X, each
   2*T*I*O, so backward = 2x forward and one training step costs 3 * 2*T*I*O.
3. A sparse layer of density d does all three matmuls on its active weights only:
   3 * 2*T*I*O*d (Graphcore's 3*2*I*B*O*(1-s) with s = 1 - d). nn.Linear has d = 1.
4. On a RigL mask-update step the grow criterion needs the dense gradient for the inactive weights
   too: the extra dW work is 2*T*I*O*(1-d) per sparse layer.
5. Attention per layer: Q K^T is B*h matmuls of (L x k)(k x L) = 2*B*h*L*L*k; A V is the same.
   Forward 4*B*L^2*H, backward 2x (dQ, dK from the scores; dA, dV from the output), so a step costs
   12*B*L^2*H per layer. Attention has no weights, so it is dense in both totals.
6. A ViT patch embedding is a Conv2d with kernel = stride = p: a matmul over the B*(image/p)^2
   patches with I = C*p*p and O = hidden. Its input is the pixels, which need no gradient, so its
   backward is dW only: 2x forward in all, not 3x.
7. Heads that read only the first token (ViT's classifier, BERT's pooler) see T = B.
8. Not counted: embedding lookups (a gather), LayerNorm, softmax, GELU, dropout, residual adds, biases
   and the loss. They are elementwise: O(T*H + T*h*L) against O(T*H^2 + T*L*H) for the matmuls. A rough
   hand count (~60*H + 8*h*L per token per layer, ~5*V for the loss's log-softmax over a V-word
   vocabulary) gives about 2% of an encoder layer of BERT-tiny (H = 128) and about 2% of its whole
   step with V = 8192, less for wider models. torch's FlopCounterMode does not count them either (it
   counts mm/addmm/bmm/baddbmm, convolutions and fused attention kernels), so tests/test_flops.py
   compares like with like.
9. Every token attends to all L positions (packed sequences carry no padding).
10. (in _density) Straight-through layers: an effective density of (2*d + 1) / 3.
11. BERT's MLM head on the masked positions only (a model with ``masked_positions_modules``, given
    ``predictions_per_seq`` = P): the head's transform dense (H x H) and vocabulary decoder (H x V) see
    T = B*P gathered rows instead of B*L tokens. Both still cost 3x forward: the gathered rows come from the
    encoder, so their input gradient is needed too. The gather itself moves data, it is no matmul; and the
    loss's log-softmax (step 8) runs on B*P rows as well. Without P the head is counted on every token, as
    the model runs it when batches carry no ``masked_positions``.

>>> from sparsetrain.models.builders import build_model
>>> bert = build_model("bert", "tiny", vocab_size=1000, seq_len=128)
>>> report = count_step_flops(bert, batch_size=8, seq_len=128)
>>> report.sparse_total == report.dense_total
True
>>> masked = count_step_flops(bert, batch_size=8, seq_len=128, predictions_per_seq=20)
>>> next(r.tokens for r in masked.rows if r.name == "cls.predictions.decoder")  # 8 x 20, not 8 x 128
160
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class LayerFlops:
    """One matmul layer's share of a training step (FLOPs are forward + backward)."""

    name: str
    in_features: int
    out_features: int
    tokens: int
    density: float
    dense_flops: float
    sparse_flops: float


@dataclass
class FlopReport:
    """FLOPs of one training step: per-layer rows, attention, totals and the RigL update extra."""

    rows: list[LayerFlops]
    attention_flops: float
    dense_total: float
    sparse_total: float
    rigl_update_extra: float
    batch_size: int
    seq_tokens: int
    predictions_per_seq: int | None = None

    @property
    def sparse_ratio(self) -> float:
        """sparse_total / dense_total."""
        return self.sparse_total / self.dense_total if self.dense_total else 1.0

    def format_table(self) -> str:
        """A per-layer table with the attention row, totals and the sparse/dense ratio."""
        width = max([len(r.name) for r in self.rows] + [len("attention (QK^T, AV)"), 5])
        header = (
            f"{'layer':<{width}}  {'in':>6}  {'out':>6}  {'tokens':>8}  {'density':>7}  "
            f"{'dense':>9}  {'sparse':>9}"
        )
        head = (f"; MLM head on {self.predictions_per_seq} masked positions per sequence"
                if self.predictions_per_seq else "")
        lines = [
            f"FLOPs per training step (fwd + bwd), batch {self.batch_size} x {self.seq_tokens} tokens{head}",
            header,
            "-" * len(header),
        ]
        for r in self.rows:
            lines.append(
                f"{r.name:<{width}}  {r.in_features:>6}  {r.out_features:>6}  {r.tokens:>8}  "
                f"{r.density:>7.3f}  {r.dense_flops:>9.3e}  {r.sparse_flops:>9.3e}"
            )
        lines.append(
            f"{'attention (QK^T, AV)':<{width}}  {'':>6}  {'':>6}  {'':>8}  {1.0:>7.3f}  "
            f"{self.attention_flops:>9.3e}  {self.attention_flops:>9.3e}"
        )
        lines.append("-" * len(header))
        lines.append(
            f"{'total':<{width}}  {'':>6}  {'':>6}  {'':>8}  {'':>7}  "
            f"{self.dense_total:>9.3e}  {self.sparse_total:>9.3e}"
        )
        lines.append(
            f"sparse / dense = {self.sparse_ratio:.4f}; a RigL update step adds "
            f"{self.rigl_update_extra:.3e} (dense gradient of inactive weights)"
        )
        return "\n".join(lines)


def _density(name: str, module: nn.Module) -> float:
    density = float(getattr(module, "density", 1.0))
    if not 0.0 < density <= 1.0:
        raise ValueError(f"layer {name!r} has density {density}; expected a value in (0, 1]")
    caps = getattr(module, "caps", None)  # a SparseLinear's format capabilities (sparsetrain.sparsity.FormatCaps)
    if caps is not None and caps.straight_through:
        # 10. Straight-through (2:4 sparse-then-dense) layers compute Y and dX with the sparse weight but dW
        #     densely (the dense master weight is trained): 2*T*I*O*(2*d + 1) per step, i.e. an effective
        #     density of (2*d + 1) / 3 in the 3*2*T*I*O formula.
        density = (2 * density + 1) / 3
    return density


def _is_matmul_layer(module: nn.Module) -> bool:
    # Duck typing: nn.Linear and any sparse linear exposing in_features, out_features (and density).
    return isinstance(getattr(module, "in_features", None), int) and isinstance(
        getattr(module, "out_features", None), int
    )


def _first_token_only(name: str) -> bool:
    parts = name.split(".")
    return parts[-1] == "classifier" or "pooler" in parts


def count_step_flops(
    model: nn.Module, batch_size: int, seq_len: int | None = None, image_size: int | None = None,
    predictions_per_seq: int | None = None,
) -> FlopReport:
    """Count the FLOPs of one training step of ``model`` (see the derivation at the top of this file).

    Text models need ``seq_len``; vision models (a config with ``image_size`` and ``patch_size``)
    take ``image_size`` from the argument or the config. Sparse layers are any module with
    ``in_features``, ``out_features`` and a ``density`` in (0, 1]; their children are not counted again.
    ``predictions_per_seq`` is P when the batches carry ``masked_positions`` (``MLMData.predictions_per_seq``):
    a model that names ``masked_positions_modules`` runs those modules on P positions per sequence (step 11).

    >>> from sparsetrain.models.builders import build_model
    >>> vit = build_model("vit", "tiny", image_size=32, patch_size=4, num_hidden_layers=2)
    >>> count_step_flops(vit, batch_size=4).seq_tokens
    65
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    config = getattr(model, "config", None)
    is_vision, image_size, seq_tokens = _step_tokens(config, seq_len, image_size)
    tokens = batch_size * seq_tokens
    head: tuple[str, ...] = ()
    if predictions_per_seq is not None:
        if is_vision or not 1 <= predictions_per_seq <= seq_tokens:
            raise ValueError(f"predictions_per_seq must be in [1, seq_len={seq_tokens}] for a text model, "
                             f"got {predictions_per_seq}")
        head = tuple(getattr(model, "masked_positions_modules", ()))

    rows = _layer_rows(model, batch_size, tokens, head, predictions_per_seq, is_vision, image_size)
    attention = _attention_flops(config, batch_size, seq_tokens)

    rigl_extra = sum(
        2 * r.tokens * r.in_features * r.out_features * (1.0 - r.density)  # step 4
        for r in rows
        if r.density < 1.0
    )
    return FlopReport(
        rows=rows,
        attention_flops=attention,
        dense_total=sum(r.dense_flops for r in rows) + attention,
        sparse_total=sum(r.sparse_flops for r in rows) + attention,
        rigl_update_extra=float(rigl_extra),
        batch_size=batch_size,
        seq_tokens=seq_tokens,
        predictions_per_seq=predictions_per_seq if head else None,
    )


def _step_tokens(config, seq_len: int | None, image_size: int | None) -> tuple[bool, int | None, int]:
    """``(is_vision, image_size, seq_tokens)``: a vision model (a config with ``image_size`` and ``patch_size``)
    sees its patches plus [CLS] per image, at ``image_size`` or the config's; a text model ``seq_len`` tokens."""
    patch_size = getattr(config, "patch_size", None)
    is_vision = patch_size is not None and getattr(config, "image_size", None) is not None
    if is_vision:
        image_size = image_size or config.image_size
        if image_size % patch_size != 0:
            raise ValueError(f"image_size={image_size} is not a multiple of patch_size={patch_size}")
        patches = (image_size // patch_size) ** 2
        seq_tokens = patches + 1  # the [CLS] token
    else:
        if seq_len is None or seq_len < 1:
            raise ValueError(f"seq_len (>= 1) is required for a text model, got {seq_len}")
        seq_tokens = seq_len
    return is_vision, image_size, seq_tokens


def _layer_rows(model: nn.Module, batch_size: int, tokens: int, head: tuple[str, ...],
                predictions_per_seq: int | None, is_vision: bool, image_size: int | None) -> list[LayerFlops]:
    """One row per matmul layer and ViT patch embedding of ``model`` (steps 1-4, 6, 7, 11); ``head``: the
    modules that run on ``predictions_per_seq`` positions per sequence."""
    rows: list[LayerFlops] = []
    counted: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in counted):
            continue  # inside a layer already counted (e.g. a sparse layer wrapping an nn.Linear)
        if _is_matmul_layer(module):
            density = _density(name, module)
            n_in, n_out = module.in_features, module.out_features
            layer_tokens = batch_size if _first_token_only(name) else tokens
            if any(name == p or name.startswith(p + ".") for p in head):
                layer_tokens = batch_size * predictions_per_seq  # step 11
            dense = 3 * 2 * layer_tokens * n_in * n_out  # steps 1-2
        elif isinstance(module, nn.Conv2d):
            if not (
                is_vision
                and module.kernel_size == module.stride
                and module.groups == 1
                and module.padding in ((0, 0), 0)
            ):
                raise ValueError(
                    f"cannot infer the work of conv layer {name!r}: only ViT-style patch "
                    "embeddings (kernel = stride, no padding, one group) are supported"
                )
            density = 1.0
            n_in = module.in_channels * module.kernel_size[0] * module.kernel_size[1]
            n_out = module.out_channels
            layer_tokens = batch_size * (image_size // module.stride[0]) * (image_size // module.stride[1])
            dense = 2 * 2 * layer_tokens * n_in * n_out  # step 6: forward + dW only
        else:
            continue
        counted.append(name)
        rows.append(
            LayerFlops(
                name=name,
                in_features=n_in,
                out_features=n_out,
                tokens=layer_tokens,
                density=density,
                dense_flops=float(dense),
                sparse_flops=float(dense * density),
            )
        )
    return rows


def _attention_flops(config, batch_size: int, seq_tokens: int) -> float:
    """Step 5: the attention matmuls of all layers (0 for a model without ``num_attention_heads``)."""
    attention = 0.0
    heads = getattr(config, "num_attention_heads", None)
    if heads:  # step 5
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        attention = float(12 * batch_size * seq_tokens**2 * heads * head_dim * config.num_hidden_layers)
    return attention


def step_flops(report: FlopReport, is_update_step: bool, dense_grad: bool) -> float:
    """FLOPs to add to the cumulative count for one optimizer step.

    ``dense_grad`` is whether the policy needs the dense gradient on update steps (RigL does, SET does
    not); only then does an update step cost ``rigl_update_extra`` more.

    >>> report = FlopReport([], 0.0, 10.0, 4.0, 1.5, batch_size=1, seq_tokens=1)
    >>> step_flops(report, is_update_step=True, dense_grad=True), step_flops(report, True, False)
    (5.5, 4.0)
    """
    extra = report.rigl_update_extra if (is_update_step and dense_grad) else 0.0
    return report.sparse_total + extra
