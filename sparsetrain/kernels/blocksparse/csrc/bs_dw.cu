// Sampled weight gradient of block-sparse TRAINING at 16x16 blocks: dvalues[s] += dY[:, r]ᵀ · X[:, c] for
// every active block s = (r, c), summed over tokens, fp32, plus (optionally) the bias gradient Σ_t dY.
//
// Why: the Triton kernel (_triton.py sampled_grad_kernel) gives each group of blocks its own pass over the
// tokens and gathers the 16-wide X strip of every block, so X is re-read once per active block in 32-byte row
// segments (~1 GB of L2 traffic at T = 16384, 1024 -> 4096, 10%). Here the operands are staged per token chunk:
// the range of dY columns and the range of X columns that the CTA's blocks touch; every warp then accumulates
// up to MAXB blocks in registers (ldmatrix.trans gives both the dYᵀ and the X fragments) across ALL chunks of
// its token split, and adds them to the output with one float2 atomic per register pair at the end. The host
// (_cuda_tables.py dw_table) builds the CTA table of <= WARPS * MAXB blocks per CTA in one of two layouts
// ("strips": the narrower of X and dY staged whole, the other as a strip of at most 32 blocks; "tiles":
// rectangles of the block grid), with a disjoint range of bias columns (dY columns) per CTA inside its A range.
#include "common.cuh"

namespace {
using namespace sparsetrain;

constexpr int BLK = 16;
constexpr int WARPS = 16;
constexpr int MAXB = 8;  // blocks per warp (8 x 8 fp32 accumulator registers)
constexpr int BIAS_G = 2;  // 16-column bias groups per warp summed on the tensor cores (4 registers each)

struct Cta {       // two int4 per CTA in the table
  int first, n;    // its blocks in the order list
  int a_col0, a_ncols;  // dY columns staged
  int b_col0, b_ncols;  // X columns staged
  int bias_c0, bias_c1;  // dY columns whose bias gradient it sums (inside the A range)
};

struct DwArgs {
  const uint16_t* x;   // [T, I], row stride sx, 16-byte aligned
  const uint16_t* dy;  // [T, O], row stride sdy, 16-byte aligned
  const Cta* cta;
  const int4* blk;     // per block in order: slot, A offset (halves), B offset (halves), 0
  float* dv;           // [n_blocks, 16, 16] fp32, zeroed
  float* db;           // [O] fp32, zeroed, or null
  Pieces pdy;          // dY in three tensors of row stride sdy (a fused q/k/v projection's gradients), or one
  int t, sx, sdy, tokens_per_split, a_stride, b_stride;  // strides of the staged rows (halves)
};

__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// float2 atomics exist from sm_90 on; two scalar ones elsewhere (e.g. an A100 builds and runs this too).
__device__ __forceinline__ void add2(float* p, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(p), make_float2(x, y));
#else
  atomicAdd(p, x);
  atomicAdd(p + 1, y);
#endif
}

template <int TC, bool BF16>
__global__ void __launch_bounds__(WARPS * 32) bs_dw_kernel(DwArgs a) {
  using T = std::conditional_t<BF16, __nv_bfloat16, __half>;
  extern __shared__ __align__(16) uint16_t smem[];
  const Cta c = a.cta[blockIdx.x];
  if (c.n == 0 && c.bias_c1 <= c.bias_c0) return;  // a spare row of the table (room for later topologies)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int ts = blockIdx.y * a.tokens_per_split, te = min(a.t, ts + a.tokens_per_split);
  const int stage_halves = TC * (a.a_stride + a.b_stride);
  const int n_chunks = (te - ts + TC - 1) / TC;

  // The copies of a chunk: a thread keeps one 16-byte column of a staged range and walks its rows (the first
  // dr * cpr threads, dr = NT / cpr rows apart), so the column's address (its piece too) is worked out once per
  // chunk and each copy adds a row step (walking the [TC, cpr] grid by NT elements with a carry moves the column
  // at every copy, so every copy would work out its address and piece again). Wider ranges (cpr > NT): a thread
  // takes columns NT apart, every row of each.
  constexpr int NT = WARPS * 32;
  auto stage = [&](uint16_t* dst, int dst_stride, const uint16_t* src, const Pieces& pc, int ld, int col0, int cpr,
                   int row0) {
    if (cpr == 0) return;
    const int dr = cpr <= NT ? NT / cpr : 1;
    int r0 = 0, cc = threadIdx.x;
    if (cpr <= NT) {
      if (threadIdx.x >= dr * cpr) return;
      r0 = threadIdx.x / cpr;
      cc = threadIdx.x - r0 * cpr;
    }
    for (; cc < cpr; cc += NT) {
      const uint16_t* g = pc.at(src, row0 + r0, ld, col0 + cc * 8);
      const long long g_step = static_cast<long long>(dr) * ld;
      uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst + r0 * dst_stride + cc * 8));
      const uint32_t d_step = 2u * dr * dst_stride;
      for (int r = r0; r < TC; r += dr, g += g_step, d += d_step) {
        const bool ok = row0 + r < te;
        cp_async16(d, ok ? g : src, ok ? 16 : 0);
      }
    }
  };
  auto load = [&](int ch, int st) {  // token chunk ch: dY[:, a range] then X[:, b range], rows past te zero
    uint16_t* as = smem + st * stage_halves;
    const int row0 = ts + ch * TC;
    stage(as, a.a_stride, a.dy, a.pdy, a.sdy, c.a_col0, c.a_ncols >> 3, row0);
    stage(as + TC * a.a_stride, a.b_stride, a.x, Pieces{nullptr, nullptr, 0}, a.sx, c.b_col0, c.b_ncols >> 3, row0);
    cp_async_commit();
  };

  // this warp's blocks
  const int b0 = c.first + warp * MAXB;
  const int nb = max(0, min(MAXB, c.first + c.n - b0));
  int a_off[MAXB], b_off[MAXB];
