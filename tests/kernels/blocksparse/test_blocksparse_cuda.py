"""The CUDA backend (csrc/bs_dds.cu, csrc/bs_dw.cu): its host-built tables (plain torch, tested here) and every
tile on the GPU vs the fp32 reference (``pytest -m gpu`` on the device machine)."""
from __future__ import annotations

import pytest
import torch
from blocksparse_cases import check_dds_tiles, check_fwd_bwd, make_mask, rel

from sparsetrain.kernels.blocksparse import _cuda, plans
from sparsetrain.kernels.blocksparse._cuda_tables import (
    DW_LAYOUTS,
    STRIP_BLOCKS,
    dw_ctas_used,
    dw_table,
    dw_widths,
    entry_info,
    ks_table,
    warp_bounds,
    warp_ranges,
)
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.reference import reference_grads
from sparsetrain.kernels.blocksparse.testing import forced_config


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b", [16, 32])
@pytest.mark.parametrize("pattern", ["random", "empty_rows_cols", "dense", "single"])
def test_gpu_cuda_dds_every_tile(dtype, b, pattern, poison):
    """Every tile of the CUDA X-stationary kernel (csrc/bs_dds.cu), forward X·Wᵀ and input gradient dY·W, vs
    the fp32 reference on fresh inputs: token counts that are not a multiple of the tile (and T = 5), empty
    block rows and columns, density 1, a single block, no bias / bias in the activation dtype / fp32 bias,
    values in the activation dtype and fp32 master values."""

    torch.backends.cuda.matmul.allow_tf32 = False
    I, O = 512, 1024
    gen = torch.Generator().manual_seed(b + len(pattern))
    meta = BlockSparseMeta.from_mask(make_mask(pattern, (O // b, I // b), gen), b).to("cuda")
    probe = torch.empty(1, O, device="cuda", dtype=dtype)
    tiles = _cuda.candidates(probe, b, O)
    assert len(tiles) == len(_cuda.CANDIDATES), "the CUDA kernel did not build or a tile does not fit"
    check_dds_tiles(meta, tiles, I, O, b, dtype)
    built = list(meta._groups["plans"].values())
    assert len(built) == 16 * len(tiles) and all(isinstance(p, _cuda.CudaDdsPlan) for p in built)


def test_cuda_dds_entry_info_and_warp_ranges():
    """The host side of the CUDA X-stationary kernel (plain torch, so it runs here): the per-entry info
    (value offset / -1 for padding, column of the dense operand, output column, last-of-block flag) and the
    warp ranges, which must be cut at output-block boundaries and cover every entry once."""

    mask = torch.tensor([[1, 0, 1], [0, 0, 0], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    meta = BlockSparseMeta.from_mask(mask, 16)
    info = entry_info(meta, forward=True).tolist()
    # forward: per block row (output block), the active block columns; row 1 is empty -> one padding entry
    fwd = [[0, 0, 0, 0], [256, 32, 0, 1], [-1, 0, 16, 1], [512, 16, 32, 0], [768, 32, 32, 1],
           [1024, 0, 48, 0], [1280, 16, 48, 0], [1536, 32, 48, 1]]
    # then padding up to the entries any topology of 7 blocks over 4 output blocks needs (7 + 4): no warp range
    # reaches it, and its output column (past the last block) leaves the last real entry the last of its block
    assert info == fwd + [[-1, 0, 64, 0]] * 2 + [[-1, 0, 64, 1]]
    # input gradient: per block column, the block rows (transpose metadata), slots as stored
    dx = entry_info(meta, forward=False).tolist()[: int(meta.padded_entries(False, 1)[0][-1])]
    slots = {(r, c): s for s, (r, c) in enumerate(mask.nonzero().tolist())}
    expect = []
    for c in range(3):
        rows = [r for r in range(4) if mask[r, c]]
        for i, r in enumerate(rows):
            expect.append([slots[(r, c)] * 256, r * 16, c * 16, int(i == len(rows) - 1)])
    assert dx == expect
    pptr = meta.padded_entries(True, 1)[0]
    for n in (1, 2, 3, 5, 16):
        wb = warp_bounds(pptr, n).tolist()
        assert wb[0] == 0 and wb[-1] == len(fwd) and wb == sorted(wb) and len(wb) == n + 1
        assert set(wb) <= set(pptr.tolist())  # every range starts at an output block's first entry


# Every CUDA X-stationary tile, forward and input gradient, on a BERT-base-like layer (768 x 768 at 10%) whose
# last warp range ends at the end of the entry table with fewer than 32 entries.
_SANITIZED_DDS = """
import torch
from sparsetrain.kernels.blocksparse import _cuda, plans
from sparsetrain.kernels.blocksparse._cuda_tables import warp_bounds
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.testing import forced_config

gen = torch.Generator().manual_seed(0)
meta = BlockSparseMeta.from_mask(torch.rand(48, 48, generator=gen) < 0.1, 16).to("cuda")
a = torch.randn(300, 768, device="cuda", dtype=torch.bfloat16)
values = torch.randn(meta.n_blocks, 16, 16, device="cuda", dtype=torch.bfloat16)
tiles = _cuda.candidates(a, 16, 768)
assert tiles, "the CUDA kernel did not build"
for forward in (True, False):
    pptr = meta.padded_entries(forward, 1)[0]
    for cfg in tiles:
        wb = warp_bounds(pptr, cfg.splits * _cuda._lib(a.device).sparsetrain_bs_dds_warps(16, cfg.mt, cfg.half))
        assert 0 < int(wb[-1] - wb[-2]) < 32 and int(wb[-1]) % 32, (cfg, wb.tolist())
        with forced_config(fwd=cfg, dx=cfg):
            plans.dds(a, values, meta, None, forward)
torch.cuda.synchronize()
print("launched", len(tiles), "tiles")
"""


@pytest.mark.gpu
def test_gpu_cuda_dds_reads_nothing_past_its_entry_table():
    """The X-stationary kernel's first batch of entry infos: a lane past its warp's range reads nothing. Each
    warp used to load 32 entries whenever its range held one, so the warp whose range ends the table read up to
    31 entries (496 bytes) past it: harmless inside a caching-allocator segment, an illegal address where the
    table ends one. Checked by compute-sanitizer's memcheck on every tile with the caching allocator off (each
    tensor its own allocation, so a read past the table is outside any); it reported the read before the fix.
    (The entry table now also carries padding after its last range, sized for in-place mask updates, so a read
    past the ranges mostly lands in it; the launches must still be memcheck-clean.)"""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from sparsetrain.kernels._runtime.cuda_build import nvcc_path

    nvcc = nvcc_path()
    near_nvcc = Path(nvcc).parent / "compute-sanitizer" if nvcc else None
    sanitizer = str(near_nvcc) if near_nvcc and near_nvcc.is_file() else shutil.which("compute-sanitizer")
    assert sanitizer, "compute-sanitizer (CUDA toolkit, beside nvcc) is needed for this test"
    _cuda.candidates(torch.empty(1, 768, device="cuda", dtype=torch.bfloat16), 16, 768)  # build the library here
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    done = subprocess.run([sanitizer, "--tool", "memcheck", "--kernel-name", "kns=bs_dds_kernel",
                           "--error-exitcode", "99", sys.executable, "-c", _SANITIZED_DDS],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "launched" in out, out[-4000:]
    assert "ERROR SUMMARY: 0 errors" in out, out[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pattern", ["random", "empty_rows_cols", "dense", "single"])
@pytest.mark.parametrize("I,O", [(512, 1024), (1024, 512)])  # X staged whole / dY staged whole
def test_gpu_cuda_dw_every_tile(dtype, pattern, I, O):
    """Every tile of the CUDA weight-gradient kernel (csrc/bs_dw.cu) vs the fp32 reference on fresh inputs,
    with and without the fused bias gradient, at token counts that are not a multiple of the chunk."""

    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(len(pattern) + I)
    meta = BlockSparseMeta.from_mask(make_mask(pattern, (O // 16, I // 16), gen), 16).to("cuda")
    for T in (3000 + 7, 5):
        x = torch.randn(T, I, device="cuda", dtype=dtype)
        dy = torch.randn(T, O, device="cuda", dtype=dtype)
        tiles = _cuda.dw_candidates(x, dy, meta, True)
        assert len(tiles) == len(_cuda.DW_CANDIDATES), "the CUDA kernel did not build or a tile does not fit"
        v = torch.zeros(meta.n_blocks, 16, 16, device="cuda")
        _, dv_ref, db_ref = reference_grads(x.float(), dy.float(), v, meta)
        for cfg in tiles:
            for with_bias in (True, False):
                with forced_config(dw=cfg):
                    dv, db = plans.sampled_grad(x, dy, meta, with_bias=with_bias)
                assert rel(dv, dv_ref) < 1e-4, (cfg, T, with_bias)
                if with_bias:
                    assert rel(db, db_ref) < 1e-4, (cfg, T)
    built = list(meta._groups["plans"].values())
    assert built and all(isinstance(p, _cuda.CudaDwPlan) for p in built)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_cuda_dw_bias_ranges_wider_than_the_tensor_core_groups(dtype):
    """A CTA whose bias range is wider than the 2 x WARPS 16-column groups its warps sum on the tensor cores
    (512 columns): the columns past them are summed by threads. 2048 -> 1024 with few blocks: one "strips" CTA
    stages dY whole and sums all 1024 bias columns."""
    torch.backends.cuda.matmul.allow_tf32 = False
    I, O = 2048, 1024
    mask = torch.zeros(O // 16, I // 16, dtype=torch.bool)
    mask[[0, 5, 63], [7, 20, 12]] = True               # one X strip: one CTA, whose bias range is all of dY
    meta = BlockSparseMeta.from_mask(mask, 16).to("cuda")
    cta = dw_table(meta, True, 128, "strips")[0].cpu()
    assert int((cta[:, 7] - cta[:, 6]).max()) > 512     # the case under test: some range past the mma groups
    x = torch.randn(3000 + 7, I, device="cuda", dtype=dtype)
    dy = torch.randn(3000 + 7, O, device="cuda", dtype=dtype)
    _, dv_ref, db_ref = reference_grads(x.float(), dy.float(), torch.zeros(meta.n_blocks, 16, 16, device="cuda"),
                                        meta)
    tiles = _cuda.dw_candidates(x, dy, meta, True)
    assert tiles
    for cfg in tiles:
        with forced_config(dw=cfg):
            dv, db = plans.sampled_grad(x, dy, meta, with_bias=True)
        assert rel(dv, dv_ref) < 1e-4 and rel(db, db_ref) < 1e-4, cfg


def test_cuda_dw_table_covers_every_block_and_bias_column():
    """The weight-gradient kernel's CTA table (plain torch, runs here): every block in exactly one CTA at
    offsets inside that CTA's staged column ranges, strips no wider than STRIP_BLOCKS, and bias ranges that
    partition the output features and lie inside each CTA's staged dY columns; both orientations, empty rows."""

    gen = torch.Generator().manual_seed(0)
    for O, I in ((1024, 512), (512, 1024), (4096, 1024), (1024, 4096)):
        for d in (0.02, 0.1, 0.5, 1.0):
            mask = torch.rand(O // 16, I // 16, generator=gen) < d
            mask[: mask.shape[0] // 3] = False  # a run of empty block rows
            meta = BlockSparseMeta.from_mask(mask, 16)
            for with_bias in (True, False):
                cta, blk, aw, bw = dw_table(meta, with_bias, 128)
                c, b = cta.tolist(), blk.tolist()
                assert sum(x[1] for x in c) == meta.n_blocks
                assert sorted(x[0] for x in b[: meta.n_blocks]) == list(range(meta.n_blocks))
                for x in c:
                    assert x[1] <= 128 and x[3] <= aw and x[5] <= bw
                    assert min(x[3], x[5]) <= STRIP_BLOCKS * 16  # one operand is a strip
                    for k in range(x[0], x[0] + x[1]):
                        s, ao, bo, _ = b[k]
                        r, cc = int(meta.row_idx[s]), int(meta.col_idx[s])
                        assert (x[2] + ao, x[4] + bo) == (r * 16, cc * 16)
                        assert 0 <= ao < x[3] and 0 <= bo < x[5]
                if with_bias:
                    pos = 0
                    for lo, hi in sorted((x[6], x[7]) for x in c if x[7] > x[6]):
                        assert lo == pos
                        pos = hi
                    assert pos == O
                    assert all(x[2] <= x[6] and x[7] <= x[2] + x[3] for x in c if x[7] > x[6])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pattern", ["random", "empty_rows_cols", "dense", "single"])
def test_gpu_cuda_k_streamed_every_tile(dtype, pattern, poison):
    """The K-streamed CUDA tiles (large K, 16x16 blocks), forward and input gradient, vs the fp32 reference:
    K = 1552 and 1600 (the last K part partial), output-block groups that do not fill the last CTA, T = 1037
    and 5, no bias / 16-bit / fp32 bias, fp32 master values."""

    torch.backends.cuda.matmul.allow_tf32 = False
    I, O, b = 1552, 1600, 16
    gen = torch.Generator().manual_seed(len(pattern))
    meta = BlockSparseMeta.from_mask(make_mask(pattern, (O // b, I // b), gen), b).to("cuda")
    tiles = _cuda.ks_candidates(torch.empty(1, I, device="cuda", dtype=dtype), b, I)
    assert len(tiles) == len(_cuda.KS_CANDIDATES), "the CUDA kernel did not build or a tile does not fit"
    check_dds_tiles(meta, tiles, I, O, b, dtype)
    built = list(meta._groups["plans"].values())
    assert built and all(isinstance(p, _cuda.CudaKsPlan) for p in built)


def test_k_streamed_tables():
    """The K-streamed kernel's per-warp entry lists (plain torch, runs here): every active block once per
    product, each warp's entries in (K part, output block, k) order with counts that match, offsets right."""

    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(13, 21, generator=gen) < 0.3
    mask[2] = False
    meta = BlockSparseMeta.from_mask(mask, 16)
    slots = {(r, c): s for s, (r, c) in enumerate(mask.nonzero().tolist())}
    for forward in (True, False):
        for ob, kp in ((4, 256), (2, 64)):
            info, wstart, counts, n_parts, n_out = ks_table(meta, forward, ob, kp)
            k = meta.in_features if forward else meta.out_features
            assert n_out == (13 if forward else 21) and n_parts == -(-k // kp)
            info, wstart = info.tolist(), wstart.tolist()
            counts = counts.view(-1, n_parts, ob).tolist()
            assert wstart[-1] == meta.n_blocks and len(wstart) == -(-n_out // ob) + 1
            seen = []
            for w in range(len(wstart) - 1):
                e = wstart[w]
                for p in range(n_parts):
                    for j in range(ob):
                        o = w * ob + j
                        ks = [kk for kk in range(k // 16) if o < n_out and kk * 16 // kp == p
                              and (mask[o, kk] if forward else mask[kk, o])]
                        assert counts[w][p][j] == len(ks)
                        for kk in ks:
                            s = slots[(o, kk) if forward else (kk, o)]
                            assert info[e] == [s * 256, kk * 16 - p * kp]
                            seen.append(s)
                            e += 1
                assert e == wstart[w + 1]
            assert sorted(seen) == list(range(meta.n_blocks))


def _cuda_tables(meta):
    return {"info_f": entry_info(meta, True), "info_b": entry_info(meta, False),
            "wb_f": warp_ranges(meta, True, 8), "wb_b": warp_ranges(meta, False, 5),
            "ks": ks_table(meta, True, 4, 256), "dw": dw_table(meta, True, 128), "dw_x": dw_table(meta, False, 128)}


def test_cuda_tables_follow_an_in_place_rewrite():
    """The CUDA kernels' tables (plain torch, so here) are refilled by BlockSparseMeta.rewrite_: the very tensors
    the plans launch with hold the new topology's tables (the CTA table with its spare rows empty), or, where the
    new topology outgrows the CTA table, nothing changes and the caller builds new metadata."""
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(48, 32, generator=gen) < 0.1
    meta = BlockSparseMeta.from_mask(mask, 16)
    kept = _cuda_tables(meta)
    new = mask.flatten()[torch.randperm(mask.numel(), generator=gen)].view(mask.shape)
    assert meta.rewrite_(new)
    fresh = _cuda_tables(BlockSparseMeta.from_mask(new, 16))
    for name in ("info_f", "info_b", "wb_f", "wb_b"):
        assert torch.equal(kept[name], fresh[name]), name
    for a, b in zip(kept["ks"], fresh["ks"]):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b
    for name in ("dw", "dw_x"):
        (cta, blk, aw, bw), (fcta, fblk, faw, fbw) = kept[name], fresh[name]
        used = int((fcta[:, 1] > 0).sum() + (fcta[:, 7] > fcta[:, 6]).logical_and(fcta[:, 1] == 0).sum())
        assert torch.equal(blk, fblk) and faw <= aw and fbw <= bw
        assert torch.equal(cta[:used], fcta[:used]) and not cta[used:].any()   # spare rows: no work
    assert kept["dw"][0] is meta._groups[("bs_dw_table", True, 128, "strips")][0]

    # a topology that needs more CTAs than the kept table has rows: refused, nothing changed. (The staged widths
    # are the largest any topology needs, so only the rows can run out; here the spare rows are taken away.)
    narrow = torch.zeros(48, 32, dtype=torch.bool)
    narrow.view(-1)[: int(mask.sum())] = True          # all blocks in the first 5 block rows
    meta = BlockSparseMeta.from_mask(mask, 16)
    tables = _cuda_tables(meta)
    key, used = ("bs_dw_table", True, 128, "strips"), dw_ctas_used(meta, True, 128)
    cta, blk, aw, bw = tables["dw"]
    most = DW_LAYOUTS["strips"].most(meta, 128)        # no topology of this grid and count needs more rows
    assert (aw, bw) == dw_widths(meta, 128) == (512, 512) and cta.shape[0] == used + max(8, used // 4, most - used)
    meta._groups[key] = (cta[:used].clone(), blk, aw, bw)
    needed = dw_ctas_used(BlockSparseMeta.from_mask(narrow, 16), True, 128)
    assert needed > used                               # bias-only CTAs for the 43 empty rows
    before = [t.clone() for t in (meta._groups[key][0], tables["info_f"], *(getattr(meta, n) for n in meta.TENSORS))]
    assert meta.rewrite_(narrow) is False
    after = [meta._groups[key][0], tables["info_f"], *(getattr(meta, n) for n in meta.TENSORS)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["strips", "tiles"])
@pytest.mark.parametrize("ks", [False, True])
def test_gpu_cuda_plans_follow_an_in_place_rewrite(ks, layout, poison):
    """The CUDA plans (X-stationary or K-streamed forward / dX, the weight gradient in either CTA layout with its
    spare CTA rows) kept on a metadata compute a new topology after BlockSparseMeta.rewrite_, with no plan
    rebuilt: what a CUDA graph that launched them replays after a mask update."""
    torch.backends.cuda.matmul.allow_tf32 = False
    (I, O), b = ((1600, 768) if ks else (768, 1024)), 16
    gen = torch.Generator().manual_seed(7)
    mask = torch.rand(O // b, I // b, generator=gen) < 0.1
    meta = BlockSparseMeta.from_mask(mask, b).to("cuda")
    x = torch.randn(1037, I, device="cuda", dtype=torch.bfloat16)
    probe = x if ks else torch.empty(1, I, device="cuda", dtype=torch.bfloat16)
    fwd = (_cuda.ks_candidates(probe, b, I) if ks else _cuda.candidates(probe, b, I))[0]
    tiles = dict(fwd=fwd, dx=_cuda.candidates(torch.empty(1, O, device="cuda", dtype=torch.bfloat16), b, O)[0],
                 dw=_cuda.CudaDwConfig(32, layout))

    def check() -> None:
        values = (torch.randn(meta.n_blocks, b, b, device="cuda") / b).to(torch.bfloat16).requires_grad_()
        bias = torch.randn(O, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        check_fwd_bwd(x.clone().requires_grad_(), values, bias, meta)

    with forced_config(**tiles):
        check()
        kept = dict(meta._groups["plans"])
        assert {type(p) for p in kept.values()} <= {_cuda.CudaDdsPlan, _cuda.CudaKsPlan, _cuda.CudaDwPlan}
        new = mask.flatten()[torch.randperm(mask.numel(), generator=gen)].view(mask.shape)
        assert meta.rewrite_(new.to("cuda"))
        check()
        assert all(meta._groups["plans"][k] is p for k, p in kept.items()) and len(meta._groups["plans"]) == len(kept)


def test_plain_dds_kernels_carry_no_epilogue_code(tmp_path):
    """The GELU epilogues are compiled into their own instantiations of bs_dds / bs_dds_ks (``EPI``): the plain
    kernels hold none of their arithmetic. With the epilogue behind a runtime flag every kernel carried it,
    unrolled (8x the PTX instructions of the plain 16x16 forward), and that forward ran 1.8x slower on an H100.
    Compiles the source to PTX for sm_90 (needs nvcc, no GPU): every kernel comes as a plain and an epilogue
    instantiation; no plain kernel executes an exponential (erf and GELU's derivative do), every epilogue one does."""
    import re
    import subprocess
    from pathlib import Path

    from sparsetrain.kernels._runtime.cuda_build import INCLUDE, nvcc_path

    nvcc = nvcc_path()
    if nvcc is None:
        pytest.skip("needs nvcc")
    src = Path(_cuda.CSRC) / "bs_dds.cu"
    ptx = tmp_path / "bs_dds.ptx"
    subprocess.run([nvcc, "-O3", "-std=c++20", "-gencode=arch=compute_90,code=sm_90", f"-I{INCLUDE}", "-ptx",
                    "-o", str(ptx), str(src)], check=True, capture_output=True, timeout=600)
    text = ptx.read_text()
    kernels = {}   # (kernel template args without EPI, EPI) -> body
    for m in re.finditer(r"\.entry (_Z\w*(bs_dds(?:_ks)?_kernel)I(\w+)EEvNS_\w+)\(", text):
        args = m.group(3)   # mangled template arguments, the last one EPI: ...Lb0E / ...Lb1E
        body = text[m.end(): text.find("\n}\n", m.end())]
        kernels[(m.group(2), args[:-4], args[-4:] == "Lb1E")] = body
    plain = {k: v for k, v in kernels.items() if not k[2]}
    assert plain and len(plain) * 2 == len(kernels), sorted(kernels)[:4]
    for (name, args, _), body in plain.items():
        twin = kernels[(name, args, True)]
        assert "ex2.approx" not in body, (name, args)
        assert "ex2.approx" in twin, (name, args)
