"""ViT's patch embedding as one matrix product: ``model.patch_matmul``.

A ViT embeds its image by a convolution whose kernel and stride are the patch size, which is a linear map of
each non-overlapping patch: ``[B, C, H, W]`` cut into ``(H/p)(W/p)`` patches of ``C·p·p`` values times the
weight seen as ``[D, C·p·p]``. As a convolution (cuDNN) the step converts the image to channels-last and back and
runs a convolution kernel forward and for the weight gradient (ViT-B/16 at 256 images on an H200: ~3.4 ms of an
~84 ms step, against a floor of ~0.1 ms for the product); as a product, the patches are one reshaping copy
(fused with the cast to the compute dtype under ``torch.compile``) and the weight gradient an ordinary matrix
product.

:func:`use_patch_matmul` changes the class of the patch embedding's ``nn.Conv2d`` in place: the same Parameters
under the same names (checkpoints and exports are unchanged), the same function. Inputs the product does not
cover (a stride other than the kernel, padding, a size not a multiple of the patch) go to the convolution.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PatchMatmul(nn.Conv2d):
    """An ``nn.Conv2d`` with ``kernel_size == stride`` and no padding, computed as one matrix product over the
    patches; its output is the convolution's ``[B, D, H/p, W/p]`` (a view of the product's ``[B, N, D]``, so the
    usual ``flatten(2).transpose(1, 2)`` after it copies nothing)."""

    def _covers(self, x: torch.Tensor) -> bool:
        ph, pw = self.kernel_size
        return (tuple(self.stride) == (ph, pw) and tuple(self.padding) == (0, 0) and tuple(self.dilation) == (1, 1)
                and self.groups == 1 and x.dim() == 4 and x.shape[-2] % ph == 0 and x.shape[-1] % pw == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._covers(x):
            return super().forward(x)
        b, c, h, w = x.shape
        ph, pw = self.kernel_size
        gh, gw = h // ph, w // pw
        patches = x.reshape(b, c, gh, ph, gw, pw).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * ph * pw)
        y = F.linear(patches, self.weight.reshape(self.out_channels, -1), self.bias)   # [B, N, D]
        return y.transpose(1, 2).reshape(b, self.out_channels, gh, gw)


def use_patch_matmul(model: nn.Module) -> nn.Module:
    """Compute every ViT patch embedding of ``model`` (``embeddings.patch_embeddings.projection``) as one matrix
    product (:class:`PatchMatmul`), in place; returns ``model``. A model without one is returned unchanged.

    >>> conv = nn.Conv2d(3, 8, 4, stride=4)
    >>> m = nn.Module(); m.patch_embeddings = nn.Module(); m.patch_embeddings.projection = conv
    >>> type(use_patch_matmul(m).patch_embeddings.projection).__name__
    'PatchMatmul'
    """
    for name, module in model.named_modules():
        if name.endswith("patch_embeddings"):
            conv = getattr(module, "projection", None)
            if type(conv) is nn.Conv2d:
                conv.__class__ = PatchMatmul
    return model


__all__ = ["PatchMatmul", "use_patch_matmul"]
