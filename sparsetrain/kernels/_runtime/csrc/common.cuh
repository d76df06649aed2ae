// Device helpers shared by sparsetrain's CUDA kernels (spmm/csrc/*.cu, blocksparse/csrc/*.cu).
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include <type_traits>

namespace sparsetrain {

// Blocks per multiprocessor the compiler must fit (a register cap) in the skinny-SpMM kernels, for N <= 16 tokens
// (NT <= 2 n8 tiles) and for more. A cap of 8 blocks takes 3-13% off the N <= 16 kernels on an H200; for larger
// N it makes ptxas spill, so those keep no cap (docs/history/inference.md).
constexpr int MIN_BLOCKS_SMALL_N = 8;
constexpr int MIN_BLOCKS = 1;
template <int NT>
constexpr int min_blocks() { return NT <= 2 ? MIN_BLOCKS_SMALL_N : MIN_BLOCKS; }

// 16 bytes global -> shared (`src_bytes` < 16: the rest zero-filled); the shared address as a 32-bit one
__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  cp_async16(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), gmem, src_bytes);
}
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem, int src_bytes) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Copies the [rows, 8 * cpr]-half tile at `src` (row stride ld halves, 16-byte aligned) into shared memory at
// byte address `dst`, rows dst_stride halves apart, rows at or past `valid` zero-filled: the NT threads of the CTA
// take elements threadIdx.x + k * NT of the row-major [rows, cpr] grid of 16-byte chunks (balanced), and each
// thread steps its addresses by constants (one more step where its column wraps), so a copy costs a few
// instructions and no address arithmetic of its own. One call per piece of an operand in pieces.
template <int NT>
__device__ __forceinline__ void stage_tile(uint32_t dst, int dst_stride, const uint16_t* src, long long ld, int cpr,
                                           int rows, int valid) {
  if (cpr <= 0) return;
  const int dr = NT / cpr, dc = NT - dr * cpr;  // cpr > NT: dr = 0, dc = NT (< 2 cpr: one wrap at most)
  int r = threadIdx.x / cpr, cc = threadIdx.x - r * cpr;
  const uint16_t* g = src + r * ld + cc * 8;
  uint32_t d = dst + 2u * (r * dst_stride + cc * 8);
  const long long g_step = dr * ld + dc * 8, g_wrap = ld - cpr * 8;
  const uint32_t d_step = 2u * (dr * dst_stride + dc * 8), d_wrap = 2u * (dst_stride - cpr * 8);
  while (r < rows) {
    const bool ok = r < valid;
    cp_async16(d, ok ? g : src, ok ? 16 : 0);
    r += dr;
    cc += dc;
    g += g_step;
    d += d_step;
    if (cc >= cpr) {
      cc -= cpr;
      ++r;
      g += g_wrap;
      d += d_wrap;
    }
  }
}

