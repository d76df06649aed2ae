"""Prune-and-regrow as one replayed CUDA graph: a mask update of every layer in one launch.

An update of a :class:`~sparsetrain.sparsity.schedulers.PruneRegrow` scheduler is the same few dozen small ops per
layer every time (scores, the choice, the block moves, the topology's index lists), and on a GPU each op costs
more to launch from Python than to run. Where every layer can be updated with no host sync into tensors it keeps
(``layer.graph_update_key()`` is not None: the block format whose kept tables are all built on the device), the
built-in policies (SET, RigL) run that sequence from a CUDA graph:

- what changes from one update to the next comes in through static buffers filled before the replay: each layer's
  drop count ``k`` (the drop fraction's schedule), and the grow scores (SET: the very numbers of the CPU generator
  seeded from (seed, step, layer), written into pinned memory; RigL: the block sums of the all-reduced dense
  gradient, computed eagerly);
- the choice is a rank test (``rank < k``) instead of a ``topk(k)`` whose shape would follow ``k``: the same
  blocks, ties broken by index as :func:`~sparsetrain.sparsity.layout.topk_mask` does;
- the sequence is captured ahead of the first update (:meth:`GraphedUpdate.prepare`, which the training loop
  calls in its start-up window), else at the first update, and replayed at every update. Whenever what a layer
  keeps changed since the capture (a new launch plan's table, new buffers), the update captures again; where a
  capture fails the update runs eagerly (after two failures, every later one);
- layers of one shape and kept tables (the format's ``graph_batch_key``: in BERT the attention projections, the
  FFN ups, the FFN downs) run as one sequence over their stack, each op once for the group (``set_masks``; the
  kernel tables built once under ``torch.func.vmap``); a layer without such a twin runs alone. The sequences are
  independent (each reads the shared inputs and writes only its own tensors), so the capture puts them on
  ``streams`` side streams, round robin: parallel branches of the graph;
- a ``gate`` (a 0-d bool on the device; the training loop's "every loss finite so far") multiplies every drop
  count, so an update after a NaN moves nothing without the host reading the flag.

The same sequence runs eagerly on any device (CPU tests compare it with the per-layer path).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from sparsetrain.sparsity import criteria
from sparsetrain.sparsity.layout import grid_shape, to_scores_grid
from sparsetrain.sparsity.policies import SET, RigL


def ranked(scores: Tensor, k: Tensor) -> Tensor:
    """Bool mask of ``scores``' shape, True at its ``k`` largest entries (``scores [R, C]`` with ``k`` a 0-d device
    tensor, or a stack ``[L, R, C]`` with ``k [L]``, each grid on its own), ties broken by index: the blocks
    :func:`~sparsetrain.sparsity.layout.topk_mask` picks, with shapes that do not follow k."""
    flat = scores.flatten(-2)
    order = torch.argsort(flat, dim=-1, descending=True, stable=True)
    steps = torch.arange(flat.shape[-1], device=flat.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, steps)
    return (rank < k.unsqueeze(-1)).view(scores.shape)


class _Group(NamedTuple):
    """Layers whose update runs as one sequence over their stack (equal ``graph_batch_key``)."""
    index: list[int]       # their places in GraphedUpdate.layers
    rows: Tensor           # the same, on the device (their drop counts in GraphedUpdate.k)


def why_not_graphed(sched) -> str | None:
    """Why ``sched``'s updates cannot run from one graph (None: they can)."""
    if type(sched.policy) not in (SET, RigL):
        return f"policy {type(sched.policy).__name__} is not a built-in one (SET, RigL)"
    for name, layer in sched.layers.items():
        key = getattr(layer, "graph_update_key", lambda: None)()
        if key is None:
            return f"layer {name} cannot be updated without the host"
    return None


