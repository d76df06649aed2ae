// Dense x block-sparse products of block-sparse TRAINING (blocksparse.py), "X-stationary":
//   forward  out[T, O] = A[T, I] · Wᵀ   (A = X; entries per block row of W: kidx = block column)
//   input    out[T, I] = A[T, O] · W    (A = dY; entries per block column: kidx = block row; TRANS)
// W is the compressed values [n_blocks, BLK, BLK] (row-major blocks, 16-bit, the dtype of A).
//
// Why: the Triton kernel (_blocksparse_triton.py) gives each (token tile, output block) program its own gather
// of the b-wide strips of A that the block row touches, so A is re-read once per active block: at 16x16 blocks
// and 10% density that is 820 MB per product at T = 16384, 1024 -> 4096, in 32-byte row segments, and the
// product runs slower than dense cuBLAS (docs/history/blocksparse.md). Here one CTA keeps a whole token tile of A
// ([TM, K], up to ~200 KB) in shared memory and walks ALL output blocks of its range over it: A is read from
// HBM once per CTA; what is re-read per token tile is W itself (density * O * I * 2 bytes, from L2).
//
// Work split: the CTA's warps each take a contiguous range of the padded entry list (blocksparse.py
// padded_entries(group_k=1): every output block has >= 1 entry, slot -1 = padding for an empty one), cut at
// output-block boundaries and balanced by entry count on the host. A warp streams its W blocks through a
// private S-stage cp.async ring in shared memory (16-byte chunks XOR-swizzled so that ldmatrix is conflict
// free; .trans for the input gradient, so no transposed copy of W exists), reads A fragments with ldmatrix
// from the resident tile, accumulates an [TM x BLK] fp32 tile with mma.sync m16n8k16, and writes it (+ bias)
// when its output block changes. The entry indices come 32 at a time, one per lane, and are shuffled out.
#include "common.cuh"

