"""model.patch_matmul: a ViT's patch embedding as one matrix product computes what the convolution computes, with
the same Parameters under the same names, and falls back to the convolution where the product does not apply."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from sparsetrain.models import build_model
from sparsetrain.models.patches import PatchMatmul, use_patch_matmul


def _pair(c_in, d, p, **kw):
    torch.manual_seed(0)
    conv = nn.Conv2d(c_in, d, p, stride=p, **kw)
    twin = nn.Conv2d(c_in, d, p, stride=p, **kw)
    twin.load_state_dict(conv.state_dict())
    twin.__class__ = PatchMatmul
    return conv, twin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(2, 3, 32, 32), (1, 3, 48, 16), (3, 1, 8, 24)])
def test_the_product_equals_the_convolution_and_its_gradients(shape, dtype):
    conv, twin = _pair(shape[1], 24, 8)
    conv, twin = conv.to(dtype), twin.to(dtype)
    x = torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(1), requires_grad=True)
    dy = torch.randn(shape[0], 24, shape[2] // 8, shape[3] // 8, dtype=dtype)
    y_ref, y = conv(x), twin(x)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y, y_ref, **tol)
    g_ref = torch.autograd.grad(y_ref, (x, conv.weight, conv.bias), dy)
    g = torch.autograd.grad(y, (x, twin.weight, twin.bias), dy)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, **tol)
    # what ViTPatchEmbeddings does next copies nothing: the product's [B, N, D] comes back
    assert y.flatten(2).transpose(1, 2).is_contiguous()


def test_what_the_product_does_not_cover_goes_to_the_convolution():
    conv, twin = _pair(3, 8, 4, padding=1)                       # padding: not a patch product
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(twin(x), conv(x))
    conv, twin = _pair(3, 8, 4)
    x = torch.randn(2, 3, 18, 16)                                # 18 is no multiple of the patch
    torch.testing.assert_close(twin(x), conv(x))


def _vit(patch_matmul):
    torch.manual_seed(0)
    return build_model("vit", "tiny", image_size=32, patch_size=8, num_labels=10,
                       patch_matmul=patch_matmul).eval()


def test_a_vit_built_with_it_computes_the_same_logits_from_the_same_state_dict():
    plain, matmul = _vit(False), _vit(True)
    assert type(matmul.vit.embeddings.patch_embeddings.projection) is PatchMatmul
    assert type(plain.vit.embeddings.patch_embeddings.projection) is nn.Conv2d
    assert plain.state_dict().keys() == matmul.state_dict().keys()
    matmul.load_state_dict(plain.state_dict())
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(matmul(pixel_values=x).logits, plain(pixel_values=x).logits,
                                   rtol=1e-5, atol=1e-5)


def test_use_patch_matmul_leaves_a_model_without_a_patch_embedding_alone():
    model = nn.Sequential(nn.Conv2d(3, 4, 2, stride=2))
    assert type(use_patch_matmul(model)[0]) is nn.Conv2d


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_patch_matmul_must_be_a_bool_and_a_vit_setting(bad):
    with pytest.raises(ValueError, match="patch_matmul"):
        build_model("vit", "tiny", image_size=32, patch_size=8, num_labels=10, patch_matmul=bad)
    with pytest.raises(ValueError, match="patch_matmul"):
        build_model("bert", "tiny", vocab_size=100, seq_len=16, patch_matmul=True)


def test_patch_matmul_config_key_is_checked_before_anything_is_built():
    from sparsetrain.config import ConfigError, compose, validate

    cfg = compose(["recipe=vit_digits", "model.patch_matmul=maybe"])
    with pytest.raises(ConfigError, match="model.patch_matmul"):
        validate(cfg)


@pytest.mark.gpu
def test_gpu_patch_matmul_matches_the_convolution_in_bf16_compiled():
    conv, twin = _pair(3, 768, 16)
    conv, twin = conv.cuda(), twin.cuda()
    x = torch.randn(8, 3, 224, 224, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_ref = conv(x).float()
        y = torch.compile(twin)(x).float()
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
