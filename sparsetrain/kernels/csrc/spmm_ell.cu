// Skinny SpMM Y[N, M] = X[N, K] · W[M, K]ᵀ (+ bias), N <= 16, with W in the row-per-lane step format
// (sparsetrain/kernels/spmm_ell.py: instances of 32 rows x 256 columns; per step a 32-bit lane mask and, in
// lane order, each active lane's (value, column byte)).
//
// CUDA cores, work per nonzero:
//   1. a block of 8 warps (8 row groups, 256 rows) copies its split's X columns into shared memory transposed:
//      per window and group of 8 tokens a plane of 16-byte rows, one per column;
//   2. each warp walks its row group's steps of the split's windows. Per step a lane with a nonzero reads
//      its (value, column), the column's 16 tokens (two 16-byte shared loads; lanes of one column read the
//      same address: a broadcast) and does 8 half2 FMAs into half2 partial sums, which go into fp32
//      accumulators every 8 steps (fp16) or 4 steps (bf16);
//   3. masks are read 4 steps at a time, two groups ahead, and each group's values one group ahead, so the
//      loads of a group overlap the FMAs of the one before.
// Split-K over windows, the fp32 workspace and the last block's write of Y: common.cuh (finish_split_k).
#include "common.cuh"

namespace {
using namespace sparsetrain;

constexpr int WIN = 256;
constexpr int WARPS = 8;
constexpr int THREADS = 32 * WARPS;
constexpr int GROUP = 4;  // steps per 16-byte mask load

struct Args {
  const uint16_t* x;          // [N, K], row stride sx
  const uint32_t* masks;      // [S + 8]
  const uint16_t* values;     // [nnz]
  const uint8_t* cols;        // [nnz]
  const int32_t* step_off;    // [G * W + 1]
  const int32_t* entry_off;   // [G * W + 1]
  const uint16_t* bias;       // [M] or null
  uint16_t* y;                // [N, M], row stride sy
  float* ws;                  // [N * M] fp32 zeros (split-K only)
  int32_t* locks;             // [grid_m] zeros (split-K only)
  int n, m, k, sx, sy, groups, windows, wins_per_split, split_k;
};

// Byte offset of tokens 8h..8h+7 of column kk (counted from the split's first column) in the X copy: per
// window of 256 columns, NTOK / 8 planes of 16-byte rows (a column's tokens 8h.. in plane h), so 16-byte reads
// of random columns fall on random bank groups and the plane is an immediate offset.
template <int NTOK>
__device__ __forceinline__ uint32_t x_offset(uint32_t kk, uint32_t h) {
  return (kk >> 8) * (WIN * NTOK * 2) + h * (WIN * 16) + ((kk & (WIN - 1)) << 4);
}

// X[:, w0 * 256 : (w0 + nwin) * 256] into xs (zeros past N and K), NTOK tokens per column.
template <int NTOK>
__device__ __forceinline__ void stage_x(const Args& a, unsigned char* xs, int w0, int nwin) {
  const int cols = nwin * WIN;
  for (int kk = threadIdx.x; kk < cols; kk += THREADS) {
    const int col = w0 * WIN + kk;
    uint32_t p[NTOK / 2];
#pragma unroll
    for (int j = 0; j < NTOK / 2; ++j) {
      uint32_t lo = 0, hi = 0;
      if (col < a.k) {
        if (2 * j < a.n) lo = __ldg(a.x + static_cast<long long>(2 * j) * a.sx + col);
        if (2 * j + 1 < a.n) hi = __ldg(a.x + static_cast<long long>(2 * j + 1) * a.sx + col);
      }
      p[j] = lo | (hi << 16);
    }
#pragma unroll
    for (int h = 0; h < NTOK / 8; ++h)
      *reinterpret_cast<uint4*>(xs + x_offset<NTOK>(kk, h)) = make_uint4(p[4 * h], p[4 * h + 1], p[4 * h + 2],
                                                                         p[4 * h + 3]);
  }
}

struct Entries {
  uint32_t v[GROUP];  // value bits, both halves (a half2 of the value twice); 0 where the lane is idle
  uint32_t c[GROUP];  // 16 x the column inside the window
};

// This lane's entries of the 4 steps with masks m, starting at value index e (advanced past the group).
__device__ __forceinline__ void load_entries(const Args& a, uint4 m, unsigned& e, uint32_t lt, int lane,
                                             Entries& out) {
  const uint32_t ms[GROUP] = {m.x, m.y, m.z, m.w};
#pragma unroll
  for (int u = 0; u < GROUP; ++u) {
    const unsigned idx = e + __popc(ms[u] & lt);
    e += __popc(ms[u]);
    uint32_t v = 0, c = 0;
    if (ms[u] & (1u << lane)) {
      v = __ldg(a.values + idx);
      c = __ldg(a.cols + idx);
    }
    out.v[u] = __byte_perm(v, 0, 0x1010);
    out.c[u] = c << 4;  // byte offset of the column's row in a plane
  }
}

__device__ __forceinline__ uint4 load_masks(const Args& a, int s, int s_end) {
  return s < s_end ? __ldg(reinterpret_cast<const uint4*>(a.masks + s)) : make_uint4(0, 0, 0, 0);
}

template <bool BF16>
__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  if constexpr (BF16) asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  else asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

template <bool BF16>
__device__ __forceinline__ float2 unpack2(uint32_t h) {
  if constexpr (BF16) {
    return make_float2(__uint_as_float(h << 16), __uint_as_float(h & 0xffff0000u));
  } else {
    __half2 v = *reinterpret_cast<__half2*>(&h);
    return __half22float2(v);
  }
}

template <int NTOK, bool BF16>
__global__ void __launch_bounds__(THREADS, 4) spmm_ell_kernel(const Args a) {
  using T = typename std::conditional<BF16, __nv_bfloat16, __half>::type;
  constexpr int FLUSH = BF16 ? 1 : 2;  // groups per fp32 flush
  extern __shared__ __align__(16) unsigned char xs[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = blockIdx.x * WARPS + warp;
  const int w0 = blockIdx.y * a.wins_per_split;
  const int nwin = min(a.wins_per_split, a.windows - w0);
  stage_x<NTOK>(a, xs, w0, nwin);
  __syncthreads();

  float acc[NTOK];
#pragma unroll
  for (int i = 0; i < NTOK; ++i) acc[i] = 0.f;
  if (g < a.groups) {
    const int inst0 = g * a.windows + w0;
    int s = a.step_off[inst0];
    const int s_end = a.step_off[inst0 + nwin];
    unsigned e = a.entry_off[inst0];
    const uint32_t lt = (1u << lane) - 1u;
    int wi = 0, bnd = a.step_off[inst0 + 1];

    uint4 m_ahead = load_masks(a, s + GROUP, s_end);
    Entries cur;
    load_entries(a, load_masks(a, s, s_end), e, lt, lane, cur);
    uint32_t part[NTOK / 2];
#pragma unroll
    for (int j = 0; j < NTOK / 2; ++j) part[j] = 0;
    int it = 0;
    for (; s < s_end; s += GROUP) {
      const uint4 m_next = m_ahead;
      m_ahead = load_masks(a, s + 2 * GROUP, s_end);
      Entries nxt;
      load_entries(a, m_next, e, lt, lane, nxt);
      while (s >= bnd) bnd = a.step_off[inst0 + (++wi) + 1];
      const unsigned char* xw = xs + wi * WIN * NTOK * 2;
#pragma unroll
      for (int u = 0; u < GROUP; ++u) {
#pragma unroll
        for (int h = 0; h < NTOK / 8; ++h) {
          const uint4 xv = *reinterpret_cast<const uint4*>(xw + cur.c[u] + h * WIN * 16);
          part[4 * h + 0] = hfma2<BF16>(cur.v[u], xv.x, part[4 * h + 0]);
          part[4 * h + 1] = hfma2<BF16>(cur.v[u], xv.y, part[4 * h + 1]);
          part[4 * h + 2] = hfma2<BF16>(cur.v[u], xv.z, part[4 * h + 2]);
          part[4 * h + 3] = hfma2<BF16>(cur.v[u], xv.w, part[4 * h + 3]);
        }
      }
      if (++it == FLUSH) {
        it = 0;
#pragma unroll
        for (int j = 0; j < NTOK / 2; ++j) {
          const float2 f = unpack2<BF16>(part[j]);
          acc[2 * j] += f.x;
          acc[2 * j + 1] += f.y;
          part[j] = 0;
        }
      }
      cur = nxt;
    }
#pragma unroll
    for (int j = 0; j < NTOK / 2; ++j) {
      const float2 f = unpack2<BF16>(part[j]);
      acc[2 * j] += f.x;
      acc[2 * j + 1] += f.y;
    }
  }

  const int row = g * 32 + lane;
  const bool mine = g < a.groups && row < a.m;
#pragma unroll
  for (int t = 0; t < NTOK; ++t) {
    if (!mine || t >= a.n) continue;
    if (a.split_k == 1) {
      float v = acc[t];
      if (a.bias) v += to_float<T>(reinterpret_cast<const T*>(a.bias)[row]);
      reinterpret_cast<T*>(a.y)[static_cast<long long>(t) * a.sy + row] = from_float<T>(v);
    } else {
      atomicAdd(a.ws + static_cast<long long>(t) * a.m + row, acc[t]);
    }
  }
  if (a.split_k > 1)
    finish_split_k<T>(blockIdx.x * THREADS, THREADS, a.m, a.n, a.bias, a.y, a.sy, a.split_k, a.ws, a.locks,
                      blockIdx.x, THREADS);
}

template <int NTOK, bool BF16>
int launch_t(const Args& a, int grid_m, cudaStream_t stream) {
  const int smem = a.wins_per_split * WIN * NTOK * 2;
  auto kern = spmm_ell_kernel<NTOK, BF16>;
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  kern<<<dim3(grid_m, a.split_k), THREADS, smem, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" {

// Shared memory per block: wins_per_split * 256 * (n <= 8 ? 16 : 32) bytes.
int sparsetrain_spmm_ell(long long x, long long masks, long long values, long long cols, long long step_off,
                         long long entry_off, long long bias, long long y, long long ws, long long locks, int n,
                         int m, int k, int sx, int sy, int groups, int windows, int wins_per_split, int split_k,
                         int bf16, long long stream) {
  if (n < 1 || n > 16 || (masks & 15) || wins_per_split < 1 || split_k * wins_per_split < windows) return -1;
  Args a;
  a.x = reinterpret_cast<const uint16_t*>(x);
  a.masks = reinterpret_cast<const uint32_t*>(masks);
  a.values = reinterpret_cast<const uint16_t*>(values);
  a.cols = reinterpret_cast<const uint8_t*>(cols);
  a.step_off = reinterpret_cast<const int32_t*>(step_off);
  a.entry_off = reinterpret_cast<const int32_t*>(entry_off);
  a.bias = reinterpret_cast<const uint16_t*>(bias);
  a.y = reinterpret_cast<uint16_t*>(y);
  a.ws = reinterpret_cast<float*>(ws);
  a.locks = reinterpret_cast<int32_t*>(locks);
  a.n = n; a.m = m; a.k = k; a.sx = sx; a.sy = sy; a.groups = groups; a.windows = windows;
  a.wins_per_split = wins_per_split; a.split_k = split_k;
  const int grid_m = (groups + WARPS - 1) / WARPS;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (n <= 8) return bf16 ? launch_t<8, true>(a, grid_m, s) : launch_t<8, false>(a, grid_m, s);
  return bf16 ? launch_t<16, true>(a, grid_m, s) : launch_t<16, false>(a, grid_m, s);
}

}  // extern "C"
