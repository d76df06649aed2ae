// Skinny SpMM Y[N, M] = X[N, K] · W[M, K]ᵀ (+ bias), N <= 16, with W in the row-per-lane step format
// (sparsetrain/kernels/spmm_ell.py: instances of 32 rows x 256 columns; steps of one slot per lane, stored in
// groups of 4 steps: per lane its 4 values (8 bytes) and its 4 column bytes (4 bytes); an idle slot is 0).
//
// CUDA cores, work per step (not per weight element):
//   1. a block of 8 warps (8 row groups, 256 rows) copies its split's X columns into shared memory transposed:
//      per window and group of 8 tokens a plane of 16-byte rows, one per column;
//   2. each warp walks its row group's steps of the split's windows, a group of 4 steps at a time. A lane's
//      group is two coalesced loads (8 + 4 bytes, no index arithmetic: the slot is the lane), issued RING
//      groups ahead of use, so the weight stream is never behind a dependent load. Per step a lane fetches its
//      column's 16 tokens (two 16-byte shared loads; lanes of one column read the same address: a broadcast)
//      and does 8 half2 FMAs into half2 partial sums, which go into fp32 accumulators every 8 steps (fp16) or
//      4 steps (bf16).
// Split-K over windows, the fp32 workspace and the last block's write of Y: common.cuh (finish_split_k).
#include "common.cuh"

namespace {
using namespace sparsetrain;

constexpr int WIN = 256;
constexpr int WARPS = 8;
constexpr int THREADS = 32 * WARPS;
constexpr int GROUP = 4;  // steps per group
constexpr int RING = 4;   // groups in flight per warp

struct Args {
  const uint16_t* x;          // [N, K], row stride sx
  const uint2* values;        // [Q * 32]: group q, lane l -> its 4 values
  const uint32_t* cols;       // [Q * 32]: group q, lane l -> its 4 column bytes
  const int32_t* group_off;   // [G * W + 1]: each instance's first group
  const uint16_t* bias;       // [M] or null
  uint16_t* y;                // [N, M], row stride sy
  float* ws;                  // [N * M] fp32 zeros (split-K only)
  int32_t* locks;             // [grid_m] zeros (split-K only)
  int n, m, k, sx, sy, groups, windows, wins_per_split, split_k;
};

// Byte offset of tokens 8h..8h+7 of column kk (counted from the split's first column) in the X copy: per
// window of 256 columns, NTOK / 8 planes of 16-byte rows (a column's tokens 8h.. in plane h).
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

struct Group {
  uint2 v;     // 4 values
  uint32_t c;  // 4 column bytes
};

__device__ __forceinline__ Group load_group(const Args& a, int q, int q_end, int lane) {
  Group g{make_uint2(0, 0), 0};
  if (q < q_end) {
    const long long i = static_cast<long long>(q) * 32 + lane;
    g.v = __ldg(a.values + i);
    g.c = __ldg(a.cols + i);
  }
  return g;
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
__device__ __forceinline__ void flush(uint32_t (&part)[NTOK / 2], float (&acc)[NTOK]) {
#pragma unroll
  for (int j = 0; j < NTOK / 2; ++j) {
    const float2 f = unpack2<BF16>(part[j]);
    acc[2 * j] += f.x;
    acc[2 * j + 1] += f.y;
    part[j] = 0;
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
  const int inst0 = g * a.windows + w0;
  const int q0 = g < a.groups ? a.group_off[inst0] : 0;
  const int q_end = g < a.groups ? a.group_off[inst0 + nwin] : 0;
  Group ring[RING];
#pragma unroll
  for (int d = 0; d < RING; ++d) ring[d] = load_group(a, q0 + d, q_end, lane);  // before staging X: overlap
  stage_x<NTOK>(a, xs, w0, nwin);
  __syncthreads();

  float acc[NTOK];
#pragma unroll
  for (int i = 0; i < NTOK; ++i) acc[i] = 0.f;
  uint32_t part[NTOK / 2];
#pragma unroll
  for (int j = 0; j < NTOK / 2; ++j) part[j] = 0;
  int wi = 0, bnd = q0 < q_end ? a.group_off[inst0 + 1] : 0, it = 0;
  for (int q = q0; q < q_end; q += RING) {
#pragma unroll
    for (int d = 0; d < RING; ++d) {
      const int qq = q + d;
      if (qq >= q_end) break;
      while (qq >= bnd) bnd = a.group_off[inst0 + (++wi) + 1];
      const unsigned char* xw = xs + wi * (WIN * NTOK * 2);
      const Group cur = ring[d];
      ring[d] = load_group(a, qq + RING, q_end, lane);
#pragma unroll
      for (int u = 0; u < GROUP; ++u) {
        const uint32_t vv = __byte_perm(u < 2 ? cur.v.x : cur.v.y, 0, (u & 1) ? 0x3232 : 0x1010);
        const uint32_t off = __byte_perm(cur.c, 0, 0x4440 + u) << 4;
#pragma unroll
        for (int h = 0; h < NTOK / 8; ++h) {
          const uint4 xv = *reinterpret_cast<const uint4*>(xw + off + h * WIN * 16);
          part[4 * h + 0] = hfma2<BF16>(vv, xv.x, part[4 * h + 0]);
          part[4 * h + 1] = hfma2<BF16>(vv, xv.y, part[4 * h + 1]);
          part[4 * h + 2] = hfma2<BF16>(vv, xv.z, part[4 * h + 2]);
          part[4 * h + 3] = hfma2<BF16>(vv, xv.w, part[4 * h + 3]);
        }
      }
      if (++it == FLUSH) {
        it = 0;
        flush<NTOK, BF16>(part, acc);
      }
    }
  }
  flush<NTOK, BF16>(part, acc);

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
int sparsetrain_spmm_ell(long long x, long long values, long long cols, long long group_off, long long bias,
                         long long y, long long ws, long long locks, int n, int m, int k, int sx, int sy,
                         int groups, int windows, int wins_per_split, int split_k, int bf16, long long stream) {
  if (n < 1 || n > 16 || (values & 7) || (cols & 3) || wins_per_split < 1 || split_k * wins_per_split < windows)
    return -1;
  Args a;
  a.x = reinterpret_cast<const uint16_t*>(x);
  a.values = reinterpret_cast<const uint2*>(values);
  a.cols = reinterpret_cast<const uint32_t*>(cols);
  a.group_off = reinterpret_cast<const int32_t*>(group_off);
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
