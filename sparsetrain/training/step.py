"""One optimizer step, run eagerly or replayed from one CUDA graph.

A step is ``grad_accum`` micro-batches of forward and backward, the gradient clip, ``optimizer.step()`` and the
guard's non-finite check, all on the device with no host sync. :class:`TrainStep` runs it in one of two ways:

- **eager**: the Python of every op runs every step (any device, any number of processes);
- **graph** (``trainer.cuda_graph``): the whole step, the sparse kernels included, is captured once into a CUDA
  graph and then replayed, one launch per step, with the batch copied into static input buffers. The host is
  then free while the GPU works. With several processes the step averages the gradients itself after the last
  micro-batch (``sync``, :mod:`sparsetrain.training.grad_sync`: DDP's reducer cannot be captured), so the graph
  holds the NCCL all-reduce too. Every rank then takes the same path at every step (replay, eager or capture):
  it depends only on the step count, the mask updates and the batch shapes, the same on every rank.

What stays outside the graph: the learning-rate update (the optimizer's ``lr`` is a device tensor, refilled
in place), the sparsity scheduler's hook, logging. A step the graph cannot replay runs eagerly with the very
same body: the step before a RigL update where a layer hands its dense gradient to a Python hook (block-format
layers take a probe instead, and that step is replayed from a second graph: :meth:`TrainStep._grow_step`), and a
batch whose shapes differ from the captured ones. After a mask update, :meth:`TrainStep.topology_changed` keeps the
graph when the update rewrote everything the step reads in place (``reads``: the parameters, buffers and
optimizer state are the same tensors at the same addresses, as after an update of the masked format, or of the
block format where its kept tables fit the new topology), so the next replay reads the new topology. An update
that installed new tensors (a block topology that outgrows a kept table) drops the graph: the next step runs
eagerly (it builds the new topology's plans) and the one after is captured again. Each re-capture costs about two eager steps;
``captures``, ``eager_steps`` and ``graphs_kept`` count them for the run summary.

Capture rules this module keeps: the optimizer is capturable with its ``lr`` on the device, autocast does not
cache casts, gradients are ``None`` when capture starts (the graph allocates and then overwrites them), the
first steps run on a side stream. A capture that fails (an op in the model reads a value on the host, say)
raises :class:`GraphCaptureError`; the loop then goes on eagerly under ``trainer.cuda_graph=auto``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from sparsetrain.training.grad_sync import GradSync
from sparsetrain.training.optim_capture import make_eager_safe, make_graph_safe

if TYPE_CHECKING:
    from sparsetrain.training.guard import Guard
    from sparsetrain.training.setup import TrainArgs

Batch = dict[str, Tensor]


class GraphCaptureError(RuntimeError):
    """The step could not be captured (nothing was applied to the model: the step can run again eagerly)."""


def graph_mode(setting: bool | str, on_cuda: bool, processes: int, mixed_precision: str,
               compile_mode: str | None, optimizer_capturable: bool = True, sharded: bool = False,
               running_stats: bool = False) -> bool:
    """Whether the run replays its steps from a CUDA graph (``trainer.cuda_graph``: true, false or auto). ``auto``
    means yes on CUDA with bf16 or fp32 unless ``torch.compile`` makes graphs of its own, also with several
    processes that each hold the whole model (DDP-style: each replays its own graph, the gradient all-reduce
    inside it). ``sharded`` (FSDP) and ``running_stats`` (BatchNorm statistics, which DDP broadcasts before every
    forward) rule it out: ``auto`` then runs eager steps. ``true`` where it cannot work is an error naming the key
    (config validation catches it before any work).

    >>> graph_mode("auto", on_cuda=True, processes=2, mixed_precision="bf16", compile_mode=None)
    True
    >>> graph_mode("auto", on_cuda=True, processes=2, mixed_precision="bf16", compile_mode=None, sharded=True)
    False
    >>> graph_mode(True, on_cuda=True, processes=2, mixed_precision="bf16", compile_mode=None)
    True
    """
    own_graphs = compile_mode in ("reduce-overhead", "max-autotune")
    several = processes > 1
    blockers = [why for bad, why in ((not on_cuda, "the run is not on a CUDA device"),
                                     (mixed_precision == "fp16", "fp16 loss scaling syncs with the host"),
                                     (own_graphs, f"trainer.compile_mode={compile_mode} captures graphs itself"),
                                     (not optimizer_capturable, "the optimizer has no 'capturable' option (use "
                                                                "torch.optim.AdamW or Adam)"),
                                     (several and sharded, f"the run shards the model over {processes} processes "
                                                           f"(FSDP); graphs need each process to hold the whole "
                                                           f"model, as under DDP"),
                                     (several and running_stats, "the model has BatchNorm running statistics, "
                                                                 "which DDP keeps equal across processes"))
                if bad]
    if setting == "auto":
        return not blockers
    if setting and blockers:
        raise ValueError(f"trainer.cuda_graph: is true but {blockers[0]}; use trainer.cuda_graph=auto or false")
    return bool(setting)


class TrainStep:
    """``step(micro_batches) -> loss`` (a device scalar: the mean micro-batch loss) for one optimizer step.

    ``forward(batch)`` returns the model output (``.loss``); ``backward(loss)``; ``clip()`` returns the gradient
    norm (or None); ``no_sync()`` is the context for micro-batches before the last (DDP's gradient sync off);
    ``sync()``, when given, averages the gradients across processes after the last micro-batch's backward (the
    step's own sync, instead of DDP's); ``autocast()`` the mixed-precision context; ``observe(loss, grad_norm)``
    folds the non-finite check into device flags. With ``graph=True`` (CUDA) steps are replayed from a CUDA graph
    when they can be.
    """

    def __init__(self, forward: Callable[[Batch], object], backward: Callable[[Tensor], None],
                 optimizer: torch.optim.Optimizer, *, clip: Callable[[], Tensor | None],
                 observe: Callable[[Tensor, Tensor | None], None],
                 autocast: Callable[[], AbstractContextManager],
                 no_sync: Callable[[], AbstractContextManager] = nullcontext,
                 sync: Callable[[], None] | None = None, graph: bool = False,
                 warmup: int = 1, plain_forward: Callable[[Batch], object] | None = None,
                 reads: Callable[[], Iterable[Tensor]] | None = None,
                 probes: Callable[[], list[Tensor] | None] | None = None) -> None:
        self.forward, self.backward, self.optimizer = forward, backward, optimizer
        self.plain_forward = plain_forward or forward   # the uncompiled model, for steps with Python hooks
        self.clip, self.observe, self.autocast, self.no_sync = clip, observe, autocast, no_sync
        self.sync = sync
        self.graph_mode = bool(graph)
        self.warmup = max(1, int(warmup))
        self.captures = 0      # graphs captured in this process
        self.replays = 0       # steps replayed from a graph
        self.eager_steps = 0   # steps run eagerly
        self.capture_s = 0.0   # host seconds spent capturing
        self.graphs_kept = 0   # mask updates after which the graph was kept (rewritten in place)
        self.grow_captures = 0  # graphs of RigL's grow step captured (replays count in ``replays``)
        self.reads = reads     # every tensor the step reads besides the batch (None: no update keeps a graph)
        self._read_at_capture: list[tuple[Tensor, int]] | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static: list[Batch] | None = None
        self._static_loss: Tensor | None = None
        self._since_invalidate = 0
        self._side: torch.cuda.Stream | None = None
        self.probes = probes   # the dense-gradient probes of a grow step (None: a layer needs a Python hook)
        self._grow: tuple[torch.cuda.CUDAGraph, Tensor, list[tuple[Tensor, Tensor]]] | None = None
        self._grow_warm = False
        self._grow_failed = False

    # -- the step's body: the same ops eagerly and under capture ------------------------------------------
    def _body(self, batches: list[Batch], plain: bool = False) -> Tensor:
        n, forward = len(batches), (self.plain_forward if plain else self.forward)
        total: Tensor | None = None
        for k, batch in enumerate(batches):
            with (self.no_sync() if k < n - 1 else nullcontext()), self.autocast():
                loss = forward(batch).loss / n
            self.backward(loss)
            part = loss.detach().float()
            total = part if total is None else total + part
        if self.sync is not None:
            self.sync()
        grad_norm = self.clip()
        self.optimizer.step()
        self.observe(total, grad_norm)
        return total

    def _eager(self, batches: list[Batch], plain: bool = False) -> Tensor:
        if self.captures:  # the gradients may be a graph's buffers: an eager backward must not add to them
            self.optimizer.zero_grad(set_to_none=True)
        loss = self._body(batches, plain)
        self.optimizer.zero_grad(set_to_none=True)
        self.eager_steps += 1
        return loss

    # -- public ---------------------------------------------------------------------------------------
    def invalidate(self) -> None:
        """Drop the graph (the model's tensors it reads were replaced, e.g. by a mask update; or the run ends:
        NCCL cannot destroy a communicator while a graph that captured its collectives is alive)."""
        self._graph = None
        self._static_loss = None
        self._since_invalidate = 0
        self._read_at_capture = None
        self._grow, self._grow_warm = None, False

    def _remember_reads(self) -> None:
        self._read_at_capture = None if self.reads is None else [(t, t.data_ptr()) for t in self.reads()]

    def topology_changed(self, update: bool = True) -> None:
        """After a mask update: keep the graph if every tensor in ``reads()`` is the very tensor the graph was
        captured with, at the same address (the update wrote in place, so a replay reads the new topology);
        otherwise :meth:`invalidate`. The tensors are held from the capture on, so an identity cannot be a
        freed tensor's reused id. ``update=False``: start-up work, not a mask update (not counted as one)."""
        kept = self._read_at_capture
        if (self._graph is not None or self._grow is not None) and kept is not None:
            now = list(self.reads())
            if len(now) == len(kept) and all(t is k and t.data_ptr() == ptr for t, (k, ptr) in zip(now, kept)):
                self.graphs_kept += update
                return
        self.invalidate()

    def __call__(self, batches: list[Batch], *, eager: bool = False, plain: bool = False,
                 grow: bool = False) -> Tensor:
        """Run one optimizer step on ``batches`` (already on the device). ``eager=True`` forces the eager path
        for this step; ``plain=True`` also runs the uncompiled model (a step whose layers hand gradients to
        Python hooks: through a compiled forward they broke its graph and recompiled it); ``grow=True``: the
        sparse layers capture their dense gradient (RigL's step before an update, :meth:`_grow_step`)."""
        if grow and not eager:
            return self._grow_step(batches)
        if plain or grow:
            return self._eager(batches, plain=True)
        if not self.graph_mode:
            return self._eager(batches)
        if eager or not self._fits(batches):
            return self._eager(batches)
        if self._graph is not None:
            self._load(batches)
            self._graph.replay()
            self.replays += 1
            return self._static_loss
        if self._since_invalidate < self.warmup:
            # eager steps before a capture build every lazily made launch plan and tuned choice; the first ones
            # of the process run on a side stream, as capture needs
            self._since_invalidate += 1
            if self.captures == 0:
                self._side = self._side or torch.cuda.Stream()
                self._side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self._side):
                    loss = self._eager(batches)
                torch.cuda.current_stream().wait_stream(self._side)
                return loss
            return self._eager(batches)
        return self._capture(batches)

    def _grow_step(self, batches: list[Batch]) -> Tensor:
        """A step whose layers capture their dense gradient. Where each of them takes a probe
        (``kernels/blocksparse/probe.py``) it runs the compiled model and, in a graph run, is replayed from a
        second graph that shares the step graph's memory pool (the two never run at once and hand nothing to
        each other through it; :meth:`_capture_grow`): the first such step after a capture runs eagerly, the
        next is captured. Else (a layer fills ``dense_grad`` by a Python hook) the uncompiled model runs
        eagerly."""
        probes = self.probes() if self.probes is not None else None
        if not probes:
            return self._eager(batches, plain=True)
        for p in probes:
            p.grad = None
        if not (self.graph_mode and self._graph is not None and self._fits(batches)) or self._grow_failed:
            return self._eager(batches)
        if self._grow is not None:
            graph, loss, grads = self._grow
            self._load(batches)
            graph.replay()
            self.replays += 1
            for p, g in grads:   # the replay wrote the same tensors; the caller drops them after reading
                p.grad = g
            return loss
        if not self._grow_warm:  # builds what the capture variant makes lazily (its compiled graph, plans)
            self._grow_warm = True
            return self._eager(batches)
        loss = self._capture_grow(batches, probes)
        return self._eager(batches) if loss is None else loss

    def prepare_grow(self) -> bool:
        """Start-up work of a RigL run, called with the layers armed: compile the grow step's variant (one forward
        and backward on the captured inputs; the gradients are dropped, nothing is applied) and capture its graph
        without replaying it, so that the first grow step replays. False where grow steps cannot be replayed."""
        probes = self.probes() if self.probes is not None else None
        if not (probes and self.graph_mode and self._graph is not None and self._grow is None
                and not self._grow_failed):
            return False
        self._drop_step_graph()   # its pool is not held while the grow variant compiles and warms up
        with self.autocast():
            loss = self.forward(self._static[0]).loss
        self.backward(loss)
        del loss   # its autograd graph holds the leaves' gradient accumulators: alive, they break the capture
        self._drop_grads(probes)   # the capture's own drop then frees the warm-up's cached blocks
        self._grow_warm = True
        return self._capture_grow(None, probes) is not None

    def _capture_grow(self, batches: list[Batch] | None, probes: list[Tensor]) -> Tensor | None:
        """Capture the grow step (the step graph captured again after it, in its pool) and replay it on
        ``batches``; ``None``: capture only (start-up). Returns its loss, or None where the capture failed
        (nothing ran; later grow steps run eagerly)."""
        import time

        t0 = time.perf_counter()
        if batches is not None:
            self._load(batches)
        # captured first, in a pool of its own; the step graph is dropped and captured again in that pool by the
        # next step: the grow variant's allocations are coarser (a fused projection's output in one piece, where
        # the step writes three), so the step's fit in the blocks it leaves. The other way round the pool grew by
        # 2.4 GB at BERT-base (new segments for what the step's pieces had split up).
        self._drop_step_graph()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                loss = self._body(self._static)
        except Exception as e:   # nothing ran
            torch.cuda.synchronize()
            self._drop_grads(probes)
            self._grow_failed = True
            print(f"warning: RigL's grow step could not be captured ({type(e).__name__}: {e}); it runs "
                  f"eagerly".splitlines()[0], flush=True)
            return None
        self._grow = graph, loss, [(p, p.grad) for p in probes]
        self._remember_reads()
        self.grow_captures += 1
        if batches is None:     # start-up: the gradients the capture allocated stay the graph's, unread
            self._drop_grads(probes)
        else:
            graph.replay()
            self.replays += 1
        self.capture_s += time.perf_counter() - t0
        return loss

    def _drop_step_graph(self) -> None:
        """Drop the step graph, its gradients and its pool's cached blocks (the next ordinary step captures it
        again, in the grow graph's pool: :meth:`_capture_grow`)."""
        torch.cuda.synchronize()   # nothing of the step graph still runs when it is dropped
        self._graph, self._static_loss, self._read_at_capture = None, None, None
        self._since_invalidate = self.warmup
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()

    def _drop_grads(self, probes: list[Tensor]) -> None:
        """Drop the parameters' and the probes' gradients."""
        self.optimizer.zero_grad(set_to_none=True)
        for p in probes:
            p.grad = None

    def _load(self, batches: list[Batch]) -> None:
        """Copy ``batches`` into the captured graphs' static inputs."""
        for dst, src in zip(self._static, batches, strict=True):
            for k, t in src.items():
                dst[k].copy_(t, non_blocking=True)

    def _fits(self, batches: list[Batch]) -> bool:
        """Whether ``batches`` have the captured shapes (or nothing is captured yet)."""
        if self._static is None:
            return all(torch.is_tensor(t) and t.is_cuda for b in batches for t in b.values())
        if len(batches) != len(self._static):
            return False
        return all(b.keys() == s.keys() and all(b[k].shape == s[k].shape and b[k].dtype == s[k].dtype for k in b)
                   for b, s in zip(batches, self._static, strict=True))

    def _capture(self, batches: list[Batch]) -> Tensor:
        import time

        t0 = time.perf_counter()
        if self._static is None:
            self._static = [{k: t.clone() for k, t in b.items()} for b in batches]
        else:
            self._load(batches)
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            # a private pool per capture (the dropped graph's pool is freed), or the grow graph's where one is kept
            # (_capture_grow); errors only for this thread's calls:
            # the batch threads pin memory meanwhile, which in the default global mode broke a capture at random
            # ("operation failed due to a previous error during capture", 1 of 5 graph runs on an H100)
            with torch.cuda.graph(graph, pool=None if self._grow is None else self._grow[0].pool(),
                                  capture_error_mode="thread_local"):
                loss = self._body(self._static)
        except Exception as e:
            torch.cuda.synchronize()
            self.optimizer.zero_grad(set_to_none=True)
            raise GraphCaptureError(f"the training step could not be captured into a CUDA graph: "
                                    f"{type(e).__name__}: {e}".splitlines()[0]) from e
        self._graph, self._static_loss = graph, loss
        self._remember_reads()
        self.captures += 1
        graph.replay()       # capture records the step without running it
        self.replays += 1
        self.capture_s += time.perf_counter() - t0
        return loss

    def stats(self) -> dict[str, float | int]:
        return {"graph_captures": self.captures, "graph_replays": self.replays, "eager_steps": self.eager_steps,
                "graphs_kept": self.graphs_kept, "grow_captures": self.grow_captures,
                "capture_s": round(self.capture_s, 3)}


