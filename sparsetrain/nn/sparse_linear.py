"""SparseLinear: a drop-in ``nn.Linear`` whose weight is block-sparse, in a pluggable storage format.

>>> lin = torch.nn.Linear(64, 32)
>>> sl = SparseLinear.from_dense(lin, density=0.25, block=Block(8, 8), generator=torch.Generator().manual_seed(0))
>>> sl.density
0.25
>>> sl(torch.randn(5, 64)).shape
torch.Size([5, 32])

The state dict always holds ``weight`` (dense, zeros outside the mask — or the dense master weight for
straight-through 2:4 training), ``mask`` (bool block grid) and ``bias``, whatever the storage format, so
checkpoints move between formats and ``save_pretrained`` writes a dense checkpoint with zeros.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from sparsetrain.nn.formats.base import (
    FormatCaps,
    WeightFormat,
    get_format,
    is_sharded,
    swap_parameter,
    whole,
    write_whole,
)
from sparsetrain.sparsity.layout import (
    Block,
    BlockLike,
    block_reduce,
    grid_shape,
    n_active_blocks,
    random_mask,
    to_element_mask,
    topk_mask,
)


class SparseLinear(nn.Module):
    """Linear layer ``y = x W_effᵀ + b`` with ``W_eff`` zero outside the active blocks of ``mask``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        block: BlockLike = 1,
        mask: Tensor | None = None,
        weight: Tensor | None = None,
        format: str | type[WeightFormat] | WeightFormat = "masked",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.block = Block.parse(block)
        grid = grid_shape((self.out_features, self.in_features), self.block)
        if weight is None:
            ref = nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
            weight = ref.weight.detach()
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({out_features}, {in_features})")
        if mask is None:
            mask = torch.ones(grid, dtype=torch.bool)
        mask = mask.to(torch.bool)
        if tuple(mask.shape) != grid:
            raise ValueError(f"mask has shape {tuple(mask.shape)}, expected block grid {grid} for block {self.block}")
        self.register_buffer("mask", mask.clone().to(weight.device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=weight.device, dtype=weight.dtype))
        else:
            self.register_parameter("bias", None)
        self.capture_dense_grad = False
        self.dense_grad: Tensor | None = None
        self.grad_probe: Tensor | None = None   # see arm_dense_grad
        self.mask_is_scratch = False            # ``mask`` shared by layers of one shape: Semi24Format.share_masks
        self.storage: WeightFormat = get_format(format)
        self.storage.setup(self, weight, self.mask)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        mask: Tensor | None = None,
        *,
        density: float | None = None,
        block: BlockLike = 1,
        format: str | type[WeightFormat] | WeightFormat = "masked",
        generator: torch.Generator | None = None,
        init: str = "random",
    ) -> SparseLinear:
        """Wrap an ``nn.Linear``. Give a block ``mask``, or a ``density`` and an ``init`` rule:
        ``"random"`` (uniform over blocks, from ``generator``) or ``"magnitude"`` (largest block L1 norms)."""
        block = Block.parse(block)
        w = linear.weight.detach()
        if mask is None:
            grid = grid_shape(w.shape, block)
            k = n_active_blocks(w.shape, block, 1.0 if density is None else density)
            if init == "random":
                gen = generator if generator is not None else torch.Generator().manual_seed(0)
                mask = random_mask(grid, k, gen)
            elif init == "magnitude":
                mask = topk_mask(block_reduce(w.abs().float().cpu(), block), k)
            else:
                raise ValueError(f"init must be 'random' or 'magnitude', got {init!r}")
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, block=block,
                    mask=mask, weight=w, format=format)
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(linear.bias.detach())
        return layer

    # ---- RigL's dense gradient -----------------------------------------------------------------
    def arm_dense_grad(self, want: bool) -> None:
        """Capture the dense weight gradient in the next backward passes (``want``), or stop and drop it. Where
        the format takes a probe (the block format: ``kernels/blocksparse/probe.py``) the gradient arrives as the
        probe's gradient, which a compiled and a replayed step fill too; otherwise a Python hook fills
        ``dense_grad`` (an uncompiled eager step). Read it with :meth:`dense_gradient`."""
        self.capture_dense_grad = bool(want)
        if not want:
            self.drop_dense_grad()
        elif self.grad_probe is None or self.grad_probe.device != self.mask.device:
            self.grad_probe = self.storage.new_probe(self)

    def dense_gradient(self) -> Tensor | None:
        """The dense weight gradient captured since it was last dropped (float32 ``[O, I]``), or None."""
        if self.dense_grad is not None or self.grad_probe is None:
            return self.dense_grad
        return self.grad_probe.grad

    def drop_dense_grad(self) -> None:
        self.dense_grad = None
        if self.grad_probe is not None:
            self.grad_probe.grad = None

    def dense_phase(self) -> nn.Linear:
        """An ``nn.Linear`` holding this layer's own weight and bias Parameters (for a straight-through
        format, the dense master weight): swapped in for the layer, it trains on with the same optimizer and
        optimizer state. Unlike :meth:`to_dense`, nothing is copied.

        >>> sl = SparseLinear(8, 4, format="masked_st")
        >>> sl.dense_phase().weight is sl.weight
        True
        """
        w = self.weight_parameter()
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"format {self.format_name!r} stores its weight as {tuple(w.shape)}, not as a dense "
                             f"({self.out_features}, {self.in_features}) Parameter; use to_dense() for a copy")
        return self._linear_on(w)

    def _linear_on(self, weight: nn.Parameter) -> nn.Linear:
        """An ``nn.Linear`` holding ``weight`` and this layer's bias Parameter (nothing allocated or copied)."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight = weight
        if self.bias is not None:
            lin.bias = self.bias
        return lin

    def densify(self, optimizer: torch.optim.Optimizer | None = None) -> nn.Linear:
        """The ``nn.Linear`` of a dense phase (sparse-then-dense) that trains on from this layer: a format with a
        dense weight Parameter hands it over (:meth:`dense_phase`, the optimizer state stays); a compressed one
        (``block``) gives a new dense Parameter holding ``W_eff``, and ``optimizer`` trains it in the old one's
        place, its moments laid out densely: the active blocks keep theirs; the positions outside the mask start
        at zero with a zero first moment and, for Adam's second moment, the mean of the active positions' (see
        :func:`settle_new_moments`).

        >>> sl = SparseLinear.from_dense(nn.Linear(32, 16), density=0.5, block=16, format="block")
        >>> lin = sl.densify()
        >>> type(lin).__name__, tuple(lin.weight.shape), bool(torch.equal(lin.weight, sl.dense_weight()))
        ('Linear', (16, 32), True)
        """
        w = self.weight_parameter()
        if tuple(w.shape) == (self.out_features, self.in_features):
            lin = self.dense_phase()
        elif is_sharded(w):
            raise ValueError("a sharded (FSDP) block-format layer cannot become dense in place; "
                             "sparsity.scheduler.dense_from needs one process or data parallelism")
        else:
            dense = nn.Parameter(self.storage.dense_layout(self, w.detach()).clone(), requires_grad=w.requires_grad)
            swap_parameter(optimizer, w, dense, lambda t: self.storage.dense_layout(self, t))
            lin = self._linear_on(dense)
        settle_new_moments(optimizer, lin.weight, self.element_mask())
        return lin

    def to_dense(self) -> nn.Linear:
        """An ``nn.Linear`` carrying ``W_eff`` (zeros outside the mask)."""
        w = self.dense_weight()
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=w.device, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
            if self.bias is not None:
                lin.bias.copy_(self.bias.detach())
        return lin

    # ---- the module ---------------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        return self.storage.forward(self, x)

    def dense_weight(self) -> Tensor:
        return self.storage.dense_weight(self)

    def weight_parameter(self) -> nn.Parameter:
        return self.storage.weight_parameter(self)

    def element_mask(self) -> Tensor:
        return to_element_mask(self.current_mask(), self.block)

    def current_mask(self) -> Tensor:
        """The block mask as it is now: ``mask``, or, where that buffer is scratch shared by the layers of one
        shape (2:4 layers that derive their mask in every forward), this layer's own mask computed anew."""
        return self.storage.current_mask(self)

    def settle_regrown_moments(self, optimizer: torch.optim.Optimizer | None) -> None:
        """After :meth:`set_mask`: the regrown weights' Adam second moment becomes the mean of the others'
        (:func:`settle_regrown_moments`)."""
        settle_regrown_moments(optimizer, self.weight_parameter(), self.storage.active_in_parameter(self))

    @staticmethod
    def settle_moments_of(layers: list[SparseLinear], optimizer: torch.optim.Optimizer | None, moved: Tensor) -> None:
        """:meth:`settle_regrown_moments` of same-shaped ``layers`` whose weights are active everywhere in their
        Parameter (the block format), where ``moved [L]`` is True (:func:`settle_regrown_moments_all`)."""
        settle_regrown_moments_all(optimizer, [m.weight_parameter() for m in layers], moved)

    def set_mask(self, new_mask: Tensor, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Rewrite the topology (see :mod:`sparsetrain.nn.formats` for what happens to weights/moments)."""
        if tuple(new_mask.shape) != tuple(self.mask.shape):
            raise ValueError(f"new mask shape {tuple(new_mask.shape)} != {tuple(self.mask.shape)}")
        self.storage.set_mask(self, new_mask.to(torch.bool), optimizer)

    def shrink_to(self, new_mask: Tensor, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Keep only the active blocks of ``new_mask``, a subset of the mask (gradual pruning): a format that keeps
        its count rebuilds its storage at the new one; the others set the mask."""
        if tuple(new_mask.shape) != tuple(self.mask.shape):
            raise ValueError(f"new mask shape {tuple(new_mask.shape)} != {tuple(self.mask.shape)}")
        self.storage.shrink(self, new_mask.to(torch.bool), optimizer)

    def graph_update_key(self):
        """None, or what :meth:`set_mask` touches, by identity, where it can be replayed from a CUDA graph."""
        return self.storage.graph_update_key(self)

    def set_format(self, format: str | type[WeightFormat] | WeightFormat,
                   optimizer: torch.optim.Optimizer | None = None) -> None:
        """Move to another storage format (e.g. masked -> block on GPU). Call before building the optimizer,
        or pass it: the old weight parameter's optimizer state is dropped."""
        weight, mask = self.storage.state_weight(self).clone(), self.current_mask().clone()
        old = self.weight_parameter()
        for name in [n for n, p in self._parameters.items() if p is old]:
            del self._parameters[name]
        if optimizer is not None:
            optimizer.state.pop(old, None)
        self.storage = get_format(format)
        self.storage.setup(self, weight, mask)

    @property
    def density(self) -> float:
        """Fraction of active weights."""
        return float(self.current_mask().float().mean().item())

    @property
    def n_active(self) -> int:
        return self.storage.n_active(self)

    @property
    def format_name(self) -> str:
        """The format's registered name (or dotted path): for messages and logs, not for decisions."""
        return self.storage.name

    @property
    def caps(self) -> FormatCaps:
        """What the storage format can do (see :class:`~sparsetrain.nn.formats.FormatCaps`)."""
        return self.storage.caps

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"block={self.block}, density={self.density:.4f}, format={self.storage.extra_repr()}")

    # ---- state dict: always dense weight + mask -----------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.storage.state_weight(self) if not keep_vars else \
            self.storage.state_weight(self)
        mask = self.current_mask()
        destination[prefix + "mask"] = mask if keep_vars else mask.detach().clone()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        wkey, mkey, bkey = prefix + "weight", prefix + "mask", prefix + "bias"
        if wkey not in state_dict:
            missing_keys.append(wkey)
            return
        weight = state_dict[wkey]
        if tuple(weight.shape) != (self.out_features, self.in_features):
            error_msgs.append(f"size mismatch for {wkey}: {tuple(weight.shape)} vs "
                              f"({self.out_features}, {self.in_features})")
            return
        if mkey in state_dict:
            mask = state_dict[mkey].to(torch.bool)
            if tuple(mask.shape) != tuple(self.mask.shape):
                error_msgs.append(f"size mismatch for {mkey}: {tuple(mask.shape)} vs {tuple(self.mask.shape)}")
                return
        else:
            # A dense checkpoint (e.g. from save_pretrained): keep this layer's topology.
            missing_keys.append(mkey)
            mask = self.mask
        self.storage.load(self, weight, mask)
        if self.bias is not None:
            if bkey in state_dict:
                with torch.no_grad():
                    self.bias.copy_(state_dict[bkey])
            else:
                missing_keys.append(bkey)
        for key in state_dict:
            if key.startswith(prefix) and "." not in key[len(prefix):] and key not in (wkey, mkey, bkey):
                unexpected_keys.append(key)


