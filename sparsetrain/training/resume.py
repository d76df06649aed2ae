"""Where a run starts from, decided in one place before anything is written: fresh, resumed from which
checkpoint, started from another run's weights (``trainer.init_from``), or refused and why. :func:`decide_start`
makes the whole decision (reading only); :func:`prepare_run_dir` then carries it out in the run directory; the
loop asks :func:`data_position` where in the data a resumed run continues. Checkpoint files themselves are only
written and read by :mod:`sparsetrain.training.checkpoint`.

* ``trainer.resume=auto`` takes the newest *intact* checkpoint (a damaged one is named and skipped);
  with none it starts from step 0, replacing the metrics of a run killed before its first checkpoint.
* A fresh start (no ``trainer.resume``) over a finished run or one with checkpoints is refused; over a partial
  run with no checkpoint it starts again and says that the old metrics are replaced.
* Resuming with another value of anything that shapes the model or its masks is refused with one line listing
  the keys (:func:`shape_changes`, on plain dicts).
* Resuming on another number of processes (or another split of the global batch into processes, micro-batch
  size and accumulation) continues at the same sample of the same epoch with the same global batch
  (:func:`data_position`); a run whose global batch differs, or whose micro-batches cannot start at that
  sample, is refused in one line naming the settings. Model, masks and optimizer state are replicated under
  DDP, so they load on any process count.
* ``trainer.init_from`` starts a *new* run (step 0, a new optimizer, LR schedule and data order) from another
  run's checkpoint: its weights and masks only (BERT phase II from phase I). It names a checkpoint dir or a run
  dir (its newest intact checkpoint). The model and the sparsity layout must match (:data:`INIT_KEYS`);
  ``data.seq_len`` and everything else may differ. With ``trainer.resume=auto`` a checkpoint of the run itself
  wins (the continued run resumes itself); with ``trainer.resume=PATH`` it is refused.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparsetrain.training import checkpoint as ckpt
from sparsetrain.training.batches import same_sample_position
from sparsetrain.training.checkpoint import CheckpointError
from sparsetrain.training.metrics import METRICS_FILE

#: Config keys (and key prefixes) a resumed run must share with its checkpoint: they decide the model's
#: shapes, which weights are masked and how masks evolve, or the data order.
SHAPE_KEYS = ("model", "sparsity", "data.seq_len", "data.vocab_size", "data.image_size", "seed")
#: Config keys a run started with ``trainer.init_from`` must share with the checkpoint: the model and the sparsity
#: layout (not the scheduler, its seed or the data order, which are the new run's own) ...
INIT_KEYS = ("model", "sparsity.density", "sparsity.distribution", "sparsity.density_overrides", "sparsity.block",
             "sparsity.format", "sparsity.targets", "sparsity.exclude", "data.vocab_size", "data.image_size")
#: ... except these, which shape no weight (the position table is ``model.max_position_embeddings``; the residual
#: stream's precision)
INIT_FREE = ("model.seq_len", "model.attn_implementation", "model.fp32_residual")
INIT_KEY = "trainer.init_from"
#: Settings a resumed run takes from its own config over the checkpoint's, saying so in one line: what users change
#: on purpose (a lower learning rate after a divergence, a longer schedule) ...
APPLIED_KEYS = ("optim.optimizer", "optim.lr_schedule", "optim.warmup_steps", "optim.min_lr_ratio", "trainer.max_steps")
#: ... except these: the state of another optimizer, or of another grouping of the parameters, cannot carry over.
REFUSED_KEYS = ("optim.optimizer._target_", "optim.no_decay")
#: Keys added to the config tree after runs had been saved without them, with the value those runs behaved as:
#: a stored config that lacks one compares as holding it (a run saved before ``model.fused_qkv`` existed resumes
#: with ``model.fused_qkv=false``, and is refused with ``true``).
ADDED_KEYS = {"model.fused_qkv": False, "model.fp32_residual": True}


class RunDirError(RuntimeError):
    pass


@dataclass
class StartPlan:
    """How a run starts: ``path``/``state`` of the checkpoint to resume (None: from step 0), the checkpoints
    skipped as damaged, and whether old metrics are to be replaced."""

    path: Path | None = None
    state: dict[str, Any] | None = None
    #: ``trainer.init_from``: the checkpoint whose weights and masks a fresh run starts from, and its state
    init_path: Path | None = None
    init_state: dict[str, Any] | None = None
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    replace_metrics: bool = False
    #: config keys (:data:`APPLIED_KEYS`) whose values this resumed run changes over its checkpoint's
    applied: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def check_compatible(state: dict[str, Any], path: Path, scheduler, key: str | None = None,
                     same_scheduler: bool = True) -> None:
    """A sparse run refuses a checkpoint that has no sparsity state (its masks would be invented). A resumed run
    (``same_scheduler``) also refuses another scheduler's state; ``key`` (e.g. ``trainer.init_from``) leads the
    message."""
    sp = state.get("sparsity")
    lead = f"{key}: " if key else ""
    if scheduler.sparse and not sp:
        raise CheckpointError(f"{lead}checkpoint {path} has no sparsity state, but this run uses "
                              f"{scheduler.name!r}: refusing to start with invented masks")
    if same_scheduler and sp and sp.get("name") != scheduler.name:
        raise CheckpointError(f"checkpoint {path} holds sparsity state of {sp.get('name')!r}, this run uses "
                              f"{scheduler.name!r}")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out if out or not prefix else {prefix: {}}
    return {prefix: tree}


def shape_changes(old: dict, new: dict, keys: tuple[str, ...] = SHAPE_KEYS, free: tuple[str, ...] = ()) -> list[str]:
    """Dotted keys under ``keys`` (and not under ``free``) whose values differ between two resolved configs
    (plain dicts).

    >>> shape_changes({"sparsity": {"density": 0.1}, "seed": 0}, {"sparsity": {"density": 0.2}, "seed": 0})
    ['sparsity.density']
    """
    a, b = _flatten(old), _flatten(new)
    for key, value in ADDED_KEYS.items():
        for flat, tree in ((a, old), (b, new)):
            if key not in flat and isinstance(tree.get(key.split(".")[0]), dict):
                flat[key] = value

    def under(k: str, prefixes: tuple[str, ...]) -> bool:
        return any(k == p or k.startswith(p + ".") for p in prefixes)

    return sorted(k for k in set(a) | set(b) if under(k, keys) and not under(k, free) and a.get(k) != b.get(k))


def _position_table(config: dict) -> dict:
    """``config`` with BERT's ``model.max_position_embeddings`` spelt out: the builder makes it ``seq_len`` when
    unset (sparsetrain.models.builders), so two runs that set neither compare their tables, not their seq_len."""
    model = config.get("model")
    if not isinstance(model, dict) or model.get("arch") != "bert" or "seq_len" not in model:
        return config
    return {**config, "model": {"max_position_embeddings": model["seq_len"], **model}}


def stored_config(path: Path, state: dict[str, Any]) -> dict | None:
    """The resolved config a checkpoint was trained with: its own copy, else its run's config.yaml."""
    if isinstance(state.get("config"), dict):
        return state["config"]
    yaml_path = path.parent.parent / "config.yaml"
    if yaml_path.is_file():
        import yaml

        loaded = yaml.safe_load(yaml_path.read_text())
        return loaded if isinstance(loaded, dict) else None
    return None


