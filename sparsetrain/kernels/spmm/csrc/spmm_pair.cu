// Skinny SpMM Y[N, M] = X[N, K] · W[M, K]ᵀ (+ bias) with W in the pair-bitmap format
// (sparsetrain/kernels/spmm/pair.py: 128 x 64 tiles; per tile row a 32-bit bitmap with one bit per PAIR of
// adjacent columns (2p, 2p+1), set when either is nonzero; the row's nonzero pairs stored whole, two halves
// each (low = even column); an int16 offset per row and an int32 offset per tile, both in halves).
//
// Why a second bitmap kernel: spmm_bitmap.cu decodes each weight element with a bit test, a POPC, an address
// and a predicated 2-byte load: ~12 instructions per element in its main loop (SASS count), and it is
// issue-bound at 0.8-1.1x of cuBLAS on an H200, whose HBM delivers a byte every ~7 lane-instruction slots. An
// mma.sync A-fragment register holds exactly one pair (two adjacent K columns), so storing whole pairs makes
// the decode one test, one POPC, one address and one predicated 4-byte load per REGISTER: half the work per
// element. The price is bytes: a nonzero pair stores its zero half too (0.47 B/elem at 90% sparsity against
// 0.39 for the element bitmap; the format choice in spmm/op.py weighs both).
//
// Everything else (staging with cp.async, the permuted K order, split-K, the epilogue) is spmm_bitmap.cu's.
#include "common.cuh"

namespace {
using namespace sparsetrain;

constexpr int BM = 128;       // rows of W per tile
constexpr int BK = 64;        // columns per tile (32 pairs: one 32-bit bitmap word per row)
constexpr int THREADS = 128;  // 4 warps x 32 rows each (two m16 fragments)
constexpr int XS_STRIDE = BK + 4;  // as in spmm_bitmap.cu: conflict-free 8-byte fragment loads

struct Args : SkinnyArgs {    // n_values, tile_off: in halves (always even)
  const uint32_t* bitmap;   // [TM, TK, 128]: bit p of a row = pair p (columns 2p, 2p+1) stored
  const int16_t* row_off;   // [TM, TK, 128]: the row's first half relative to its tile's first
  const uint16_t* values;   // pairs, 16-byte aligned
  int vcap;                 // halves per shared-memory value buffer (>= longest tile + 8)
};

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}

template <int NT>
using XCopies = XSlice<NT, BK, XS_STRIDE, 4, THREADS>;

template <int NT>
__device__ __forceinline__ int stage_tile(const Args& a, const XCopies<NT>& xc, int tile, int kt, uint16_t* sv,
                                          uint16_t* xs, uint32_t* sbm, int16_t* sro) {
  const int tid = threadIdx.x;
  const int first = stage_run<2, THREADS>(a, a.values, tile_span(a, tile), sv);
  xc.issue(a, xs, kt);
  // 128 rows x 4 bytes of bitmap = 32 chunks; 128 x 2 bytes of row offsets = 16 chunks.
  if (tid < 32) {
    cp_async16(sbm + 4 * tid, a.bitmap + static_cast<long long>(tile) * BM + 4 * tid, 16);
  } else if (tid < 48) {
    const int c = tid - 32;
    cp_async16(sro + 8 * c, a.row_off + static_cast<long long>(tile) * BM + 8 * c, 16);
  }
  return first;  // even: tile offsets are
}

