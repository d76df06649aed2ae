"""Direct launches of compiled Triton kernels for the launch plans (host cost).

A Triton launch ``fn[grid](*args, **constexprs)`` goes through the JIT dispatcher every time: it binds the
arguments, computes each one's specialization (16-byte alignment of pointers, divisibility of integers), builds
a cache key, looks the compiled kernel up and only then calls its launcher, which is less than half of the
host time of the whole launch (docs/history/blocksparse.md). A launch plan calls the same kernel with the same
integers and constexprs on every step, only with new data pointers, so :class:`KernelLaunch` keeps the kernel
the dispatcher returned on its first call and calls its launcher directly as long as nothing the dispatcher
decides on has changed:

- every argument has the same specialization as at the first call: tensors the same 16-byte alignment, dtype
  and device; host-made tensor descriptors the same dtype, device, shape, strides, block shape and padding
  (only the base pointer may differ); integers, floats, booleans and ``None`` the same values (any other kind
  of argument always takes the dispatcher);
- no launch hook is installed (a profiler such as proton adds them) and the function has no pre-run hooks;
- ``KernelOptions.fast_launch`` is on (read at every call: turning it off takes effect at once).

Otherwise the call goes through the dispatcher, exactly as before. Triton knobs changed after the first launch
(e.g. ``TRITON_DEBUG``) are not seen by a kernel already kept.

The direct call is the host cost of every step, so it is written for few Python calls: the check is one
generated expression in which a tensor costs one ``data_ptr()`` call (type, dtype and device are attribute
reads), or none when it is the very tensor object of the first call (the plan's own index tensors: plain
tensors without gradient, compared through a weak reference, so that no call's tensors are kept alive); idle
launch hooks are passed to the launcher as ``None`` (an empty hook chain would be called twice per launch);
the compiled kernel's launcher, function handle and metadata are read once.
"""
from __future__ import annotations

import inspect
import weakref

import torch
from torch import Tensor

from sparsetrain.kernels._runtime.options import IN_FORCE

_RUNTIME = []  # [triton.knobs.runtime] once imported ([] before; [None] for a Triton without knobs)


def _runtime():
    if not _RUNTIME:
        try:
            from triton import knobs
            _RUNTIME.append(knobs.runtime)
        except ImportError:  # an older Triton: no fast path
            _RUNTIME.append(None)
    return _RUNTIME[0]


def _descriptor_fields(d) -> dict:
    out = {}
    for k in ("shape", "strides", "block_shape", "padding", "round_f32_to_tf32"):
        f = getattr(d, k, None)
        out[k] = list(f) if isinstance(f, (list, tuple)) else f
    return out


def _checker(args: tuple):
    """A function telling whether a later argument tuple has the same specialization as ``args`` (the rules in
    the module docstring). Generated as one expression, like Triton's own argument binder, so that the check
    costs one to two microseconds. None if an argument is of a kind not handled here. It raises AttributeError
    for an object without a tensor's attributes where the first call had a tensor."""
    env: dict = {"_fields": _descriptor_fields}
    conds = [f"len(a) == {len(args)}"]
    for i, v in enumerate(args):
        x = f"a[{i}]"
        if isinstance(v, Tensor):
            # no isinstance(): an object without a tensor's dtype raises AttributeError, which the caller catches
            env[f"d{i}"], env[f"g{i}"] = v.dtype, v.device
            aligned = "==" if v.data_ptr() % 16 == 0 else "!="
            same = f"{x}.dtype is d{i} and {x}.device == g{i} and {x}.data_ptr() % 16 {aligned} 0"
            if type(v) is Tensor and not v.requires_grad:
                # a plan's own tensor (index arrays): the same object, never written, at every call. A weak
                # reference, so that a call's activation is not kept alive; an in-place write (``set_``) bumps the
                # version, and the dtype and device are compared again for ``.data =``
                env[f"w{i}"], env[f"n{i}"] = weakref.ref(v), v._version
                same = (f"({x} is w{i}() and {x}._version == n{i} and {x}.dtype is d{i} and {x}.device == g{i} "
                        f"or {same})")
            conds.append(same)
        elif type(v).__name__ == "TensorDescriptor" and isinstance(getattr(v, "base", None), Tensor):
            # a host-made descriptor: its base pointer may change; everything else the same as at the first call
            env[f"t{i}"], env[f"d{i}"], env[f"f{i}"] = type(v), v.base.dtype, _descriptor_fields(v)
            conds.append(f"type({x}) is t{i} and {x}.base.dtype is d{i} and {x}.base.get_device() == "
                         f"{v.base.get_device()} and {x}.base.data_ptr() % 16 == 0 and _fields({x}) == f{i}")
        elif v is None or isinstance(v, bool):
            conds.append(f"{x} is {v!r}")
        elif isinstance(v, (int, float)):  # the value from env: repr() of nan/inf is not an expression
            env[f"v{i}"] = v
            conds.append(f"type({x}) is {type(v).__name__} and {x} == v{i}")
        else:
            return None
    return eval(f"lambda a: {' and '.join(conds)}", env)  # noqa: S307 - built from the types above only