template <bool BF16>
__device__ __forceinline__ void mma16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// An operand given as three tensors of `width` columns each and one row stride (a fused query/key/value
// projection: its forward writes q, k and v, its backward reads their gradients where attention wrote them);
// width 0: one tensor. Column c of the whole operand is column c - p * width of piece p. T: const uint16_t for
// an input, uint16_t for an output.
template <typename T>
struct PiecesOf {
  T* p1;
  T* p2;
  int width;
  // the piece holding column col of the whole operand whose piece 0 is `base`; col made relative to it
  __device__ __forceinline__ T* select(T* base, int& col) const {
    if (width) {
      if (col >= 2 * width) {
        col -= 2 * width;
        return p2;
      }
      if (col >= width) {
        col -= width;
        return p1;
      }
    }
    return base;
  }
  // the address of (row, col) of that operand (row stride ld)
  __device__ __forceinline__ T* at(T* base, long long row, int ld, int col) const {
    T* piece = select(base, col);
    return piece + row * ld + col;
  }
};
using Pieces = PiecesOf<const uint16_t>;

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Writes the [2 x 16 rows] x [NT x 8 tokens] fp32 accumulators of one warp: straight to Y when there is no
// split-K; else adds them to the fp32 workspace, and the last block of the row tile (arrival counter) adds the
// bias, writes Y and re-zeroes its part of the workspace. Fragment element (mt, nt, i) is W row
// row_base + mt*16 + g + 8*(i >> 1) and token nt*8 + 2t + (i & 1).
template <int NT, typename T>
__device__ __forceinline__ void write_output(float (&acc)[2][NT][4], int row_base, int tile_row0, int rows_per_tile,
                                             int m, int n, const uint16_t* bias, uint16_t* y, int sy, int split_k,
                                             float* ws, int32_t* locks, int pid_m, int threads) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int o = row_base + mt * 16 + g + 8 * (i >> 1);
        const int tok = nt * 8 + 2 * t + (i & 1);
        if (o >= m || tok >= n) continue;
        if (split_k == 1) {
          float v = acc[mt][nt][i];
          if (bias) v += to_float<T>(reinterpret_cast<const T*>(bias)[o]);
          reinterpret_cast<T*>(y)[static_cast<long long>(tok) * sy + o] = from_float<T>(v);
        } else {
          atomicAdd(ws + static_cast<long long>(tok) * m + o, acc[mt][nt][i]);
        }
      }
  if (split_k == 1) return;
  __threadfence();
  __syncthreads();
  __shared__ int last;
  if (threadIdx.x == 0) last = (atomicAdd(locks + pid_m, 1) == split_k - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int rows = min(rows_per_tile, m - tile_row0);
  for (int idx = threadIdx.x; idx < rows * n; idx += threads) {
    const int tok = idx / rows, o = tile_row0 + idx % rows;
    float* p = ws + static_cast<long long>(tok) * m + o;
    float v = __ldcg(p);
    __stcg(p, 0.f);
    if (bias) v += to_float<T>(reinterpret_cast<const T*>(bias)[o]);
    reinterpret_cast<T*>(y)[static_cast<long long>(tok) * sy + o] = from_float<T>(v);
  }
  if (threadIdx.x == 0) locks[pid_m] = 0;
}

// The arguments every skinny-SpMM kernel takes besides its weight format's tensors.
struct SkinnyArgs {
  const uint16_t* x;        // [N, K] (16-byte aligned, row stride sx % 8 == 0)
  const int32_t* tile_off;  // [TM, TK]: each tile's first value
  const uint16_t* bias;     // [M] or null
  uint16_t* y;              // [N, M] with row stride sy
  float* ws;                // [N * M] fp32 zeros (split-K only)
  int32_t* locks;           // [TM] zeros (split-K only)
  long long n_values;       // stored values (the last tile ends there)
  int n, m, k, sx, sy, tk, n_tiles, tiles_per_split, split_k;
};

inline SkinnyArgs skinny_args(long long x, long long tile_off, long long bias, long long y, long long ws,
                              long long locks, long long n_values, int n, int m, int k, int sx, int sy, int tm,
                              int tk, int tiles_per_split, int split_k) {
  SkinnyArgs a;
  a.x = reinterpret_cast<const uint16_t*>(x);
  a.tile_off = reinterpret_cast<const int32_t*>(tile_off);
  a.bias = reinterpret_cast<const uint16_t*>(bias);
  a.y = reinterpret_cast<uint16_t*>(y);
  a.ws = reinterpret_cast<float*>(ws);
  a.locks = reinterpret_cast<int32_t*>(locks);
  a.n_values = n_values;
  a.n = n; a.m = m; a.k = k; a.sx = sx; a.sy = sy; a.tk = tk; a.n_tiles = tm * tk;
  a.tiles_per_split = tiles_per_split; a.split_k = split_k;
  return a;
}

// Copies elements [base, base + 16 * n_chunks / ELEM) of `src` (16-byte aligned base) into `dst` with 16-byte
// cp.async pieces, zero-filling past `rem` elements (only the matrix's last tile can run past its end).
template <int ELEM, int THREADS>
__device__ __forceinline__ void copy_window(void* dst, const void* src, int n_chunks, int rem) {
  constexpr int PER = 16 / ELEM;
  for (int c = threadIdx.x; c < n_chunks; c += THREADS) {
    const int r = rem - PER * c;
    cp_async16(static_cast<char*>(dst) + 16 * c, static_cast<const char*>(src) + 16 * c,
               r >= PER ? 16 : (r > 0 ? ELEM * r : 0));
  }
}

// [first, end) of tile `tile`'s stored elements (the matrix's last tile ends at n_values).
struct TileSpan {
  long long s, e;
};
__device__ __forceinline__ TileSpan tile_span(const SkinnyArgs& a, int tile) {
  return {a.tile_off[tile], tile + 1 < a.n_tiles ? static_cast<long long>(a.tile_off[tile + 1]) : a.n_values};
}