_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]


def build_train_step(model, compiled, optimizer, raw_opt, accelerator, args: TrainArgs, guard: Guard,
                     use_graph: bool, step_sync: bool, compiled_now: Callable[[], bool]) -> TrainStep:
    """The run's :class:`TrainStep`. DDP or one process without graphs: Accelerate's backward, no-sync, clip and
    autocast. Graph (or ``step_sync``): plain torch calls that capture, autocast without its cast cache, the
    optimizer made capturable (graph runs) and, with several processes, the step's own gradient all-reduce after
    the last micro-batch (``step_sync``: the model is not wrapped in DDP). ``compiled_now()`` says whether the
    forward may use the compiled module yet."""
    def forward(batch):
        fwd = compiled if compiled is not None and compiled_now() else model
        return fwd(**batch)

    if not (use_graph or step_sync):
        make_eager_safe(raw_opt)

        def clip():
            if not args.clip_grad_norm:
                return None
            return accelerator.clip_grad_norm_(model.parameters(), args.clip_grad_norm)

        return TrainStep(forward, accelerator.backward, optimizer, clip=clip, observe=guard.observe,
                         autocast=accelerator.autocast, no_sync=lambda: accelerator.no_sync(model),
                         plain_forward=lambda batch: model(**batch), probes=lambda: probes_of(model))
    if use_graph:
        make_graph_safe(raw_opt, accelerator.device)
    else:
        make_eager_safe(raw_opt)
    def params():   # the order of accelerate's clip (the same norm); read again after a dense phase's new layers
        return [p for p in model.parameters() if p.requires_grad]

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.mixed_precision)
    sync = GradSync(params, accelerator.num_processes) if step_sync else None

    def clip():
        if not args.clip_grad_norm:
            return None
        return torch.nn.utils.clip_grad_norm_(params(), args.clip_grad_norm, foreach=use_graph or None)

    def autocast():
        # Attention: the fused kernels named first, the fp32 math path last. (The graph steps' fall to the math
        # path that was measured came from an all-True mask transformers builds under capture; the model no
        # longer passes one, models/mlm.py. This order was in place for every graph-mode number since.)
        stack = ExitStack()
        stack.enter_context(torch.autocast(accelerator.device.type, dtype=dtype or torch.float32,
                                           enabled=dtype is not None, cache_enabled=False))
        stack.enter_context(sdpa_kernel(_ATTENTION, set_priority=True))
        return stack

    # a compiled forward compiles on its first call, which must not be a capture: the process's first step
    # runs the plain model (it tunes the kernels), the second the compiled one, the third is captured
    def reads():   # what the captured step reads besides the batch (a mask update may rewrite it in place)
        return [*model.parameters(), *model.buffers(),
                *(v for state in raw_opt.state.values() for v in state.values() if torch.is_tensor(v))]

    return TrainStep(forward, lambda loss: loss.backward(), raw_opt, clip=clip, observe=guard.observe,
                     autocast=autocast, sync=sync, graph=use_graph, warmup=2 if compiled is not None else 1,
                     plain_forward=lambda batch: model(**batch), reads=reads, probes=lambda: probes_of(model))


def probes_of(model: torch.nn.Module) -> list[Tensor] | None:
    """The dense-gradient probes of the layers that capture their dense gradient now; None where one of them
    has none (its Python hook runs in an uncompiled eager step only) or none captures."""
    layers = [m for m in model.modules() if getattr(m, "capture_dense_grad", False)]
    probes = [getattr(m, "grad_probe", None) for m in layers]
    return probes if layers and all(p is not None for p in probes) else None
