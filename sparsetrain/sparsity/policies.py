"""Prune/regrow policies: a policy is two score functions, nothing else.

The scheduler turns scores into masks (:func:`sparsetrain.sparsity.update.update_mask`), zeroes regrown
weights and their optimizer moments, and counts FLOPs. A custom policy overrides one method:

>>> class GradEMA(RigL):
...     ema: dict = {}
...     def grow_scores(self, weight, grad, mask):  # self.layer names the layer being updated
...         old = self.ema.get(self.layer, 0.0)
...         self.ema[self.layer] = 0.9 * old + grad.abs()
...         return self.ema[self.layer]

and is selected from YAML with ``sparsity.scheduler.policy._target_: my_pkg.GradEMA``.
Scores are per element (summed per block by the framework) or per block.

Labels: a run's method is ``prune_regrow/<policy.name>`` in summaries and Pareto tables. The built-ins are
``random`` (SET), ``gradient`` (RigL) and ``magnitude``; any other class is named by its class name
(``prune_regrow/GradEMA``), so a subclass is never mistaken for its parent, unless it sets ``name`` itself.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sparsetrain.sparsity import criteria


class Policy:
    """Base policy: magnitude drop, no growth (subclasses define ``grow_scores``)."""

    #: set True when ``grow_scores``/``drop_scores`` read ``grad``: the scheduler then captures the dense
    #: gradient (all positions, all-reduced across ranks) on update steps only.
    needs_grad: bool = False
    #: a CPU generator seeded identically on every rank, set by the scheduler before each call.
    generator: torch.Generator | None = None
    #: fully-qualified name of the layer being scored, set by the scheduler before each call.
    layer: str | None = None
    #: the label of runs using this policy (``prune_regrow/<name>``): a subclass that does not set it in its
    #: own body gets its class name (see __init_subclass__), never its parent's label.
    name: str = "policy"

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__name__

    def drop_scores(self, weight: Tensor, grad: Tensor | None, mask: Tensor) -> Tensor:
        """Higher = more worth keeping. Default: magnitude (block L1 norm)."""
        return criteria.magnitude(weight)

    def grow_scores(self, weight: Tensor, grad: Tensor | None, mask: Tensor) -> Tensor:
        """Higher = grown first."""
        raise NotImplementedError(f"{type(self).__name__} does not grow weights")

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Magnitude(Policy):
    """Prune by magnitude only (gradual magnitude pruning)."""

    name = "magnitude"


class SET(Policy):
    """Magnitude prune + random regrow (Mocanu et al. 2018; Graphcore's dynamic sparse BERT)."""

    name = "random"

    def grow_scores(self, weight, grad, mask):
        return criteria.random(mask.shape, self.generator)


class RigL(SET):
    """Magnitude prune + regrow where the dense gradient is largest (Evci et al. 2020)."""

    needs_grad = True
    name = "gradient"

    def grow_scores(self, weight, grad, mask):
        return criteria.gradient(grad)


POLICIES = {"set": SET, "random": SET, "rigl": RigL, "gradient": RigL, "magnitude": Magnitude}


def get_policy(policy: str | Policy) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, type) and issubclass(policy, Policy):
        return policy()
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {sorted(POLICIES)} or give a Policy subclass")
    return POLICIES[policy]()
