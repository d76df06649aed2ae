// Skinny SpMM Y[N, M] = X[N, K] · W[M, K]ᵀ (+ bias) with W in sparsetrain's bitmap format
// (sparsetrain/kernels/spmm/bitmap.py: 128 x 64 tiles; per tile row a 64-bit bitmap, an int16 offset of the
// row's zero slot, then the row's nonzeros; per tile an int32 offset into `values`).
//
// Why CUDA and not Triton for this one: the Triton kernel (spmm/_triton.py) has to build the dense
// [128, 64] tile as a register tensor, which costs ~10 instructions and one scattered global load per weight
// element (L1/TEX-bound, 0.3-0.6x of cuBLAS on an H200). Here
//   1. each tile's packed values are copied into shared memory with 16-byte cp.async (coalesced, one
//      transaction per 8 values, double-buffered so the next tile is in flight while this one is decoded);
//   2. every thread decodes exactly the weight elements its mma.sync A fragments hold, straight into
//      registers. The MMA's K order is permuted so that a thread's elements of a row are 16 adjacent
//      columns: their nonzeros are one contiguous run, and each element costs a bit test, a POPC with an
//      immediate mask (its rank in the run) and one *predicated* 2-byte shared-memory load (no traffic for
//      absent elements);
//   3. mma.sync.m16n8k16 (fp32 accumulation) multiplies by X, staged once per tile in shared memory.
// No dense tile is ever written anywhere. Split-K: fp32 partials are added atomically into a workspace and
// the last block of a row tile (arrival counter) writes Y and re-zeroes its part of the workspace.
//
// Built at first use by sparsetrain/kernels/_runtime/cuda_build.py with nvcc for the GPU's own architecture
// and called through ctypes (no torch headers): every pointer and the stream come in as integers.
#include "common.cuh"