// Copies a tile's run of ELEM-byte elements of `src` into `dst` from the 16-byte boundary at or below its first
// (cp.async); returns the index of the tile's first element in `dst`.
template <int ELEM, int THREADS>
__device__ __forceinline__ int stage_run(const SkinnyArgs& a, const void* src, TileSpan t, void* dst) {
  constexpr int PER = 16 / ELEM;
  const long long base = t.s & ~static_cast<long long>(PER - 1);
  copy_window<ELEM, THREADS>(dst, static_cast<const char*>(src) + ELEM * base,
                             static_cast<int>((t.e - base + PER - 1) / PER),
                             static_cast<int>(min(a.n_values - base, 1LL << 30)));
  return static_cast<int>(t.s - base);
}

// The X slice [NT * 8 tokens, BK columns] of one tile into shared memory rows STRIDE halves apart, in pieces
// of PIECE halves (4: 8-byte copies, for strides that are not 16-byte multiples; 8: 16-byte copies); rows past
// N and columns past K zero-filled. Each thread's pieces are the same for every tile: their offsets in X are
// computed once.
template <int NT, int BK, int STRIDE, int PIECE, int THREADS>
struct XSlice {
  static constexpr int PER_ROW = BK / PIECE;
  static constexpr int PIECES = NT * 8 * PER_ROW;
  static constexpr int PER_THREAD = (PIECES + THREADS - 1) / THREADS;
  int src[PER_THREAD];  // element offset of the piece in X for tile 0 (row * sx + col); -1: past N / none
  __device__ __forceinline__ explicit XSlice(const SkinnyArgs& a) {
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
      const unsigned c = threadIdx.x + THREADS * i;  // unsigned: / and % by powers of two are shifts and masks
      const int row = static_cast<int>(c / PER_ROW);
      src[i] = (c < PIECES && row < a.n) ? row * a.sx + PIECE * static_cast<int>(c % PER_ROW) : -1;
    }
  }
  __device__ __forceinline__ void issue(const SkinnyArgs& a, uint16_t* xs, int kt) const {
    const int k_left = a.k - kt * BK;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
      const unsigned c = threadIdx.x + THREADS * i;
      if constexpr (PIECES % THREADS != 0) {
        if (c >= PIECES) break;
      }
      const int col = PIECE * static_cast<int>(c % PER_ROW);  // from c, not stored: the compiler folds it
      const int cols = k_left - col;
      const int bytes = src[i] < 0 ? 0 : (cols >= PIECE ? 2 * PIECE : (cols > 0 ? 2 * cols : 0));
      uint16_t* dst = xs + (c / PER_ROW) * STRIDE + col;
      const uint16_t* from = a.x + (bytes ? src[i] + kt * BK : 0);
      if constexpr (PIECE == 4) cp_async8(dst, from, bytes);
      else cp_async16(dst, from, bytes);
    }
  }
};

// Launches `kern<NT, BF16>` (NT = token tiles of 8: 1, 2, 4 or 8 for N <= 8, 16, 32, 64) with `smem` bytes of
// dynamic shared memory, raising the block's shared-memory limit when it exceeds 48 KB. Returns a cudaError_t.
template <int NT, bool BF16, typename Args>
int launch_one(void (*kern)(Args), const Args& a, int smem, dim3 grid, int threads, cudaStream_t stream) {
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  kern<<<grid, threads, smem, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

// Calls launch<NT, BF16>() for the smallest NT in {1, 2, 4, 8} with 8 * NT >= n.
template <typename Launcher>
int dispatch_tokens(int n, bool bf16, Launcher&& launch) {
  const int nt = (n + 7) / 8;
  if (bf16) {
    if (nt <= 1) return launch.template operator()<1, true>();
    if (nt <= 2) return launch.template operator()<2, true>();
    if (nt <= 4) return launch.template operator()<4, true>();
    return launch.template operator()<8, true>();
  }
  if (nt <= 1) return launch.template operator()<1, false>();
  if (nt <= 2) return launch.template operator()<2, false>();
  if (nt <= 4) return launch.template operator()<4, false>();
  return launch.template operator()<8, false>();
}

}  // namespace sparsetrain
