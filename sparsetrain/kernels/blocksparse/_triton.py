"""Triton kernels for block-sparse training: ``Y = X·Wᵀ``, ``dX = dY·W`` and ``dW = dYᵀ·X`` at active blocks.

The weight ``W [O, I]`` is stored compressed: ``values [n_blocks, B, B]`` holds only the active ``B x B``
blocks, in row-major block order (slot ``s`` is the ``s``-th active block when the block grid is read row by
row). :mod:`.meta` builds the int32 metadata and :mod:`.gather` / :mod:`.tma` launch these kernels. Two
kernels cover the three products for every block size:

- :func:`dense_x_blocksparse_kernel` (``out = A · B`` with ``B`` block-sparse): the forward pass
  (``A = X``, ``B = Wᵀ``, entries listed per block-row of ``W``) and the input gradient (``A = dY``,
  ``B = W``, entries listed per block-column of ``W`` through the transpose metadata — no transposed
  copy of the values). One program per (``BLOCK_T`` tokens, a run of ``B``-wide output column blocks).
- :func:`sampled_grad_kernel` (``dW = dYᵀ · X`` only at active blocks): one program per (group of up to
  ``GROUP`` active blocks of one block-row, slice of the tokens), reducing over the tokens.

Small blocks would give ``tl.dot`` operands only 16 wide; both kernels therefore gather ``GROUP_K`` /
``GROUP`` blocks side by side into one wider operand (a ``[BLOCK_T, GROUP*B]`` strip of ``X``), so the
tensor cores see K = 64 (forward) or M = 64..128 (weight gradient) even at ``B = 16``.

Two more cover the forward / input gradient and the weight gradient for 32-128 blocks on Hopper with operand
tiles fetched by the Tensor Memory Accelerator (:func:`dense_x_blocksparse_tma_kernel`,
:func:`sampled_grad_tma_kernel`; whole boxes at data-dependent coordinates, no per-thread gather addresses).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dense_x_blocksparse_kernel(
    a_ptr,     # [T, K] dense left operand (X in the forward, dY for dX), strides (stride_at, stride_ak)
    v_ptr,     # [n_blocks, BLOCK, BLOCK] block values of W (contiguous); A's dtype or float32 (cast on load)
    ptr_ptr,   # [n_out_blocks + 1] int32: padded entries of output column block j are ptr[j] .. ptr[j + 1] - 1
    kidx_ptr,  # [n_entries] int32 per padded entry: which BLOCK-wide column block of A it multiplies
    slot_ptr,  # [n_entries] int32 per padded entry: slot of its block in v_ptr, -1 for padding
    oidx_ptr,  # [n_entries] int32 per padded entry: its output column block j
    bias_ptr,  # [N] bias, read only when HAS_BIAS
    out_ptr,   # [T, N] dense output, unit column stride, row stride stride_o; every element is written
    aux_ptr,   # EPI 2: GELU's input, laid out as out (else unused)
    out2_ptr,  # EPI 1, 2: GELU's output, laid out as out (else unused)
    a1_ptr, a2_ptr,      # A_PARTS: A's second and third pieces (else unused)
    out1_ptr, out2p_ptr,  # OUT_PARTS: the output's second and third pieces (else unused)
    T, stride_at, stride_ak, stride_o, n_out_blocks, n_ranges, blocks_per_prog,
    FORWARD: tl.constexpr,   # True: B = Wᵀ (entries listed per block-row of W); False: B = W (per block-column)
    HAS_BIAS: tl.constexpr,
    EPI: tl.constexpr,       # 0, or an epilogue of sparsetrain.kernels.blocksparse.epilogue (_store_epilogue)
    BLOCK: tl.constexpr,     # block edge B (16, 32, 64, 128)
    GROUP_K: tl.constexpr,   # blocks gathered into one tl.dot (K = GROUP_K * BLOCK); entry lists padded to it
    BLOCK_T: tl.constexpr,   # tokens per program
    CACHE_A: tl.constexpr,   # cache modifier of the A loads: ".ca" keeps them in L1 for re-reads by this program
    WIDE: tl.constexpr = False,  # GROUP_K == 1 only: accumulate outᵀ [BLOCK, BLOCK_T] (the W block as the MMA's
                                 # M side, the tokens as its N side: one wgmma m64n256 instead of n64 ones)
    A_PARTS: tl.constexpr = 0,    # > 0: A is three tensors of A_PARTS column blocks each (a_ptr, a1_ptr, a2_ptr),
                                  # one row stride (stride_at): e.g. the query, key and value gradients
    OUT_PARTS: tl.constexpr = 0,  # > 0: the output is three tensors of OUT_PARTS column blocks each (out_ptr,
                                  # out1_ptr, out2p_ptr), row stride stride_o; no epilogue
):
    pid = tl.program_id(0)
    # A program owns BLOCK_T tokens and blocks_per_prog consecutive output column blocks, walked as ONE
    # flat loop over their (padded) entries so the load pipeline never drains between output blocks; an
    # output block is stored when its last entry has been multiplied. The range index is the fast one:
    # programs running together share one token tile of A in L2.
    pid_t = pid // n_ranges
    rng = pid % n_ranges
    j_first = rng * blocks_per_prog
    j_last = tl.minimum(j_first + blocks_per_prog, n_out_blocks)
    e_begin = tl.load(ptr_ptr + j_first)
    e_end = tl.load(ptr_ptr + j_last)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    offs_b = tl.arange(0, BLOCK)
    # int64 row offsets: T * K can pass 2**31 for long sequences. (Launchers pass row-major A: stride_ak == 1,
    # which Triton specializes, so the gathered rows are known contiguous and loaded 16 bytes at a time.)
    a_rows = offs_t.to(tl.int64)[:, None] * stride_at    # element offsets of A's rows
    out_rows = offs_t.to(tl.int64)[:, None] * stride_o  # element offsets of the output rows
    acc = tl.zeros((BLOCK, BLOCK_T) if WIDE else (BLOCK_T, BLOCK), dtype=tl.float32)
    for e0 in range(e_begin, e_end, GROUP_K):
        j = tl.load(oidx_ptr + e0)
        seg_end = tl.load(ptr_ptr + j + 1)
        if GROUP_K == 1:
            kb = tl.load(kidx_ptr + e0)
            slot = tl.load(slot_ptr + e0)
            cols_ok = offs_b < tl.where(slot >= 0, BLOCK, 0)  # all False for a padding entry
            a_base, kb = _piece(a_ptr, a1_ptr, a2_ptr, kb, A_PARTS)
            a = tl.load(a_base + a_rows + (kb * BLOCK + offs_b[None, :]) * stride_ak,
                        mask=t_ok[:, None] & cols_ok[None, :], other=0.0, cache_modifier=CACHE_A)
            vb = v_ptr + tl.maximum(slot, 0) * (BLOCK * BLOCK)
            v = tl.load(vb + offs_b[:, None] * BLOCK + offs_b[None, :], mask=cols_ok[:, None], other=0.0)
            v = v.to(a_ptr.dtype.element_ty)  # float32 master values under autocast: cast here, not per step
            if WIDE:
                if not FORWARD:
                    v = tl.trans(v)  # outᵀ[c, t] = sum_r W_block[r, c] · dY[t, r]
            elif FORWARD:
                v = tl.trans(v)  # B[k, n] = W_block[n, k]
        else:
            ent = e0 + tl.arange(0, GROUP_K)
            kb = tl.load(kidx_ptr + ent)
            slot = tl.load(slot_ptr + ent)
            ok = slot >= 0
            # [BLOCK_T, GROUP_K, BLOCK] strip of A: GROUP_K gathered column blocks, each BLOCK contiguous.
            if A_PARTS:
                a_base, kb = _pieces(a_ptr, a1_ptr, a2_ptr, kb, A_PARTS)
                a_base = a_base[None, :, None]
            else:
                a_base = a_ptr
            a = tl.load(a_base + a_rows[:, :, None] + ((kb * BLOCK)[None, :, None] + offs_b[None, None, :]) * stride_ak,
                        mask=t_ok[:, None, None] & ok[None, :, None], other=0.0, cache_modifier=CACHE_A)
            a = tl.reshape(a, (BLOCK_T, GROUP_K * BLOCK))
            vb = v_ptr + tl.maximum(slot, 0) * (BLOCK * BLOCK)
            if FORWARD:
                # [n, g, k] = W_slot(g)[n, k]; reshaped to [n, (g, k)] and transposed to [(g, k), n].
                v = tl.load(vb[None, :, None] + offs_b[:, None, None] * BLOCK + offs_b[None, None, :],
                            mask=ok[None, :, None], other=0.0)
                v = tl.trans(tl.reshape(v.to(a_ptr.dtype.element_ty), (BLOCK, GROUP_K * BLOCK)))
            else:
                # [g, k, n] = W_slot(g)[k, n] -> [(g, k), n]
                v = tl.load(vb[:, None, None] + offs_b[None, :, None] * BLOCK + offs_b[None, None, :],
                            mask=ok[:, None, None], other=0.0)
                v = tl.reshape(v.to(a_ptr.dtype.element_ty), (GROUP_K * BLOCK, BLOCK))
        if WIDE:
            acc = tl.dot(v, tl.trans(a), acc)  # accᵀ[n, t] += sum_k V[n, k] · A[t, k]
        else:
            acc = tl.dot(a, v, acc)
        if e0 + GROUP_K >= seg_end:  # last entry of output block j: write it, start the next one
            res = tl.trans(acc) if WIDE else acc
            if HAS_BIAS:
                res += tl.load(bias_ptr + j * BLOCK + offs_b).to(tl.float32)[None, :]
            if OUT_PARTS:
                o_base, jj = _piece(out_ptr, out1_ptr, out2p_ptr, j, OUT_PARTS)
                tl.store(o_base + out_rows + jj * BLOCK + offs_b[None, :], res.to(out_ptr.dtype.element_ty),
                         mask=t_ok[:, None])
            else:
                _store_epilogue(out_ptr, aux_ptr, out2_ptr, out_rows + j * BLOCK + offs_b[None, :], res,
                                t_ok[:, None], EPI)
            acc = tl.zeros((BLOCK, BLOCK_T) if WIDE else (BLOCK_T, BLOCK), dtype=tl.float32)


@triton.jit
def _piece(p0, p1, p2, blk, PARTS: tl.constexpr):
    """``(base pointer, column block inside it)`` of column block ``blk`` of an operand given as three tensors of
    ``PARTS`` column blocks each (``PARTS`` 0: one tensor, ``p0``)."""
    if PARTS:
        part = blk // PARTS
        return tl.where(part == 0, p0, tl.where(part == 1, p1, p2)), blk - part * PARTS
    return p0, blk


@triton.jit
def _pieces(p0, p1, p2, blks, PARTS: tl.constexpr):
    """:func:`_piece` for a vector of column blocks: a vector of base pointers (``PARTS`` > 0)."""
    part = blks // PARTS
    z = part * 0   # the pointers broadcast to the vector's shape: tl.where takes no scalar pointer with them
    return tl.where(part == 0, p0 + z, tl.where(part == 1, p1 + z, p2 + z)), blks - part * PARTS


@triton.jit
def _cdf(x):
    return 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def _store_epilogue(out_ptr, aux_ptr, out2_ptr, off, res, mask, EPI: tl.constexpr):
    """Stores ``res`` (float32) at ``out_ptr + off`` in out's dtype, with the epilogue ``EPI``: 1, ``out2 =
    gelu(out)``; 2, ``out = out * gelu'(aux)`` and ``out2 = gelu(aux)``. GELU is the exact (erf) one, computed in
    float32 from the stored 16-bit values, as the unfused ops compute it."""
    v = res.to(out_ptr.dtype.element_ty)
    if EPI == 1:
        h = v.to(tl.float32)
        tl.store(out2_ptr + off, (h * _cdf(h)).to(out_ptr.dtype.element_ty), mask=mask)
    if EPI == 2:
        p = tl.load(aux_ptr + off, mask=mask, other=0.0).to(tl.float32)
        cdf = _cdf(p)  # one erf for GELU and its derivative
        tl.store(out2_ptr + off, (p * cdf).to(out_ptr.dtype.element_ty), mask=mask)
        dgelu = cdf + p * 0.3989422804014327 * tl.exp(-0.5 * p * p)
        v = (v.to(tl.float32) * dgelu).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + off, v, mask=mask)


@triton.jit
def gelu_epilogue_kernel(out_ptr, aux_ptr, out2_ptr, n, EPI: tl.constexpr, BLOCK: tl.constexpr):
    """The epilogue of :func:`_store_epilogue` as a pass of its own over a finished product ``out`` (contiguous,
    ``n`` elements; ``aux`` and ``out2`` alike): for plans whose kernel has no epilogue of its own."""
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = off < n
    _store_epilogue(out_ptr, aux_ptr, out2_ptr, off, tl.load(out_ptr + off, mask=mask, other=0.0).to(tl.float32),
                    mask, EPI)


@triton.jit
def _dw_item(grow_ptr, gstart_ptr, gcount_ptr, T, n_groups, t_per_split, HAS_DBIAS: tl.constexpr):
    """A weight-gradient program's work item: its group (block row ``r``, first slot ``s0``, ``cnt`` blocks) and
    token range [t_begin, t_end). The token slice is the slow index: the programs running together all read one
    slice of X and dY, which fits in L2, so each byte comes from DRAM about once although a column block of X is
    read by every active block of that column."""
    pid = tl.program_id(0)
    split = pid // n_groups
    grp = pid % n_groups
    r = tl.load(grow_ptr + grp)
    s0 = tl.load(gstart_ptr + grp)
    cnt = tl.load(gcount_ptr + grp)
    t_begin = split * t_per_split
    t_end = tl.minimum(t_begin + t_per_split, T)
    if not HAS_DBIAS:
        t_end = tl.where(cnt > 0, t_end, t_begin)  # empty row without bias: nothing to do
    t_end = tl.where(cnt >= 0, t_end, t_begin)     # a padding group (count -1, dw_groups(fixed=True)): nothing
    return grp, r, s0, cnt, t_begin, t_end


@triton.jit
def _store_dw(dv_ptr, slot, acc, keep, BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    """Writes (SPLIT == 1) or adds (fp32 atomics) one block's gradient ``acc[n, k]`` at ``slot``, if ``keep``."""
    offs_b = tl.arange(0, BLOCK)
    dst = dv_ptr + slot * (BLOCK * BLOCK) + offs_b[:, None] * BLOCK + offs_b[None, :]
    has = (offs_b < BLOCK * keep.to(tl.int32))[:, None]  # all False when not kept
    if SPLIT == 1:
        tl.store(dst, acc.to(dv_ptr.dtype.element_ty), mask=has)
    else:
        tl.atomic_add(dst, acc, mask=has)


