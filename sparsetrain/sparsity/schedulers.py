"""Sparsity schedulers: one small interface the training loop calls after each optimizer step.

    sched.attach(model, optimizer, total_steps)   # once, after sparsify() and the optimizer exist
    for step in range(1, total_steps + 1):        # optimizer steps (gradient accumulation aware)
        ... forward / backward / optimizer.step() ...
        record = sched.step(step)                 # None, or a dict saying what changed
    sched.state_dict() / sched.load_state_dict()  # in every checkpoint

Masks themselves live in the model (each SparseLinear's ``mask`` buffer), so they travel with the model
state; a scheduler's own state is its step counter and its policy's state. A scheduler sees layers only
through the :class:`~sparsetrain.sparsity.protocol.SparseLayer` protocol and decides by their ``caps``.
Determinism: random choices use a CPU generator seeded from (seed, step, layer index) — identical on every
data-parallel rank and after a resume. Gradient scores are all-reduced before choosing.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsetrain.sparsity.graphed import GraphedUpdate
from sparsetrain.sparsity.layout import to_scores_grid
from sparsetrain.sparsity.policies import Policy, get_policy
from sparsetrain.sparsity.protocol import SparseLayer, sparse_layers
from sparsetrain.sparsity.schedules import UpdateSchedule, make_drop_schedule
from sparsetrain.sparsity.update import update_mask

__all__ = ["Dense", "PruneRegrow", "SparsityScheduler", "Static", "sparse_layers"]


def _check_fraction(value: float, name: str) -> float:
    v = float(value)
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return v


#: Mask updates closer than this many steps apart on average make a run mostly update masks on a GPU, where one
#: costs several steps (``SparsityScheduler.schedule_warning`` says so before the run starts).
MIN_UPDATE_INTERVAL = 10


class SparsityScheduler:
    """Base class. Subclasses override ``_update(step)`` and, if needed, ``initial_density``."""

    #: False for schedulers that keep the model dense (no sparsify)
    sparse: bool = True
    # The masks (hence the block format's index tensors) never change after attach: a run may be CUDA-graphed
    # (trainer.compile_mode=reduce-overhead), whose graphs keep the tensors' addresses.
    static_topology: bool = False
    #: Fraction of the training steps the model is sparse (sparse-then-dense: its sparse phase); FLOP totals use it
    sparse_fraction: float = 1.0
    #: Every mask this scheduler writes is a transposable 2:4 mask (formats with ``needs_nm`` accept it)
    produces_nm: bool = False
    #: Its updates shrink the active count (formats with ``keeps_count`` cannot hold its masks)
    shrinks_count: bool = False
    name: str = "base"

    def __init__(self, seed: int = 0, dense_from: float | None = None) -> None:
        self.seed = int(seed)
        if dense_from is not None:
            if not 0.0 < float(dense_from) <= 1.0:
                raise ValueError(f"dense_from must be in (0, 1] or null, got {dense_from!r}")
            self.sparse_fraction = float(dense_from)
        self.dense_from = None if dense_from is None else float(dense_from)
        self.dense_step: int | None = None
        self.switched = False
        self.step_count = 0
        self.layers: dict[str, SparseLayer] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.total_steps = 0
        self._density: float | None = None

    # -- what sparsify() should start from -------------------------------------------------------
    def initial_density(self, target: float) -> float:
        """Density each layer starts at, given its target density."""
        return target

    def initial_format(self, requested: str) -> str:
        return requested

    def set_targets(self, targets: dict[str, float]) -> None:
        """Final density per layer name (from the distribution), given before ``attach``. Default: unused."""

    def prepare_flop_count(self, layers: dict[str, SparseLayer]) -> None:
        """Put freshly sparsified ``layers`` in the state whose FLOPs dominate the run, for a FLOP count
        without training. Default: they already are."""

    def update_schedule(self, total_steps: int) -> UpdateSchedule | None:
        """The steps at which masks change in a run of ``total_steps`` (None: never). Pure: no layer needed."""
        return None

    def schedule_warning(self, total_steps: int) -> str | None:
        """One line when a run of ``total_steps`` would update its masks so often (fewer than
        :data:`MIN_UPDATE_INTERVAL` steps apart) that it mostly updates masks; None otherwise."""
        schedule = self.update_schedule(total_steps)
        if schedule is None or schedule.num_updates() == 0 or schedule.interval >= MIN_UPDATE_INTERVAL:
            return None
        every = "every step" if schedule.interval == 1 else f"one every {schedule.interval} steps"
        if getattr(self, "interval", None) is None:
            asked, fix = f"num_updates={self.num_updates}", "for a run this short, lower sparsity.scheduler.num_updates"
        else:
            asked, fix = f"interval={self.interval}", "raise sparsity.scheduler.interval"
        return (f"sparsity.scheduler.{asked} over trainer.max_steps={total_steps} gives {schedule.num_updates()} "
                f"mask updates, {every}; an update costs several steps on a GPU (the run summary's update_steps "
                f"says how many), so this run would mostly update masks: {fix}")

    # -- the interface ----------------------------------------------------------------------------
    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
               total_steps: int = 1) -> SparsityScheduler:
        if int(total_steps) < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        self.model = model
        self.layers = sparse_layers(model)
        if self.sparse and not self.layers:
            raise ValueError(f"{type(self).__name__} found no SparseLinear layer: call sparsify(model, ...) first")
        self.optimizer = optimizer
        self.total_steps = int(total_steps)
        if self.dense_from is not None:   # a dense phase of no steps (dense_from 1.0): sparse to the end, no switch
            step = max(1, int(round(self.dense_from * self.total_steps)))
            self.dense_step = step if step < self.total_steps else None
        self._on_attach()
        self._arm(self.step_count + 1)
        self._density = None
        return self

    def prepare_updates(self, grow: Callable[[], object] | None = None) -> bool:
        """Build ahead of the first mask update what every update reuses (start-up work); True when something
        the training step reads may have been replaced. ``grow``: the training step's own start-up work for a
        step whose layers capture their dense gradient, called with the layers armed (a policy that needs the
        gradient). Nothing to build here."""
        return False

    def gate_update(self, step: int, ok: torch.Tensor | None) -> bool:
        """Let the mask update of ``step`` change masks only where ``ok`` (a 0-d bool on the device: every loss so
        far finite) holds, without the host reading it. True where the update honours it on the device (the loop
        then need not check the weights first, a host sync); False: the loop checks before (the default)."""
        return False

    def step(self, step: int | None = None) -> dict[str, Any] | None:
        """Call after optimizer step number ``step`` (1-based). Returns a record when masks changed."""
        self.step_count = self.step_count + 1 if step is None else int(step)
        if self._dense_due(self.step_count):
            self._densify()
            record = {"event": "phase_switch", "phase": "dense", "pruned": 0, "regrown": 0}
        else:
            record = None if self.switched and self.dense_from is not None else self._update(self.step_count)
        if record is not None:
            self._density = None
            record.setdefault("step", self.step_count)
        self._arm(self.step_count + 1)
        return record

    def state_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "step": self.step_count, "seed": self.seed}
        return {**out, "switched": True} if self.switched and self.dense_from is not None else out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"checkpoint holds sparsity state of {state.get('name')!r}, this run uses {self.name!r}")
        self.step_count = int(state["step"])
        self.seed = int(state["seed"])
        if self.dense_from is not None and state.get("switched") and not self.switched:
            self._densify()   # before the model and optimizer states, which the dense phase saved
        self._arm(self.step_count + 1)

    # -- sparse-then-dense (``dense_from``) ---------------------------------------------------------------
    def _dense_due(self, step: int) -> bool:
        return self.dense_step is not None and not self.switched and step >= self.dense_step

    def _densify(self) -> None:
        """Every sparse layer becomes an ``nn.Linear`` (``layer.densify``): its weight kept, the positions outside
        the mask trainable from zero (optimizer moments: :meth:`SparseLinear.densify`)."""
        for name, layer in self.layers.items():
            self.model.set_submodule(name, layer.densify(self.optimizer))
        self.layers = {}
        self._density = None
        self.switched = True

    @property
    def density(self) -> float:
        """Overall density of the sparse layers (1.0 when there are none)."""
        if self._density is None:
            tot = sum(m.in_features * m.out_features for m in self.layers.values())
            act = sum(m.n_active * m.block.numel for m in self.layers.values())
            self._density = act / tot if tot else 1.0
        return self._density

    def describe(self) -> str:
        """The run's method label: the name, and ``+dense@F`` for a dense phase from fraction F."""
        return self.name + self._dense_label()

    def _dense_label(self) -> str:
        return f"+dense@{self.dense_from:g}" if self.dense_from is not None else ""

    def is_update_step(self, step: int) -> bool:
        """Whether ``step(step)`` may rewrite masks: the loop checks the weights are finite before it does (a host
        sync). A scheduler that does not say is taken to update at every step unless its topology is static."""
        return not self.static_topology

    # -- hooks for subclasses ---------------------------------------------------------------------
    def _on_attach(self) -> None:
        pass

    def _update(self, step: int) -> dict[str, Any] | None:
        return None

    def _arm(self, next_step: int) -> None:
        """Ask layers for their dense gradient on the next step if it is an update step that needs it."""

    # -- helpers ----------------------------------------------------------------------------------
    def _generator(self, step: int, index: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + step * 7_919 + index) % (2**63 - 1))