def settle_new_moments(optimizer: torch.optim.Optimizer | None, weight: Tensor, mask: Tensor) -> None:
    """Adam's second moment (``exp_avg_sq``) of ``weight`` at the positions outside ``mask`` that have none yet
    (zero) becomes the mean of the positions inside: the dense phase's new weights then step like the others.

    With a zero second moment and the tensor's step count hundreds of steps on, Adam's bias correction no longer
    damps a new weight's first updates: they come out at 3-6x the learning rate for tens of steps, for 90% of a
    layer's weights at once. On BERT-base (H200, 2026-11-29) that sent a 90% sparse run switching to dense at
    half of 1000 steps from eval loss 6.13 back to the unigram plateau (7.10). First moments stay zero.

    >>> w = nn.Parameter(torch.zeros(2, 2)); opt = torch.optim.Adam([w])
    >>> opt.state[w] = {"exp_avg_sq": torch.tensor([[4.0, 0.0], [2.0, 0.0]])}
    >>> settle_new_moments(opt, w, torch.tensor([[True, False], [True, False]]))
    >>> opt.state[w]["exp_avg_sq"].tolist()
    [[4.0, 3.0], [2.0, 3.0]]
    """
    inside = mask.to(dtype=torch.bool)
    _settle_second_moment(optimizer, weight, fill=lambda v: ~inside.to(v.device),
                          mean_of=lambda v: inside.to(v.device))


