"""2:4 layers that derive their mask in every forward share one ``mask`` buffer per shape after planning
(:meth:`Semi24Format.share_masks`): the step computes the same, and what is read from a layer between steps
(checkpoint, density, dense weight, the ranks' signatures) is still that layer's own mask."""
import copy

import pytest
import torch
from torch import nn

from sparsetrain.kernels.semi24 import is_transposable24, transposable24_reference
from sparsetrain.nn import SparseLinear, plan_dispatch
from sparsetrain.nn.formats.semi24 import Semi24Format
from sparsetrain.training.ranks import layer_signatures


def _model(device="cpu", recompute=True, d=32, h=64) -> nn.Sequential:
    torch.manual_seed(0)
    fmt = lambda: Semi24Format(recompute_every_forward=recompute)  # noqa: E731
    return nn.Sequential(SparseLinear(d, h, format=fmt()), nn.GELU(), SparseLinear(h, h, format=fmt()),
                         nn.GELU(), SparseLinear(h, h, format=fmt()), nn.GELU(),
                         SparseLinear(h, d, format=fmt())).to(device)


def _layers(model) -> dict[str, SparseLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, SparseLinear)}


def _own_masks(model) -> list[torch.Tensor]:
    return [transposable24_reference(m.weight.detach())[0] for m in _layers(model).values()]


def test_layers_of_one_shape_share_one_mask_and_compute_the_same():
    model = _model()
    plain = copy.deepcopy(model)
    freed = Semi24Format.share_masks(_layers(model))
    a, b, c, d = _layers(model).values()
    assert freed == 64 * 64 and b.mask is c.mask and a.mask is not b.mask and d.mask is not b.mask
    assert b.mask_is_scratch and c.mask_is_scratch and not a.mask_is_scratch and not d.mask_is_scratch
    assert Semi24Format.share_masks(_layers(model)) == 0               # planned twice: nothing more
    opt, opt_plain = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, plain))
    for _ in range(3):                                                 # steps move the weights, so the masks
        x = torch.randn(8, 32)
        y, y_plain = model(x), plain(x)
        assert torch.equal(y, y_plain)
        y.square().sum().backward()
        y_plain.square().sum().backward()
        for p, q in zip(model.parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad)
        opt.step(), opt_plain.step(), opt.zero_grad(), opt_plain.zero_grad()
    own = _own_masks(model)
    assert not torch.equal(own[1], own[2])                             # the two shared layers' masks differ
    for layer, want in zip(_layers(model).values(), own):
        assert torch.equal(layer.current_mask(), want) and is_transposable24(want)
        assert torch.equal(layer.state_dict()["mask"], want)
        assert torch.equal(layer.dense_weight(), layer.weight.detach() * want)
        assert layer.density == 0.5 and layer.n_active == int(want.sum())
    for layer in _layers(plain).values():      # unshared: the mask of the last forward, before the last step
        layer.storage.recompute_mask(layer)
    assert torch.equal(layer_signatures(model)[1], layer_signatures(plain)[1])


def test_a_checkpoint_of_shared_layers_loads_into_unshared_ones():
    model = _model()
    Semi24Format.share_masks(_layers(model))
    fresh = _model()
    fresh.load_state_dict(model.state_dict())
    x = torch.randn(4, 32)
    assert torch.equal(fresh(x), model(x))
    for layer, want in zip(_layers(fresh).values(), _own_masks(model)):
        assert torch.equal(layer.mask, want)


def test_planning_shares_only_masks_derived_in_every_forward():
    model = _model()
    plan_dispatch(model, tokens=8)                                     # CPU: nothing timed, the masks shared
    assert _layers(model)["2"].mask is _layers(model)["4"].mask
    given = _model(recompute=False)                                    # masks a scheduler sets: each its own
    plan_dispatch(given, tokens=8)
    assert _layers(given)["2"].mask is not _layers(given)["4"].mask


def test_compiled_dense_mode_of_shared_layers_computes_each_mask_as_a_temporary(monkeypatch):
    """The CUDA routing on the CPU (``_fast_path`` forced on, as in test_semi24_format): compiled, mode "dense",
    shared layers take ``transposable24_mask_of`` (a new tensor: no write to the shared buffer inside the graph)
    and give the outputs and gradients of unshared layers, whose compiled step writes their own buffers."""
    import torch._dynamo

    monkeypatch.setattr(Semi24Format, "_fast_path", lambda self, layer, x: True)
    torch._dynamo.reset()
    model = _model()
    for layer in _layers(model).values():
        layer.storage.mode = "dense"
    plain = copy.deepcopy(model)
    Semi24Format.share_masks(_layers(model))
    scratch_before = _layers(model)["2"].mask.clone()
    x = torch.randn(6, 32)
    explain = torch._dynamo.explain(model)(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = torch.compile(model, backend="aot_eager")(xa)
    yb = torch.compile(plain, backend="aot_eager")(xb)
    assert torch.equal(ya, yb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert torch.equal(_layers(model)["2"].mask, scratch_before)       # the graph did not write the scratch
    assert torch.equal(_layers(plain)["4"].mask, _own_masks(plain)[2])  # unshared: written in place, as before
    torch._dynamo.reset()


@pytest.mark.gpu
def test_gpu_compiled_shared_masks_equal_unshared_and_keep_one_buffer_per_shape():
    import torch._dynamo

    torch._dynamo.reset()
    model = _model("cuda", d=512, h=1024)                            # shapes cuSPARSELt takes
    plain = copy.deepcopy(model)
    plan_dispatch(model, tokens=4096)
    for m in (model, plain):
        for layer in _layers(m).values():
            layer.storage.mode = "dense"
    assert len({m.mask.data_ptr() for m in _layers(model).values()}) == 3
    assert len({m.mask.data_ptr() for m in _layers(plain).values()}) == 4
    x = torch.randn(4096, 512, device="cuda")
    outs = []
    for m in (model, plain):
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = torch.compile(m)(xi)
        y.float().square().sum().backward()
        outs.append([y.detach(), xi.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    for layer in _layers(model).values():
        assert torch.equal(layer.state_dict()["mask"], transposable24_reference(layer.weight.detach())[0])
    torch._dynamo.reset()
