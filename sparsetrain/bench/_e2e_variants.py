"""What ``sparsetrain bench e2e`` runs: the modes, the variants (a recipe and overrides of its own, the defaults per
model) and each run's overrides, from what its recipe says (:func:`recipe_facts`) and the bench's arguments.
Only the standard library is imported at module level."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

#: The overrides of each mode: eager steps; the whole step replayed from a CUDA graph; the same with the model
#: compiled (torch.compile's default mode, its fused elementwise kernels captured in the graph).
MODES = {"eager": ["trainer.cuda_graph=false", "trainer.compile=false"],
         "graph": ["trainer.cuda_graph=true", "trainer.compile=false"],
         "compiled": ["trainer.cuda_graph=true", "trainer.compile=true"]}


@dataclass(frozen=True)
class Variant:
    """One thing to benchmark: a recipe and overrides of its own (``--recipe-map name=recipe[:overrides]``)."""

    name: str
    recipe: str
    overrides: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Variant:
        """``"static_b64=bert_static:sparsity.block=64 trainer=gpu"`` -> Variant (overrides split on spaces)."""
        name, sep, rest = text.partition("=")
        recipe, _, overrides = rest.partition(":")
        if not sep or not name.strip() or not recipe.strip():
            raise ValueError(f"--recipe-map wants name=recipe[:overrides], got {text!r}")
        return cls(name.strip(), recipe.strip(), tuple(overrides.split()))


# ViT: ViT-B/16 at 224 px on synthetic images (vit_base_dense / vit_base_static; the 2:4 variant is the
# sparse-then-dense recipe with ViT-B and the 2:4 phase for the whole run; at ViT-L, the recipe's own model).
DEFAULT_VARIANTS = {
    "bert": (Variant("dense", "bert_dense"), Variant("static_b64", "bert_static", ("sparsity.block=64",)),
             Variant("static_b16", "bert_static"), Variant("dynamic_b16", "bert_phase1_dynamic")),
    "bert_large": (Variant("dense", "bert_large_dense"),
                   Variant("static_b64", "bert_large_static", ("sparsity.block=64",)),
                   Variant("static_b16", "bert_large_static"), Variant("dynamic_b16", "bert_large_dynamic")),
    "vit": (Variant("dense", "vit_base_dense"), Variant("static_b64", "vit_base_static", ("sparsity.block=64",)),
            Variant("static_b16", "vit_base_static"),
            Variant("semi24", "vit_24_sparse_then_dense", ("model=vit_base", "sparsity.scheduler.sparse_fraction=1.0"))),
    "vit_large": (Variant("dense", "vit_large_dense"),
                  Variant("static_b64", "vit_large_static", ("sparsity.block=64",)),
                  Variant("static_b16", "vit_large_static"), Variant("dynamic_b16", "vit_large_dynamic"),
                  Variant("semi24", "vit_24_sparse_then_dense", ("sparsity.scheduler.sparse_fraction=1.0",))),
}
DEFAULT_BATCH = {"bert": 256, "bert_large": 256, "vit": 256, "vit_large": 128}


# ---- what each run is -----------------------------------------------------------------------------------
def recipe_facts(variant: Variant) -> dict:
    """What the recipe, as configured (its own overrides, none of the bench's), says: whether its topology
    changes (a scheduler taking ``num_updates``), its steps and update interval, whether the data has a
    ``seq_len``."""
    import importlib
    import inspect

    from omegaconf import OmegaConf

    from sparsetrain.config import compose

    cfg = compose([f"recipe={variant.recipe}", *variant.overrides])
    sched = OmegaConf.to_container(cfg.sparsity.scheduler, resolve=False)
    module, _, name = str(sched["_target_"]).rpartition(".")
    params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    steps, interval, n = int(cfg.trainer.max_steps), sched.get("interval"), sched.get("num_updates")
    dynamic = "num_updates" in params
    return {"dynamic": dynamic, "recipe_steps": steps, "recipe_num_updates": n if dynamic else None,
            "recipe_interval": (interval or steps / n) if dynamic and (interval or n) else None,
            "start": float(sched.get("start", 0.0)), "end": float(sched.get("end", 1.0)),
            "has_interval": "interval" in sched,
            "text": OmegaConf.select(cfg, "data.seq_len") is not None}


def update_steps(num_updates: int, steps: int, start: float = 0.0, end: float = 1.0) -> list[int]:
    """The steps at which a ``num_updates`` scheduler updates in a run of ``steps`` (PruneRegrow's spacing)."""
    from sparsetrain.sparsity.schedules import UpdateSchedule

    s, e = int(start * steps), max(1, int(round(end * steps)))
    n = min(num_updates, max(1, e - s - 1))
    sched = UpdateSchedule.from_num_updates(n, s, e) if e - s >= 2 else UpdateSchedule(s, e, 1)
    return [k for k in range(1, steps + 1) if sched.is_update_step(k)]


def auto_updates(steps: int, log_every: int, start: float = 0.0, end: float = 1.0) -> int:
    """The number of updates for which each update and the two steps after it (an eager step, a re-capture)
    fall inside one window, none in window 1, with as many update windows as update-free ones."""
    best, best_score = 1, -1
    for n in range(1, steps // 2):
        ups = update_steps(n, steps, start, end)
        if not ups or any(u <= log_every or u + 2 > steps or (u - 1) % log_every > log_every - 3 for u in ups):
            continue
        with_update = {(u - 1) // log_every for u in ups}
        clean = (steps + log_every - 1) // log_every - 1 - len(with_update)
        if min(len(with_update), clean) > best_score:
            best, best_score = n, min(len(with_update), clean)
    return best


def merged(*groups: list[str] | tuple[str, ...]) -> list[str]:
    """Overrides in order, a later one replacing an earlier one of the same key (``+``/``~`` prefixes aside)."""
    out: dict[str, str] = {}
    for group in groups:
        for o in group:
            out[o.split("=", 1)[0].lstrip("+~")] = o
    return list(out.values())


def run_overrides(variant: Variant, mode: str, args: argparse.Namespace, facts: dict) -> list[str]:
    common = ["trainer=gpu", f"trainer.max_steps={args.steps}", f"trainer.batch_size={args.batch}",
              "trainer.grad_accum=1", "trainer.eval_every=0", f"trainer.log_every={args.log_every}",
              "trainer.checkpoint_every=0", "logger=quiet", "logger.plot=false",
              *MODES[mode]]
    if facts.get("text"):
        common.append(f"data.seq_len={args.seq}")
    dynamic = []
    if facts.get("dynamic"):
        n = args.updates or auto_updates(args.steps, args.log_every, facts["start"], facts["end"])
        dynamic = ["sparsity.scheduler.interval=null"] if facts.get("has_interval") else []
        dynamic.append(f"sparsity.scheduler.num_updates={n}")
    return merged([f"recipe={variant.recipe}"], common, variant.overrides, dynamic, args.extra)
