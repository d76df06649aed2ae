"""The products' epilogues (sparsetrain.kernels.blocksparse.epilogue): the GELU after the forward and GELU's
derivative after the input gradient, in the Triton gather kernel (under the interpreter here), as a pass of its
own after a plan without one, and in the CUDA kernels (``-m gpu``), against plain torch on fresh inputs."""
from __future__ import annotations

import pytest
import torch
from blocksparse_cases import make_mask

from sparsetrain.kernels.blocksparse import _cuda, epilogue, gather, plans
from sparsetrain.kernels.blocksparse.epilogue import DGELU, GELU, EpiloguePlan
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.testing import forced_config, untuned


def test_reference_is_gelu_and_its_derivative():
    """The plain-torch epilogue that every kernel is checked against: GELU, and GELU's derivative times the
    product, as autograd differentiates F.gelu (fp32)."""
    h = torch.randn(7, 32, dtype=torch.float64).float().requires_grad_()
    v = torch.randn(7, 32)
    torch.nn.functional.gelu(h).backward(v)
    out, out2 = epilogue.reference(v, h.detach(), DGELU)
    torch.testing.assert_close(out, h.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out2, torch.nn.functional.gelu(h.detach()))
    same, g = epilogue.reference(h.detach(), None, GELU)
    assert same is not None and torch.equal(g, torch.nn.functional.gelu(h.detach()))
    with pytest.raises(ValueError, match="epilogue"):
        epilogue.reference(v, None, 3)


