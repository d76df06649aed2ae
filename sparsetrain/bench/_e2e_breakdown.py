"""The per-step breakdown of ``sparsetrain bench e2e --breakdown``: a few optimizer steps of one run profiled in a
process of its own, their GPU kernels sorted into categories by name (:func:`classify_kernel`: block-sparse,
attention, linears, optimizer, elementwise) and summed per step, host gaps (wall time minus summed kernel time)
and the MLM head's share of the step's FLOPs. :func:`profiled_train` starts and stops the profiler at whole loop
iterations; :func:`profile_child` is the profiled process (``python -m sparsetrain.bench.e2e --profile-child JOB``);
:func:`format_breakdown` prints the results. Only the standard library is imported at module level."""
from __future__ import annotations

import json
import time
from pathlib import Path

CATEGORY_PATTERNS = (
    ("block-sparse", ("bs_dds", "bs_dw", "dense_x_blocksparse", "sampled_grad")),
    ("attention", ("flash", "fmha", "sdpa", "efficient_attention")),
    ("linears", ("nvjet", "gemm", "cutlass", "sm90_xmma", "splitkreduce", "cublas")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
)
CATEGORIES = (*(c for c, _ in CATEGORY_PATTERNS), "elementwise")


def classify_kernel(name: str) -> str:
    """The category of a GPU kernel by its name: our block-sparse kernels first (a name may also say gemm),
    attention before linears (fused attention kernels are cutlass kernels too), everything unnamed is
    elementwise (norms, activations, dropout, softmax of the loss, copies).

    >>> classify_kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"), classify_kernel("bs_dds_kernel")
    ('linears', 'block-sparse')
    """
    low = name.lower()
    return next((cat for cat, keys in CATEGORY_PATTERNS if any(k in low for k in keys)), "elementwise")


#: How many of the profiled steps' kernels (the largest by time per step) the JSON lists by name.
TOP_KERNELS = 50


def breakdown(kernels: list[tuple[str, float]], wall_s: float, steps: int) -> dict:
    """Milliseconds per step per category from ``(kernel name, µs)`` pairs over ``steps`` steps that took
    ``wall_s``; host gaps = wall − summed kernel time (negative where kernels overlapped); the :data:`TOP_KERNELS`
    largest kernels by name."""
    ms = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[str, float] = {}
    for name, us in kernels:
        ms[classify_kernel(name)] += us / 1e3 / steps
        by_name[name] = by_name.get(name, 0.0) + us / 1e3 / steps
    total = sum(ms.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    return {"ms_per_step": ms, "kernels_ms": total, "wall_ms": 1e3 * wall_s / steps,
            "host_gaps_ms": 1e3 * wall_s / steps - total,
            "top_kernels": [[n[:120], round(t, 4), classify_kernel(n)] for n, t in top]}


def profiled_train(spec, run_dir: Path, first: int, count: int, start, stop) -> dict:
    """``train(spec, run_dir)`` with ``start()`` called just before optimizer step ``first`` and ``stop()`` just
    before step ``first + count`` (``TrainStep.__call__`` wrapped for the run): the window is ``count`` whole
    loop iterations. Returns ``{"steps": count, "calls": ...}``."""
    from sparsetrain.training import step as step_module
    from sparsetrain.training.loop import train

    original = step_module.TrainStep.__call__
    seen = {"calls": 0, "started": False, "stopped": False}

    def wrapped(self, batches, **kwargs):
        seen["calls"] += 1
        if seen["calls"] == first:
            start()
            seen["started"] = True
        elif seen["calls"] == first + count and seen["started"]:
            stop()
            seen["stopped"] = True
        return original(self, batches, **kwargs)

    step_module.TrainStep.__call__ = wrapped
    try:
        train(spec, run_dir)
    finally:
        step_module.TrainStep.__call__ = original
    if not seen["stopped"]:
        raise RuntimeError(f"the run ended after {seen['calls']} steps, before step {first + count}")
    return {"steps": count, "calls": seen["calls"]}


def step_counts(overrides: list[str], device_name: str = "") -> dict:
    """What the run of ``overrides`` must do per step, as ``sparsetrain flops`` counts it: the MLM head's (or
    classifier's) share of the FLOPs and, on a card :mod:`sparsetrain.floor` knows (by ``device_name``), the
    counted floor per category in ms (``floor_ms``, None elsewhere) and the card's name."""
    from omegaconf import OmegaConf

    from sparsetrain import flops
    from sparsetrain.config import build_run, compose, predictions_per_seq
    from sparsetrain.floor import card_for, step_floor
    from sparsetrain.training.setup import sparsify_model

    cfg = compose(overrides)
    spec = build_run(cfg)
    model = spec.build_model()
    parameters = sum(p.numel() for p in model.parameters())
    sparsify_model(model, spec.scheduler, spec.sparsify_kwargs, format="masked")
    report = flops.count_step_flops(model, batch_size=int(cfg.trainer.batch_size),
                                    seq_len=OmegaConf.select(cfg, "data.seq_len"),
                                    image_size=OmegaConf.select(cfg, "data.image_size"),
                                    predictions_per_seq=predictions_per_seq(cfg))
    heads = (*getattr(model, "masked_positions_modules", ()), "cls", "classifier", "lm_head")
    head = sum(r.sparse_flops for r in report.rows if r.name.split(".")[0] in heads)
    card = card_for(device_name)
    floor = None if card is None else {r.category: r.ms for r in step_floor(report, model.config, parameters, card)}
    return {"head_flops_share": head / report.sparse_total, "floor_ms": floor, "floor_card": card and card.name}


def profile_child(job_path: str) -> int:
    """In a process of its own: build the run as the CLI does, train with steps N..N+2 under torch.profiler
    (CUDA activity) and write the breakdown next to the job file."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from sparsetrain.config import build_run, compose

    job = json.loads(Path(job_path).read_text())
    prof = profile(activities=[ProfilerActivity.CUDA])
    clock = {}

    def start():
        prof.start()
        torch.cuda.synchronize()
        clock["t0"] = time.perf_counter()

    def stop():
        torch.cuda.synchronize()
        clock["wall"] = time.perf_counter() - clock["t0"]
        prof.stop()

    spec = build_run(compose(job["overrides"]))
    info = profiled_train(spec, Path(job["run_dir"]), job["first"], job["count"], start, stop)
    kernels = [(e.name, e.device_time_total) for e in prof.events() if e.device_type == DeviceType.CUDA]
    out = breakdown(kernels, clock["wall"], info["steps"])
    out.update(step_counts(job["overrides"], torch.cuda.get_device_name()))
    Path(job["result"]).write_text(json.dumps(out, indent=1))
    return 0


def format_breakdown(results: dict) -> str:
    """The breakdown table; under a run measured on a card with a counted floor, the floor's row and measured /
    floor per category (``sparsetrain flops --floor``)."""
    lines = [f"{'run':<24}" + "".join(f"{c:>14}" for c in (*CATEGORIES, "host gaps", "wall")) + "   head FLOPs"]
    for name, b in results.items():
        if b.get("error"):
            lines.append(f"{name:<24}  error: {b['error']}")
            continue
        ms = b["ms_per_step"]
        lines.append(f"{name:<24}" + "".join(f"{ms[c]:>14.2f}" for c in CATEGORIES)
                     + f"{b['host_gaps_ms']:>14.2f}{b['wall_ms']:>14.2f}   {100 * b['head_flops_share']:.1f}%")
        floor = b.get("floor_ms")
        if floor:
            total = sum(floor.values())
            lines.append(f"{'  floor':<24}" + "".join(f"{floor[c]:>14.2f}" for c in CATEGORIES)
                         + f"{0.0:>14.2f}{total:>14.2f}   {b['floor_card']}")
            lines.append(f"{'  x floor':<24}" + "".join(f"{ms[c] / max(floor[c], 1e-9):>14.1f}" for c in CATEGORIES)
                         + f"{'':>14}{b['wall_ms'] / max(total, 1e-9):>14.1f}")
    return "\n".join(lines)