namespace {
using namespace sparsetrain;

using OutPieces = PiecesOf<uint16_t>;  // out in three tensors (common.cuh)

struct Args {
  const uint16_t* a;       // [T, K], row stride sa (halves), 16-byte aligned, sa % 8 == 0
  const uint16_t* values;  // [n_blocks, BLK, BLK], 16-byte aligned
  const int4* info;        // [E] per entry: value offset (slot * BLK * BLK, -1: padding), A column of its
                           // block (halves), output column of its block, 1 if the last entry of its block
  const int32_t* wbound;   // [gridDim.x * WARPS + 1] first entry of each warp's range
  const void* bias;        // [n_out * BLK] or null
  uint16_t* out;           // [T, n_out * BLK], row stride so
  const uint16_t* aux;     // epilogue 2: GELU's input, as out (row stride so); else null
  uint16_t* out2;          // epilogues 1, 2: GELU's output, as out; else null
  Pieces pa;               // A in three tensors (the input gradient of a fused q/k/v projection), or one
  OutPieces po;            // out in three tensors (its forward), or one
  int t, k, sa, so, bias_f32, epi;
};

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ int4 lds128(uint32_t addr) {
  int4 v;
  asm volatile("ld.shared.v4.s32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ int lds32(uint32_t addr) {
  int v;
  asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}

template <int BLK>
struct Swz {  // 16-byte chunk c of block row r lives at chunk (c ^ f(r)): 8 consecutive rows hit 8 bank groups
  static constexpr int CPR = BLK / 8;  // chunks per row
  static constexpr int RPG = 8 / CPR > 0 ? 8 / CPR : 1;
  __device__ __forceinline__ static int chunk(int r, int c) { return r * CPR + (c ^ ((r / RPG) % CPR)); }
};

template <bool BF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (BF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// The exact (erf) GELU, and GELU with its derivative from one erf, in fp32, as torch computes them.
__device__ __forceinline__ float gelu_f(float x) { return 0.5f * x * (1.f + erff(x * 0.70710678118654752f)); }
__device__ __forceinline__ void gelu_dgelu_f(float x, float& g, float& dg) {
  const float cdf = 0.5f * (1.f + erff(x * 0.70710678118654752f));
  g = x * cdf;
  dg = cdf + x * 0.39894228040143268f * __expf(-0.5f * x * x);
}

template <bool BF16>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (BF16) return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
  else return __half22float2(*reinterpret_cast<__half2*>(&v));
}

// The epilogues on 8 stored 16-bit values v (a rounded output, as the plain product stores it), p (GELU's input
// at the same place, epilogue 2): 1 (forward of Linear + GELU): out2 = gelu(v); 2 (input gradient of
// GELU + Linear): out = v * gelu'(p), out2 = gelu(p) (the GELU output the weight gradient reads).
template <bool BF16>
__device__ __forceinline__ void epilogue8(uint4& v, uint4 p, uint4& g, int epi) {
  uint32_t* vv = reinterpret_cast<uint32_t*>(&v);
  const uint32_t* pp = reinterpret_cast<const uint32_t*>(&p);
  uint32_t* gg = reinterpret_cast<uint32_t*>(&g);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (epi == 1) {
      const float2 x = unpack2<BF16>(vv[i]);
      gg[i] = pack2<BF16>(gelu_f(x.x), gelu_f(x.y));
    } else {
      const float2 x = unpack2<BF16>(pp[i]), d = unpack2<BF16>(vv[i]);
      float g0, g1, d0, d1;
      gelu_dgelu_f(x.x, g0, d0);
      gelu_dgelu_f(x.y, g1, d1);
      gg[i] = pack2<BF16>(g0, g1);
      vv[i] = pack2<BF16>(d.x * d0, d.y * d1);
    }
  }
}

// Writes one warp's finished [16 * MT tokens x BLK] output tile (+ bias of columns col0..; at column ocol of
// `out`, which differs from col0 where the output is in pieces) and zeroes its accumulators: fragments
// into the warp's shared-memory staging tile (rows BLK + 8 halves apart: conflict-free), then 16-byte stores of
// whole rows, rows past T skipped; an epilogue (EPI: epi > 0, epilogue8) works on the 16-byte rows as they are
// stored. EPI is a template argument so the plain kernels carry no epilogue code (behind a runtime flag the
// epilogue's arithmetic is inlined, unrolled, into every kernel: several times its instructions).
template <int BLK, int MT, bool BF16, bool EPI>
__device__ __forceinline__ void store_block(float (&acc)[MT][BLK / 8][4], uint16_t* ostage, const void* bias,
                                            int bias_f32, uint16_t* out, int so, int t, int t0, int col0,
                                            int ocol, const uint16_t* aux, uint16_t* out2, int epi) {
  using T = std::conditional_t<BF16, __nv_bfloat16, __half>;
  constexpr int OS = BLK + 8, RCH = BLK / 8;  // staged row stride (halves), 16-byte chunks per row
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int nt = 0; nt < BLK / 8; ++nt) {
    const int c = nt * 8 + 2 * t4;
    float b0 = 0.f, b1 = 0.f;
    if (bias) {
      if (bias_f32) {
        const float2 bv = __ldg(reinterpret_cast<const float2*>(static_cast<const float*>(bias) + col0 + c));
        b0 = bv.x;
        b1 = bv.y;
      } else {
        const T* bp = static_cast<const T*>(bias) + col0 + c;
        b0 = to_float<T>(bp[0]);
        b1 = to_float<T>(bp[1]);
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        *reinterpret_cast<uint32_t*>(ostage + (mt * 16 + g + 8 * h) * OS + c) =
            pack2<BF16>(acc[mt][nt][2 * h] + b0, acc[mt][nt][2 * h + 1] + b1);
        acc[mt][nt][2 * h] = 0.f;
        acc[mt][nt][2 * h + 1] = 0.f;
      }
  }
  __syncwarp();
  auto row = [&](int i) {
    const int c = lane + 32 * i, r = c / RCH, cc = c % RCH;
    if (t0 + r < t) {
      const long long o = static_cast<long long>(t0 + r) * so + ocol + 8 * cc;
      uint4 v = *reinterpret_cast<const uint4*>(ostage + r * OS + 8 * cc);
      if constexpr (EPI) {
        uint4 g;
        epilogue8<BF16>(v, epi == 2 ? *reinterpret_cast<const uint4*>(aux + o) : v, g, epi);
        *reinterpret_cast<uint4*>(out2 + o) = g;
      }
      *reinterpret_cast<uint4*>(out + o) = v;
    }
  };
  if constexpr (EPI) {  // not unrolled: the epilogue's arithmetic once in the code, not once per row chunk
#pragma unroll 1
    for (int i = 0; i < 16 * MT * RCH / 32; ++i) row(i);
  } else {
#pragma unroll
    for (int i = 0; i < 16 * MT * RCH / 32; ++i) row(i);
  }
  __syncwarp();
}

// Shared memory: the A tile [TM][K + 8] | per warp: S ring stages of one W block, a 64-entry ring of entry
// infos (two batches of 32), an output staging tile [TM][BLK + 8].
template <int BLK, int MT, int WARPS, int S>
struct Layout {
  static constexpr int TM = 16 * MT;
  static constexpr int OS = BLK + 8;  // halves per staged output row (+16 bytes: conflict-free fragment writes)
  static constexpr int WARP_BYTES = 2 * S * BLK * BLK + 64 * 16 + 2 * TM * OS;
  static int bytes(int k) { return 2 * TM * (k + 8) + WARPS * WARP_BYTES; }
};

template <int BLK, int MT, int WARPS, int S, bool TRANS, bool BF16, bool EPI>
__global__ void __launch_bounds__(WARPS * 32) bs_dds_kernel(Args a) {
  using L = Layout<BLK, MT, WARPS, S>;
  constexpr int TM = L::TM;
  constexpr int NT = BLK / 8;         // n8 tiles per output block
  constexpr int KS = BLK / 16;        // k16 steps per block
  constexpr int BCH = BLK * BLK / 8;  // 16-byte chunks per W block
  constexpr int CPL = (BCH + 31) / 32;  // of them per lane
  extern __shared__ __align__(16) unsigned char smem[];
  const int xs_stride = a.k + 8;  // halves; +16 bytes per row: ldmatrix rows fall in distinct banks
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint16_t* xs = reinterpret_cast<uint16_t*>(smem);
  unsigned char* wbase = smem + 2 * TM * xs_stride + warp * L::WARP_BYTES;
  const uint32_t ring_addr = static_cast<uint32_t>(__cvta_generic_to_shared(wbase));
  const uint32_t info_addr = ring_addr + 2 * S * BLK * BLK;
  uint16_t* ostage = reinterpret_cast<uint16_t*>(wbase + 2 * S * BLK * BLK + 64 * 16);
  int4* info_s = reinterpret_cast<int4*>(wbase + 2 * S * BLK * BLK);
  const int t0 = blockIdx.y * TM;  // the CTAs of one token tile are adjacent (x) and share its A in L2

  // 1. the token tile of A, rows past T zero-filled (group 0 of every thread), piece by piece
  {
    const uint32_t xs_s = static_cast<uint32_t>(__cvta_generic_to_shared(xs));
    const int valid = a.t - t0, w = a.pa.width ? a.pa.width : a.k;
    const long long row0 = static_cast<long long>(t0) * a.sa;
    stage_tile<WARPS * 32>(xs_s, xs_stride, a.a + row0, a.sa, w >> 3, TM, valid);
    if (a.pa.width) {
      stage_tile<WARPS * 32>(xs_s + 2u * w, xs_stride, a.pa.p1 + row0, a.sa, w >> 3, TM, valid);
      stage_tile<WARPS * 32>(xs_s + 4u * w, xs_stride, a.pa.p2 + row0, a.sa, w >> 3, TM, valid);
    }
    cp_async_commit();
  }

  const int wi = blockIdx.x * WARPS + warp;
  const int e0 = a.wbound[wi], n_e = a.wbound[wi + 1] - e0;
  const int4 none = make_int4(-1, 0, 0, 0);
  // entry infos, 32 at a time (one per lane) into a 64-entry ring: batch m at slots (32 m) & 63
  // lanes past the range read nothing (lane < n_e, as in bs_dds_ks): the last range ends at the last real entry,
  // which the padding of the fixed-size table (room for in-place mask updates) may or may not follow
  int4 pre = lane < n_e ? __ldg(a.info + e0 + lane) : none;
  info_s[lane] = pre;
  pre = 32 + lane < n_e ? __ldg(a.info + e0 + 32 + lane) : none;  // batch 1: stored at q = 16
  __syncwarp();

  // per-lane constants of the W-block copies (lane's chunks, swizzled) and of the ldmatrix addresses
  int cp_dst[CPL];
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = lane + 32 * i;
    cp_dst[i] = 16 * Swz<BLK>::chunk(c / (BLK / 8), c % (BLK / 8));
  }
  auto issue = [&](int q, int stage) {  // entry q's W block into `stage`; one commit group, possibly empty
    if (q < n_e) {
      const int off = lds32(info_addr + 16u * (q & 63));
      const uint16_t* src = a.values + (off >= 0 ? off : 0);
      const uint32_t dst = ring_addr + 2u * stage * BLK * BLK;
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        if (BCH % 32 == 0 || lane + 32 * i < BCH) {
          const uint32_t d = dst + cp_dst[i];
          cp_async16(d, src + 8 * (lane + 32 * i), off >= 0 ? 16 : 0);
        }
      }
    }
    cp_async_commit();
  };

