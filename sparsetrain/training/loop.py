"""The training loop: Accelerate, a thin sparsity hook, metrics, checkpoints. It knows nothing about RigL.

    for each optimizer step:
        grad_accum micro-batches: forward, backward (no gradient sync until the last)
        clip, optimizer.step(), lr.step()
        record = scheduler.step(step)          # the only sparsity call on the hot path

Several processes: DDP averages the gradients during the last backward, except in a CUDA-graph run, whose step
averages them itself (grad_sync.py) so that the whole step, the all-reduce included, is one graph.
"""
from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from sparsetrain import flops as flop_count
from sparsetrain.kernels import set_kernel_options
from sparsetrain.kernels.blocksparse import tuner as blocksparse_tuner
from sparsetrain.training import checkpoint as ckpt
from sparsetrain.training.batches import Batches, Prefetcher
from sparsetrain.training.grad_sync import GradSync, broadcast_from_rank0
from sparsetrain.training.guard import Guard, Interrupted, NonFiniteLoss, RunStopped, mask_update_due
from sparsetrain.training.metrics import (
    METRICS_FILE,
    MetricsLogger,
    Progress,
    format_summary,
    read_metrics,
    train_seconds,
    window_rate,
    write_summary,
)
from sparsetrain.training.plots import plot_run
from sparsetrain.training.ranks import compare_masks, mask_signature
from sparsetrain.training.resume import (
    INIT_KEY,
    RunDirError,
    StartPlan,
    check_same_shape,
    data_position,
    plan_start,
    resume_command,
)
from sparsetrain.training.setup import RunSpec, TrainArgs, lr_scheduler, plan_kernel_dispatch, sparsify_model
from sparsetrain.training.sharded import prepare_fsdp, whole
from sparsetrain.training.step import (
    GraphCaptureError,
    TrainStep,
    graph_mode,
    make_eager_safe,
    make_graph_safe,
)
from sparsetrain.training.tracking import end_tracking, init_tracking, log_tracking

__all__ = ["Batches", "RunDirError", "RunStopped", "mask_signature", "train"]

# Tests only: several processes sync gradients in the step (as CUDA-graph runs do) in an eager run, which is
# how the gloo CPU tests check that path against DDP.
_STEP_SYNC_WITHOUT_GRAPH = False


def _items_in(batch: dict[str, torch.Tensor]) -> tuple[int, str]:
    if "input_ids" in batch:
        return batch["input_ids"].numel(), "tokens_per_s"
    return len(next(iter(batch.values()))), "samples_per_s"


