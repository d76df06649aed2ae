"""The training loop: Accelerate, a thin sparsity hook, metrics, checkpoints. It knows nothing about RigL.

    for each optimizer step:
        grad_accum micro-batches: forward, backward (no gradient sync until the last)
        clip, optimizer.step(), lr.step()
        record = scheduler.step(step)          # the only sparsity call on the hot path
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from sparsetrain import flops as flop_count
from sparsetrain.kernels import set_kernel_options
from sparsetrain.training import checkpoint as ckpt
from sparsetrain.training.metrics import MetricsLogger, Progress, format_summary, window_rate, write_summary
from sparsetrain.training.plots import plot_run
from sparsetrain.training.setup import RunSpec, TrainArgs, lr_scheduler, plan_kernel_dispatch, sparsify_model
from sparsetrain.training.tracking import end_tracking, init_tracking, log_tracking


class RunDirError(RuntimeError):
    pass


class Batches:
    """Deterministic, resumable batches: epoch ``e`` is a permutation seeded by (seed, e); global micro-batch
    ``b`` holds ``batch_size x world`` samples and this rank takes its slice. The position is ``b``."""

    def __init__(self, dataset, collator, batch_size: int, world: int, rank: int, seed: int) -> None:
        self.dataset, self.collator = dataset, collator
        self.batch_size, self.world, self.rank, self.seed = batch_size, world, rank, seed
        self.per_epoch = len(dataset) // (batch_size * world)
        if self.per_epoch < 1:
            raise ValueError(f"trainer.batch_size: {batch_size} x {world} process(es) is larger than the "
                             f"training set ({len(dataset)} examples)")
        self._perm_epoch, self._perm = -1, None

    def indices(self, b: int) -> list[int]:
        epoch, i = divmod(b, self.per_epoch)
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 7_919 + epoch)
            self._perm, self._perm_epoch = torch.randperm(len(self.dataset), generator=gen), epoch
        g = self.batch_size * self.world
        start = i * g + self.rank * self.batch_size
        return self._perm[start:start + self.batch_size].tolist()

    def get(self, b: int) -> dict[str, torch.Tensor]:
        epoch = b // self.per_epoch
        if hasattr(self.collator, "set_epoch"):
            self.collator.set_epoch(epoch)
        return self.collator([self.dataset[i] for i in self.indices(b)])


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
    try:
        return _train(spec, Path(run_dir))
    finally:
        set_kernel_options(previous)


def _train(spec: RunSpec, run_dir: Path) -> dict[str, Any]:
    import logging

    from accelerate import Accelerator
    from accelerate.utils import set_seed

    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-save INFO lines drown the progress bar
    args: TrainArgs = spec.train_args
    scheduler = spec.scheduler
    ckpt_root = run_dir / "checkpoints"

    # -- 1. refuse to clobber: decided before anything is written --------------------------------
    resume_path = ckpt.find_resume(args.resume, ckpt_root)
    if resume_path is None and (run_dir / "metrics.jsonl").exists():
        raise RunDirError(f"{run_dir} already holds a run (metrics.jsonl); continue it with trainer.resume=auto "
                          f"or choose another hydra.run.dir")
    resume_state = ckpt.read_state(resume_path) if resume_path else None
    if resume_state is not None:
        ckpt.check_compatible(resume_state, resume_path, scheduler)

    # -- 2. model and sparsity (cheap; validates the structure before any data is read) -----------
    set_seed(args.seed)
    model = spec.build_model()
    sparsify_model(model, scheduler, spec.sparsify_kwargs)

    cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=cpu,
                              log_with="wandb" if args.wandb else None, project_dir=str(run_dir))
    main = accelerator.is_main_process
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        from omegaconf import OmegaConf

        OmegaConf.save(OmegaConf.create(spec.config), run_dir / "config.yaml")
    optimizer = spec.build_optimizer(model)
    lr_sched = lr_scheduler(optimizer, args)
    model, optimizer = accelerator.prepare(model, optimizer)
    inner = accelerator.unwrap_model(model)
    raw_opt = getattr(optimizer, "optimizer", optimizer)
    scheduler.attach(inner, raw_opt, total_steps=args.max_steps)

    # -- 3. data ------------------------------------------------------------------------------------
    data = spec.build_data()
    vocab = getattr(getattr(inner, "config", None), "vocab_size", None)
    if hasattr(data, "vocab_size") and vocab is not None and data.vocab_size > vocab:
        raise ValueError(f"data.vocab_size: the tokenizer has {data.vocab_size} tokens, the model {vocab}")
    batches = Batches(data.train, data.collator, args.batch_size, accelerator.num_processes,
                      accelerator.process_index, args.seed)
    eval_batches = Batches(data.eval, data.collator, args.batch_size, accelerator.num_processes,
                           accelerator.process_index, args.seed + 1)
    global_batch = args.batch_size * args.grad_accum * accelerator.num_processes
    seq_len = getattr(data, "seq_len", None)
    image_size = getattr(data, "image_size", None)

    def flop_report():
        return flop_count.count_step_flops(inner, batch_size=global_batch, seq_len=seq_len, image_size=image_size)

    report = flop_report()
    dispatch = plan_kernel_dispatch(inner, tokens=args.batch_size * report.seq_tokens, cpu=cpu)
    needs_grad = bool(getattr(getattr(scheduler, "policy", None), "needs_grad", False))

    # -- 4. resume ------------------------------------------------------------------------------------
    step, micro, train_flops, elapsed = 0, 0, 0.0, 0.0
    window = {"loss": 0.0, "steps": 0, "items": 0, "time": 0.0}
    hook_time = step_time = 0.0
    if resume_state is not None:
        if scheduler.sparse:
            scheduler.load_state_dict(resume_state["sparsity"])
        ckpt.load_checkpoint(accelerator, resume_path)
        lr_sched.load_state_dict(resume_state["lr_scheduler"])
        step, micro = resume_state["step"], resume_state["micro_batches"]
        train_flops, elapsed = resume_state["train_flops"], resume_state["elapsed_s"]
        window = resume_state["window"]
        report = flop_report()
        if main:
            MetricsLogger.truncate_after(run_dir, step)
            print(f"resumed from {resume_path} at step {step}", flush=True)
    logger = MetricsLogger(run_dir, is_main_process=main)
    if args.wandb:
        init_tracking(accelerator, args.wandb_project, str(run_dir), spec.config, mode=args.wandb_mode,
                           name=args.wandb_name, enabled=True)
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
    first_step = step

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

    def save(at: int) -> None:
        window["loss"] += float(accelerator.reduce(win_loss.clone(), reduction="mean").item())
        win_loss.zero_()
        extra = {"lr_scheduler": lr_sched.state_dict(), "micro_batches": micro, "train_flops": train_flops,
                 "elapsed_s": elapsed, "window": dict(window), "args": asdict(args)}
        ckpt.save_checkpoint(accelerator, ckpt_root, at, scheduler, extra, args.keep_checkpoints)

    # -- 5. the loop -------------------------------------------------------------------------------
    model.train()
    last_eval = None
    win_loss = torch.zeros((), device=accelerator.device)
    rate_key = "tokens_per_s" if seq_len else "samples_per_s"
    if torch.cuda.is_available() and not cpu:
        torch.cuda.reset_peak_memory_stats()
    while step < args.max_steps:
        t0 = time.perf_counter()
        loss_acc = torch.zeros((), device=accelerator.device)
        items = 0
        for k in range(args.grad_accum):
            batch = _to(batches.get(micro), accelerator.device)
            micro += 1
            n_items, rate_key = _items_in(batch)
            items += n_items
            sync = nullcontext() if k == args.grad_accum - 1 else accelerator.no_sync(model)
            fwd = compiled if compiled is not None and step > first_step else model
            with sync, accelerator.autocast():
                loss = fwd(**batch).loss / args.grad_accum
            accelerator.backward(loss)
            loss_acc += loss.detach().float()
        if args.clip_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        optimizer.step()
        lr_sched.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        th = time.perf_counter()
        record = scheduler.step(step)                       # the sparsity hook
        dt_hook = time.perf_counter() - th
        if record is not None:
            train_flops += flop_count.step_flops(report, is_update_step=True, dense_grad=needs_grad)
            report = flop_report()                          # density may have changed (gradual, phase switch)
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
            log({"step": step, **record, "density": scheduler.density})
        if step % args.log_every == 0 or step == args.max_steps:
            window["loss"] += float(accelerator.reduce(win_loss.clone(), reduction="mean").item())
            win_loss.zero_()
            row = {"step": step, "loss": window["loss"] / max(1, window["steps"]), "lr": lr_sched.get_last_lr()[0],
                   "train_flops": train_flops, rate_key: window["items"] / max(window["time"], 1e-9),
                   "density": scheduler.density, "elapsed_s": elapsed}
            if torch.cuda.is_available() and not cpu:
                row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
            log(row)
            progress.update(step, loss=row["loss"], lr=row["lr"], **{rate_key: row[rate_key]})
            window = {"loss": 0.0, "steps": 0, "items": 0, "time": 0.0}
        if args.eval_every and (step % args.eval_every == 0 or step == args.max_steps):
            last_eval = evaluate()
            log({"step": step, **last_eval, "train_flops": train_flops, "elapsed_s": elapsed})
        if args.checkpoint_every and step % args.checkpoint_every == 0 and step < args.max_steps:
            save(step)
    save(step)
    progress.close()
    masks_identical = None
    if accelerator.num_processes > 1:
        # every rank must hold the same topology; a mismatch would silently train different models
        sig = accelerator.gather(mask_signature(inner).to(accelerator.device).reshape(1))
        masks_identical = bool((sig == sig[0]).all())
        if not masks_identical:
            raise RuntimeError(f"sparsity masks differ between ranks: signatures {sig.tolist()}")

    # -- 6. summary -------------------------------------------------------------------------------------
    summary = {
        "status": "finished", "method": spec.method, "recipe": args.recipe, "density": scheduler.density,
        "block": spec.block_label if scheduler.sparse else "-", "steps": step,
        "final_eval_loss": last_eval["eval_loss"] if last_eval else None,
        "total_train_flops": train_flops, "wall_s": elapsed,
        "tokens_per_s" if rate_key == "tokens_per_s" else "samples_per_s":
            window_rate(run_dir, rate_key) if main else None,
        "hook_share_non_update_steps": hook_time / step_time if step_time else None,
        "processes": accelerator.num_processes, "ranks_masks_identical": masks_identical,
        "flops_per_step_dense": report.dense_total, "flops_per_step_sparse": report.sparse_total,
    }
    if main:
        write_summary(run_dir, **summary)
        if args.plot:
            plot_run(run_dir)
        print(format_summary(summary), flush=True)
    if args.wandb:
        end_tracking(accelerator)
    accelerator.wait_for_everyone()  # no rank tears the process group down while another still uses it
    accelerator.end_training()
    return summary


def mask_signature(model: torch.nn.Module) -> torch.Tensor:
    """A number that changes when any active position of any SparseLinear changes."""
    from sparsetrain.sparsity.schedulers import sparse_layers

    sig = torch.zeros((), dtype=torch.float64)
    for i, layer in enumerate(sparse_layers(model).values()):
        m = layer.mask.detach().flatten().cpu().double()
        sig += ((torch.arange(m.numel(), dtype=torch.float64) + 1) * m).sum() * (i + 1)
    return sig
