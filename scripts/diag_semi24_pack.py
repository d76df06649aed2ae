"""Where does the fused cuSPARSELt packing differ from torch._cslt_compress at 64M-element weights?

For each shape: pack W and Wᵀ with the Triton kernel and with _cslt_compress, several times, with the output
buffers pre-filled by different garbage; report sizes, the count and region (values / metadata / past the
documented size) of differing int16 words, and whether the two packed forms give the same cuSPARSELt product.

    python scripts/diag_semi24_pack.py [--out DIR]
"""
from __future__ import annotations

import json
import os
import sys

import torch

from sparsetrain.kernels import semi24 as s24


def diff_report(ours: torch.Tensor, ref: torch.Tensor, n: int, k: int) -> dict:
    a, b = ours.reshape(-1).view(torch.int16), ref.reshape(-1).view(torch.int16)
    rep = {"ours_numel": a.numel(), "ref_numel": b.numel(), "documented": n * k * 9 // 16}
    m = min(a.numel(), b.numel())
    d = (a[:m] != b[:m]).nonzero().flatten()
    half = n * k // 2
    rep["n_diff"] = int(d.numel())
    rep["n_diff_values"] = int((d < half).sum())
    rep["n_diff_meta"] = int((d >= half).sum())
    rep["first_diff"] = [int(i) for i in d[:8]]
    if d.numel():
        i = int(d[0])
        rep["first_diff_words"] = [int(a[i]), int(b[i])]
        rep["last_diff"] = int(d[-1])
    return rep


def main():
    out = os.environ.get("OUT", ".")
    res = []
    for (n, k) in [(16384, 4096), (4096, 16384), (4096, 1024)]:
        for rep in range(3):
            # Fill the allocator's free memory with garbage so torch.empty returns dirty buffers.
            junk = torch.full((n * k,), -12345, dtype=torch.int16, device="cuda")
            del junk
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            r = s24.transposable24(w, pack=True, pack_t=True)
            ref = s24.compress(r.wm)
            ref_t = s24.compress(r.wm.t().contiguous())
            row = {"shape": [n, k], "rep": rep, "W": diff_report(r.packed, ref, n, k),
                   "Wt": diff_report(r.packed_t, ref_t, k, n),
                   "zero_in_wm": int((r.wm[r.mask] == 0).sum()),
                   "mask_ok": bool(s24.is_transposable24(r.mask)) if hasattr(s24, "is_transposable24") else None}
            x = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
            try:
                y1 = s24.sparse_mm_t(r.packed, x, s24.AlgChoice(0))
                y2 = s24.sparse_mm_t(ref, x, s24.AlgChoice(0))
                row["products_equal"] = bool(torch.equal(y1, y2))
                row["products_rel"] = float((y1.float() - y2.float()).norm() / y2.float().norm())
                yd = x.float() @ r.wm.float().t()
                row["ours_vs_dense_rel"] = float((y1.float() - yd).norm() / yd.norm())
            except Exception as e:  # noqa: BLE001 - a diagnostic: record and continue
                row["products_error"] = repr(e)[:300]
            print(json.dumps(row), flush=True)
            res.append(row)
            del r, ref, ref_t, w
            torch.cuda.empty_cache()
    with open(os.path.join(out, "diag_semi24_pack.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