def check_same_shape(path: Path, state: dict[str, Any], config: dict, key: str = "trainer.resume") -> None:
    """Refuse a checkpoint trained with other values of the keys that shape the model and its masks: for
    ``trainer.resume`` :data:`SHAPE_KEYS`, for ``trainer.init_from`` :data:`INIT_KEYS` (less :data:`INIT_FREE`)."""
    old = stored_config(path, state)
    if old is None or not config:
        return
    if key == INIT_KEY:
        old, config = _position_table(old), _position_table(config)
        changed = shape_changes(old, config, INIT_KEYS, INIT_FREE)
        fix = "start from a checkpoint of the same model and sparsity layout, or set these keys to its values"
    else:
        changed = shape_changes(old, config)
        fix = "resume with the checkpoint's values or start a new run dir"
    if changed:
        shown = ", ".join(f"{k} ({_get(old, k)} -> {_get(config, k)})" for k in changed[:8])
        more = f" and {len(changed) - 8} more" if len(changed) > 8 else ""
        raise CheckpointError(f"{key}: checkpoint {path} was trained with other model/mask settings: "
                              f"{shown}{more}; {fix}")


def changed_settings(path: Path, state: dict[str, Any], config: dict, notes: list[str]) -> list[str]:
    """The :data:`APPLIED_KEYS` a resumed run changes over its checkpoint's (a line for the log added to
    ``notes``); :data:`REFUSED_KEYS` changed raise :class:`CheckpointError` naming them."""
    old = stored_config(path, state)
    if old is None or not config:
        return []
    refused = shape_changes(old, config, REFUSED_KEYS)
    if refused:
        shown = ", ".join(f"{k} ({_get(old, k)} -> {_get(config, k)})" for k in refused)
        raise CheckpointError(f"trainer.resume: checkpoint {path} was trained with another {shown}: its optimizer "
                              f"state cannot carry over; resume with the checkpoint's value, or start a new run from "
                              f"its weights and masks with {INIT_KEY}={path}")
    applied = shape_changes(old, config, APPLIED_KEYS, REFUSED_KEYS)
    if applied:
        shown = ", ".join(f"{k} ({_get(old, k)} -> {_get(config, k)})" for k in applied)
        longer = "; the learning-rate and mask-update schedules follow the new length" \
            if "trainer.max_steps" in applied else ""
        notes.append(f"trainer.resume: this run's {shown} replace the checkpoint's{longer}")
    return applied