#pragma unroll
  for (int j = 0; j < MAXB; ++j) {
    const int4 inf = j < nb ? __ldg(a.blk + b0 + j) : make_int4(0, 0, 0, 0);
    a_off[j] = inf.y;
    b_off[j] = inf.z;
  }
  // consecutive blocks of a warp often share a block row (the table's order: row-major, or column-major where dY
  // is staged whole), so their dYᵀ (or X) fragment is loaded once: bit j set = block j loads its own
  unsigned a_new = 1u, b_new = 1u;
#pragma unroll
  for (int j = 1; j < MAXB; ++j) {
    a_new |= static_cast<unsigned>(a_off[j] != a_off[j - 1]) << j;
    b_new |= static_cast<unsigned>(b_off[j] != b_off[j - 1]) << j;
  }
  const bool share_a = __popc(a_new) <= __popc(b_new);  // warp-uniform: the offsets are the warp's
  float acc[MAXB][2][4];
#pragma unroll
  for (int j = 0; j < MAXB; ++j)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][nt][i] = 0.f;
  // bias: column sums of dY on the tensor cores, dYᵀ fragment x a ones fragment (each row of the 16 x 8 result
  // is one column's sum): warp w sums the 16-column groups w and w + WARPS of the CTA's bias range; columns past
  // the first 2 * WARPS groups (a "tiles" row band wider than 32 blocks) are summed by threads, two columns each
  const int bias_n = a.db != nullptr ? c.bias_c1 - c.bias_c0 : 0;
  const int bias_a = c.bias_c0 - c.a_col0;  // the range's offset in the staged A range (halves)
  float bacc[BIAS_G][4];
#pragma unroll
  for (int q = 0; q < BIAS_G; ++q)