def settle_regrown_moments(optimizer: torch.optim.Optimizer | None, param: Tensor,
                           active: Tensor | None = None) -> None:
    """After a mask update: Adam's second moment of ``param`` where it is zero (the newly regrown weights, whose
    moments the update zeroed) at ``active`` positions (None: everywhere) becomes the mean of the non-zero ones.

    The same reason as :func:`settle_new_moments`: a regrown weight with a zero second moment and the tensor's step
    count far on takes its first updates at 3-6x the learning rate. No host sync (the mean is a ratio of device
    sums), so the graphed update can capture it. First moments stay zero.

    >>> w = nn.Parameter(torch.zeros(2, 2)); opt = torch.optim.Adam([w])
    >>> opt.state[w] = {"exp_avg_sq": torch.tensor([[4.0, 0.0], [2.0, 0.0]])}
    >>> settle_regrown_moments(opt, w, torch.tensor([[True, True], [True, False]]))
    >>> opt.state[w]["exp_avg_sq"].tolist()
    [[4.0, 3.0], [2.0, 0.0]]
    """
    def where(v: Tensor) -> Tensor:
        return torch.ones_like(v, dtype=torch.bool) if active is None else active.to(v.device, torch.bool)

    _settle_second_moment(optimizer, param, fill=where, mean_of=lambda v: where(v) & (v != 0))