def _to(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def train(spec: RunSpec, run_dir: Path) -> dict[str, Any]:
    """Run one training job described by ``spec`` into ``run_dir``; return the summary.

    The run's kernel options (``spec.train_args.kernels``) are in force for the whole run, set once here and
    restored when it ends.
    """
    previous = set_kernel_options(spec.train_args.kernels)
    ended: list = []   # the run's Accelerator, handed back by a run that finished or stopped, for the teardown
    try:
        summary = _train(spec, Path(run_dir), ended)
    except RunStopped:
        if ended:
            _end(ended[0])
        raise
    finally:
        set_kernel_options(previous)
    if ended:
        _end(ended[0])
    return summary


def _end(accelerator) -> None:
    """The end of a run, once its step, model and optimizer are gone with ``_train``'s frame: what still refers to
    them goes too (accelerate's lists, reference cycles), so a DDP reducer is not torn down after its process
    group (gloo's was seen to hang there), then every rank meets, the process group goes, and accelerate's
    process-wide state with it."""
    import gc

    accelerator.free_memory()
    gc.collect()
    accelerator.wait_for_everyone()   # no rank tears the process group down while another still uses it
    accelerator.end_training()
    # accelerate keeps one process-wide state (mixed precision, the process group just destroyed): the next run in
    # this process (a Hydra sweep's next job, a test) starts its own, e.g. with another precision.
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _prepare_run_dir(run_dir: Path, plan: StartPlan, config: dict) -> None:
    """Main process, once every check passed: tidy the checkpoints, say how the run starts, save the config."""
    run_dir.mkdir(parents=True, exist_ok=True)
    root = run_dir / "checkpoints"
    for path, why in plan.skipped:
        print(f"warning: skipping damaged checkpoint ({why}); kept as {ckpt.set_aside(path).name}", flush=True)
    for name in ckpt.remove_partial(root):
        print(f"removed the partial checkpoint {root / name} (an interrupted write)", flush=True)
    if plan.replace_metrics:
        (run_dir / METRICS_FILE).unlink(missing_ok=True)
    for note in plan.notes:
        print(note, flush=True)
    from omegaconf import OmegaConf

    OmegaConf.save(OmegaConf.create(config), run_dir / "config.yaml")
    print(f"run directory: {run_dir}", flush=True)


def _train(spec: RunSpec, run_dir: Path, ended: list) -> dict[str, Any]:
    import logging

    from accelerate import Accelerator
    from accelerate.utils import DistributedType, set_seed

    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-save INFO lines drown the progress bar
    args: TrainArgs = spec.train_args
    scheduler = spec.scheduler
    ckpt_root = run_dir / "checkpoints"

    # -- 1. how the run starts (fresh, or which checkpoint), decided before anything is written -----
    plan = plan_start(args.resume, run_dir, args.init_from)
    resume_state = plan.state
    if resume_state is not None:
        ckpt.check_compatible(resume_state, plan.path, scheduler)
        check_same_shape(plan.path, resume_state, spec.config)
    if plan.init_state is not None:   # trainer.init_from: the same model and mask layout; the scheduler is ours
        ckpt.check_compatible(plan.init_state, plan.init_path, scheduler, key=INIT_KEY, same_scheduler=False)
        check_same_shape(plan.init_path, plan.init_state, spec.config, key=INIT_KEY)

    # -- 2. model and sparsity (cheap; validates the structure before any data is read) -----------
    set_seed(args.seed)
    model = spec.build_model()
    sparsify_model(model, scheduler, spec.sparsify_kwargs)
    if plan.init_path is not None:   # its weights and masks, before the optimizer exists (block: values resized)
        ckpt.load_model_state(model, plan.init_path, key=INIT_KEY)

    # -- 3. data: read before config.yaml is written, so that a data error leaves the run dir untouched -----
    data = spec.build_data()
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if hasattr(data, "vocab_size") and vocab is not None and data.vocab_size > vocab:
        raise ValueError(f"data.vocab_size: the tokenizer has {data.vocab_size} tokens, the model {vocab}")

    cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=cpu,
                              log_with="wandb" if args.wandb else None, project_dir=str(run_dir))
    main = accelerator.is_main_process
    prepare_fsdp(accelerator, model)   # FSDP: a setup the sparse layers cannot train under is refused here
    if resume_state is not None:  # another process count: the same global batch, from the same sample, or refused
        resume_micro, note = data_position(plan.path, resume_state, accelerator.num_processes, args.batch_size,
                                           args.grad_accum, len(data.train))
        plan.notes += [note] if note else []
    # the batch size against both sets, before the run dir is touched; the held-out set only where it is read
    batches = Batches(data.train, data.collator, args.batch_size, accelerator.num_processes,
                      accelerator.process_index, args.seed)
    eval_batches = Batches(data.eval, data.collator, args.batch_size, accelerator.num_processes,
                           accelerator.process_index, args.seed + 1,
                           what="held-out set (trainer.eval_every)") if args.eval_every else None
    if main:
        _prepare_run_dir(run_dir, plan, spec.config)
        tokenizer = getattr(data, "tokenizer", None)
        if tokenizer is not None and not (run_dir / "tokenizer").exists():
            tokenizer.save_pretrained(str(run_dir / "tokenizer"))  # export reads it: the data cache may be gone
    optimizer = spec.build_optimizer(model)
    lr_sched = lr_scheduler(optimizer, args)
    use_graph = graph_mode(args.cuda_graph, accelerator.device.type == "cuda", accelerator.num_processes,
                           args.mixed_precision, args.compile_mode if args.compile else None,
                           optimizer_capturable="capturable" in optimizer.param_groups[0],
                           sharded=accelerator.distributed_type == DistributedType.FSDP,
                           running_stats=any(getattr(m, "track_running_stats", False) for m in model.modules()))
    step_sync = accelerator.num_processes > 1 and (use_graph or _STEP_SYNC_WITHOUT_GRAPH)
    if step_sync:
        # DDP's reducer cannot be captured: the model is placed and given autocast as prepare() does, without
        # the DDP wrapper (accelerate calls that evaluation_mode), and starts from rank 0's weights as under DDP
        model = accelerator.prepare_model(model, evaluation_mode=True)
        optimizer = accelerator.prepare_optimizer(optimizer)
        broadcast_from_rank0(model)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    inner = accelerator.unwrap_model(model)
    raw_opt = getattr(optimizer, "optimizer", optimizer)
    scheduler.attach(inner, raw_opt, total_steps=args.max_steps)

    global_batch = args.batch_size * args.grad_accum * accelerator.num_processes
    seq_len = getattr(data, "seq_len", None)
    image_size = getattr(data, "image_size", None)

    def flop_report():
        return flop_count.count_step_flops(inner, batch_size=global_batch, seq_len=seq_len, image_size=image_size,
                                           predictions_per_seq=getattr(data, "predictions_per_seq", None))

    report = flop_report()
    dispatch = plan_kernel_dispatch(inner, tokens=args.batch_size * report.seq_tokens, cpu=cpu)
    needs_grad = bool(getattr(getattr(scheduler, "policy", None), "needs_grad", False))

    # -- 4. resume ------------------------------------------------------------------------------------
    step, micro, train_flops, elapsed = 0, 0, 0.0, 0.0
    window = {"loss": 0.0, "steps": 0, "items": 0, "time": 0.0}
    win_loss = torch.zeros((), device=accelerator.device)   # the window's loss, summed on device
    hook_time = step_time = 0.0
    wandb_id = None
    if resume_state is not None:
        if scheduler.sparse:
            scheduler.load_state_dict(resume_state["sparsity"])
        ckpt.load_checkpoint(accelerator, model, optimizer, plan.path, resume_state.get("processes", 1))
        lr_sched.load_state_dict(resume_state["lr_scheduler"])
        step, micro = resume_state["step"], resume_micro
        train_flops, elapsed = resume_state["train_flops"], resume_state["elapsed_s"]
        window = resume_state["window"]
        if torch.is_tensor(resume_state.get("win_loss")):
            win_loss = resume_state["win_loss"].to(accelerator.device)
        if plan.path.resolve().parent == ckpt_root.resolve():   # the same run continues its tracker run
            wandb_id = resume_state.get("wandb_run_id")
        report = flop_report()
        if main:
            MetricsLogger.truncate_after(run_dir, step)
            print(f"resumed from {plan.path} at step {step}", flush=True)
    logger = MetricsLogger(run_dir, is_main_process=main)
    if args.wandb:
        wandb_id = init_tracking(accelerator, args.wandb_project, str(run_dir), spec.config, mode=args.wandb_mode,
                                 name=args.wandb_name, enabled=True, run_id=wandb_id)
    progress = Progress(args.max_steps, initial=step, disable=not (args.progress and main))

    def log(row: dict) -> None:
        logger.log(row)
        if args.wandb:
            log_tracking(accelerator, row, row["step"])

    for rec in dispatch:  # shape-aware 2:4 vs dense decisions, one row per layer
        log({"step": step, "event": "dispatch", **rec})
    # torch.compile of the training forward (trainer.compile). The first step of this process runs eagerly:
    # it tunes the sparse kernels and builds their metadata outside any CUDA-graph memory pool (needed by
    # compile_mode=reduce-overhead). Evaluation and checkpoints use the uncompiled module (same parameters).
    compiled = torch.compile(model, mode=args.compile_mode) if args.compile else None
    if compiled is not None and main:
        print("trainer.compile: the first compiled step builds the model's kernels (BERT-base on an H100: about "
              "a minute); trainer.compile=false skips it", flush=True)
    first_step = step
    guard = Guard(accelerator.device, accelerator.num_processes, start_step=step)
    run_step = _step_runner(model, compiled, optimizer, raw_opt, accelerator, args, guard, use_graph, step_sync,
                            lambda: step > first_step)

    def evaluate() -> dict[str, float]:
        model.eval()
        total, correct, count, n = torch.zeros((), device=accelerator.device), 0, 0, 0
        with torch.no_grad():
            for b in range(min(args.eval_batches, eval_batches.per_epoch)):
                batch = _to(eval_batches.get(b), accelerator.device)
                with accelerator.autocast():
                    out = model(**batch)
                total += out.loss.float()
                n += 1
                if "pixel_values" in batch:
                    correct += int((out.logits.argmax(-1) == batch["labels"]).sum())
                    count += len(batch["labels"])
        model.train()
        loss = accelerator.reduce(total / max(n, 1), reduction="mean").item()
        row = {"eval_loss": loss}
        if count:
            acc = accelerator.reduce(torch.tensor(correct / count, device=accelerator.device), "mean").item()
            row["eval_accuracy"] = acc
        return row

    def save(at: int) -> Path:
        # the loss check (guard.py) runs before the optimizer step; an update that overflowed the weights is
        # caught here: reading every weight once costs little next to writing them all
        if not bool(torch.stack([torch.isfinite(whole(p)).all() for p in inner.parameters()]).all()):
            raise NonFiniteLoss(stopped(f"non-finite weights at step {at}; nothing was saved"))
        # the window's device sum is stored as it is (not folded into a float): a resumed run adds the same
        # float32 values in the same order as an uninterrupted one
        extra = {"lr_scheduler": lr_sched.state_dict(), "micro_batches": micro, "train_flops": train_flops,
                 "elapsed_s": elapsed, "window": dict(window), "args": asdict(args), "config": spec.config,
                 "win_loss": accelerator.reduce(win_loss.clone(), reduction="mean").cpu(),
                 "wandb_run_id": wandb_id}
        return ckpt.save_checkpoint(accelerator, model, optimizer, ckpt_root, at, scheduler, extra,
                                    args.keep_checkpoints)

    def sync_point(at: int) -> bool:
        """Steps that synchronise with the device anyway; the guard reads its flags there (see guard.py)."""
        return (at % args.log_every == 0 or at == args.max_steps or mask_update_due(scheduler, at)
                or bool(args.eval_every and at % args.eval_every == 0)
                or bool(args.checkpoint_every and at % args.checkpoint_every == 0))

    def stopped(what: str) -> str:
        """One line for a non-finite stop: what happened and how to go on from the last good checkpoint."""
        last = ckpt.list_checkpoints(ckpt_root)
        resume = "auto" if last or plan.path is None else str(plan.path)
        where = last[-1] if last else plan.path
        fix = "change what made it diverge (e.g. a lower optim.optimizer.lr)"
        if where is None:
            return f"{what}; no checkpoint was written yet: {fix} and start the run again"
        return (f"{what}; the last good checkpoint is {where}: {fix} and continue with "
                f"{resume_command(run_dir, args.overrides, resume)}")

    # -- 5. the loop -------------------------------------------------------------------------------
    model.train()
    # a resumed run reports the evaluation it already logged until it evaluates again (resuming a finished run
    # rewrote its summary with no final_eval_loss)
    last_eval = _last_eval(read_metrics(run_dir), step) if step else None
    rate_key = "tokens_per_s" if seq_len else "samples_per_s"
    peak_mem = 0.0   # GiB since the loop started: the statistics are reset after each window's row
    if torch.cuda.is_available() and not cpu:
        torch.cuda.reset_peak_memory_stats()
    try:
        # trainer.num_workers threads collate (and, for graph steps, pin) the next batches while a step runs
        with guard, Prefetcher(batches, micro, args.num_workers, pin=use_graph) as feed:
            while step < args.max_steps:
                t0 = time.perf_counter()
                micro_batches, items = [], 0
                for _ in range(args.grad_accum):
                    batch = _to(feed.get(micro), accelerator.device)  # pinned by the feed for graph steps
                    micro += 1
                    n_items, rate_key = _items_in(batch)
                    items += n_items
                    micro_batches.append(batch)
                # a step whose layers hand their dense gradient to Python (RigL's grow step) runs eagerly, on
                # the uncompiled model
                hooks_step = needs_grad and mask_update_due(scheduler, step + 1)
                try:
                    loss_acc = run_step(micro_batches, plain=hooks_step)
                except GraphCaptureError as e:
                    if args.cuda_graph is True:
                        raise ValueError(f"trainer.cuda_graph: is true but {e}; set trainer.cuda_graph=false "
                                         f"or auto") from e
                    if main:
                        print(f"warning: {e}; the run goes on with eager steps", flush=True)
                    run_step.graph_mode = False
                    loss_acc = run_step(micro_batches, eager=True)
                lr_sched.step()
                step += 1
                stop = None
                if sync_point(step):   # before the sparsity hook: a mask update never runs on NaN weights
                    first_bad, stop = guard.poll()
                    if first_bad is not None:
                        raise NonFiniteLoss(stopped(f"non-finite loss or gradient norm at step {first_bad} "
                                                    f"(seen at step {step}); nothing after it was saved"))
                th = time.perf_counter()
                record = scheduler.step(step)                       # the sparsity hook
                dt_hook = time.perf_counter() - th
                if record is not None:
                    run_step.topology_changed()                     # kept only if written in place
                    train_flops += flop_count.step_flops(report, is_update_step=True, dense_grad=needs_grad)
                    report = flop_report()                          # density may have changed
                else:
                    train_flops += flop_count.step_flops(report, is_update_step=False, dense_grad=False)
                    hook_time += dt_hook
                win_loss += loss_acc                                # summed on device: no sync per step
                window["steps"] += 1
                window["items"] += items * accelerator.num_processes
                dt = time.perf_counter() - t0
                elapsed += dt
                window["time"] += dt
                if record is None:
                    step_time += dt
                if record is not None:
                    ranks = compare_masks(inner, accelerator.num_processes)  # several processes: one all-gather
                    log({"step": step, **record, "density": scheduler.density, **ranks.row})
                    ranks.raise_if_diverged(step)             # before the next optimizer step or checkpoint
                if step % args.log_every == 0 or step == args.max_steps:
                    t_sync = time.perf_counter()
                    window["loss"] += float(accelerator.reduce(win_loss.clone(), reduction="mean").item())
                    wait = time.perf_counter() - t_sync       # the GPU work the host had queued ahead
                    window["time"] += wait
                    elapsed += wait
                    win_loss.zero_()
                    row = {"step": step, "loss": window["loss"] / max(1, window["steps"]),
                           "lr": lr_sched.get_last_lr()[0], "train_flops": train_flops,
                           rate_key: window["items"] / max(window["time"], 1e-9),
                           "density": scheduler.density, "elapsed_s": elapsed}
                    if torch.cuda.is_available() and not cpu:
                        peak_mem = max(peak_mem, torch.cuda.max_memory_allocated() / 2**30)   # since the reset
                        # what the allocator held from the device in this window: with CUDA graphs the graphs'
                        # private pools, which the allocated statistics stop counting after capture
                        row["peak_mem_gb"], row["reserved_gb"] = peak_mem, torch.cuda.max_memory_reserved() / 2**30
                    if step - window["steps"] <= first_step + run_step.warmup:
                        row["startup"] = True     # the window holds the process's tuning, compile or first capture
                    log(row)
                    if "reserved_gb" in row:
                        if row.get("startup"):   # blocks freed by tuning and compiling go back to the device
                            torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()      # the next row's reserved_gb: its window only
                    progress.update(step, loss=row["loss"], lr=row["lr"], **{rate_key: row[rate_key]})
                    window = {"loss": 0.0, "steps": 0, "items": 0, "time": 0.0}
                if args.eval_every and (step % args.eval_every == 0 or step == args.max_steps):
                    last_eval = evaluate()
                    log({"step": step, **last_eval, "train_flops": train_flops, "elapsed_s": elapsed})
                if args.checkpoint_every and step % args.checkpoint_every == 0 and step < args.max_steps:
                    save(step)
                if accelerator.num_processes == 1:
                    stop = guard.signal            # one process: act on a signal after this very step
                if stop and step < args.max_steps:
                    import signal

                    path = save(step)
                    raise Interrupted(f"stopped by {signal.Signals(stop).name} after step {step}; checkpoint "
                                      f"{path} written; continue with "
                                      f"{resume_command(run_dir, args.overrides)}", stop)
            save(step)
    except RunStopped:
        progress.close()
        logger.close()
        if args.wandb:
            end_tracking(accelerator)
        run_step.invalidate()            # before the process group goes: NCCL waits for graphs holding its ops
        ended.append(accelerator)        # train() ends it once this frame's model and step are gone
        raise
    progress.close()
    logger.close()
    final_ranks = compare_masks(inner, accelerator.num_processes)  # the final masks too (identical: None alone)
    final_ranks.raise_if_diverged()

    # -- 6. summary -------------------------------------------------------------------------------------
    summary = {
        "status": "finished", "method": spec.method, "recipe": args.recipe, "density": scheduler.density,
        "block": spec.block_label if scheduler.sparse else "-", "steps": step,
        "final_eval_loss": last_eval["eval_loss"] if last_eval else None,
        "total_train_flops": train_flops, "wall_s": elapsed,
        "train_s": train_seconds(read_metrics(run_dir), step) if main else None,   # start-up left out
        "device": torch.cuda.get_device_name(accelerator.device) if accelerator.device.type == "cuda" else "cpu",
        "tokens_per_s" if rate_key == "tokens_per_s" else "samples_per_s":
            window_rate(run_dir, rate_key) if main else None,
        "hook_share_non_update_steps": hook_time / step_time if step_time else None,
        "processes": accelerator.num_processes, "ranks_masks_identical": final_ranks.identical,
        "flops_per_step_dense": report.dense_total, "flops_per_step_sparse": report.sparse_total,
        "step_mode": "cuda_graph" if run_step.graph_mode else "eager", **run_step.stats(),
        "kernel_choices": blocksparse_tuner.choice_counts(),   # tuned block-sparse products per backend
    }
    if main:
        write_summary(run_dir, **summary)
        if args.plot:
            plot_run(run_dir)
        print(format_summary(summary), flush=True)
        print(f"run directory: {run_dir}", flush=True)
    if args.wandb:
        end_tracking(accelerator)
    run_step.invalidate()            # before the process group goes: NCCL waits for graphs holding its ops
    ended.append(accelerator)        # train() ends it once this frame's model and step are gone
    return summary