def _case(b, forward, dtype, T=37, seed=0):
    gen = torch.Generator().manual_seed(seed)
    O, I = 4 * b, 3 * b
    meta = BlockSparseMeta.from_mask(make_mask("random", (O // b, I // b), gen), b)
    values = (torch.randn(meta.n_blocks, b, b, generator=gen) / b**0.5).to(dtype)
    a = torch.randn(T, I if forward else O, generator=gen).to(dtype)
    bias = torch.randn(O, generator=gen).to(dtype) if forward else None
    aux = torch.randn(T, O if forward else I, generator=gen).to(dtype)
    return meta, values, a, bias, aux


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("b", [16, 32])
@pytest.mark.parametrize("forward,epi", [(True, GELU), (False, DGELU), (True, DGELU), (False, GELU)])
def test_gather_kernel_epilogue_matches_the_product_then_torch(dtype, b, forward, epi, poison):
    """dds_epilogue (the gather kernel's store, under the interpreter) = the plain product, then the epilogue
    in torch; both outputs written everywhere (outputs start as NaN)."""
    meta, values, a, bias, aux = _case(b, forward, dtype, seed=b + epi)
    plain = plans.dds(a, values, meta, bias, forward)
    out, out2 = plans.dds_epilogue(a, values, meta, bias, forward, epi, aux if epi == DGELU else None)
    want, want2 = epilogue.reference(plain, aux, epi)
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(out2, want2, **tol)
    kept = [k for k in meta._groups["plans"] if k[0] == "plan_dds_epi"]
    assert len(kept) == 1 and meta._groups["plans"][kept[0]].native_epilogue
    again, again2 = plans.dds_epilogue(a, values, meta, bias, forward, epi, aux if epi == DGELU else None)
    assert torch.equal(again, out) and torch.equal(again2, out2)   # the kept plan, as the first call


@pytest.mark.parametrize("epi", [GELU, DGELU])
def test_a_plan_without_an_epilogue_gets_a_pass_of_its_own(epi, poison):
    """EpiloguePlan (the product, then the epilogue kernel over its output; under the interpreter here) gives
    what the gather kernel's own epilogue gives."""
    meta, values, a, bias, aux = _case(16, epi == GELU, torch.float16, T=53, seed=epi)
    forward = epi == GELU
    cfg = gather.INTERP_DDS[16]
    inner = gather.dds_plan(meta, cfg, forward, bias is not None, a.shape[0], a.stride())
    assert inner.options["EPI"] == 0
    wrapped = EpiloguePlan(inner, epi)
    assert wrapped.stable and wrapped.out_width == inner.out_width and not wrapped.native_epilogue
    out = torch.full((a.shape[0], inner.out_width), float("nan"), dtype=a.dtype)
    out2 = torch.full_like(out, float("nan"))
    wrapped(a, values, bias if bias is not None else a, out, aux if epi == DGELU else None, out2)
    native, native2 = plans.dds_epilogue(a, values, meta, bias, forward, epi, aux if epi == DGELU else None)
    torch.testing.assert_close(out, native, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(out2, native2, rtol=2e-3, atol=2e-3)


def test_epilogue_pass_contiguous_and_strided():
    """apply(): contiguous operands take the epilogue kernel (the interpreter here), a strided output the torch
    reference; both as the reference computes them."""
    v, p = torch.randn(20, 8), torch.randn(20, 8)
    out, out2 = v.clone(), torch.empty(20, 8)
    epilogue.apply(out, p, out2, DGELU)
    want, want2 = epilogue.reference(v, p, DGELU)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(out2, want2)
    view = torch.randn(20, 16)[:, :8]
    out2b = torch.empty(20, 8)
    expect = epilogue.reference(view.clone(), None, GELU)[1]
    epilogue.apply(view, None, out2b, GELU)
    torch.testing.assert_close(out2b, expect)


def test_the_choice_is_the_plain_products_then_the_faster_form(monkeypatch):
    """dds_epilogue asks the tuner for the plain product's config (the same key and candidates as dds), builds
    that config with the epilogue, and where the kernel has it, times it against the plain kernel plus a pass of
    its own and keeps the faster (a CPU test drives the timing with a fake timer)."""
    from sparsetrain.kernels.blocksparse import tuner
    from sparsetrain.kernels.blocksparse.testing import use_timer

    meta, values, a, bias, aux = _case(16, True, torch.float16)
    seen = []
    real = tuner.pick

    def spy(kind, key, device, cands, launch, estimate=False):
        seen.append((kind, key))
        return real(kind, key, device, cands, launch, estimate)

    monkeypatch.setattr(tuner, "pick", spy)
    plans.dds(a, values, meta, bias, True)
    plans.dds_epilogue(a, values, meta, bias, True, GELU)
    assert len(seen) == 2 and seen[0] == seen[1]
    kept = [p for k, p in meta._groups["plans"].items() if k[0] == "plan_dds_epi"]
    assert len(kept) == 1 and kept[0].native_epilogue           # untimed (interpreter): the fused form
    made = []
    real_make = tuner.make_plan
    monkeypatch.setattr(tuner, "make_plan", lambda cfg, p: made.append(p.epi) or real_make(cfg, p))
    for faster in ("pass", "fused"):
        meta._groups.clear()
        tuner._TUNED.clear()
        plans._FORMS.clear()
        with use_timer(lambda cfg, launch, faster=faster: (launch(), 1.0 if cfg == faster else 2.0)[1]):
            out, out2 = plans.dds_epilogue(a, values, meta, bias, True, GELU)
        kept = [p for k, p in meta._groups["plans"].items() if k[0] == "plan_dds_epi"]
        assert len(kept) == 1 and kept[0].native_epilogue == (faster == "fused"), faster
        want, want2 = epilogue.reference(plans.dds(a, values, meta, bias, True), None, GELU)
        torch.testing.assert_close(out2, want2, rtol=2e-3, atol=2e-3)
    assert GELU in made and 0 in made


# ---- on the GPU -----------------------------------------------------------------------------------------------
def _cuda_tiles(meta, forward, b, dtype):
    k = meta.in_features if forward else meta.out_features
    probe = torch.empty(1, k, device="cuda", dtype=dtype)
    tiles = _cuda.candidates(probe, b, k) + _cuda.ks_candidates(torch.empty(1, k, device="cuda", dtype=dtype), b, k)
    assert tiles, "the CUDA kernel did not build"
    return tiles


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b", [16, 32])
@pytest.mark.parametrize("forward,epi", [(True, GELU), (False, DGELU)])
def test_gpu_cuda_epilogues_every_tile(dtype, b, forward, epi, poison):
    """Every CUDA tile (X-stationary; K-streamed where K allows) with each epilogue in the kernel, and the same
    tile followed by the epilogue's own pass = its plain product, then the epilogue in torch; T not a multiple of
    any tile, and T = 5."""
    torch.backends.cuda.matmul.allow_tf32 = False
    I, O = (768, 1600) if forward else (1600, 768)  # K = 1600 for the K-streamed 16x16 tiles in the input gradient
    gen = torch.Generator().manual_seed(b + epi)
    meta = BlockSparseMeta.from_mask(make_mask("random", (O // b, I // b), gen), b).to("cuda")
    for T in (1037, 5):
        a = torch.randn(T, I if forward else O, device="cuda", dtype=dtype)
        values = (torch.randn(meta.n_blocks, b, b, device="cuda") / b).to(dtype)
        bias = torch.randn(O, device="cuda", dtype=dtype) if forward else None
        aux = torch.randn(T, O if forward else I, device="cuda", dtype=dtype) if epi == DGELU else None
        for cfg in _cuda_tiles(meta, forward, b, dtype):
            with forced_config(fwd=cfg, dx=cfg), untuned():   # untimed: the kernel's own epilogue
                plain = plans.dds(a, values, meta, bias, forward)
                out, out2 = plans.dds_epilogue(a, values, meta, bias, forward, epi, aux)
                p = _cuda.CudaDdsPlan if isinstance(cfg, _cuda.CudaDdsConfig) else _cuda.CudaKsPlan
                inner = p(a, meta, cfg, forward, bias is not None)
            want, want2 = epilogue.reference(plain, aux, epi)
            passed, passed2 = torch.full_like(plain, float("nan")), torch.full_like(plain, float("nan"))
            EpiloguePlan(inner, epi)(a, values, bias if bias is not None else a, passed, aux, passed2)
            for got, ref in ((out, want), (out2, want2), (passed, want), (passed2, want2)):
                torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2, msg=str(cfg))
        kept = [p for k, p in meta._groups["plans"].items() if k[0] == "plan_dds_epi"]
        assert kept and all(p.native_epilogue for p in kept)
