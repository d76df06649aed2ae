"""Helpers the skinny-SpMM tests share (imported by the test modules of this folder)."""
import torch


def _sparse(m, k, sparsity, dtype=torch.float32, device="cpu"):
    w = torch.randn(m, k, device=device).to(dtype)
    w[torch.rand(m, k, device=device) < sparsity] = 0
    return w


def _nan_tail_view(n, k, dtype):
    """X [n, k] whose rows continue with NaN past column k (row stride a multiple of 8, 16-byte aligned, so the
    kernels take it without a padded copy): a kernel that reads past K returns NaN."""
    full = torch.full((n, -(-k // 8) * 8 + 8), float("nan"), device="cuda", dtype=dtype)
    full[:, :k] = torch.randn(n, k, device="cuda").to(dtype)
    return full[:, :k]


def _rel_err(y, ref):
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))
