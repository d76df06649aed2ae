"""The ``sparsetrain`` command: train | recipes | flops | pareto | bench | export.

    sparsetrain train recipe=quickstart                      # one run (Hydra overrides follow)
    sparsetrain train -m recipe=quickstart sparsity.density=0.05,0.1,0.2   # a sweep (Hydra multirun)
    sparsetrain recipes                                      # list recipes
    sparsetrain flops recipe=bert_phase1_dynamic             # per-layer FLOPs, dense vs sparse
    sparsetrain flops recipe=bert_static --floor h200        # ... and the step's floor per category on a card
    sparsetrain pareto multirun/quickstart/... --out pareto.png
    sparsetrain bench blocksparse|semi24|inference|e2e [args]   # GPU benchmarks (ratios vs dense, one run)
    sparsetrain export RUN_DIR --format hf|sparse --out DIR
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

USAGE = __doc__


def _check_recipe(argv: Sequence[str]) -> int | None:
    from sparsetrain.config import list_recipes

    for a in argv:
        if a.startswith("recipe="):
            names = [n.strip() for n in a.split("=", 1)[1].split(",")]
            recipes = list_recipes()
            unknown = [n for n in names if n not in recipes]
            if unknown:
                print(f"error: unknown recipe {unknown[0]!r}. Recipes:", file=sys.stderr)
                for name, desc in recipes.items():
                    print(f"  {name:<28} {desc}", file=sys.stderr)
                return 2
    return None


def _sweep(overrides: list[str], limit: int = 256) -> list[list[str]] | None:
    """The override lists of a ``-m`` sweep's jobs, expanded as Hydra's basic sweeper does (discrete sweeps:
    ``a=1,2``, ``choice``, ``range``); None when it cannot be expanded here (other sweeps, too many jobs)."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    lists = []
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.get_key_element()
        if o.is_sweep_override():
            if not o.is_discrete_sweep():
                return None
            lists.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            lists.append([f"{key}={o.get_value_element_as_str()}"])
    jobs = [list(job) for job in itertools.islice(itertools.product(*lists), limit + 1)]
    return jobs if len(jobs) <= limit else None


def _prevalidate(argv: Sequence[str]) -> tuple[str | None, Path | None]:
    """Compose and validate each job Hydra is about to run, before Hydra creates any run directory. Returns
    the error line of the first invalid job (or None), and the deepest directory on the way to the run (or
    sweep) directory that exists now: what a failed run must never remove. Hydra's own flags (``--cfg``,
    ``--help``, ``-cd``...) and composition errors are left to Hydra, which reports them before creating
    anything."""
    from omegaconf import OmegaConf

    from sparsetrain.config import ConfigError, compose, validate

    flags = [a for a in argv if a.startswith("-")]
    if any(f not in ("-m", "--multirun") for f in flags):
        return None, None
    overrides = [a for a in argv if not a.startswith("-")]
    try:
        if flags and (first := _sweep(overrides)):  # a recipe's own grid (hydra.sweeper.params) joins the
            # command line's, which wins per key
            params = OmegaConf.select(compose(first[0], return_hydra_config=True), "hydra.sweeper.params") or {}
            given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
            overrides = [f"{k}={v}" for k, v in params.items() if k not in given] + overrides
        jobs = _sweep(overrides) if flags else [overrides]
        for job in jobs or []:
            validate(compose(job))
        hydra_cfg = compose(jobs[0] if jobs else overrides, return_hydra_config=True)
        target = Path(str(OmegaConf.select(hydra_cfg, "hydra.sweep.dir" if flags else "hydra.run.dir")))
    except ConfigError as e:
        return str(e), None
    except Exception:  # noqa: BLE001 - anything else (a Hydra parse error...) is Hydra's to report
        return None, None
    existing = target.resolve()
    while not existing.is_dir():
        existing = existing.parent
    return None, existing


def _remove_new_empty_dirs(run_dir: Path, existing: Path | None) -> None:
    """Remove ``run_dir`` and its parents while they are empty, up to (never including) ``existing``, the
    deepest directory on the way that existed before Hydra ran: what Hydra created for a run that failed.
    Nothing is removed when that directory is unknown or is not an ancestor of ``run_dir``."""
    d = run_dir.resolve()
    if existing is None or existing not in d.parents:
        return
    while d != existing:
        try:
            if any(d.iterdir()):
                return
            d.rmdir()
        except OSError:
            return
        d = d.parent


def cmd_train(argv: Sequence[str]) -> int:
    import hydra

    from sparsetrain.config import config_dir, register_recipes

    bad = _check_recipe(argv)
    if bad is not None:
        return bad
    callbacks = [a for a in argv if a.lstrip("+~").startswith(("hydra.callbacks", "hydra/callbacks"))]
    if callbacks:   # Hydra instantiates them before sparsetrain sees the config: a package helper would run
        print(f"error: hydra.callbacks: not accepted ({callbacks[0]!r}); sparsetrain runs no Hydra callbacks",
              file=sys.stderr)
        return 2
    problem, existing = _prevalidate(argv)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    register_recipes()

    @hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
    def _app(cfg) -> float | None:
        from hydra.core.hydra_config import HydraConfig

        from sparsetrain.config import ConfigError, build_run, run_dir_from_hydra
        from sparsetrain.training.checkpoint import CheckpointError
        from sparsetrain.training.loop import RunDirError, train

        run_dir = run_dir_from_hydra()
        try:
            spec = build_run(cfg)
            spec.train_args.overrides = tuple(HydraConfig.get().overrides.task)  # for the printed resume command
            note = spec.scheduler.schedule_warning(spec.train_args.max_steps)   # e.g. a short dynamic run
            if note and os.environ.get("RANK", "0") == "0":
                print(f"warning: {note}", flush=True)
            summary = train(spec, run_dir)
        except (ConfigError, CheckpointError, RunDirError, FileNotFoundError, ValueError) as e:
            # ValueError: structural problems found while building (block/targets vs a pretrained model).
            # A stop (SIGTERM/SIGINT: 128 + signal; non-finite loss: 1) carries its own exit code.
            _remove_new_empty_dirs(run_dir, existing)
            if os.environ.get("RANK", "0") == "0":  # one line, not one per process
                print(f"error: {e}", file=sys.stderr)
            sys.exit(getattr(e, "exit_code", 2))
        except BaseException:
            _remove_new_empty_dirs(run_dir, existing)
            raise
        return summary.get("final_eval_loss")

    saved = sys.argv
    sys.argv = ["sparsetrain train", *argv]
    try:
        _app()
    finally:
        sys.argv = saved
    return 0