class Dense(SparsityScheduler):
    """No sparsity at all: the dense baseline."""

    sparse = False
    static_topology = True
    name = "dense"


class Static(SparsityScheduler):
    """The mask chosen at initialisation (random or magnitude, see ``sparsify(init=...)``) never changes.
    ``dense_from``: the fraction of training after which every sparse layer trains dense (sparse-then-dense)."""

    static_topology = True
    name = "static"

    def __init__(self, dense_from: float | None = None, seed: int = 0) -> None:
        super().__init__(seed, dense_from)
        self.static_topology = dense_from is None   # the dense phase replaces the layers

    def is_update_step(self, step: int) -> bool:
        return self._dense_due(step)


REGROW_MOMENTS = ("zero", "mean")


class PruneRegrow(SparsityScheduler):
    """Every ΔT steps between start and end: drop a fraction of the active blocks by the policy's drop score
    (magnitude: block L1 norm) and regrow as many inactive blocks by its grow score (random = SET,
    gradient = RigL). The active count is exactly constant.

    ``num_updates`` spaces that many updates evenly over ``[start, end)`` (Graphcore: 160); alternatively
    give ``interval``. ``start``/``end`` are fractions of training. ``drop_fraction`` follows
    ``drop_schedule`` (constant, cosine, linear) down to 0 at ``end``. ``dense_from``: the fraction of training
    after which every sparse layer trains dense (sparse-then-dense; no update after it). ``regrow_moments``: the
    Adam second moment a regrown weight starts with: ``zero`` (RigL's and SET's published setting) or ``mean``
    (the mean of the layer's active weights', so that its first updates are not several times the learning rate;
    :func:`~sparsetrain.nn.sparse_linear.settle_regrown_moments`). First moments start at zero either way.
    """

    name = "prune_regrow"

    def __init__(self, policy: str | Policy = "set", drop_fraction: float = 0.5, drop_schedule: str = "cosine",
                 num_updates: int | None = None, interval: int | None = None, start: float = 0.0,
                 end: float = 1.0, seed: int = 0, dense_from: float | None = None,
                 regrow_moments: str = "zero") -> None:
        super().__init__(seed, dense_from)
        if regrow_moments not in REGROW_MOMENTS:
            raise ValueError(f"regrow_moments must be one of {', '.join(REGROW_MOMENTS)}, got {regrow_moments!r}")
        self.regrow_moments = regrow_moments
        self.policy = get_policy(policy)
        self.drop_fraction = _check_fraction(drop_fraction, "drop_fraction")
        make_drop_schedule(drop_schedule, self.drop_fraction, 1)  # validate the name now
        self.drop_schedule_name = drop_schedule
        if num_updates is not None and interval is not None:
            raise ValueError("give num_updates or interval, not both")
        if num_updates is None and interval is None:
            num_updates = 160  # Graphcore's dynamic sparse BERT
        if num_updates is not None and int(num_updates) < 1:
            raise ValueError(f"num_updates must be >= 1, got {num_updates}")
        if interval is not None and int(interval) < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.num_updates, self.interval = num_updates, interval
        self.start, self.end = _check_fraction(start, "start"), _check_fraction(end, "end")
        if self.end <= self.start:
            raise ValueError(f"end ({end}) must be after start ({start})")
        self._graphed: GraphedUpdate | bool | None = None
        self._gate: torch.Tensor | None = None

    @property
    def method(self) -> str:
        return f"prune_regrow/{self.policy.name}"

    def describe(self) -> str:
        return self.method + self._dense_label()

    def update_schedule(self, total_steps: int) -> UpdateSchedule:
        s, e = int(self.start * total_steps), max(1, int(round(self.end * total_steps)))
        if self.num_updates is None:
            return UpdateSchedule(s, e, int(self.interval))
        n = min(int(self.num_updates), max(1, e - s - 1))
        return UpdateSchedule.from_num_updates(n, s, e) if e - s >= 2 else UpdateSchedule(s, e, 1)

    def _on_attach(self) -> None:
        self.schedule = self.update_schedule(self.total_steps)
        s, e = self.schedule.start, self.schedule.end
        self.drop_fn = make_drop_schedule(self.drop_schedule_name, self.drop_fraction, end_step=e, start_step=s)

    def _arm(self, next_step: int) -> None:
        if not self.policy.needs_grad or not self.layers:
            return
        want = self.schedule.is_update_step(next_step)
        for layer in self.layers.values():
            layer.arm_dense_grad(want)

    def is_update_step(self, step: int) -> bool:
        return self._dense_due(step) or (not self.switched and self.schedule.is_update_step(step))

    def prepare_updates(self, grow: Callable[[], object] | None = None) -> bool:
        """Capture the graphed update (:meth:`GraphedUpdate.prepare`) once the layers' kernel plans exist, so that
        the first update replays instead of capturing; True when it did. RigL: ``grow()`` runs with every layer
        armed (the training step captures its grow step), then each layer is armed as it was."""
        if self.switched or not self.layers:
            return False
        graphed = self._graph_update()
        done = bool(graphed) and graphed.prepare()
        if grow is not None and self.policy.needs_grad:
            armed = [layer.capture_dense_grad for layer in self.layers.values()]
            for layer in self.layers.values():
                layer.arm_dense_grad(True)
            try:
                grow()
            finally:
                for layer, was in zip(self.layers.values(), armed):
                    layer.arm_dense_grad(was)
        return done

    def gate_update(self, step: int, ok: torch.Tensor | None) -> bool:
        """The graphed update, once captured, takes ``ok`` into the graph: a false one makes every drop count 0."""
        graphed = self._graphed
        ready = bool(graphed) and graphed.graph is not None and not self.switched and not self._dense_due(step)
        self._gate = ok if ok is not None and ready else None
        return self._gate is not None

    def _graph_update(self) -> GraphedUpdate | bool:
        """The graphed update, decided once the layers' kernel plans exist (at start-up or the first update);
        False where the layers must update one by one."""
        if self._graphed is None:
            self._graphed = GraphedUpdate.for_scheduler(self) or False
        return self._graphed

    def _update(self, step: int) -> dict[str, Any] | None:
        if not self.is_update_step(step):
            return None
        frac = self.drop_fn(step)
        grads = self._reduced_grads() if self.policy.needs_grad else {}
        gate, self._gate = self._gate, None
        if self._graph_update() and self._graphed.run(step, frac, grads, gate):
            n = self._graphed.last_count
            return {"event": "mask_update", "pruned": n, "regrown": n, "drop_fraction": frac}
        if gate is not None and not bool(gate):   # (the graph could not run: the gate is read here)
            return None
        pruned = regrown = 0
        for i, (name, layer) in enumerate(self.layers.items()):
            w, mask = layer.dense_weight(), layer.mask
            g = grads.get(name)
            self.policy.generator = self._generator(step, i)
            self.policy.layer = name
            drop = to_scores_grid(self.policy.drop_scores(w, g, mask), w.shape, layer.block)
            grow = to_scores_grid(self.policy.grow_scores(w, g, mask), w.shape, layer.block)
            n_active = layer.n_active
            n = int(round(frac * n_active))
            # scores made on the host (SET's random grow scores) go to the device without a sync: the driver
            # stages pageable memory before the call returns (a pinned tensor might change before the copy ran)
            drop, grow = (t.to(mask.device, non_blocking=t.device.type == "cpu" and not t.is_pinned())
                          for t in (drop, grow))
            u = update_mask(mask, drop, grow, n, n_active)
            if u.n_dropped:
                layer.set_mask(u.mask, self.optimizer)
                if self.regrow_moments == "mean":
                    layer.settle_regrown_moments(self.optimizer)
            pruned += u.n_dropped
            regrown += u.n_grown
            layer.drop_dense_grad()
        return {"event": "mask_update", "pruned": pruned, "regrown": regrown, "drop_fraction": frac}

    def _reduced_grads(self) -> dict[str, torch.Tensor]:
        grads = {}
        for name, layer in self.layers.items():
            g = layer.dense_gradient()
            if g is None:
                raise RuntimeError(f"layer {name}: no dense gradient was captured for this update step")
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(g)
            grads[name] = g
        return grads

    def state_dict(self):
        return {**super().state_dict(), "policy": self.policy.state_dict()}

    def load_state_dict(self, state):
        self.policy.load_state_dict(state.get("policy", {}))
        super().load_state_dict(state)