@triton.jit
def _add_dbias(db_ptr, gfirst_ptr, grp, r, dbacc, BLOCK: tl.constexpr):
    """Adds a group's Σ_t dY over its token slice to the bias gradient; only the first group of a block row does
    (gfirst is 0 or 1), so a row's tokens are counted once per slice."""
    offs_b = tl.arange(0, BLOCK)
    first = tl.load(gfirst_ptr + grp)
    tl.atomic_add(db_ptr + r * BLOCK + offs_b, dbacc, mask=offs_b < BLOCK * first)


@triton.jit
def sampled_grad_kernel(
    x_ptr,       # [T, I] layer input X, strides (stride_xt, stride_xk) (row-major: stride_xk == 1)
    dy_ptr,      # [T, O] output gradient dY, unit column stride, row stride stride_dy
    grow_ptr,    # [n_groups] int32: block row of each group
    gstart_ptr,  # [n_groups] int32: first slot of the group (the slots of one block row are consecutive)
    gcount_ptr,  # [n_groups] int32: blocks in the group, 0..GROUP (0: an empty block row, kept for dbias; -1: padding)
    gfirst_ptr,  # [n_groups] int32: 1 for the first group of its block row (it alone adds the bias gradient)
    kidx_ptr,    # [n_blocks] int32: block column of each slot
    dv_ptr,      # [n_blocks, BLOCK, BLOCK] gradient of the values: float32 zero-filled when SPLIT > 1, else any dtype
    db_ptr,      # [O] float32 bias gradient, zero-filled; written only when HAS_DBIAS
    dy1_ptr, dy2_ptr,  # DY_PARTS: dY's second and third pieces (else unused)
    T, stride_xt, stride_xk, stride_dy, n_groups, t_per_split,
    HAS_DBIAS: tl.constexpr,
    BLOCK: tl.constexpr,     # block edge B
    GROUP: tl.constexpr,     # blocks per group: the tl.dot has M = GROUP * BLOCK
    BLOCK_T: tl.constexpr,   # tokens per reduction step
    SPLIT: tl.constexpr,     # token slices; > 1 adds partial sums with fp32 atomics
    DY_PARTS: tl.constexpr = 0,  # > 0: dY is three tensors of DY_PARTS column blocks each (dy_ptr, dy1_ptr,
                                 # dy2_ptr), row stride stride_dy
):
    grp, r, s0, cnt, t_begin, t_end = _dw_item(grow_ptr, gstart_ptr, gcount_ptr, T, n_groups, t_per_split,
                                               HAS_DBIAS)
    offs_b = tl.arange(0, BLOCK)
    dy_base, rr = _piece(dy_ptr, dy1_ptr, dy2_ptr, r, DY_PARTS)   # block row r of dY: its piece and place there
    acc = tl.zeros((GROUP * BLOCK, BLOCK), dtype=tl.float32)
    dbacc = tl.zeros((BLOCK,), dtype=tl.float32)
    # 16-bit dY: the bias gradient's column sums on the tensor cores (ones[16, BLOCK_T] · dY, 16 equal rows, a
    # quarter of the block product's work at 64x64) instead of a cross-thread reduction of every dY tile
    DB_MMA: tl.constexpr = HAS_DBIAS and dy_ptr.dtype.element_ty != tl.float32
    ones = tl.full((16, BLOCK_T), 1.0, dy_ptr.dtype.element_ty)
    dbt = tl.zeros((16, BLOCK), dtype=tl.float32)
    if GROUP == 1:
        kb = tl.load(kidx_ptr + s0, mask=cnt > 0, other=0)
        for t0 in range(t_begin, t_end, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            t_ok = offs_t < t_end
            rows = offs_t.to(tl.int64)[:, None]
            # (an empty row reads column block 0 for nothing; only happens with a bias, and is not stored)
            xg = tl.load(x_ptr + rows * stride_xt + (kb * BLOCK + offs_b[None, :]) * stride_xk, mask=t_ok[:, None],
                         other=0.0)
            dy = tl.load(dy_base + rows * stride_dy + rr * BLOCK + offs_b[None, :], mask=t_ok[:, None], other=0.0)
            acc = tl.dot(tl.trans(xg), dy, acc)  # acc[k, n] = sum_t X[t, kb*B + k] * dY[t, r*B + n]
            if DB_MMA:
                dbt = tl.dot(ones, dy, dbt)
            elif HAS_DBIAS:
                dbacc += tl.sum(dy.to(tl.float32), axis=0)
        # dW block (n, k) = acc[k, n]: store transposed.
        dst = dv_ptr + s0 * (BLOCK * BLOCK) + offs_b[None, :] * BLOCK + offs_b[:, None]
        has = (offs_b < BLOCK * tl.minimum(cnt, 1))[:, None]  # all False for an empty row
        if SPLIT == 1:
            tl.store(dst, acc.to(dv_ptr.dtype.element_ty), mask=has)
        else:
            tl.atomic_add(dst, acc, mask=has)
    else:
        offs_g = tl.arange(0, GROUP)
        ok_g = offs_g < cnt
        kb = tl.load(kidx_ptr + s0 + offs_g, mask=ok_g, other=0)
        for t0 in range(t_begin, t_end, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            t_ok = offs_t < t_end
            rows = offs_t.to(tl.int64)[:, None]
            xg = tl.load(x_ptr + rows[:, :, None] * stride_xt
                         + ((kb * BLOCK)[None, :, None] + offs_b[None, None, :]) * stride_xk,
                         mask=t_ok[:, None, None] & ok_g[None, :, None], other=0.0)
            xg = tl.reshape(xg, (BLOCK_T, GROUP * BLOCK))
            dy = tl.load(dy_base + rows * stride_dy + rr * BLOCK + offs_b[None, :], mask=t_ok[:, None], other=0.0)
            acc = tl.dot(tl.trans(xg), dy, acc)  # acc[(g, k), n] = dW block g at (n, k)
            if DB_MMA:
                dbt = tl.dot(ones, dy, dbt)
            elif HAS_DBIAS:
                dbacc += tl.sum(dy.to(tl.float32), axis=0)
        acc3 = tl.reshape(acc, (GROUP, BLOCK, BLOCK))  # [g, k, n]
        dst = (dv_ptr + (s0 + offs_g)[:, None, None] * (BLOCK * BLOCK)
               + offs_b[None, None, :] * BLOCK + offs_b[None, :, None])
        if SPLIT == 1:
            tl.store(dst, acc3.to(dv_ptr.dtype.element_ty), mask=ok_g[:, None, None])
        else:
            tl.atomic_add(dst, acc3, mask=ok_g[:, None, None])
    if DB_MMA:
        dbacc = tl.sum(dbt, axis=0) * 0.0625  # 16 equal rows: exact
    if HAS_DBIAS:
        _add_dbias(db_ptr, gfirst_ptr, grp, r, dbacc, BLOCK)


@triton.jit
def dense_x_blocksparse_tma_kernel(
    a_ptr,     # [T, K] A (X or dY), unit column stride, row stride stride_at (16-byte aligned rows); or, when
               # HOST_DESC, a host-made tensor descriptor of it with block [BLOCK_T, BLOCK]
    v_ptr,     # [n_blocks, BLOCK, BLOCK] block values of W (contiguous, A's dtype); or (HOST_DESC) a descriptor of
               # them viewed as [n_blocks * BLOCK, BLOCK] with block [BLOCK, BLOCK]
    ptr_ptr,   # [n_out_blocks + 1] int32: entries of output column block j are ptr[j] .. ptr[j + 1] - 1 (no padding)
    kidx_ptr,  # [n_entries] int32: the column block of A each entry multiplies
    slot_ptr,  # [n_entries] int32: the entry's slot in the values (input gradient only; the forward's slot is e)
    bias_ptr,  # [N] bias, read only when HAS_BIAS
    out_ptr,   # [T, N] dense output, unit column stride, row stride stride_o; every element is written
    T, K, stride_at, n_blocks, stride_o, n_out_blocks,
    FORWARD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    WIDE: tl.constexpr,      # accumulate outᵀ [BLOCK, BLOCK_T] (tokens as the MMA's N side)
    HOST_DESC: tl.constexpr = False,
):
    """The dense x block-sparse product with both operands fetched by the Tensor Memory Accelerator: one
    program per (BLOCK_T tokens, output column block); the tile loads are whole [BLOCK_T, BLOCK] / [BLOCK, BLOCK]
    boxes at data-dependent coordinates, so no thread computes a gather address. Eager launches make the
    descriptors on the device; under CUDA-graph capture they come made on the host (HOST_DESC), which Triton
    encodes at every launch but a graph only once (docs/history/blocksparse.md)."""
    if HOST_DESC:
        a_desc = a_ptr
        v_desc = v_ptr
    else:  # rows past T read as zeros
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[T, K], strides=[stride_at, 1],
                                           block_shape=[BLOCK_T, BLOCK])
        v_desc = tl.make_tensor_descriptor(v_ptr, shape=[n_blocks * BLOCK, BLOCK], strides=[BLOCK, 1],
                                           block_shape=[BLOCK, BLOCK])
    pid = tl.program_id(0)
    pid_t = pid // n_out_blocks  # output block is the fast index: programs running together share A's tile in L2
    j = pid % n_out_blocks
    e_begin = tl.load(ptr_ptr + j)
    e_end = tl.load(ptr_ptr + j + 1)
    t0 = pid_t * BLOCK_T
    acc = tl.zeros((BLOCK, BLOCK_T) if WIDE else (BLOCK_T, BLOCK), dtype=tl.float32)
    for e in range(e_begin, e_end):
        kb = tl.load(kidx_ptr + e)
        slot = e if FORWARD else tl.load(slot_ptr + e)
        a = a_desc.load([t0, kb * BLOCK])          # [BLOCK_T, BLOCK]
        w = v_desc.load([slot * BLOCK, 0])         # W_slot[r, c]
        if WIDE:
            acc = tl.dot(w if FORWARD else tl.trans(w), tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w) if FORWARD else w, acc)
    res = tl.trans(acc) if WIDE else acc
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_b = tl.arange(0, BLOCK)
    if HAS_BIAS:
        res += tl.load(bias_ptr + j * BLOCK + offs_b).to(tl.float32)[None, :]
    dst = out_ptr + offs_t.to(tl.int64)[:, None] * stride_o + j * BLOCK + offs_b[None, :]
    tl.store(dst, res.to(out_ptr.dtype.element_ty), mask=(offs_t < T)[:, None])