def cmd_recipes(argv: Sequence[str]) -> int:
    from sparsetrain.config import list_recipes, recipes_dir

    recipes = list_recipes()
    width = max(len(n) for n in recipes)
    print(f"recipes ({recipes_dir()}):")
    for name, desc in recipes.items():
        print(f"  {name:<{width}}  {desc}")
    print("\nrun one with: sparsetrain train recipe=NAME [overrides]")
    return 0


def cmd_flops(argv: Sequence[str]) -> int:
    from omegaconf import OmegaConf

    from sparsetrain import flops
    from sparsetrain.config import ConfigError, build_run, compose, predictions_per_seq
    from sparsetrain.training.setup import sparsify_model

    argv, card = _floor_flag(list(argv))
    if isinstance(card, int):
        return card
    bad = _check_recipe(argv)
    if bad is not None:
        return bad
    try:
        cfg = compose(list(argv))
        spec = build_run(cfg)
        model = spec.build_model()
        layers = sparsify_model(model, spec.scheduler, spec.sparsify_kwargs, format="masked")
        spec.scheduler.prepare_flop_count(layers)  # e.g. sparse-then-dense counts its 2:4 phase
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t = cfg.trainer
    global_batch = t.batch_size * t.grad_accum
    seq = OmegaConf.select(cfg, "data.seq_len")
    img = OmegaConf.select(cfg, "data.image_size")
    report = flops.count_step_flops(model, batch_size=global_batch, seq_len=seq, image_size=img,
                                    predictions_per_seq=predictions_per_seq(cfg))
    print(f"recipe: {cfg.recipe_info.name}   method: {spec.method}   steps: {t.max_steps}")
    print(report.format_table())
    frac = spec.scheduler.sparse_fraction  # sparse-then-dense: dense after the 2:4 phase
    total_dense = report.dense_total * t.max_steps
    total_sparse = (report.sparse_total * frac + report.dense_total * (1 - frac)) * t.max_steps
    policy = getattr(spec.scheduler, "policy", None)
    extra = ""
    if getattr(policy, "needs_grad", False):  # only a policy reading the dense gradient pays for it
        extra = f"; {type(policy).__name__}'s dense gradient adds {report.rigl_update_extra:.3e} per update step"
    print(f"\ntraining total ({t.max_steps} steps): dense {total_dense:.3e}  sparse {total_sparse:.3e}  "
          f"(x{total_sparse / total_dense:.3f}{extra})")
    if card is not None:
        from sparsetrain.floor import format_floor, step_floor

        n = sum(p.numel() for p in model.parameters())
        print("\n" + format_floor(step_floor(report, model.config, n, card), card))
    return 0


def _floor_flag(argv: list[str]):
    """``--floor CARD`` (or ``--floor=CARD``) taken out of ``argv``: (the rest, the Card or None), or (argv, 2)
    after an error message naming the flag."""
    from sparsetrain.floor import CARDS

    rest, card = [], None
    it = iter(argv)
    for a in it:
        if a == "--floor" or a.startswith("--floor="):
            name = a.partition("=")[2] if "=" in a else next(it, "")
            if name.lower() not in CARDS:
                print(f"error: --floor must name a card: {', '.join(CARDS)}; got {name!r}", file=sys.stderr)
                return argv, 2
            card = CARDS[name.lower()]
        else:
            rest.append(a)
    return rest, card


def cmd_pareto(argv: Sequence[str]) -> int:
    from sparsetrain import pareto

    return pareto.main(list(argv))


def cmd_bench(argv: Sequence[str]) -> int:
    from sparsetrain import bench

    if not argv or argv[0] not in bench.BENCHES:
        print(f"usage: sparsetrain bench {{{'|'.join(bench.BENCHES)}}} [args]  (needs a CUDA GPU)", file=sys.stderr)
        return 2
    return bench.run(argv[0], list(argv[1:]))


def cmd_export(argv: Sequence[str]) -> int:
    from sparsetrain.export import main as export_main

    return export_main(list(argv))


COMMANDS = {"train": cmd_train, "recipes": cmd_recipes, "flops": cmd_flops, "pareto": cmd_pareto,
            "bench": cmd_bench, "export": cmd_export}


def _working_dir_on_path() -> None:
    """Put the working directory first on ``sys.path``, as ``python -m`` does, so that ``_target_`` paths
    name the user's own modules (``policy._target_=my_policies.GradEMA`` with my_policies.py here)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _working_dir_on_path()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd = argv[0]
    if cmd not in COMMANDS:
        print(f"error: unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
        return 2
    return COMMANDS[cmd](argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