template <int NT, bool BF16>
__global__ void __launch_bounds__(THREADS, min_blocks<NT>()) spmm_pair_mma_kernel(const Args a) {
  using T = typename std::conditional<BF16, __nv_bfloat16, __half>::type;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Per stage: [value window (vcap halves)] [X slice (NT*8 x XS_STRIDE halves)] [bitmap 512 B] [row offsets]
  const int x_halves = NT * 8 * XS_STRIDE;
  const int stage_bytes = 2 * (a.vcap + x_halves) + BM * 4 + BM * 2;  // multiple of 16 (see launch_t)
  auto sv_of = [&](int st) { return reinterpret_cast<uint16_t*>(smem_raw + st * stage_bytes); };
  auto xs_of = [&](int st) { return sv_of(st) + a.vcap; };
  auto sbm_of = [&](int st) { return reinterpret_cast<uint32_t*>(xs_of(st) + x_halves); };
  auto sro_of = [&](int st) { return reinterpret_cast<int16_t*>(sbm_of(st) + BM); };

  const int pid_m = blockIdx.x, pid_s = blockIdx.y;
  const int kt_begin = pid_s * a.tiles_per_split;
  const int kt_end = min(kt_begin + a.tiles_per_split, a.tk);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const uint32_t before_mask = (1u << (8 * t)) - 1u;  // pairs of the lanes t' < t in a bitmap word
  // A pair's rank is a mask + POPC; a 256-entry shared-memory table instead was measured 6-10% slower on an H200
  // (its loads sit on the critical path; docs/history/inference.md).

  float acc[2][NT][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

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

    // Lane (g, t) owns columns [16t, 16t + 16) = pairs [8t, 8t + 8) of its 4 rows; in k16 step kk the MMA's K
    // order is permuted (as in spmm_bitmap.cu) so that fragment columns {2t, 2t+1} are pair 8t + 2kk and
    // {2t+8, 2t+9} pair 8t + 2kk + 1. A lane's stored pairs of a row are one contiguous run of words.
    uint32_t bits[2][2];
    uint32_t run[2][2];  // shared-memory byte address of the run's first word
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int r = warp * 32 + mt * 16 + g + 8 * rr;
        const uint32_t word = sbm[r];
        bits[mt][rr] = (word >> (8 * t)) & 0xFFu;
        run[mt][rr] = static_cast<unsigned>(__cvta_generic_to_shared(sv + first_cur + sro[r])) +
                      4u * __popc(word & before_mask);
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
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int p = 2 * kk + e;  // compile-time: the masks are immediates
            const uint32_t h = bits[mt][rr];
            const uint32_t off = 4u * __popc(h & ((1u << p) - 1u));
            af[2 * e + rr] = (h & (1u << p)) ? lds32(run[mt][rr] + off) : 0u;
          }
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
  const int stage_bytes = 2 * (a.vcap + NT * 8 * XS_STRIDE) + BM * 4 + BM * 2;
  return launch_one<NT, BF16>(spmm_pair_mma_kernel<NT, BF16>, a, 2 * stage_bytes, dim3(grid_m, grid_s), THREADS, stream);
}

}  // namespace

extern "C" {

// Returns 0 on success, a cudaError_t code otherwise, -1 for arguments this kernel does not take.
int sparsetrain_spmm_pair(long long x, long long bitmap, long long row_off, long long values,
                          long long tile_off, long long bias, long long y, long long ws, long long locks,
                          long long n_values, int n, int m, int k, int sx, int sy, int tm, int tk,
                          int tiles_per_split, int split_k, int max_tile_len, int bf16, long long stream) {
  if (n < 1 || n > 64 || (sx & 7) || (x & 15) || (values & 15) || (bitmap & 15) || (row_off & 15) ||
      (n_values & 1))
    return -1;
  Args a;
  static_cast<SkinnyArgs&>(a) = skinny_args(x, tile_off, bias, y, ws, locks, n_values, n, m, k, sx, sy, tm, tk,
                                            tiles_per_split, split_k);
  a.bitmap = reinterpret_cast<const uint32_t*>(bitmap);
  a.row_off = reinterpret_cast<const int16_t*>(row_off);
  a.values = reinterpret_cast<const uint16_t*>(values);
  a.vcap = ((max_tile_len + 7 + 7) / 8) * 8 + 8;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  return dispatch_tokens(n, bf16, [&]<int NT, bool BF16>() { return launch_t<NT, BF16>(a, tm, split_k, s); });
}

}  // extern "C"