namespace {
using namespace sparsetrain;

constexpr int BM = 128;       // rows of W per tile (fixed: compress(block_m=128))
constexpr int BK = 64;        // columns per tile
constexpr int THREADS = 128;  // 4 warps x 32 rows each (two m16 fragments)
// Halves per staged X row: 68 halves = 34 words; 34 = 2 (mod 8) makes each half-warp's 8-byte fragment
// loads (rows g = 0..3 or 4..7, column groups t = 0..3) hit 32 distinct banks.
constexpr int XS_STRIDE = BK + 4;

struct Args : SkinnyArgs {
  const uint32_t* bitmap;   // [TM, TK, 128, 2] (low word = columns 0..31)
  const int16_t* row_off;   // [TM, TK, 128]
  const uint16_t* values;   // packed values (16-byte aligned)
  int vcap;                 // halves per shared-memory value buffer (>= longest tile + 8)
};

// X slices: the staged rows are 136 bytes apart (XS_STRIDE), so 8-byte pieces.
template <int NT>
using XCopies = XSlice<NT, BK, XS_STRIDE, 4, THREADS>;

// Issues the cp.async copies of one tile (values window, X slice, bitmap, row offsets) into one stage.
// Returns the shared-memory index of the tile's first value (the window starts 16-byte aligned below it).
template <int NT>
__device__ __forceinline__ int stage_tile(const Args& a, const XCopies<NT>& xc, int tile, int kt, uint16_t* sv,
                                          uint16_t* xs, uint32_t* sbm, int16_t* sro) {
  const int tid = threadIdx.x;
  const int first = stage_run<2, THREADS>(a, a.values, tile_span(a, tile), sv);
  xc.issue(a, xs, kt);
  // 128 rows x 8 bytes of bitmap = 64 chunks; 128 x 2 bytes of row offsets = 16 chunks.
  if (tid < 64) {
    cp_async16(sbm + 4 * tid, a.bitmap + static_cast<long long>(tile) * (2 * BM) + 4 * tid, 16);
  } else if (tid < 80) {
    const int c = tid - 64;
    cp_async16(sro + 8 * c, a.row_off + static_cast<long long>(tile) * BM + 8 * c, 16);
  }
  return first;
}

template <int NT, bool BF16>
__global__ void __launch_bounds__(THREADS, min_blocks<NT>()) spmm_bitmap_mma_kernel(const Args a) {
  using T = typename std::conditional<BF16, __nv_bfloat16, __half>::type;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Per stage: [value window (vcap halves)] [X slice (NT*8 x XS_STRIDE halves)] [bitmap 1 KB] [row offsets]
  const int x_halves = NT * 8 * XS_STRIDE;
  const int stage_bytes = 2 * (a.vcap + x_halves) + BM * 8 + BM * 2;  // multiple of 16 (see launch_t)
  auto sv_of = [&](int st) { return reinterpret_cast<uint16_t*>(smem_raw + st * stage_bytes); };
  auto xs_of = [&](int st) { return sv_of(st) + a.vcap; };
  auto sbm_of = [&](int st) { return reinterpret_cast<uint32_t*>(xs_of(st) + x_halves); };
  auto sro_of = [&](int st) { return reinterpret_cast<int16_t*>(sbm_of(st) + 2 * BM); };

  const int pid_m = blockIdx.x, pid_s = blockIdx.y;
  const int kt_begin = pid_s * a.tiles_per_split;
  const int kt_end = min(kt_begin + a.tiles_per_split, a.tk);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;

  float acc[2][NT][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

  // Shared-memory index of the current / next tile's first value (scalars: a run-time-indexed pair would
  // live in local memory).
  const XCopies<NT> xc(a);
  int first_cur = 0, first_next = 0;
  if (kt_begin < kt_end) {
    first_cur = stage_tile<NT>(a, xc, pid_m * a.tk + kt_begin, kt_begin, sv_of(0), xs_of(0), sbm_of(0), sro_of(0));
  }
  cp_async_commit();
  for (int kt = kt_begin; kt < kt_end; ++kt) {
    const int st = (kt - kt_begin) & 1;
    if (kt + 1 < kt_end) {
      first_next = stage_tile<NT>(a, xc, pid_m * a.tk + kt + 1, kt + 1, sv_of(st ^ 1), xs_of(st ^ 1),
                                  sbm_of(st ^ 1), sro_of(st ^ 1));
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const uint16_t* sv = sv_of(st);
    const uint16_t* xs = xs_of(st);
    const uint32_t* sbm = sbm_of(st);
    const int16_t* sro = sro_of(st);

    // Lane (g, t) owns columns [16t, 16t + 16) of its 4 rows (2 fragments x rows g, g + 8). Inside k16 step
    // kk the MMA's K index is permuted (the same permutation for A and B, so the product is unchanged):
    // fragment columns {2t, 2t+1, 2t+8, 2t+9} hold tile columns 16t + 4kk + {0, 1, 2, 3}. So a lane's
    // columns are 16 adjacent bits of the row's bitmap and its nonzeros one contiguous run in `sv`.
    uint32_t bits[2][2];
    const uint16_t* run[2][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int r = warp * 32 + mt * 16 + g + 8 * rr;
        const uint32_t lo = sbm[2 * r], hi = sbm[2 * r + 1];
        const uint32_t word = t < 2 ? lo : hi;
        bits[mt][rr] = (t & 1) ? (word >> 16) : (word & 0xFFFFu);
        const int before = (t & 1 ? __popc(word & 0xFFFFu) : 0) + (t >= 2 ? __popc(lo) : 0);
        run[mt][rr] = sv + first_cur + sro[r] + 1 + before;  // zero slot + 1 = the row's first nonzero
      }

#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t bf[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint2 v = *reinterpret_cast<const uint2*>(xs + (nt * 8 + g) * XS_STRIDE + 16 * t + 4 * kk);
        bf[nt][0] = v.x;
        bf[nt][1] = v.y;
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        uint32_t af[4];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          uint32_t v[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int j = 4 * kk + e;  // compile-time: masks are immediates
            const uint32_t h = bits[mt][rr];
            v[e] = (h & (1u << j)) ? static_cast<uint32_t>(run[mt][rr][__popc(h & ((1u << j) - 1u))]) : 0u;
          }
          af[rr] = v[0] | (v[1] << 16);      // a0 / a1: fragment columns 2t, 2t+1
          af[2 + rr] = v[2] | (v[3] << 16);  // a2 / a3: fragment columns 2t+8, 2t+9
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma16816<BF16>(acc[mt][nt], af, bf[nt][0], bf[nt][1]);
      }
    }
    __syncthreads();  // this stage is overwritten by the copy issued in the next iteration
    first_cur = first_next;
  }
  cp_async_wait<0>();

  write_output<NT, T>(acc, pid_m * BM + warp * 32, pid_m * BM, BM, a.m, a.n, a.bias, a.y, a.sy, a.split_k, a.ws,
                      a.locks, pid_m, THREADS);
}

template <int NT, bool BF16>
int launch_t(const Args& a, int grid_m, int grid_s, cudaStream_t stream) {
  const int stage_bytes = 2 * (a.vcap + NT * 8 * XS_STRIDE) + BM * 8 + BM * 2;
  return launch_one<NT, BF16>(spmm_bitmap_mma_kernel<NT, BF16>, a, 2 * stage_bytes, dim3(grid_m, grid_s), THREADS, stream);
}

}  // namespace

extern "C" {

// Returns 0 on success, a cudaError_t code otherwise, -1 for arguments this kernel does not take.
int sparsetrain_spmm_bitmap(long long x, long long bitmap, long long row_off, long long values,
                            long long tile_off, long long bias, long long y, long long ws, long long locks,
                            long long n_values, int n, int m, int k, int sx, int sy, int tm, int tk,
                            int tiles_per_split, int split_k, int max_tile_len, int bf16, long long stream) {
  if (n < 1 || n > 64 || (sx & 7) || (x & 15) || (values & 15) || (bitmap & 15) || (row_off & 15)) return -1;
  Args a;
  static_cast<SkinnyArgs&>(a) = skinny_args(x, tile_off, bias, y, ws, locks, n_values, n, m, k, sx, sy, tm, tk,
                                            tiles_per_split, split_k);
  a.bitmap = reinterpret_cast<const uint32_t*>(bitmap);
  a.row_off = reinterpret_cast<const int16_t*>(row_off);
  a.values = reinterpret_cast<const uint16_t*>(values);
  a.vcap = ((max_tile_len + 7 + 7) / 8) * 8 + 8;  // misaligned start + round up, in 16-byte chunks
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  return dispatch_tokens(n, bf16, [&]<int NT, bool BF16>() { return launch_t<NT, BF16>(a, tm, split_k, s); });
}

}  // extern "C"