def _split(processes: int, batch_size: int, grad_accum: int) -> str:
    return f"{processes} process(es) x trainer.batch_size={batch_size} x trainer.grad_accum={grad_accum}"


def _keep_global(total: int, processes: int, batch_size: int) -> str:
    """Settings that give ``total`` samples per optimizer step on ``processes`` processes."""
    if total % processes:
        return f"a process count that divides {total}"
    per = total // processes
    if per % batch_size == 0:
        return f"trainer.grad_accum={per // batch_size}"
    return f"trainer.batch_size={per} trainer.grad_accum=1"


def data_position(path: Path, state: dict[str, Any], processes: int, batch_size: int, grad_accum: int,
                  samples: int) -> tuple[int, str | None]:
    """``(micro, note)``: the global micro-batch index (:class:`~sparsetrain.training.batches.Batches`) at which
    this run continues the checkpoint of ``state``, and a line for the log when it splits the global batch
    otherwise. Raises :class:`CheckpointError` when the global batch (processes x batch size x accumulation)
    differs, or when no micro-batch of this run starts at the checkpoint's sample; ``samples`` is the size of
    the training set.

    >>> state = {"micro_batches": 4, "processes": 2, "args": {"batch_size": 4, "grad_accum": 1}}
    >>> data_position(Path("ckpt"), state, processes=1, batch_size=4, grad_accum=2, samples=40)[0]
    8
    """
    micro, old_processes = state["micro_batches"], state.get("processes", 1)
    old = state.get("args") or {}
    if "batch_size" not in old:   # written before the batch split was stored: the position as it is
        return micro, None
    old_batch, old_accum = old["batch_size"], old.get("grad_accum", 1)
    old_total, total = old_processes * old_batch * old_accum, processes * batch_size * grad_accum
    if old_total != total:
        raise CheckpointError(f"trainer.resume: checkpoint {path} was trained with a global batch of {old_total} "
                              f"({_split(old_processes, old_batch, old_accum)}), this run has {total} "
                              f"({_split(processes, batch_size, grad_accum)}): the learning-rate and mask "
                              f"schedules count steps of one global batch; keep it with "
                              f"{_keep_global(old_total, processes, batch_size)}")
    old_group, group = old_processes * old_batch, processes * batch_size
    if (old_processes, old_group) == (processes, group):
        return micro, None
    position = same_sample_position(micro, samples, old_group, group)
    if position is None:
        epoch, i = divmod(micro, max(1, samples // old_group))
        raise CheckpointError(f"trainer.resume: checkpoint {path} stopped at sample {i * old_group} of epoch "
                              f"{epoch}, where no micro-batch of this run starts ({group} samples: {processes} "
                              f"process(es) x trainer.batch_size={batch_size}); resume with processes x "
                              f"trainer.batch_size = {old_group}, as the checkpoint was written")
    note = (f"resuming a checkpoint of {_split(old_processes, old_batch, old_accum)} with "
            f"{_split(processes, batch_size, grad_accum)}: the same global batch ({total}), continuing at the "
            f"same sample (sums and dropout draws differ from an uninterrupted run in rounding and randomness)")
    if group != old_group:
        note += f" (evaluation reads trainer.eval_batches x {group} samples, the checkpoint's run x {old_group})"
    return position, note


def _get(tree: dict, key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return "unset"
        node = node[part]
    return repr(node)


def _newest_intact(root: Path) -> tuple[Path | None, dict[str, Any] | None, list[tuple[Path, str]]]:
    """The newest checkpoint under ``root`` that reads intact, its state, and the damaged ones skipped."""
    skipped = []
    for path in reversed(ckpt.list_checkpoints(root)):
        try:
            return path, ckpt.read_state(path), skipped
        except CheckpointError as e:
            skipped.append((path, str(e)))
    return None, None, skipped


def find_init(init_from: str | Path) -> tuple[Path, dict[str, Any], list[str]]:
    """``trainer.init_from``: a checkpoint dir, or a run dir (its newest intact checkpoint). Returns the
    checkpoint, its state (every file checked intact, read with weights_only) and notes for the log; anything
    else raises :class:`CheckpointError` naming ``trainer.init_from``. Reads only: nothing is set aside."""
    path = Path(init_from)
    notes = []
    try:
        if (path / ckpt.STATE_FILE).is_file():
            return path, ckpt.read_state(path), notes
        if (path / "checkpoints").is_dir():
            found, state, skipped = _newest_intact(path / "checkpoints")
            notes += [f"{INIT_KEY}: skipping the damaged checkpoint {p} ({why})" for p, why in skipped]
            if found is None:
                raise CheckpointError(f"run dir {path} holds no intact checkpoint under checkpoints/")
            return found, state, notes
    except CheckpointError as e:
        raise CheckpointError(f"{INIT_KEY}: {e}") from None
    what = "is not a sparsetrain checkpoint" if path.exists() else "does not exist"
    raise CheckpointError(f"{INIT_KEY}: {path} {what} (a checkpoint dir holds {ckpt.STATE_FILE}, a run dir "
                          f"checkpoints/step_XXXXXXXX)")


def plan_start(resume: str | None, run_dir: Path, init_from: str | None = None) -> StartPlan:
    """Decide (reading only) how the run in ``run_dir`` starts; raise RunDirError/CheckpointError if it can't.
    The caller then checks the checkpoint against the run (:func:`check_same_shape`), and a fresh run's
    ``init_from`` checkpoint too."""
    if init_from is not None and resume not in (None, "auto"):
        raise CheckpointError(f"{INIT_KEY} and trainer.resume={resume} are both set: trainer.resume=PATH continues "
                              f"a run from its checkpoint (step, optimizer, schedules), {INIT_KEY} starts a new run "
                              f"from a checkpoint's weights and masks; set one of them")
    root = run_dir / "checkpoints"
    plan = StartPlan()
    has_metrics = (run_dir / METRICS_FILE).exists()
    finished = (run_dir / "summary.json").exists()
    if resume is None:
        if has_metrics and (finished or ckpt.list_checkpoints(root)):
            raise RunDirError(f"{run_dir} already holds a run (metrics.jsonl); continue it with "
                              f"trainer.resume=auto or choose another hydra.run.dir")
    elif resume == "auto":
        plan.path, plan.state, plan.skipped = _newest_intact(root)
        if plan.path is None and has_metrics and finished:
            raise RunDirError(f"{run_dir} holds a finished run without an intact checkpoint; choose another "
                              f"hydra.run.dir")
    else:
        path = Path(resume)
        if not (path / ckpt.STATE_FILE).is_file():
            raise CheckpointError(f"trainer.resume: {path} is not a sparsetrain checkpoint (no {ckpt.STATE_FILE})")
        plan.path, plan.state = path, ckpt.read_state(path)
    if plan.path is None and has_metrics:
        plan.replace_metrics = True
        plan.notes.append(f"{run_dir} holds a partial run with no checkpoint: starting again from step 0 "
                          f"(its metrics.jsonl is replaced)")
    elif plan.path is None and resume == "auto":
        plan.notes.append(f"trainer.resume=auto: no checkpoint under {root}, starting from step 0")
    if init_from is not None and plan.path is not None:
        plan.notes.append(f"{INIT_KEY} is not used: trainer.resume=auto continues this run from its own checkpoint "
                          f"{plan.path}")
    elif init_from is not None:
        plan.init_path, plan.init_state, notes = find_init(init_from)
        plan.notes += notes + [f"{INIT_KEY}: starting from the weights and masks of {plan.init_path} (step "
                               f"{plan.init_state['step']} of its run) at step 0, with a new optimizer and "
                               f"learning-rate schedule"]
    return plan


def decide_start(resume: str | None, run_dir: Path, init_from: str | None, scheduler, config: dict) -> StartPlan:
    """The whole decision of how the run in ``run_dir`` starts (reading only): :func:`plan_start`, then the
    checkpoint to resume checked against this run's scheduler and config (:func:`check_compatible`,
    :func:`check_same_shape`), and a fresh run's ``init_from`` checkpoint the same way. Raises
    :class:`RunDirError` or :class:`CheckpointError` naming the setting when the run cannot start."""
    plan = plan_start(resume, run_dir, init_from)
    if plan.state is not None:
        check_compatible(plan.state, plan.path, scheduler)
        check_same_shape(plan.path, plan.state, config)
        plan.applied = changed_settings(plan.path, plan.state, config, plan.notes)
    if plan.init_state is not None:   # the same model and mask layout; the scheduler is the new run's own
        check_compatible(plan.init_state, plan.init_path, scheduler, key=INIT_KEY, same_scheduler=False)
        check_same_shape(plan.init_path, plan.init_state, config, key=INIT_KEY)
    return plan


def prepare_run_dir(run_dir: Path, plan: StartPlan, config: dict) -> None:
    """Main process, once every check passed: set damaged checkpoints aside, remove leftovers of an interrupted
    write, replace a partial run's metrics, say how the run starts, save the config."""
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


#: What to do before continuing a run that stopped, by why it stopped.
DIVERGED = "change what made it diverge (e.g. a lower optim.optimizer.lr)"
DISK_FULL = "make room on the disk (or lower trainer.keep_checkpoints)"
NOT_WRITTEN = "fix what stopped the write"


def continue_message(what: str, run_dir: Path, overrides: tuple[str, ...] | list[str],
                     started_from: Path | None, fix: str = DIVERGED) -> str:
    """One line for a run that stopped (a non-finite value, a checkpoint it could not write): what happened and
    how to go on from the last good checkpoint (the run's newest, else the checkpoint it was started from)."""
    last = ckpt.list_checkpoints(run_dir / "checkpoints")
    resume = "auto" if last or started_from is None else str(started_from)
    where = last[-1] if last else started_from
    if where is None:
        return f"{what}; no checkpoint was written yet: {fix} and start the run again"
    return f"{what}; the last good checkpoint is {where}: {fix} and continue with " \
           f"{resume_command(run_dir, overrides, resume)}"


def resume_command(run_dir: Path, overrides: tuple[str, ...] | list[str] = (), resume: str = "auto") -> str:
    """The command that continues the run in ``run_dir`` from its newest checkpoint (or from ``resume``).

    >>> resume_command(Path("runs/a"), ["recipe=quickstart", "trainer.resume=x"])
    'sparsetrain train recipe=quickstart hydra.run.dir=runs/a trainer.resume=auto'
    """
    kept = [o for o in overrides if not o.lstrip("+~").startswith(("trainer.resume=", "hydra.run.dir="))]
    if not overrides:
        kept = ["<the same overrides>"]
    parts = ["sparsetrain", "train", *kept, f"hydra.run.dir={run_dir}", f"trainer.resume={resume}"]
    return " ".join(p if p == "<the same overrides>" else shlex.quote(p) for p in parts)