def _last_eval(rows: list[dict], step: int) -> dict | None:
    """The ``eval_*`` values of the last evaluation row at or before ``step`` (None if there is none)."""
    evals = [r for r in rows if "eval_loss" in r and r.get("step", 0) <= step]
    return {k: v for k, v in evals[-1].items() if k.startswith("eval_")} if evals else None


_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]


def _step_runner(model, compiled, optimizer, raw_opt, accelerator, args: TrainArgs, guard: Guard, use_graph: bool,
                 step_sync: bool, compiled_now) -> TrainStep:
    """The run's :class:`TrainStep`. DDP or one process without graphs: Accelerate's backward, no-sync, clip and
    autocast. Graph (or ``step_sync``): plain torch calls that capture, autocast without its cast cache, the
    optimizer made capturable (graph runs) and, with several processes, the step's own gradient all-reduce after
    the last micro-batch (``step_sync``: the model is not wrapped in DDP)."""
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
                         plain_forward=lambda batch: model(**batch))
    if use_graph:
        make_graph_safe(raw_opt, accelerator.device)
    else:
        make_eager_safe(raw_opt)
    params = [p for p in model.parameters() if p.requires_grad]   # the order of accelerate's clip: the same norm
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.mixed_precision)
    sync = GradSync(lambda: params, accelerator.num_processes) if step_sync else None

    def clip():
        if not args.clip_grad_norm:
            return None
        return torch.nn.utils.clip_grad_norm_(params, args.clip_grad_norm, foreach=use_graph or None)

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
                     plain_forward=lambda batch: model(**batch), reads=reads)