def _settle_second_moment(optimizer, param: Tensor, fill, mean_of) -> None:
    """Adam's ``exp_avg_sq`` of ``param``: its zero entries where ``fill(v)`` is True become the mean of the entries
    where ``mean_of(v)`` is (both bool masks of the whole moment ``v``; nothing where ``param`` has no such state).
    No host sync: the mean is a ratio of device sums. A sharded moment (FSDP2) is gathered, settled whole, and
    each rank keeps its shard."""
    state = optimizer.state.get(param) if optimizer is not None else None
    v = state.get("exp_avg_sq") if state else None
    if not torch.is_tensor(v) or v.shape != param.shape:
        return
    with torch.no_grad():
        full = whole(v)
        write_whole(v, _settled(full, fill(full), mean_of(full)))


def _settled(full: Tensor, fill: Tensor, source: Tensor, dims: tuple[int, ...] | None = None) -> Tensor:
    """``full`` with its zeros where ``fill`` is True replaced by the mean of its entries where ``source`` is (over
    ``dims``, the rest kept apart; None: over all)."""
    dims = tuple(range(full.dim())) if dims is None else dims
    mean = (full.float() * source).sum(dims, keepdim=True) / source.sum(dims, keepdim=True).clamp(min=1)
    return torch.where(fill & (full == 0), mean.to(full.dtype), full)


def settle_regrown_moments_all(optimizer: torch.optim.Optimizer | None, params: list[Tensor], moved: Tensor) -> None:
    """:func:`settle_regrown_moments` (active everywhere) of same-shaped ``params`` where ``moved`` (a bool tensor
    ``[L]`` on their device) is True: those whose blocks an update moved; the others stay as they are, as the
    per-layer update leaves a layer it did not change. Whole moments are settled in one pass over their stack, each
    with its own mean; no host sync either way."""
    states = [optimizer.state.get(p) if optimizer is not None else None for p in params]
    vs = [s.get("exp_avg_sq") if s else None for s in states]
    if not all(torch.is_tensor(v) and v.shape == p.shape and not is_sharded(v) for v, p in zip(vs, params)):
        for p, m in zip(params, moved.unbind(0)):
            _settle_second_moment(optimizer, p, fill=lambda v, m=m: m.expand(v.shape), mean_of=lambda v: v != 0)
        return
    with torch.no_grad():
        full = torch.stack(vs)
        fill = moved.view(-1, *([1] * (full.dim() - 1))).expand(full.shape)
        done = _settled(full, fill, full != 0, tuple(range(1, full.dim())))
        torch._foreach_copy_(vs, list(done.unbind(0)))