@triton.jit
def sampled_grad_tma_kernel(
    x_ptr,       # [T, I] layer input X, unit column stride, row stride stride_xt (16-byte aligned rows)
    dy_ptr,      # [T, O] output gradient dY, unit column stride, row stride stride_dy (16-byte aligned rows)
    grow_ptr, gstart_ptr, gcount_ptr, gfirst_ptr,  # groups of GROUP blocks (BlockSparseMeta.dw_groups(GROUP))
    kidx_ptr,    # [n_blocks] int32: block column of each slot
    dv_ptr,      # [n_blocks, BLOCK, BLOCK] gradient of the values: float32 zero-filled when SPLIT > 1, else any dtype
    db_ptr,      # [O] float32 bias gradient, zero-filled; written only when HAS_DBIAS
    T, I, O, stride_xt, stride_dy, n_groups, t_per_split,
    HAS_DBIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,   # tokens per reduction step
    SPLIT: tl.constexpr,     # token slices; > 1 adds partial sums with fp32 atomics
    HOST_DESC: tl.constexpr = False,  # x_ptr / dy_ptr are host-made descriptors with block [BLOCK_T, BLOCK]
    GROUP: tl.constexpr = 1,  # blocks per program (1 or 2), consecutive slots of one block row
):
    """dW at active blocks with TMA loads: one program per (group, token slice) reduces
    ``acc[n, k] = sum_t dY[t, r*B + n] · X[t, kb*B + k]``, which is the block as stored (no transposed store).
    With ``GROUP = 2`` the two blocks of a group share each dY tile: 21 instead of 16 MACs per byte loaded
    (the 50%-dense products are bound by L2 bandwidth, docs/history/blocksparse.md)."""
    if HOST_DESC:
        x_desc = x_ptr
        dy_desc = dy_ptr
    else:  # rows past T read as zeros
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[T, I], strides=[stride_xt, 1],
                                           block_shape=[BLOCK_T, BLOCK])
        dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[T, O], strides=[stride_dy, 1],
                                            block_shape=[BLOCK_T, BLOCK])
    grp, r, s0, cnt, t_begin, t_end = _dw_item(grow_ptr, gstart_ptr, gcount_ptr, T, n_groups, t_per_split,
                                               HAS_DBIAS)
    kb = tl.load(kidx_ptr + s0, mask=cnt > 0, other=0)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    dbacc = tl.zeros((BLOCK,), dtype=tl.float32)
    dbt = tl.zeros((BLOCK, 16), dtype=tl.float32)  # 16-bit dY: bias column sums as dYᵀ · ones (sampled_grad_kernel)
    if GROUP == 2:  # a group of one block loads its X tile twice and stores the second result nowhere
        kb1 = tl.load(kidx_ptr + s0 + 1, mask=cnt > 1, other=0)
        acc1 = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for t0 in range(t_begin, t_end, BLOCK_T):
        # (t_per_split is a multiple of BLOCK_T, so a step never reaches into the next slice; rows past T read
        # as zeros)
        x = x_desc.load([t0, kb * BLOCK])
        dy = dy_desc.load([t0, r * BLOCK])
        dyt = tl.trans(dy)
        acc = tl.dot(dyt, x, acc)
        if GROUP == 2:
            acc1 = tl.dot(dyt, x_desc.load([t0, kb1 * BLOCK]), acc1)
        if HAS_DBIAS:
            if dy.dtype != tl.float32:
                dbt = tl.dot(dyt, tl.full((BLOCK_T, 16), 1.0, dy.dtype), dbt)
            else:
                dbacc += tl.sum(dy.to(tl.float32), axis=0)
    if HAS_DBIAS:
        dbacc += tl.sum(dbt, axis=1) * 0.0625  # 16 equal columns: exact (zero where dY is float32)
    _store_dw(dv_ptr, s0, acc, cnt > 0, BLOCK, SPLIT)
    if GROUP == 2:
        _store_dw(dv_ptr, s0 + 1, acc1, cnt > 1, BLOCK, SPLIT)
    if HAS_DBIAS:
        _add_dbias(db_ptr, gfirst_ptr, grp, r, dbacc, BLOCK)