#pragma unroll
  for (int q = 0; q < S - 1; ++q) issue(q, q);
  cp_async_wait<S - 1>();  // the A tile (the oldest group) has landed
  __syncthreads();
  if (n_e <= 0) return;

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

  const uint32_t xs_addr = static_cast<uint32_t>(__cvta_generic_to_shared(xs));
  const int lq = lane >> 3, l8 = lane & 7;
  // this lane's ldmatrix row of an A fragment: token row (lane & 15), k offset 8 * (lane >> 4)
  const uint32_t a_lane = xs_addr + 2u * ((lane & 15) * xs_stride + 8 * (lane >> 4));
  uint32_t b_lane[KS][NT / 2];  // byte offsets of this lane's ldmatrix rows in a W stage
#pragma unroll
  for (int ks = 0; ks < KS; ++ks)
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      if constexpr (TRANS) {  // rows of the stored block = k: b-fragments by transposing 8x8 loads
        b_lane[ks][np] = 16u * Swz<BLK>::chunk(ks * 16 + (lq & 1) * 8 + l8, 2 * np + (lq >> 1));
      } else {  // rows = n (output feature), contiguous k: the mma's "col" B layout as stored
        b_lane[ks][np] = 16u * Swz<BLK>::chunk((2 * np + (lq >> 1)) * 8 + l8, 2 * ks + (lq & 1));
      }
    }

  int stage = 0, stage_in = S - 1;  // ring stage of entry q, and of entry q + S - 1
  for (int q = 0; q < n_e; ++q) {
    if ((q & 31) == 16) {  // batch q / 32 + 1 (loaded 16 entries ago) into the ring half batch q / 32 - 1 used
      info_s[(q + 16 + lane) & 63] = pre;
      __syncwarp();
      const int nxt = q + 48 + lane;
      pre = nxt < n_e ? __ldg(a.info + e0 + nxt) : none;
    }
    issue(q + S - 1, stage_in);
    stage_in = stage_in + 1 == S ? 0 : stage_in + 1;
    const int4 inf = lds128(info_addr + 16u * (q & 63));
    cp_async_wait<S - 1>();
    __syncwarp();
    const uint32_t st = ring_addr + 2u * stage * BLK * BLK;
    stage = stage + 1 == S ? 0 : stage + 1;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t bf[NT][2];
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t r[4];
        if constexpr (TRANS) ldsm_x4_t(r, st + b_lane[ks][np]);
        else ldsm_x4(r, st + b_lane[ks][np]);
        bf[2 * np][0] = r[0];
        bf[2 * np][1] = r[1];
        bf[2 * np + 1][0] = r[2];
        bf[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t af[4];
        ldsm_x4(af, a_lane + 2u * (mt * 16 * xs_stride + inf.y + ks * 16));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma16816<BF16>(acc[mt][nt], af, bf[nt][0], bf[nt][1]);
      }
    }
    __syncwarp();  // every lane is done with this stage before a later issue() overwrites it

    if (inf.w) {  // the output block is complete
      int ocol = inf.z;
      uint16_t* out = a.po.select(a.out, ocol);
      store_block<BLK, MT, BF16, EPI>(acc, ostage, a.bias, a.bias_f32, out, a.so, a.t, t0, inf.z, ocol, a.aux,
                                      a.out2, a.epi);
    }
  }
  cp_async_wait<0>();
}

