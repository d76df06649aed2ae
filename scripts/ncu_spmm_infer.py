"""One launch of each skinny-SpMM CUDA kernel (bitmap, CSL, pair) on one random unstructured weight, as a target
for Nsight Compute (the kernels are built and the weights compressed before the profiled launches):

    python scripts/ncu_spmm_infer.py --sparsity 0.9                      # builds the kernels once
    ncu --clock-control none --kernel-name regex:spmm_ --metrics <list> python scripts/ncu_spmm_infer.py

docs/inference.md (round 5) lists the metrics it was run with.
"""
from __future__ import annotations

import argparse

import torch

from sparsetrain.kernels import spmm_csl as sc
from sparsetrain.kernels import spmm_infer as si
from sparsetrain.kernels import spmm_pair as sp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="28672x7168", help="M x K of the weight")
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    m, k = (int(v) for v in args.shape.split("x"))
    w = torch.randn(m, k, device="cuda", dtype=torch.float16)
    w.masked_fill_(torch.rand(m, k, device="cuda") < args.sparsity, 0)
    x = torch.randn(args.tokens, k, device="cuda", dtype=torch.float16)
    weights = ((si.spmm_cuda, si.compress(w)), (sc.spmm_csl_cuda, sc.compress_csl(w)),
               (sp.spmm_pair_cuda, sp.compress_pair(w)))
    torch.cuda.synchronize()
    for fn, cw in weights:
        fn(x, cw)
    torch.cuda.synchronize()
    print(f"ran bitmap, CSL and pair once at {m}x{k}, sparsity {args.sparsity}, N = {args.tokens}")


if __name__ == "__main__":
    main()
