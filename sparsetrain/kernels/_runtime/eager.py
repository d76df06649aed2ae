"""``torch.compiler.disable``, applied when the function is first called instead of when it is defined.

``torch.compiler.disable`` imports ``torch._dynamo`` (about a second, most of ``import sparsetrain``) the moment
it decorates; a function that only runs eagerly inside a compiled model (a graph break by design) needs it only
once something calls it.

>>> @eager_only
... def double(x):
...     return 2 * x
>>> double(3)
6
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Generic, ParamSpec, TypeVar

import torch

_P = ParamSpec("_P")
_R = TypeVar("_R")


class eager_only(Generic[_P, _R]):  # noqa: N801 - used as a decorator, like torch.compiler.disable
    """``fn`` wrapped by ``torch.compiler.disable`` on its first call: never traced by dynamo."""

    def __init__(self, fn: Callable[_P, _R]):
        functools.update_wrapper(self, fn)
        self._fn, self._disabled = fn, None

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        disabled = self._disabled
        if disabled is None:
            disabled = self._disabled = torch.compiler.disable(self._fn)
        return disabled(*args, **kwargs)
