"""KernelLaunch: a launch plan's kernel is called directly after the dispatcher's first call, and only while
the arguments keep the specialization the dispatcher chose (CPU: a stand-in for the JIT function)."""
import pytest
import torch

from sparsetrain.kernels import use_kernel_options
from sparsetrain.kernels._runtime import triton_launch as tl_launch
from sparsetrain.kernels._runtime.triton_launch import KernelLaunch


class _Hooks:
    def __init__(self):
        self.calls = []


class _Runtime:
    def __init__(self):
        self.launch_enter_hook, self.launch_exit_hook = _Hooks(), _Hooks()


class _Compiled:
    function, packed_metadata = "fn-handle", "meta"

    def __init__(self, log):
        self.log = log

    def run(self, *a):
        self.log.append(("direct", a))


class _Jit:
    """Stands in for a JITFunction: ``fn`` gives the signature, ``[grid]`` the dispatcher."""

    def __init__(self):
        self.log = []

        def kernel(x, y, n, BLOCK, FLAG=False):  # noqa: N803 - constexpr names as in the Triton kernels
            pass
        self.fn = kernel

    def __getitem__(self, grid):
        def dispatch(*args, **kwargs):
            self.log.append(("dispatch", grid, args, kwargs))
            return _Compiled(self.log)
        return dispatch


@pytest.fixture
def fake_gpu(monkeypatch):
    rt = _Runtime()
    monkeypatch.setattr(tl_launch, "_RUNTIME", [rt])
    monkeypatch.setattr(tl_launch, "_on_gpu", lambda tensors: True)
    monkeypatch.setattr(tl_launch, "_stream", lambda index: 7)
    return rt


def _args(n=64, offset=0):
    buf = torch.zeros(64)
    return buf[offset:offset + 32], torch.zeros(8, dtype=torch.int32), n


def test_second_call_goes_straight_to_the_compiled_kernel(fake_gpu):
    jit = _Jit()
    launch = KernelLaunch(jit, (5,), {"BLOCK": 16, "num_warps": 4})
    first, second = _args(), _args()
    launch(*first)
    launch(*second)
    assert [e[0] for e in jit.log] == ["dispatch", "direct"]
    assert jit.log[0][1] == (5, 1, 1) and jit.log[0][3] == {"BLOCK": 16, "num_warps": 4}
    direct = jit.log[1][1]
    # idle hook chains are passed as None (the launcher would call each empty chain)
    assert direct[:9] == (5, 1, 1, 7, "fn-handle", "meta", None, None, None)
    # every parameter in order: the runtime arguments, then BLOCK from the kwargs and FLAG's default
    assert direct[9:12] == second and direct[12:] == (16, False)


@pytest.mark.parametrize("change", ["misaligned", "dtype", "integer", "none", "hook", "descriptor"])
def test_a_changed_specialization_takes_the_dispatcher(fake_gpu, change):
    jit = _Jit()
    launch = KernelLaunch(jit, (5,), {"BLOCK": 16})
    launch(*_args())
    x, y, n = _args()
    if change == "misaligned":
        x = _args(offset=1)[0]  # 4-byte aligned only
    elif change == "dtype":
        x = x.double()
    elif change == "integer":
        n = 65
    elif change == "none":
        y = None
    elif change == "hook":
        fake_gpu.launch_enter_hook.calls.append(print)
    else:
        x = object()  # e.g. a host-made tensor descriptor
    launch(x, y, n)
    assert [e[0] for e in jit.log] == ["dispatch", "dispatch"]
    launch(*_args())  # the kept kernel is still used for the original specialization
    assert jit.log[-1][0] == ("dispatch" if change == "hook" else "direct")


def test_nothing_is_kept_when_disabled_or_not_compiled(fake_gpu):
    jit = _Jit()
    launch = KernelLaunch(jit, (5,), {"BLOCK": 16})
    with use_kernel_options(fast_launch=False):
        launch(*_args())
        launch(*_args())
    assert [e[0] for e in jit.log] == ["dispatch", "dispatch"]
    jit.__class__ = type("Interp", (_Jit,), {"__getitem__": lambda self, g: (lambda *a, **k: None)})
    launch = KernelLaunch(jit, (5,), {"BLOCK": 16})  # the interpreter returns no compiled kernel
    launch(*_args())
    assert launch.compiled is None


