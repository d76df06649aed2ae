"""Storage formats: typed capabilities, the registry, formats added from outside the package (by name and by
dotted path), model-level kernel planning, the dense phase."""
import importlib
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparsetrain.nn import (
    FORMATS,
    BlockFormat,
    FormatCaps,
    MaskedFormat,
    Semi24Format,
    SparseLinear,
    WeightFormat,
    get_format,
    known_formats,
    plan_dispatch,
    register_format,
    resolve_format,
    sparsify,
)
from sparsetrain.sparsity import GradualMagnitude, SparseLayer, sparse_layers


@pytest.fixture
def registry():
    """Formats a test registers are removed afterwards."""
    before = dict(FORMATS)
    yield FORMATS
    FORMATS.clear()
    FORMATS.update(before)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))


@pytest.mark.parametrize("spec,caps", [
    ("masked", FormatCaps()),
    ("masked_st", FormatCaps(straight_through=True)),
    ("block", FormatCaps(keeps_count=True, shardable=True)),
    ("2:4", FormatCaps(straight_through=True, needs_nm=True, derives_mask=True)),
])
def test_builtin_caps(spec, caps):
    layer = SparseLinear(16, 8, format=spec)
    assert layer.caps == caps and layer.format_name == spec
    assert isinstance(layer, SparseLayer) and not isinstance(nn.Linear(4, 4), SparseLayer)


def test_caps_follow_the_instance_arguments():
    assert MaskedFormat(straight_through=True).caps.straight_through
    assert Semi24Format(recompute_every_forward=False).caps == FormatCaps(straight_through=True, needs_nm=True)
    with pytest.raises(AttributeError):
        FormatCaps().keeps_count = True  # frozen


def test_registry_and_resolver():
    assert {"masked", "masked_st", "block", "2:4"} <= set(known_formats())
    assert resolve_format("block") is BlockFormat
    assert resolve_format("sparsetrain.nn.formats.block.BlockFormat") is BlockFormat
    assert resolve_format(Semi24Format) is Semi24Format
    fmt = Semi24Format()
    assert get_format(fmt) is fmt
    with pytest.raises(ValueError, match=r"unknown sparsity format 'bogus'; known formats: \[.*'masked'"):
        resolve_format("bogus")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_format("no_such_pkg_xyz.Format")
    with pytest.raises(ValueError, match="not a WeightFormat subclass"):
        resolve_format("torch.nn.Linear")
    with pytest.raises(TypeError, match="WeightFormat subclass"):
        register_format("linear")(nn.Linear)


def test_a_name_cannot_be_taken_twice(registry):
    with pytest.raises(ValueError, match="already taken"):
        @register_format("masked")
        class Other(MaskedFormat):
            pass


_USER_FORMAT = '''
import torch
import torch.nn.functional as F
from sparsetrain.nn.formats import MaskedFormat, register_format


@register_format("rounded")
class RoundedMasked(MaskedFormat):
    """masked, but the forward uses the weight rounded to multiples of 1/8 (straight-through rounding)."""

    def forward(self, layer, x):
        w = self.effective_weight(layer)
        return F.linear(x, w + (torch.round(w * 8) / 8 - w).detach(), layer.bias)
'''