template <int BLK, int MT, int WARPS, int S, bool TRANS, bool BF16>
int launch_t(const Args& a, int grid_y, cudaStream_t stream) {
  constexpr int TM = 16 * MT;
  const int smem = Layout<BLK, MT, WARPS, S>::bytes(a.k);
  auto kern = a.epi ? bs_dds_kernel<BLK, MT, WARPS, S, TRANS, BF16, true>
                    : bs_dds_kernel<BLK, MT, WARPS, S, TRANS, BF16, false>;
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  const int tiles = (a.t + TM - 1) / TM;
  if (tiles > 65535) return -1;  // token tiles run along y
  kern<<<dim3(grid_y, tiles), WARPS * 32, smem, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

// Per block size: warps per CTA and ring stages (16x16: 512 B per stage; 32x32: 2 KB). HALF: half the warps
// (and a shorter ring), which leaves room for a taller token tile when K is large (e.g. K = 3072).
template <int BLK, bool HALF>
struct Shape;
template <>
struct Shape<16, false> { static constexpr int WARPS = 16, S = 4; };
template <>
struct Shape<16, true> { static constexpr int WARPS = 8, S = 3; };
template <>
struct Shape<32, false> { static constexpr int WARPS = 8, S = 3; };
template <>
struct Shape<32, true> { static constexpr int WARPS = 4, S = 2; };

// Calls f.template operator()<BLK, MT, HALF>() for runtime (blk, mt, half); -1 when unsupported.
template <typename F>
int with_tile(int blk, int mt, int half, F&& f) {
  auto by_mt = [&]<int B, bool H>() -> int {
    switch (mt) {
      case 1: return f.template operator()<B, 1, H>();
      case 2: return f.template operator()<B, 2, H>();
      case 4: return f.template operator()<B, 4, H>();
      default: return -1;
    }
  };
  if (blk == 16) return half ? by_mt.template operator()<16, true>() : by_mt.template operator()<16, false>();
  if (blk == 32) return half ? by_mt.template operator()<32, true>() : by_mt.template operator()<32, false>();
  return -1;
}


// ---- K-streamed variant for large K (16x16 blocks) --------------------------------------------------------
// When a whole [64, K] token tile does not fit in shared memory (K >= ~1500), the tile above must shrink to 16-32
// tokens and W is re-read 2-4x more often. This variant keeps the OUTPUT stationary instead: a CTA owns a token
// tile and a group of output blocks (OB per warp, fp32 accumulators in registers), and streams the dense operand
// through shared memory in K parts of KP columns (double-buffered cp.async, one barrier per part). Each warp walks
// its entries in (part, output block, k) order (a host-built flat list), loading each W block with one 16-byte
// load per lane two entries ahead, staging it in shared memory (swizzled) for ldmatrix(.trans).
struct KsArgs {
  const uint16_t* a;       // [T, K] dense operand, row stride sa
  const uint16_t* values;  // [n_blocks, 16, 16]
  const int2* info;        // per entry of the warps' flat lists: value offset (elements), column inside its part
  const int32_t* wstart;   // [n_warps + 1] first entry of each (global) warp
  const int32_t* counts;   // [n_warps, n_parts, OB] entries per (part, output block of the warp)
  const void* bias;        // [n_out * 16] or null
  uint16_t* out;           // [T, n_out * 16], row stride so
  const uint16_t* aux;     // the epilogue's operands, as in Args
  uint16_t* out2;
  Pieces pa;               // as in Args
  OutPieces po;
  int t, k, sa, so, bias_f32, n_parts, n_out, epi;
};

template <int MT, int OB, int WARPS, int KP, int S>
struct KsLayout {
  static constexpr int TM = 16 * MT;
  static constexpr int AS = KP + 8;                  // halves per staged row
  static constexpr int A_HALVES = 2 * TM * AS;       // part p in stage p & 1
  static constexpr int W_HALVES = WARPS * (S * 256 + 64 * 8);  // per warp: S-stage W ring + 64 entry infos
  static constexpr int O_HALVES = WARPS * TM * 24;   // output staging (aliases the A stages at the end)
  static constexpr int bytes() { return 2 * ((A_HALVES > O_HALVES ? A_HALVES : O_HALVES) + W_HALVES); }
};

template <int MT, int OB, int WARPS, int KP, int S, bool TRANS, bool BF16, bool EPI>
__global__ void __launch_bounds__(WARPS * 32) bs_dds_ks_kernel(KsArgs a) {
  using L = KsLayout<MT, OB, WARPS, KP, S>;
  constexpr int TM = L::TM;
  constexpr int CPR = KP / 8;                           // 16-byte chunks per part row
  constexpr int PER = (TM * CPR) / (WARPS * 32);        // of them per thread
  static_assert((TM * CPR) % (WARPS * 32) == 0, "part chunks must divide evenly");
  extern __shared__ __align__(16) uint16_t ks_smem[];
  uint16_t* smem = ks_smem;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // the CTAs of one token tile (its output groups) are adjacent (x), so they run together and share A in L2
  const int gw = blockIdx.x * WARPS + warp;
  const int t0 = blockIdx.y * TM;
  const int ob0 = gw * OB;  // first output block of this warp
  const uint32_t smem_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t wring = smem_addr + 2u * ((L::A_HALVES > L::O_HALVES ? L::A_HALVES : L::O_HALVES) +
                                           warp * (S * 256 + 64 * 8));
  const uint32_t info_addr = wring + 2u * S * 256;  // 64 int2 entry infos (two batches of 32)

  // A parts go through registers: loaded one part ahead, stored to shared memory at the part boundary (so the
  // cp.async groups belong to the W ring alone)
  uint4 areg[PER];
  auto load_part = [&](int p) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int c = threadIdx.x + i * WARPS * 32, r = c / CPR, kc = p * KP + (c % CPR) * 8;
      areg[i] = (p < a.n_parts && t0 + r < a.t && kc < a.k)
                    ? __ldg(reinterpret_cast<const uint4*>(a.pa.at(a.a, t0 + r, a.sa, kc)))
                    : make_uint4(0, 0, 0, 0);
    }
  };
  auto store_part = [&](int p) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int c = threadIdx.x + i * WARPS * 32, r = c / CPR, col = (c % CPR) * 8;
      *reinterpret_cast<uint4*>(smem + (p & 1) * TM * L::AS + r * L::AS + col) = areg[i];
    }
  };

  const bool active = ob0 < a.n_out;
  const int e0 = active ? a.wstart[gw] : 0, n_e = active ? a.wstart[gw + 1] - e0 : 0;
  int2* info_s = reinterpret_cast<int2*>(smem + (info_addr - smem_addr) / 2);
  const int2 none = make_int2(-1, 0);
  int2 pre = lane < n_e ? __ldg(a.info + e0 + lane) : none;
  info_s[lane] = pre;
  pre = 32 + lane < n_e ? __ldg(a.info + e0 + 32 + lane) : none;
  __syncwarp();
  const int w_dst = 16 * Swz<16>::chunk(lane >> 1, lane & 1);  // this lane's 16-byte chunk of a W block
  auto issue = [&](int q, int stage) {  // entry q's W block into `stage`; one commit group, possibly empty
    if (q < n_e) {
      const int off = lds32(info_addr + 8u * (q & 63));
      cp_async16(wring + 512u * stage + w_dst, a.values + (off >= 0 ? off : 0) + 8 * lane, off >= 0 ? 16 : 0);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int q = 0; q < S - 1; ++q) issue(q, q);

  const int lq = lane >> 3, l8 = lane & 7;
  const int a_lane = (lane & 15) * L::AS + 8 * (lane >> 4);
  const uint32_t b_lane = TRANS ? 16u * Swz<16>::chunk((lq & 1) * 8 + l8, lq >> 1)
                                : 16u * Swz<16>::chunk((lq >> 1) * 8 + l8, lq & 1);
  float acc[OB][MT][2][4];
#pragma unroll
  for (int j = 0; j < OB; ++j)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][mt][nt][i] = 0.f;

  load_part(0);
  store_part(0);
  load_part(1);
  int q = 0, stage = 0, stage_in = S - 1;
  for (int p = 0; p < a.n_parts; ++p) {
    __syncthreads();  // part p is in shared memory everywhere; every warp is done with part p - 1
    if (p + 1 < a.n_parts) {
      store_part(p + 1);  // into the stage part p - 1 used (its loads were issued a part ago)
      load_part(p + 2);
    }
    if (!active) continue;
    const uint32_t abase = smem_addr + 2u * ((p & 1) * TM * L::AS + a_lane);
    const int* cnt = a.counts + (static_cast<long long>(gw) * a.n_parts + p) * OB;
#pragma unroll
    for (int j = 0; j < OB; ++j) {
      const int n = __ldg(cnt + j);
      for (int i = 0; i < n; ++i, ++q) {
        if ((q & 31) == 16) {  // next info batch into the half the previous batch used
          info_s[(q + 16 + lane) & 63] = pre;
          __syncwarp();
          pre = q + 48 + lane < n_e ? __ldg(a.info + e0 + q + 48 + lane) : none;
        }
        issue(q + S - 1, stage_in);
        stage_in = stage_in + 1 == S ? 0 : stage_in + 1;
        const int acol = lds32(info_addr + 8u * (q & 63) + 4u);
        cp_async_wait<S - 1>();
        __syncwarp();
        uint32_t r[4];
        if constexpr (TRANS) ldsm_x4_t(r, wring + 512u * stage + b_lane);
        else ldsm_x4(r, wring + 512u * stage + b_lane);
        stage = stage + 1 == S ? 0 : stage + 1;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          uint32_t af[4];
          ldsm_x4(af, abase + 2u * (mt * 16 * L::AS + acol));
          mma16816<BF16>(acc[j][mt][0], af, r[0], r[1]);
          mma16816<BF16>(acc[j][mt][1], af, r[2], r[3]);
        }
        __syncwarp();  // every lane is done with this stage before a later issue() overwrites it
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the A ring becomes the output staging area
  if (!active) return;
  uint16_t* ostage = smem + warp * TM * 24;
#pragma unroll
  for (int j = 0; j < OB; ++j) {
    if (ob0 + j >= a.n_out) break;
    int ocol = (ob0 + j) * 16;
    uint16_t* out = a.po.select(a.out, ocol);
    store_block<16, MT, BF16, EPI>(acc[j], ostage, a.bias, a.bias_f32, out, a.so, a.t, t0, (ob0 + j) * 16, ocol,
                                   a.aux, a.out2, a.epi);
  }
}

constexpr int KS_MT = 4, KS_KP = 256, KS_S = 6;  // 64 tokens per CTA, K parts of 256 columns, W ring stages
// variants: (output blocks per warp, warps): (4, 8) and (2, 16); both give a CTA 32 output blocks
template <int OB>
constexpr int ks_warps() { return OB == 4 ? 8 : 16; }

template <int OB, bool TRANS, bool BF16>
int launch_ks(const KsArgs& a, int grid_y, cudaStream_t stream) {
  constexpr int W = ks_warps<OB>();
  constexpr int smem = KsLayout<KS_MT, OB, W, KS_KP, KS_S>::bytes();
  auto kern = a.epi ? bs_dds_ks_kernel<KS_MT, OB, W, KS_KP, KS_S, TRANS, BF16, true>
                    : bs_dds_ks_kernel<KS_MT, OB, W, KS_KP, KS_S, TRANS, BF16, false>;
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  const int tiles = (a.t + 16 * KS_MT - 1) / (16 * KS_MT);
  if (tiles > 65535) return -1;  // token tiles run along y
  kern<<<dim3(grid_y, tiles), W * 32, smem, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

// Checks and fills the pieces of A (a1, a2: pieces 1 and 2, apw their width, K = 3 apw; 0: one tensor) and of
// out (o1, o2, opw): 16-byte aligned, whole blocks of `blk` columns, no epilogue beside them. False: refused.
bool set_pieces(Pieces& pa, OutPieces& po, long long a1, long long a2, long long o1, long long o2, int apw, int opw,
                int k, int blk, int epi) {
  pa = Pieces{reinterpret_cast<const uint16_t*>(a1), reinterpret_cast<const uint16_t*>(a2), apw};
  po = OutPieces{reinterpret_cast<uint16_t*>(o1), reinterpret_cast<uint16_t*>(o2), opw};
  for (int w : {apw, opw})
    if (w < 0 || (w % blk)) return false;
  if (apw && (k != 3 * apw || (a1 & 15) || (a2 & 15) || !a1 || !a2)) return false;
  if (opw && ((o1 & 15) || (o2 & 15) || !o1 || !o2 || epi)) return false;
  return true;
}

}  // namespace

extern "C" {

// Warps per CTA of a tile (the host cuts the entry list into that many ranges per CTA), -1 if unsupported.
int sparsetrain_bs_dds_warps(int blk, int mt, int half) {
  return with_tile(blk, mt, half, [&]<int B, int MT, bool H>() { return Shape<B, H>::WARPS; });
}

// Dynamic shared memory of a launch (bytes), -1 for an unsupported block or tile.
int sparsetrain_bs_dds_smem(int blk, int mt, int half, int k) {
  return with_tile(blk, mt, half, [&]<int B, int MT, bool H>() {
    return Layout<B, MT, Shape<B, H>::WARPS, Shape<B, H>::S>::bytes(k);
  });
}

// Returns 0 on success, a cudaError_t code otherwise, -1 for arguments this kernel does not take.
// epi: 0 none, 1 GELU after the product (out2 = gelu(out)), 2 GELU's derivative (out *= gelu'(aux), out2 =
// gelu(aux)); aux and out2 have out's row stride (bs_dds_ks: the same). a1, a2, o1, o2, apw, opw: A or out in
// three pieces (set_pieces); every piece has the row stride sa (A) or so (out).
int sparsetrain_bs_dds(long long a_ptr, long long values, long long info, long long wbound, long long bias,
                       long long out, long long aux, long long out2, long long a1, long long a2, long long o1,
                       long long o2, int t, int k, int sa, int so, int blk, int mt, int half, int grid_y, int trans,
                       int bf16, int bias_f32, int epi, int apw, int opw, long long stream) {
  if (t < 1 || k < blk || (k % blk) || (sa & 7) || (so & 7) || (a_ptr & 15) || (values & 15) || (out & 15) ||
      (info & 15) || grid_y < 1 || epi < 0 || epi > 2 || (epi && (out2 & 15)) || (epi == 2 && (aux & 15)))
    return -1;
  Args a;
  a.a = reinterpret_cast<const uint16_t*>(a_ptr);
  a.values = reinterpret_cast<const uint16_t*>(values);
  a.info = reinterpret_cast<const int4*>(info);
  a.wbound = reinterpret_cast<const int32_t*>(wbound);
  a.bias = reinterpret_cast<const void*>(bias);
  a.out = reinterpret_cast<uint16_t*>(out);
  a.aux = reinterpret_cast<const uint16_t*>(aux);
  a.out2 = reinterpret_cast<uint16_t*>(out2);
  a.t = t; a.k = k; a.sa = sa; a.so = so; a.bias_f32 = bias_f32; a.epi = epi;
  if (!set_pieces(a.pa, a.po, a1, a2, o1, o2, apw, opw, k, blk, epi)) return -1;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  return with_tile(blk, mt, half, [&]<int B, int MT, bool H>() {
    constexpr int W = Shape<B, H>::WARPS, S = Shape<B, H>::S;
    if (trans)
      return bf16 ? launch_t<B, MT, W, S, true, true>(a, grid_y, s) : launch_t<B, MT, W, S, true, false>(a, grid_y, s);
    return bf16 ? launch_t<B, MT, W, S, false, true>(a, grid_y, s) : launch_t<B, MT, W, S, false, false>(a, grid_y, s);
  });
}

// The K-streamed variant (16x16 blocks) with `ob` output blocks per warp (4 or 2): its tile (tokens per CTA,
// warps, K part); returns its shared memory in bytes, -1 for an unsupported `ob`.
int sparsetrain_bs_dds_ks_shape(int ob, int* tm, int* warps, int* kp) {
  if (ob != 4 && ob != 2) return -1;
  *tm = 16 * KS_MT; *kp = KS_KP;
  *warps = ob == 4 ? ks_warps<4>() : ks_warps<2>();
  return ob == 4 ? KsLayout<KS_MT, 4, ks_warps<4>(), KS_KP, KS_S>::bytes()
                 : KsLayout<KS_MT, 2, ks_warps<2>(), KS_KP, KS_S>::bytes();
}

int sparsetrain_bs_dds_ks(long long a_ptr, long long values, long long info, long long wstart, long long counts,
                          long long bias, long long out, long long aux, long long out2, long long a1, long long a2,
                          long long o1, long long o2, int t, int k, int sa, int so, int n_parts, int n_out, int ob,
                          int grid_y, int trans, int bf16, int bias_f32, int epi, int apw, int opw,
                          long long stream) {
  if (t < 1 || (k & 15) || (sa & 7) || (so & 7) || (a_ptr & 15) || (values & 15) || (out & 15) || (info & 7) ||
      grid_y < 1 || n_parts < 1 || n_parts * KS_KP < k || epi < 0 || epi > 2 || (epi && (out2 & 15)) ||
      (epi == 2 && (aux & 15)))
    return -1;
  KsArgs a;
  a.a = reinterpret_cast<const uint16_t*>(a_ptr);
  a.values = reinterpret_cast<const uint16_t*>(values);
  a.info = reinterpret_cast<const int2*>(info);
  a.wstart = reinterpret_cast<const int32_t*>(wstart);
  a.counts = reinterpret_cast<const int32_t*>(counts);
  a.bias = reinterpret_cast<const void*>(bias);
  a.out = reinterpret_cast<uint16_t*>(out);
  a.aux = reinterpret_cast<const uint16_t*>(aux);
  a.out2 = reinterpret_cast<uint16_t*>(out2);
  a.t = t; a.k = k; a.sa = sa; a.so = so; a.bias_f32 = bias_f32; a.n_parts = n_parts; a.n_out = n_out;
  a.epi = epi;
  if (!set_pieces(a.pa, a.po, a1, a2, o1, o2, apw, opw, k, 16, epi)) return -1;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  auto go = [&]<int OB>() {
    if (trans) return bf16 ? launch_ks<OB, true, true>(a, grid_y, s) : launch_ks<OB, true, false>(a, grid_y, s);
    return bf16 ? launch_ks<OB, false, true>(a, grid_y, s) : launch_ks<OB, false, false>(a, grid_y, s);
  };
  if (ob == 4) return go.template operator()<4>();
  if (ob == 2) return go.template operator()<2>();
  return -1;
}

}  // extern "C"