def test_a_missing_constexpr_keeps_the_dispatcher(fake_gpu):
    jit = _Jit()
    launch = KernelLaunch(jit, (5,), {})  # BLOCK has no default and is not given
    launch(*_args())
    assert launch.compiled is None


def test_host_descriptors_keep_the_direct_call_while_only_the_base_moves(fake_gpu):
    from triton.tools.tensor_descriptor import TensorDescriptor

    jit = _Jit()
    launch = KernelLaunch(jit, (5,), {"BLOCK": 16})
    a, b = torch.zeros(64, 32), torch.zeros(64, 32)

    def desc(t, block=(16, 32)):
        return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], list(block))

    launch(desc(a), None, 3)
    launch(desc(b), None, 3)  # a new base pointer: still direct
    launch(desc(b, (32, 32)), None, 3)  # another block shape: the dispatcher
    launch(desc(b.double()), None, 3)  # another dtype: the dispatcher
    launch(desc(torch.zeros(32, 32)), None, 3)  # another shape: the dispatcher
    assert [e[0] for e in jit.log] == ["dispatch", "direct", "dispatch", "dispatch", "dispatch"]


def test_checker_takes_non_finite_floats():
    """Float arguments are compared by value from the environment, not by their repr (nan/inf are not
    expressions); nan never equals itself, so such a call always takes the dispatcher."""
    same = tl_launch._checker((1.5, float("inf"), float("nan")))
    assert not same((1.5, float("inf"), float("nan")))
    assert tl_launch._checker((1.5, float("inf")))((1.5, float("inf")))
    assert not tl_launch._checker((1.5,))((2.5,))


def test_a_refused_launch_is_not_examined_again(fake_gpu, monkeypatch):
    calls = []
    real = tl_launch._checker
    monkeypatch.setattr(tl_launch, "_checker", lambda args: calls.append(1) or real(args))
    jit = _Jit()
    launch = KernelLaunch(jit, (5,), {"BLOCK": 16})
    for _ in range(3):
        launch(object(), None, 3)  # an argument kind the direct path does not take
    assert len(calls) == 1 and [e[0] for e in jit.log] == ["dispatch"] * 3


def test_turning_fast_launch_off_bypasses_a_kept_kernel(fake_gpu):
    """``KernelOptions.fast_launch`` is read at every call: off, even a kernel already kept takes the dispatcher."""
    jit = _Jit()
    launch = KernelLaunch(jit, (5,), {"BLOCK": 16})
    launch(*_args())
    with use_kernel_options(fast_launch=False):
        launch(*_args())
    launch(*_args())
    assert [e[0] for e in jit.log] == ["dispatch", "dispatch", "direct"]


def test_a_plan_tensor_passed_again_is_checked_by_identity(fake_gpu):
    """A tensor the plan passes at every call (index arrays) is recognized as the same object, without a
    data_ptr() call; written in place to a misaligned view (set_), or replaced, it is checked again."""
    jit = _Jit()
    launch = KernelLaunch(jit, (5,), {"BLOCK": 16})
    x, idx, n = _args()
    launch(x, idx, n)
    launch(_args()[0], idx, n)
    assert [e[0] for e in jit.log] == ["dispatch", "direct"]
    storage = torch.zeros(9, dtype=torch.int32)
    idx.set_(storage.untyped_storage(), 1, (8,), (1,))  # same object, now 4-byte aligned only
    launch(_args()[0], idx, n)
    assert jit.log[-1][0] == "dispatch"
    launch(_args()[0], torch.zeros(8, dtype=torch.int32), n)  # another, aligned tensor: direct
    assert jit.log[-1][0] == "direct"


def test_a_first_call_tensor_is_not_kept_alive(fake_gpu):
    import gc
    import weakref

    jit = _Jit()
    launch = KernelLaunch(jit, (5,), {"BLOCK": 16})
    x, idx, n = _args()
    launch(x, idx, n)
    ref = weakref.ref(x)
    del x
    jit.log.clear()  # the stand-in dispatcher logs its arguments
    gc.collect()
    assert ref() is None
    launch(*_args())
    assert [e[0] for e in jit.log] == ["direct"]
