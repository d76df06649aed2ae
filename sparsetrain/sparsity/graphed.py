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
- the layers' sequences are independent (each reads the shared inputs and writes only its own tensors), so the
  capture puts them on ``streams`` side streams, round robin: the graph holds that many parallel branches, and the
  GPU overlaps the small kernels of several layers instead of running some ten thousand of them one after another.

The same sequence runs eagerly on any device (CPU tests compare it with the per-layer path).
"""
from __future__ import annotations

import torch
from torch import Tensor

from sparsetrain.sparsity import criteria
from sparsetrain.sparsity.layout import grid_shape, to_scores_grid
from sparsetrain.sparsity.policies import SET, RigL


def ranked(scores: Tensor, k: Tensor) -> Tensor:
    """Bool mask of ``scores``' shape, True at its ``k`` largest entries (``k`` a 0-d device tensor), ties broken
    by index: the blocks :func:`~sparsetrain.sparsity.layout.topk_mask` picks, with shapes that do not follow k."""
    flat = scores.reshape(-1)
    order = torch.argsort(flat, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    return (rank < k).view(scores.shape)


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

    def __init__(self, sched, streams: int | None = None) -> None:
        streams = self.STREAMS if streams is None else streams
        if not isinstance(streams, int) or streams < 1:
            raise ValueError(f"streams must be a positive int, got {streams!r}")
        self.sched = sched
        self.streams = streams
        self.layers = list(sched.layers.values())
        self.grids = [grid_shape((m.out_features, m.in_features), m.block) for m in self.layers]
        sizes = [r * c for r, c in self.grids]
        device = self.layers[0].mask.device
        self.on_cuda = device.type == "cuda"
        self.k = torch.zeros(len(self.layers), dtype=torch.long, device=device)
        self.grow = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
        self.grow_parts = [p.view(g) for p, g in zip(self.grow.split(sizes), self.grids)]
        pin = self.on_cuda
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
    def _fill(self, step: int, counts: list[int], grads: dict[str, Tensor]) -> None:
        if self.done is not None:
            self.done.synchronize()          # the previous update's copies out of pinned memory are done
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
    def _body(self) -> None:
        for i in range(len(self.layers)):
            self._layer(i)

    def _layer(self, i: int) -> None:
        """Layer ``i``'s update: drop the k weakest active blocks, grow the k best-scored inactive ones."""
        opt, layer = self.sched.optimizer, self.layers[i]
        mask = layer.mask
        w = layer.dense_weight()
        drop = to_scores_grid(self.sched.policy.drop_scores(w, None, mask), w.shape, layer.block)
        dropped = ranked(-drop.float().masked_fill(~mask, float("inf")), self.k[i])
        grown = ranked(self.grow_parts[i].masked_fill(mask, float("-inf")), self.k[i])
        layer.set_mask((mask & ~dropped) | grown, opt)
        if self.sched.regrow_moments == "mean":
            layer.settle_regrown_moments(opt)

    def _branches(self) -> None:
        """The sequence with layer ``i`` on side stream ``i % streams``, forked from and joined back into the
        current stream (inside a capture: parallel branches of the graph)."""
        main = torch.cuda.current_stream()
        sides = [torch.cuda.Stream() for _ in range(min(self.streams, len(self.layers)))]
        for side in sides:
            side.wait_stream(main)
        for i in range(len(self.layers)):
            with torch.cuda.stream(sides[i % len(sides)]):
                self._layer(i)
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

    def run(self, step: int, frac: float, grads: dict[str, Tensor]) -> bool:
        """The update at ``step`` with drop fraction ``frac``; False (nothing done) where a layer no longer allows
        it (the caller then updates layer by layer). ``last_count``: the blocks dropped (and grown) in all."""
        keys = self._keys()
        if any(key[0] is None for key in keys):
            return False
        counts = self.counts(frac)
        self.last_count = sum(counts)
        self._fill(step, counts, grads)
        for layer in self.layers:
            layer.dense_grad = None
        if self.graph is not None and keys == self.keys:
            self.graph.replay()
            self.replays += 1
        elif not (self.on_cuda and self._capture()):
            self.graph = None
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

    def eager_update(self, step: int, frac: float, grads: dict[str, Tensor]) -> None:
        """The same sequence run eagerly, on any device (what the graph replays; tests compare it)."""
        self._fill(step, self.counts(frac), grads)
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
