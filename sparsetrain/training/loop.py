"""The training loop: Accelerate, a thin sparsity hook, metrics, checkpoints. It knows nothing about RigL.

    for each optimizer step:
        grad_accum micro-batches: forward, backward (no gradient sync until the last)
        clip, optimizer.step(), lr.step()
        record = scheduler.step(step)          # the only sparsity call on the hot path

:class:`Trainer` holds one run; each of its methods is one part of it, found by its name:

=====================  ==========================================================================================
``setup``              how the run starts (:func:`~sparsetrain.training.resume.decide_start`), model and masks,
                       data, Accelerate, optimizer, the step; ``_restore`` continues a checkpoint
``fit``                the loop: ``train_step``, then ``check_finite``, ``update_sparsity``, ``log_window``,
                       ``evaluate``, ``save_checkpoint`` and ``stop_on_signal`` at the steps that call for them
``finish``             the final masks check, the summary (summary.py), the plot
``close`` / ``end``    trackers and graphs; then Accelerate's process group and state
=====================  ==========================================================================================

Several processes: see processes.py (DDP, or a CUDA-graph step that averages gradients itself, grad_sync.py).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from sparsetrain import flops as flop_count
from sparsetrain.kernels import set_kernel_options
from sparsetrain.training import checkpoint as ckpt
from sparsetrain.training import metrics, resume
from sparsetrain.training.batches import Batches, DeviceFeed, Prefetcher, count_items
from sparsetrain.training.evaluation import evaluate
from sparsetrain.training.guard import (
    Guard,
    Interrupted,
    NonFiniteLoss,
    RunStopped,
    WriteFailed,
    mask_update_due,
)
from sparsetrain.training.processes import end_accelerator, start_accelerator, wrap
from sparsetrain.training.ranks import compare_masks, mask_signature
from sparsetrain.training.report import RunReport
from sparsetrain.training.resume import RunDirError
from sparsetrain.training.run_lock import RunDirLock
from sparsetrain.training.setup import (
    RunSpec,
    TrainArgs,
    apply_optimizer_settings,
    build_model_and_data,
    compile_settings,
    lr_scheduler,
    plan_kernel_dispatch,
)
from sparsetrain.training.sharded import whole
from sparsetrain.training.step import GraphCaptureError, build_train_step, graph_mode
from sparsetrain.training.summary import run_summary
from sparsetrain.training.window import Window

__all__ = ["Batches", "RunDirError", "RunStopped", "Trainer", "mask_signature", "train"]

# Tests only: several processes sync gradients in the step (as CUDA-graph runs do) in an eager run, which is
# how the gloo CPU tests check that path against DDP.
_STEP_SYNC_WITHOUT_GRAPH = False


def train(spec: RunSpec, run_dir: Path) -> dict[str, Any]:
    """Run one training job described by ``spec`` into ``run_dir``; return the summary.

    The run holds ``run_dir`` (run_lock.py), its kernel options (``spec.train_args.kernels``) and its compile
    settings (:func:`~sparsetrain.training.setup.compile_settings`) for the whole run, set once here and released
    when it ends.
    """
    previous = set_kernel_options(spec.train_args.kernels)
    run = Trainer(spec, Path(run_dir))
    try:
        # the main process holds the run dir; the compile settings hold for the whole run
        with RunDirLock(run.run_dir, enabled=os.environ.get("RANK", "0") == "0"), compile_settings(spec.train_args):
            run.setup()
            summary = run.fit()
    except RunStopped:
        run.end()
        raise
    finally:
        set_kernel_options(previous)
    run.end()
    return summary


class Trainer:
    """One training run of ``spec`` in ``run_dir``: ``setup()``, then ``fit()`` returns the summary, then ``end()``.

    The run's position is ``step`` (optimizer steps), ``micro`` (micro-batches read), ``train_flops`` and
    ``elapsed`` (seconds of training, start-up included); checkpoints store them and :meth:`_restore` reads them.
    """

    def __init__(self, spec: RunSpec, run_dir: Path) -> None:
        self.spec, self.run_dir = spec, run_dir
        self.args: TrainArgs = spec.train_args
        self.scheduler = spec.scheduler
        self.ckpt_root = run_dir / "checkpoints"
        self.accelerator, self._closed = None, False
        self.step, self.micro, self.train_flops, self.elapsed = 0, 0, 0.0, 0.0   # the run's position
        self.window: Window | None = None        # the logging window (window.py)
        self.hook_time = self.step_time = 0.0   # the sparsity hook's share of the steps without an update
        self.wandb_id, self.last_eval = None, None   # the tracker run a resumed run continues

    # ---- setup -------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Build the run, in an order that writes nothing until every check has passed."""
        from accelerate.utils import set_seed

        logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-save INFO lines drown the progress bar
        args = self.args
        # how the run starts (fresh, or which checkpoint), decided before anything is written
        self.plan = resume.decide_start(args.resume, self.run_dir, args.init_from, self.scheduler, self.spec.config)
        # model and sparsity (cheap; validates the structure before any data is read)
        set_seed(args.seed)
        self.model, self.data = build_model_and_data(self.spec, self.plan.init_path, resume.INIT_KEY)
        self._setup_accelerator()
        if self.main:
            resume.prepare_run_dir(self.run_dir, self.plan, self.spec.config)
            tokenizer = getattr(self.data, "tokenizer", None)
            if tokenizer is not None and not (self.run_dir / "tokenizer").exists():
                tokenizer.save_pretrained(str(self.run_dir / "tokenizer"))  # export reads it: the cache may go
        self._setup_optimizer()
        self._setup_counting()
        if self.plan.state is not None:
            self._restore()
        self._setup_logging()
        self._setup_step()

    def _setup_accelerator(self) -> None:
        """Accelerate, FSDP's refusals, the resume position in the data and the batch streams (checked against
        both sets before the run dir is touched)."""
        args = self.args
        self.cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
        self.accelerator = acc = start_accelerator(args.mixed_precision, self.cpu, args.wandb, self.run_dir,
                                                   self.model)
        self.main = acc.is_main_process
        if self.plan.state is not None:   # another process count: the same global batch, same sample, or refused
            self.resume_micro, note = resume.data_position(self.plan.path, self.plan.state, acc.num_processes,
                                                    args.batch_size, args.grad_accum, len(self.data.train))
            self.plan.notes += [note] if note else []
        data = self.data
        self.batches = Batches(data.train, data.collator, args.batch_size, acc.num_processes, acc.process_index,
                               args.seed)
        self.eval_batches = Batches(data.eval, data.collator, args.batch_size, acc.num_processes,
                                    acc.process_index, args.seed + 1,
                                    what="held-out set (trainer.eval_every)") if args.eval_every else None

    def _setup_optimizer(self) -> None:
        """Optimizer, LR schedule, whether steps replay a CUDA graph, Accelerate's wrapping, the scheduler."""
        from accelerate.utils import DistributedType

        args, acc, model = self.args, self.accelerator, self.model
        optimizer = self.spec.build_optimizer(model)
        self.lr_sched = lr_scheduler(optimizer, args)
        self.use_graph = graph_mode(
            args.cuda_graph, acc.device.type == "cuda", acc.num_processes, args.mixed_precision,
            args.compile_mode if args.compile else None,
            optimizer_capturable="capturable" in optimizer.param_groups[0],
            sharded=acc.distributed_type == DistributedType.FSDP,
            running_stats=any(getattr(m, "track_running_stats", False) for m in model.modules()))
        self.step_sync = acc.num_processes > 1 and (self.use_graph or _STEP_SYNC_WITHOUT_GRAPH)
        self.model, self.optimizer = model, optimizer = wrap(acc, model, optimizer, self.step_sync, self.scheduler)
        self.inner = acc.unwrap_model(model)
        self.raw_opt = getattr(optimizer, "optimizer", optimizer)
        self.scheduler.attach(self.inner, self.raw_opt, total_steps=args.max_steps)

    def _setup_counting(self) -> None:
        """FLOPs per step, the 2:4 dispatch decisions, whether mask updates need the dense gradient."""
        self.global_batch = self.args.batch_size * self.args.grad_accum * self.accelerator.num_processes
        self.seq_len, self.image_size = getattr(self.data, "seq_len", None), getattr(self.data, "image_size", None)
        self.flops = self.flop_report()
        self.dispatch = plan_kernel_dispatch(self.inner, tokens=self.args.batch_size * self.flops.seq_tokens,
                                             cpu=self.cpu)
        self.needs_grad = bool(getattr(getattr(self.scheduler, "policy", None), "needs_grad", False))
        self.window = Window(self.accelerator.device, track_memory=torch.cuda.is_available() and not self.cpu)

    def flop_report(self) -> flop_count.FlopReport:
        """FLOPs of one step of the global batch at the masks' current densities."""
        return flop_count.count_step_flops(self.inner, batch_size=self.global_batch, seq_len=self.seq_len,
                                           image_size=self.image_size,
                                           predictions_per_seq=getattr(self.data, "predictions_per_seq", None))

    def _restore(self) -> None:
        """Continue the checkpoint the plan chose: masks, weights, optimizer, LR schedule, the run's position."""
        state, path = self.plan.state, self.plan.path
        if self.scheduler.sparse:
            self.scheduler.load_state_dict(state["sparsity"])
        fresh = [{k: v for k, v in group.items() if k != "params"} for group in self.raw_opt.param_groups]
        ckpt.load_checkpoint(self.accelerator, self.model, self.optimizer, path, state.get("processes", 1))
        self.lr_sched.load_state_dict(state["lr_scheduler"])
        if self.plan.applied:   # what the user changed on purpose (decided and said in resume.changed_settings)
            apply_optimizer_settings(self.raw_opt, self.lr_sched, fresh, self.plan.applied)
        self.step, self.micro = state["step"], self.resume_micro
        self.train_flops, self.elapsed = state["train_flops"], state["elapsed_s"]
        self.window.restore(state["window"], state.get("win_loss"))
        if path.resolve().parent == self.ckpt_root.resolve():   # the same run continues its tracker run
            self.wandb_id = state.get("wandb_run_id")
        self.flops = self.flop_report()
        if self.main:
            metrics.MetricsLogger.truncate_after(self.run_dir, self.step)
            print(f"resumed from {path} at step {self.step}", flush=True)

    def _setup_logging(self) -> None:
        """The run's report (metrics file, tracker, progress bar); the dispatch rows; the evaluation logged."""
        self.report = RunReport(self.run_dir, self.accelerator, self.main, self.args, self.spec.config, self.step,
                                self.wandb_id)
        for rec in self.dispatch:  # shape-aware 2:4 vs dense decisions, one row per layer
            self.log({"step": self.step, "event": "dispatch", **rec})
        # a resumed run reports the evaluation it already logged until it evaluates again (resuming a finished
        # run rewrote its summary with no final_eval_loss)
        self.last_eval = metrics.last_eval(metrics.read_metrics(self.run_dir), self.step) if self.step else None

    def _setup_step(self) -> None:
        """torch.compile (``trainer.compile``), the guard and the run's :class:`TrainStep`.

        The first step of this process runs eagerly: it tunes the sparse kernels and builds their metadata outside
        any CUDA-graph memory pool (needed by compile_mode=reduce-overhead). Evaluation and checkpoints use the
        uncompiled module (same parameters)."""
        args, acc = self.args, self.accelerator
        compiled = torch.compile(self.model, mode=args.compile_mode) if args.compile else None
        if compiled is not None and self.main:
            print("trainer.compile: the first compiled step builds the model's kernels (BERT-base on an H100: about "
                  "a minute); trainer.compile=false skips it", flush=True)
        self.first_step = self.rebuilt_at = self.step
        self.guard = Guard(acc.device, acc.num_processes, start_step=self.step)
        self.run_step = build_train_step(self.model, compiled, self.optimizer, self.raw_opt, acc, args, self.guard,
                                         self.use_graph, self.step_sync, lambda: self.step > self.first_step)

    # ---- the loop ----------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train from ``step`` to ``trainer.max_steps``, then save the last checkpoint; return the summary."""
        args = self.args
        self.model.train()
        self.rate_key = "tokens_per_s" if self.seq_len else "samples_per_s"
        self.window.start_loop()
        try:
            # trainer.num_workers threads collate (and, for graph steps, pin) the next batches while a step runs
            with self.guard, Prefetcher(self.batches, self.micro, args.num_workers, pin=self.use_graph) as host:
                feed = DeviceFeed(host, self.accelerator.device, ahead=args.copy_ahead and self.use_graph)
                while self.step < args.max_steps:
                    self._one_step(feed)
                self.save_checkpoint(self.step)
        except RunStopped:
            self.close()
            raise
        return self.finish()

    def _one_step(self, feed: DeviceFeed) -> None:
        """One optimizer step and what the step count calls for after it."""
        t0 = time.perf_counter()
        loss, items = self.train_step(feed)
        gated = self.gated_update()
        stop = self.check_finite() if not gated and self.sync_point(self.step) else None   # before an update runs
        record = self.update_sparsity()
        self.window.add(loss, items * self.accelerator.num_processes)
        dt = time.perf_counter() - t0
        self.elapsed += dt
        self.window.add_time(dt)
        if record is None:
            self.step_time += dt
        else:
            ranks = compare_masks(self.inner, self.accelerator.num_processes)  # several processes: one all-gather
            row = {"step": self.step, **record, "density": self.scheduler.density, **ranks.row}
            self.guard.hold(row) if gated else self.log(row)   # gated: logged once the guard's flag is read
            ranks.raise_if_diverged(self.step)             # before the next optimizer step or checkpoint
        args, step = self.args, self.step
        if step % args.log_every == 0 or step == args.max_steps:
            self.log_window()
        if args.eval_every and (step % args.eval_every == 0 or step == args.max_steps):
            self.last_eval = self.evaluate()
            self.log({"step": step, **self.last_eval, "train_flops": self.train_flops, "elapsed_s": self.elapsed})
        if args.checkpoint_every and step % args.checkpoint_every == 0 and step < args.max_steps:
            self.save_checkpoint(step)
        if self.accelerator.num_processes == 1:
            stop = self.guard.signal            # one process: act on a signal after this very step
        if stop and step < args.max_steps:
            self.stop_on_signal(stop)

    def train_step(self, feed: DeviceFeed) -> tuple[torch.Tensor, int]:
        """Read ``grad_accum`` micro-batches and run one optimizer step and the LR schedule's; return the step's
        loss (on the device) and the items (tokens or samples) this process read."""
        micro_batches, items = [], 0
        for _ in range(self.args.grad_accum):
            batch = feed.get(self.micro)  # on the device (pinned by the feed for graph steps)
            self.micro += 1
            n_items, self.rate_key = count_items(batch)
            items += n_items
            micro_batches.append(batch)
        # RigL's grow step: the layers capture their dense gradient (TrainStep._grow_step)
        grow = self.needs_grad and mask_update_due(self.scheduler, self.step + 1)
        try:
            loss = self.run_step(micro_batches, grow=grow)
        except GraphCaptureError as e:
            if self.args.cuda_graph is True:
                raise ValueError(f"trainer.cuda_graph: is true but {e}; set trainer.cuda_graph=false or auto") from e
            if self.main:
                print(f"warning: {e}; the run goes on with eager steps", flush=True)
            self.run_step.graph_mode = False
            loss = self.run_step(micro_batches, eager=True)
        self.lr_sched.step()
        self.step += 1
        return loss, items

    def gated_update(self) -> bool:
        """Whether this step's mask update reads the guard's flag on the device (one process, a step that is no
        sync point but for the update, a scheduler that can): then the loop does not read it before."""
        at, sched = self.step, self.scheduler
        return (self.accelerator.num_processes == 1 and mask_update_due(sched, at)
                and not self.sync_point(at, gated=True) and sched.gate_update(at, self.guard.all_finite()))

    def sync_point(self, at: int, gated: bool = False) -> bool:
        """Steps that synchronise with the device anyway; the guard reads its flags there (see guard.py). ``gated``:
        but for a mask update that may read the flag on the device."""
        args = self.args
        return (at % args.log_every == 0 or at == args.max_steps or (not gated and mask_update_due(self.scheduler, at))
                or bool(args.eval_every and at % args.eval_every == 0)
                or bool(args.checkpoint_every and at % args.checkpoint_every == 0))

    def check_finite(self) -> int | None:
        """Read the guard's flags: raise :class:`NonFiniteLoss` for a non-finite loss or gradient norm since the
        last sync point; return a stop signal the processes agreed on (or None)."""
        first_bad, stop = self.guard.poll()
        for row in self.guard.release(first_bad):   # mask updates that read the flag on the device
            self.log(row)
        if first_bad is not None:
            raise NonFiniteLoss(self.stop_message(f"non-finite loss or gradient norm at step {first_bad} (seen at "
                                                  f"step {self.step}); nothing after it was saved"))
        return stop

    def update_sparsity(self) -> dict | None:
        """The sparsity hook after the optimizer step; counts the step's FLOPs (an update step's at the masks it
        ran with). Returns the scheduler's record of a mask update, or None."""
        th = time.perf_counter()
        record = self.scheduler.step(self.step)
        dt_hook = time.perf_counter() - th
        if record is not None:
            self.run_step.topology_changed()                     # kept only if written in place
            self.train_flops += flop_count.step_flops(self.flops, is_update_step=True, dense_grad=self.needs_grad)
            if not (record.get("event") == "mask_update" and record.get("pruned", -1) == record.get("regrown")):
                self.flops = self.flop_report()                 # density changed (prune and regrow keep it)
            self.rebuilt_at = self.step if record.get("event") == "phase_switch" else self.rebuilt_at
        else:
            self.train_flops += flop_count.step_flops(self.flops, is_update_step=False, dense_grad=False)
            self.hook_time += dt_hook
            if self.step == self.rebuilt_at + self.run_step.warmup + 1 and self.scheduler.prepare_updates(
                    grow=self.run_step.prepare_grow):
                self.run_step.topology_changed(update=False)   # start-up work: the update's graph, captured before the first
        return record

    def log(self, row: dict) -> None:
        self.report.log(row)   # one row to metrics.jsonl (main process) and the tracker

    def log_window(self) -> None:
        """The training row of the window that ends at this step: mean loss, rate, memory; then a new window."""
        step, window = self.step, self.window
        built = self.rebuilt_at   # the process's first step or the dense switch: tuning, compile, first capture
        startup = built < step and step - window.steps <= built + self.run_step.warmup
        loss, rate, memory, wait = window.close(self._mean)
        self.elapsed += wait
        row = {"step": step, "loss": loss, "lr": self.lr_sched.get_last_lr()[0], "train_flops": self.train_flops,
               self.rate_key: rate, "density": self.scheduler.density, "elapsed_s": self.elapsed, **memory}
        if startup:
            row["startup"] = True
        self.log(row)
        window.reset(startup)
        self.report.progress.update(step, loss=loss, lr=row["lr"], **{self.rate_key: rate})

    def _mean(self, value: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(value, reduction="mean")

    def evaluate(self) -> dict[str, float]:
        """Mean held-out loss (and accuracy for images) over ``trainer.eval_batches`` batches (evaluation.py)."""
        return evaluate(self.model, self.accelerator, self.eval_batches, self.args.eval_batches)

    # ---- checkpoints and stopping ------------------------------------------------------------------------
    def save_checkpoint(self, at: int) -> Path:
        """Write the checkpoint of step ``at`` (:func:`~sparsetrain.training.checkpoint.save_checkpoint`), after
        checking that every weight is finite."""
        # the loss check (guard.py) runs before the optimizer step; an update that overflowed the weights is
        # caught here: reading every weight once costs little next to writing them all
        if not bool(torch.stack([torch.isfinite(whole(p)).all() for p in self.inner.parameters()]).all()):
            raise NonFiniteLoss(self.stop_message(f"non-finite weights at step {at}; nothing was saved"))
        # the window's device sum is stored as it is (not folded into a float): a resumed run adds the same
        # float32 values in the same order as an uninterrupted one
        window, win_loss = self.window.state(self._mean)
        extra = {"lr_scheduler": self.lr_sched.state_dict(), "micro_batches": self.micro,
                 "train_flops": self.train_flops, "elapsed_s": self.elapsed, "window": window,
                 "args": asdict(self.args), "config": self.spec.config, "win_loss": win_loss,
                 "wandb_run_id": self.report.wandb_id}
        try:
            return ckpt.save_checkpoint(self.accelerator, self.model, self.optimizer, self.ckpt_root, at,
                                        self.scheduler, extra, self.args.keep_checkpoints)
        except ckpt.CheckpointWriteError as e:   # a full disk, say: one line, and how to go on
            fix = resume.DISK_FULL if e.disk_full else resume.NOT_WRITTEN
            raise WriteFailed(resume.continue_message(str(e), self.run_dir, self.args.overrides, self.plan.path,
                                                      fix=fix)) from None

    def stop_on_signal(self, signum: int) -> None:
        """SIGTERM / SIGINT: write a checkpoint of this step and stop with the command that continues the run."""
        import signal

        self.check_finite()   # (one process: rows of gated updates are held until the flag is read)
        path = self.save_checkpoint(self.step)
        again = resume.resume_command(self.run_dir, self.args.overrides)
        raise Interrupted(f"stopped by {signal.Signals(signum).name} after step {self.step}; checkpoint {path} "
                          f"written; continue with {again}", signum)

    def stop_message(self, what: str) -> str:
        """One line for a non-finite stop: what happened and how to go on from the last good checkpoint."""
        return resume.continue_message(what, self.run_dir, self.args.overrides, self.plan.path)

    # ---- the end -----------------------------------------------------------------------------------------
    def finish(self) -> dict[str, Any]:
        """After the last step: check the final masks agree across processes, write the summary, plot."""
        self.report.stop_writing()
        final_ranks = compare_masks(self.inner, self.accelerator.num_processes)  # identical masks: None alone
        final_ranks.raise_if_diverged()
        summary = run_summary(self, final_ranks.identical)
        self.report.write_summary(summary)
        self.close()
        return summary

    def close(self) -> None:
        """The report (metrics file, progress bar, tracker); the step's graphs, before the process group goes
        (NCCL waits for graphs holding its ops)."""
        self.report.close()
        self.run_step.invalidate()
        self._closed = True

    def end(self) -> None:
        """After :meth:`close`: drop the run's model, optimizer and step, then end Accelerate (processes.py).
        Nothing to do for a run that failed before it trained."""
        if self.accelerator is None or not self._closed:
            return
        for name in ("model", "inner", "optimizer", "raw_opt", "lr_sched", "run_step", "guard", "batches",
                     "eval_batches", "data"):
            self.__dict__.pop(name, None)
        end_accelerator(self.accelerator)