def _user_format_module(tmp_path, monkeypatch, name):
    """Write the user's module and import it afresh (so it registers its format again)."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(_USER_FORMAT))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


@pytest.mark.parametrize("by", ["name", "dotted_path"])
def test_format_from_outside_the_package_trains(tmp_path, monkeypatch, registry, by):
    user = _user_format_module(tmp_path, monkeypatch, "tmp_user_formats")
    spec = "rounded" if by == "name" else "tmp_user_formats.RoundedMasked"
    model = _mlp()
    layers = sparsify(model, targets=["0", "2"], exclude=[], density=0.5, block=4, format=spec)
    assert {type(layer.storage) for layer in layers.values()} == {user.RoundedMasked}
    assert FORMATS["rounded"] is user.RoundedMasked and layers["0"].format_name == "rounded"

    layer = layers["0"]
    x = torch.randn(5, 32)
    w = layer.dense_weight()
    torch.testing.assert_close(layer(x), F.linear(x, torch.round(w * 8) / 8, layer.bias))
    assert not torch.equal(layer(x), F.linear(x, w, layer.bias))  # the user's forward really runs

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: (l.weight.detach().clone(), l.mask.clone()) for n, l in layers.items()}
    F.mse_loss(model(x), torch.randn(5, 16)).backward()
    opt.step()
    for n, l in layers.items():
        w0, m0 = before[n]
        em = l.element_mask()
        assert not torch.equal(l.weight.detach(), w0)              # trained
        assert torch.all(l.weight.detach()[~em] == 0) and l.mask.equal(m0)  # still masked


def test_capabilities_not_names_decide(tmp_path, monkeypatch, registry):
    """Gradual pruning only asked for 'masked' by name before; any format whose count can shrink works now."""
    _user_format_module(tmp_path, monkeypatch, "tmp_user_formats_gm")
    model = _mlp()
    layers = sparsify(model, targets=["0", "2"], exclude=[], density=1.0, block=4,
                      format="tmp_user_formats_gm.RoundedMasked")
    sched = GradualMagnitude(initial_density=1.0, num_updates=2, start=0.0, end=0.5)
    sched.set_targets({n: 0.25 for n in layers})
    sched.attach(model, None, total_steps=4)
    for step in range(1, 5):
        sched.step(step)
    assert all(layer.density == pytest.approx(0.25) for layer in layers.values())
    straight = _mlp()   # a dense master weight under a mask cannot shrink (the block format can: it rebuilds)
    sparsify(straight, targets=["0", "2"], exclude=[], density=1.0, block=4, format="masked_st")
    with pytest.raises(ValueError, match="active count can shrink"):
        GradualMagnitude().attach(straight, None, total_steps=4)


def test_plan_dispatch_runs_each_formats_planner():
    model = _mlp()
    sparsify(model, targets=["0", "2"], exclude=[], density=0.5, block=4)
    assert plan_dispatch(model, tokens=8) == []  # masked does not plan
    model24 = _mlp()
    sparsify(model24, targets=["0", "2"], exclude=[], format="2:4")
    records = plan_dispatch(model24, tokens=8)
    assert [r["name"] for r in records] == ["0", "2"]
    assert all(r["choice"] == "masked-reference" for r in records)  # CPU: nothing timed


def test_plan_dispatch_frees_the_cublas_workspaces_its_timing_made(monkeypatch):
    """After planning (and only when a format planned) the cuBLAS workspaces are freed: the 2:4 timing leaves
    two the step never uses (64 MiB above dense's peak on an H200)."""
    from sparsetrain.kernels._runtime import device

    freed = []
    monkeypatch.setattr(device, "_CLEAR_CUBLAS", lambda: freed.append("cleared"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    model = _mlp()
    sparsify(model, targets=["0", "2"], exclude=[], density=0.5, block=4)
    assert plan_dispatch(model, tokens=8) == [] and freed == []
    model24 = _mlp()
    sparsify(model24, targets=["0", "2"], exclude=[], format="2:4")
    assert len(plan_dispatch(model24, tokens=8)) == 2 and freed == ["cleared"]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)      # no CUDA context: nothing to free
    assert device.release_cublas_workspaces() is False and freed == ["cleared"]


@pytest.mark.gpu
def test_gpu_plan_dispatch_keeps_no_device_memory():
    torch.manual_seed(0)
    model = nn.Sequential(SparseLinear(1024, 4096, format="2:4"), nn.GELU(),
                          SparseLinear(4096, 1024, format="2:4")).cuda()
    a = torch.randn(256, 256, device="cuda")
    (a @ a).sum().item()                      # this thread's own workspace exists before the planning
    before = torch.cuda.memory_allocated()
    records = plan_dispatch(model, tokens=4096)
    assert [r["name"] for r in records] == ["0", "2"] and all(r["ms_dense"] > 0 for r in records)
    assert torch.cuda.memory_allocated() - before < 16 * 2**20    # one kept workspace would be 32 MiB


class _CountingFormat(MaskedFormat):
    planned: list = []

    @classmethod
    def plan_kernels(cls, layers, tokens):
        cls.planned.append((sorted(layers), tokens))
        return [{"name": n, "tokens": tokens} for n in layers]


def test_plan_hook_of_a_user_format():
    model = _mlp()
    sparsify(model, targets=["0", "2"], exclude=[], format=_CountingFormat)
    assert _CountingFormat.name == f"{__name__}._CountingFormat"  # unregistered: named by its dotted path
    assert plan_dispatch(model, tokens=12) == [{"name": "0", "tokens": 12}, {"name": "2", "tokens": 12}]
    assert _CountingFormat.planned == [(["0", "2"], 12)]


@pytest.mark.parametrize("fmt", ["masked", "masked_st", "2:4"])
def test_dense_phase_shares_parameters(fmt):
    model = _mlp()
    layers = sparsify(model, targets=["0"], exclude=[], density=1.0 if fmt == "2:4" else 0.5,
                      block=1, format=fmt)
    layer = layers["0"]
    lin = layer.dense_phase()
    assert type(lin) is nn.Linear and lin.weight is layer.weight_parameter() and lin.bias is layer.bias
    model.set_submodule("0", lin)
    assert sparse_layers(model) == {}


def test_dense_phase_refuses_compressed_storage():
    layer = SparseLinear(16, 8, block=4, format="block")
    with pytest.raises(ValueError, match="use to_dense"):
        layer.dense_phase()


def test_set_format_keeps_function_and_drops_the_old_parameter():
    layer = SparseLinear.from_dense(nn.Linear(16, 8), density=0.5, block=4)
    x = torch.randn(3, 16)
    y = layer(x)
    layer.set_format("block")
    assert [n for n, _ in layer.named_parameters()] == ["bias", "values"]
    torch.testing.assert_close(layer(x), y)
    assert isinstance(layer.storage, WeightFormat) and layer.caps.keeps_count


@pytest.mark.parametrize("fmt", ["masked", "masked_st"])
def test_masked_set_mask_rewrites_its_element_mask_in_place(fmt):
    """The element mask a step multiplies by is rewritten in place by a mask update (a training step replayed
    from a CUDA graph reads it by address, so the graph can be kept), and holds the new topology."""
    from sparsetrain.sparsity.layout import to_element_mask

    layer = SparseLinear.from_dense(nn.Linear(32, 16), density=0.5, block=4, format=fmt)
    before = layer._element_mask
    ptr = before.data_ptr()
    new = ~layer.mask   # same count at density 0.5
    layer.set_mask(new)
    assert layer._element_mask is before and before.data_ptr() == ptr
    assert torch.equal(before, to_element_mask(new, layer.block).to(before.dtype))
    x = torch.randn(3, 32)
    want = F.linear(x, layer.weight * before, layer.bias)
    torch.testing.assert_close(layer(x), want)