class GraphedUpdate:
    """The update sequence of ``sched``'s layers over static inputs, run eagerly or replayed from a CUDA graph
    whose layers run as ``streams`` parallel branches."""

    STREAMS = 8   # parallel branches of the captured update
    BATCH = True  # layers of one shape in one sequence over their stack (False: one by one)

    def __init__(self, sched, streams: int | None = None, batch: bool | None = None) -> None:
        streams = self.STREAMS if streams is None else streams
        if not isinstance(streams, int) or streams < 1:
            raise ValueError(f"streams must be a positive int, got {streams!r}")
        self.sched = sched
        self.streams = streams
        self.batch = self.BATCH if batch is None else bool(batch)
        self._units: list[int | _Group] = []
        self.layers = list(sched.layers.values())
        self.grids = [grid_shape((m.out_features, m.in_features), m.block) for m in self.layers]
        sizes = [r * c for r, c in self.grids]
        device = self.layers[0].mask.device
        self.on_cuda = device.type == "cuda"
        self.k = torch.zeros(len(self.layers), dtype=torch.long, device=device)
        self.grow = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
        self.grow_parts = [p.view(g) for p, g in zip(self.grow.split(sizes), self.grids)]
        pin = self.on_cuda
        self.ok = torch.ones((), dtype=torch.bool, device=device)   # the gate: False makes every drop count 0
        self.k_now = self.k                                         # the counts the sequence reads (gated)
        self.k_host = torch.zeros(len(self.layers), dtype=torch.long, pin_memory=pin)
        self.grow_host = (torch.zeros(sum(sizes), dtype=torch.float32, pin_memory=pin)
                          if type(sched.policy) is SET else None)
        self._host_parts = None if self.grow_host is None else [
            p.view(g) for p, g in zip(self.grow_host.split(sizes), self.grids)]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.keys: list | None = None
        self.done = None          # the event after the last copy from pinned memory
        self.replays = self.captures = self.eager = self.failed = 0

    # -- inputs ------------------------------------------------------------------------------------------
    def _fill(self, step: int, counts: list[int], grads: dict[str, Tensor], gate: Tensor | None = None) -> None:
        if self.done is not None:
            self.done.synchronize()          # the previous update's copies out of pinned memory are done
        if gate is not None:
            self.ok.copy_(gate)
        else:
            self.ok.fill_(True)
        self.k_host.copy_(torch.tensor(counts, dtype=torch.long))
        sched = self.sched
        if self.grow_host is not None:       # SET: the generator's numbers, as criteria.random draws them
            for i, part in enumerate(self._host_parts):
                torch.rand(part.shape, generator=sched._generator(step, i), out=part)
            self.grow.copy_(self.grow_host, non_blocking=True)
        else:                                # RigL: block sums of |dense gradient|, on the device
            for name, part, layer in zip(sched.layers, self.grow_parts, self.layers):
                g = grads[name]
                part.copy_(to_scores_grid(criteria.gradient(g), g.shape, layer.block))
        self.k.copy_(self.k_host, non_blocking=True)
        if self.on_cuda:
            self.done = torch.cuda.Event()
            self.done.record()

    # -- the sequence -----------------------------------------------------------------------------------
    def _plan(self) -> None:
        """The units of the sequence: a layer alone, or a :class:`_Group` of layers of equal ``graph_batch_key``
        (their format updates them together: ``set_masks``), in the order of their first layer."""
        opt, units = self.sched.optimizer, {}
        for i, layer in enumerate(self.layers):
            storage = layer.storage
            key = storage.graph_batch_key(layer, opt) if self.batch else None
            if key is None or storage.active_in_parameter(layer) is not None:
                key = ("alone", i)
            units.setdefault(key, []).append(i)
        self._units = [idx[0] if len(idx) == 1 else _Group(idx, torch.tensor(idx, device=self.k.device))
                       for idx in units.values()]

    def _body(self) -> None:
        self.k_now = self.k * self.ok
        for unit in self._units:
            self._unit(unit)

    def _unit(self, unit: int | _Group) -> None:
        self._layer(unit) if isinstance(unit, int) else self._group(unit)

    def _drop_scores(self, i: int) -> Tensor:
        layer = self.layers[i]
        w = layer.dense_weight()
        return to_scores_grid(self.sched.policy.drop_scores(w, None, layer.mask), w.shape, layer.block)

    def _choose(self, mask: Tensor, drop: Tensor, grow: Tensor, k: Tensor) -> Tensor:
        """The new mask: the ``k`` weakest active blocks dropped, the ``k`` best-scored inactive ones grown (one grid
        or a stack of grids with ``k [L]``)."""
        dropped = ranked(-drop.float().masked_fill(~mask, float("inf")), k)
        grown = ranked(grow.masked_fill(mask, float("-inf")), k)
        return (mask & ~dropped) | grown

    def _layer(self, i: int) -> None:
        """Layer ``i``'s update: drop the k weakest active blocks, grow the k best-scored inactive ones."""
        opt, layer = self.sched.optimizer, self.layers[i]
        layer.set_mask(self._choose(layer.mask, self._drop_scores(i), self.grow_parts[i], self.k_now[i]), opt)
        self._settle([layer], self.k_now[i:i + 1])

    def _group(self, g: _Group) -> None:
        """The update of a group's layers over their stack: each op once for all of them (the drop scores are the
        policy's, per layer)."""
        opt, layers = self.sched.optimizer, [self.layers[i] for i in g.index]
        masks = torch.stack([m.mask for m in layers])
        drop = torch.stack([self._drop_scores(i) for i in g.index])
        grow = torch.stack([self.grow_parts[i] for i in g.index])
        k = self.k_now.index_select(0, g.rows)
        layers[0].storage.set_masks(layers, self._choose(masks, drop, grow, k), opt)
        self._settle(layers, k)

    def _settle(self, layers: list, k: Tensor) -> None:
        """Regrown moments: the mean of the others' where the scheduler asks for it, in the layers whose blocks
        moved (``k > 0``; the per-layer update leaves a layer with nothing to move as it is)."""
        if self.sched.regrow_moments == "mean":
            type(layers[0]).settle_moments_of(layers, self.sched.optimizer, k > 0)

    def _branches(self) -> None:
        """The sequence with unit ``u`` on side stream ``u % streams``, forked from and joined back into the
        current stream (inside a capture: parallel branches of the graph)."""
        main = torch.cuda.current_stream()
        self.k_now = self.k * self.ok
        sides = [torch.cuda.Stream() for _ in range(min(self.streams, len(self._units)))]
        for side in sides:
            side.wait_stream(main)
        for u, unit in enumerate(self._units):
            with torch.cuda.stream(sides[u % len(sides)]):
                self._unit(unit)
        for side in sides:
            main.wait_stream(side)

    @classmethod
    def for_scheduler(cls, sched) -> GraphedUpdate | None:
        """The graphed update of a PruneRegrow scheduler whose layers all allow it, else None."""
        return cls(sched) if why_not_graphed(sched) is None else None

    def counts(self, frac: float) -> list[int]:
        """Blocks each layer drops (and grows) at drop fraction ``frac``, clipped as ``update_mask`` clips them."""
        out = []
        for layer, (r, c) in zip(self.layers, self.grids):
            n_active = layer.n_active
            out.append(max(0, min(int(round(frac * n_active)), n_active, r * c - n_active)))
        return out

    def run(self, step: int, frac: float, grads: dict[str, Tensor], gate: Tensor | None = None) -> bool:
        """The update at ``step`` with drop fraction ``frac``; False (nothing done) where a layer no longer allows
        it (the caller then updates layer by layer). ``gate``: a 0-d bool on the device; where False, nothing moves
        (read in the graph, not on the host). ``last_count``: the blocks dropped (and grown) in all, ungated."""
        keys = self._keys()
        if any(key[0] is None for key in keys):
            return False
        counts = self.counts(frac)
        self.last_count = sum(counts)
        self._fill(step, counts, grads, gate)
        for layer in self.layers:
            layer.drop_dense_grad()
        if self.graph is not None and keys == self.keys:
            self.graph.replay()    # (writes only what the layers keep: the keys stay)
            self.replays += 1
            return True
        if not (self.on_cuda and self._capture()):
            self.graph = None
            self._plan()
            self._body()
            self.eager += 1
        self.keys = self._keys()   # what the next update must find to replay (the first one may add entries)
        return True

    def prepare(self) -> bool:
        """Capture the sequence ahead of the first update (start-up work, like the training step's own capture), and
        replay it once with ``k = 0`` for every layer: nothing dropped or grown, every kept tensor rewritten with
        what it holds. The first update then only replays. False where nothing was captured (not on a GPU, a
        layer that needs the host, a failed capture)."""
        if not self.on_cuda or self.graph is not None or any(key[0] is None for key in self._keys()):
            return False
        self.k.zero_()
        ok = self._capture()
        self.keys = self._keys() if ok else None
        return ok

    def eager_update(self, step: int, frac: float, grads: dict[str, Tensor], gate: Tensor | None = None) -> None:
        """The same sequence run eagerly, on any device (what the graph replays; tests compare it)."""
        self._fill(step, self.counts(frac), grads, gate)
        self._plan()
        self._body()

    def _keys(self) -> list:
        """What the sequence reads and writes, by identity: each layer's kept tensors and its optimizer state."""
        state = self.sched.optimizer.state if self.sched.optimizer is not None else {}
        return [(layer.graph_update_key(), tuple(id(v) for v in state.get(layer.weight_parameter(), {}).values()
                                                 if torch.is_tensor(v)))
                for layer in self.layers]

    def _capture(self) -> bool:
        """Capture the sequence and replay it (capture only records); False where the capture failed (twice in a
        run: no further try), nothing then changed on the device and the update runs eagerly."""
        if self.failed >= 2:
            return False
        for layer in self.layers:   # what a layer builds and keeps on first use is built outside the capture
            layer.dense_weight()
        self._plan()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._branches() if self.streams > 1 else self._body()
        except RuntimeError:
            torch.cuda.synchronize()
            self.failed += 1
            return False
        self.graph = graph
        self.captures += 1
        graph.replay()
        self.replays += 1
        return True