def _on_gpu(tensors: list[Tensor]) -> bool:
    return all(t.is_cuda for t in tensors)


#: ``_stream(device_index)``: the current CUDA stream as the integer the launcher takes (absent without CUDA).
_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class KernelLaunch:
    """``fn[grid](*args, **kwargs)`` with a fixed grid and fixed keyword arguments (constexprs and launch options
    such as ``num_warps``); see the module docstring for when a call skips the dispatcher."""

    __slots__ = ("fn", "grid", "kwargs", "compiled", "run", "function", "metadata", "tail", "same", "device",
                 "refused")

    def __init__(self, fn, grid: tuple[int, ...], kwargs: dict):
        self.fn, self.kwargs = fn, kwargs
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.compiled = self.run = self.function = self.metadata = self.tail = self.same = self.device = None
        self.refused = False  # a first call whose arguments cannot take the direct path: not looked at again

    def __call__(self, *args) -> None:
        run = self.run
        fast = IN_FORCE[0].fast_launch
        if run is not None and fast:
            try:
                same = self.same(args)
            except AttributeError:  # e.g. None or a descriptor where a tensor was
                same = False
        if run is not None and fast and same:
            rt = _RUNTIME[0]
            enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
            try:
                idle = (enter is None or not enter.calls) and (leave is None or not leave.calls)
            except AttributeError:  # a hook that is not a chain (older Triton): the dispatcher calls it
                idle = False
            if idle:
                g = self.grid
                run(g[0], g[1], g[2], _stream(self.device), self.function, self.metadata, None, None, None, *args,
                    *self.tail)
                return
        kernel = self.fn[self.grid](*args, **self.kwargs)
        if run is None and fast and not self.refused:
            self._keep(kernel, args)
            self.refused = self.compiled is None

    def _keep(self, kernel, args: tuple) -> None:
        """Keeps the dispatcher's kernel for direct calls when the arguments allow it."""
        if (kernel is None or not hasattr(kernel, "run") or getattr(self.fn, "pre_run_hooks", None)
                or _runtime() is None):
            return  # e.g. the CPU interpreter, which returns no compiled kernel
        same = _checker(args)
        tensors = [a.base if type(a).__name__ == "TensorDescriptor" else a for a in args
                   if isinstance(a, Tensor) or type(a).__name__ == "TensorDescriptor"]
        if same is None or not tensors or not _on_gpu(tensors):
            return
        params = list(inspect.signature(self.fn.fn).parameters.values())
        tail = []
        for p in params[len(args):]:  # the launcher takes every parameter, constexprs included, in order
            if p.name in self.kwargs:
                tail.append(self.kwargs[p.name])
            elif p.default is not inspect.Parameter.empty:
                tail.append(p.default)
            else:
                return
        self.tail, self.same, self.device = tuple(tail), same, tensors[0].get_device()
        self.run, self.function, self.metadata = kernel.run, kernel.function, kernel.packed_metadata
        self.compiled = kernel