#pragma unroll
    for (int i = 0; i < 4; ++i) bacc[q][i] = 0.f;
  const uint32_t ones = BF16 ? 0x3F803F80u : 0x3C003C00u;  // 1.0 twice, bf16 or fp16
  const int bias_col = bias_a + BIAS_G * WARPS * BLK + 2 * threadIdx.x;  // the threads' columns
  const bool do_bias = bias_col - bias_a < bias_n;
  float bsum0 = 0.f, bsum1 = 0.f;

  const int lq = lane >> 3, l8 = lane & 7;
  // ldmatrix.trans lane rows: A (dYᵀ fragment) matrix q = (m half q & 1, k half q >> 1); B (X) = (n half
  // q >> 1, k half q & 1)
  const int a_lane = ((lq >> 1) * 8 + l8) * a.a_stride + (lq & 1) * 8;
  const int b_lane = ((lq & 1) * 8 + l8) * a.b_stride + (lq >> 1) * 8;
  const uint32_t smem_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));

  if (n_chunks > 0) load(0, 0);
  for (int ch = 0; ch < n_chunks; ++ch) {
    const int st = ch & 1;
    if (ch + 1 < n_chunks) {
      load(ch + 1, st ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint32_t as = smem_addr + 2u * st * stage_halves;
    const uint32_t bs = as + 2u * TC * a.a_stride;
    // no per-block branch: a warp with fewer than MAXB blocks computes its empty slots on offset 0 and never
    // writes them, so the compiler can issue every ldmatrix of the step ahead of the mma that needs it
    // (ncu with the branch: 33% of the stall cycles waiting on shared-memory loads, 4 warps per scheduler).
    // The one fragment shared by consecutive blocks is loaded where it changes (SHARE_A: the dYᵀ one).
    auto products = [&](auto share_a) {
      constexpr bool SHARE_A = decltype(share_a)::value;
#pragma unroll
      for (int ks = 0; ks < TC / 16; ++ks) {
        uint32_t af[4], bf[4];
#pragma unroll
        for (int j = 0; j < MAXB; ++j) {
          if (!SHARE_A || (a_new >> j & 1u)) ldsm_x4_t(af, as + 2u * (a_lane + ks * 16 * a.a_stride + a_off[j]));
          if (SHARE_A || (b_new >> j & 1u)) ldsm_x4_t(bf, bs + 2u * (b_lane + ks * 16 * a.b_stride + b_off[j]));
          mma16816<BF16>(acc[j][0], af, bf[0], bf[1]);
          mma16816<BF16>(acc[j][1], af, bf[2], bf[3]);
        }
      }
    };
    if (share_a) products(std::true_type{});
    else products(std::false_type{});
#pragma unroll
    for (int q = 0; q < BIAS_G; ++q) {
      const int col = (warp + q * WARPS) * BLK;
      if (col < bias_n) {  // warp-uniform
#pragma unroll
        for (int ks = 0; ks < TC / 16; ++ks) {
          uint32_t af[4];
          ldsm_x4_t(af, as + 2u * (a_lane + ks * 16 * a.a_stride + bias_a + col));
          mma16816<BF16>(bacc[q], af, ones, ones);
        }
      }
    }
    if (do_bias) {
      const uint16_t* ap = smem + st * stage_halves + bias_col;
#pragma unroll 8
      for (int r = 0; r < TC; ++r) {
        const T* p = reinterpret_cast<const T*>(ap + r * a.a_stride);
        bsum0 += to_float<T>(p[0]);
        bsum1 += to_float<T>(p[1]);
      }
    }
    __syncthreads();  // the next iteration's copies overwrite this stage
  }

#pragma unroll
  for (int j = 0; j < MAXB; ++j) {
    if (j < nb) {
      const int slot = __ldg(a.blk + b0 + j).x;
      float* d = a.dv + static_cast<long long>(slot) * BLK * BLK;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          add2(d + (g + 8 * h) * BLK + nt * 8 + 2 * t4, acc[j][nt][2 * h], acc[j][nt][2 * h + 1]);
    }
  }
  if (n_chunks > 0) {
#pragma unroll
    for (int q = 0; q < BIAS_G; ++q) {  // row g and g + 8 of the group: the columns' sums (every column equal)
      const int col = (warp + q * WARPS) * BLK;
      if (col < bias_n && t4 == 0) {
        atomicAdd(a.db + c.bias_c0 + col + g, bacc[q][0]);
        atomicAdd(a.db + c.bias_c0 + col + g + 8, bacc[q][2]);
      }
    }
    if (do_bias) add2(a.db + c.bias_c0 + bias_col - bias_a, bsum0, bsum1);
  }
}

template <int TC, bool BF16>
int launch_t(const DwArgs& a, int n_cta, int splits, cudaStream_t stream) {
  const int smem = 2 * 2 * TC * (a.a_stride + a.b_stride);
  auto kern = bs_dw_kernel<TC, BF16>;
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  kern<<<dim3(n_cta, splits), WARPS * 32, smem, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" {

// Blocks per CTA (WARPS * MAXB) and warps, for the host's CTA table.
int sparsetrain_bs_dw_cap(int* warps) {
  *warps = WARPS;
  return WARPS * MAXB;
}

// Returns 0 on success, a cudaError_t code otherwise, -1 for arguments this kernel does not take.
// a_width / b_width: the widest staged A (dY) and B (X) column ranges of any CTA (multiples of 8). dy1, dy2,
// dyw: dY's pieces 1 and 2 and their width (columns, a multiple of 16; 0: dY is one tensor).
int sparsetrain_bs_dw(long long x, long long dy, long long cta, long long blk, long long dv, long long db,
                      long long dy1, long long dy2, int t, int sx, int sdy, int n_cta, int splits,
                      int tokens_per_split, int a_width, int b_width, int tc, int bf16, int dyw, long long stream) {
  if (t < 1 || (sx & 7) || (sdy & 7) || (x & 15) || (dy & 15) || (a_width & 7) || (b_width & 7) || n_cta < 1 ||
      splits < 1 || (db & 7) || (dv & 7) || dyw < 0 || (dyw & 15) ||
      (dyw && (!dy1 || !dy2 || (dy1 & 15) || (dy2 & 15))))
    return -1;
  DwArgs a;
  a.x = reinterpret_cast<const uint16_t*>(x);
  a.dy = reinterpret_cast<const uint16_t*>(dy);
  a.cta = reinterpret_cast<const Cta*>(cta);
  a.blk = reinterpret_cast<const int4*>(blk);
  a.dv = reinterpret_cast<float*>(dv);
  a.db = reinterpret_cast<float*>(db);
  a.pdy = Pieces{reinterpret_cast<const uint16_t*>(dy1), reinterpret_cast<const uint16_t*>(dy2), dyw};
  a.t = t; a.sx = sx; a.sdy = sdy; a.tokens_per_split = tokens_per_split;
  a.a_stride = a_width + 8;  // +16 bytes per row: the 8 rows of an ldmatrix fall in distinct banks
  a.b_stride = b_width + 8;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (tc == 32) return bf16 ? launch_t<32, true>(a, n_cta, splits, s) : launch_t<32, false>(a, n_cta, splits, s);
  if (tc == 16) return bf16 ? launch_t<16, true>(a, n_cta, splits, s) : launch_t<16, false>(a, n_cta, splits, s);
  return -1;
}

}  // extern "C"
