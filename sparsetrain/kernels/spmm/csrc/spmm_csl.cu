// Skinny SpMM Y[N, M] = X[N, K] · W[M, K]ᵀ (+ bias) with W in tiled CSL with byte locations
// (sparsetrain/kernels/spmm/csl.py: 128 x 64 tiles of 32 sub-tiles 16 x 16; per nonzero a value and a one-byte
// position inside its sub-tile; int16 sub-tile offsets; int32 tile offsets).
//
// Work per nonzero, not per weight element (Flash-LLM's "load as sparse, compute as dense"):
//   1. the tile's values, locations and sub-tile offsets and the X slice are copied into shared memory with
//      16-byte cp.async, double-buffered (tile kt + 1 in flight while tile kt is computed);
//   2. each warp owns 32 rows (8 sub-tiles) of a dense [32, 64] half tile in shared memory: it zeroes it
//      (16-byte stores) and scatters the sub-tiles' nonzeros into it, 4 lanes per sub-tile (one 2-byte store
//      per nonzero, no search for a nonzero's sub-tile);
//   3. ldmatrix + mma.sync.m16n8k16 (fp32 accumulation) multiply it by X.
// Split-K and the output are as in spmm_bitmap.cu (common.cuh: write_output).
#include "common.cuh"

namespace {
using namespace sparsetrain;

constexpr int BM = 128;
constexpr int BK = 64;
constexpr int THREADS = 128;
constexpr int XS_STRIDE = BK + 8;  // halves: 144-byte rows, conflict-free 4-byte fragment loads
constexpr int AS_STRIDE = BK + 8;  // halves: 144-byte rows, conflict-free ldmatrix
constexpr int N_SUB = 32;

struct Args : SkinnyArgs {    // n_values = nonzeros
  const uint16_t* values;
  const uint8_t* locs;
  const int16_t* sub_off;   // [TM, TK, 32]
  int vcap;  // halves per value window (multiple of 8)
  int lcap;  // bytes per location window (multiple of 16)
};

struct Staged {
  int v0, l0, len;  // window index of the tile's first value / location; the tile's nonzero count
};

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

template <int NT>
using XCopies = XSlice<NT, BK, XS_STRIDE, 8, THREADS>;

template <int NT>
__device__ __forceinline__ Staged stage_tile(const Args& a, const XCopies<NT>& xc, int tile, int kt, uint16_t* sv,
                                             uint8_t* sl, int16_t* so, uint16_t* xs) {
  const int tid = threadIdx.x;
  const TileSpan t = tile_span(a, tile);
  const int first_v = stage_run<2, THREADS>(a, a.values, t, sv);
  const int first_l = stage_run<1, THREADS>(a, a.locs, t, sl);
  if (tid < 4) cp_async16(so + 8 * tid, a.sub_off + static_cast<long long>(tile) * N_SUB + 8 * tid, 16);
  xc.issue(a, xs, kt);
  return Staged{first_v, first_l, static_cast<int>(t.e - t.s)};
}

// Scatters the warp's 8 sub-tiles into its zeroed dense slab: 4 lanes per sub-tile (lane >> 2), each taking
// every 4th of the sub-tile's nonzeros, so the sub-tile of a nonzero is known without a search.
__device__ __forceinline__ void scatter(uint16_t* as, const uint16_t* sv, const uint8_t* sl, const int16_t* so,
                                        const Staged& st, int warp, int lane) {
  const int q = lane >> 2, sub = warp * 8 + q;
  const int begin = so[sub];
  const int end = sub + 1 < N_SUB ? so[sub + 1] : st.len;
  uint16_t* origin = as + (q >> 2) * 16 * AS_STRIDE + (q & 3) * 16;
  const uint8_t* lp = sl + st.l0;
  const uint16_t* vp = sv + st.v0;
#pragma unroll 4
  for (int i = begin + (lane & 3); i < end; i += 4) {
    const int l = lp[i];
    origin[(l >> 4) * AS_STRIDE + (l & 15)] = vp[i];
  }
}

// Zeroes the warp's [32, 64] slab (16-byte stores; the 8 padding halves of each row are left alone).
__device__ __forceinline__ void zero_slab(uint16_t* as, int lane) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int c = lane + 32 * i, row = c >> 3, q = c & 7;  // 256 pieces of 16 bytes
    *reinterpret_cast<uint4*>(as + row * AS_STRIDE + 8 * q) = make_uint4(0, 0, 0, 0);
  }
}

template <int NT, bool BF16>
__global__ void __launch_bounds__(THREADS, min_blocks<NT>()) spmm_csl_mma_kernel(const Args a) {
  using T = typename std::conditional<BF16, __nv_bfloat16, __half>::type;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int x_halves = NT * 8 * XS_STRIDE;
  const int stage_bytes = 2 * a.vcap + a.lcap + 2 * N_SUB + 2 * x_halves;  // multiple of 16
  uint16_t* as_all = reinterpret_cast<uint16_t*>(smem_raw + 2 * stage_bytes);
  auto sv_of = [&](int st) { return reinterpret_cast<uint16_t*>(smem_raw + st * stage_bytes); };
  auto sl_of = [&](int st) { return reinterpret_cast<uint8_t*>(sv_of(st) + a.vcap); };
  auto so_of = [&](int st) { return reinterpret_cast<int16_t*>(sl_of(st) + a.lcap); };
  auto xs_of = [&](int st) { return reinterpret_cast<uint16_t*>(so_of(st) + N_SUB); };

  const int pid_m = blockIdx.x, pid_s = blockIdx.y;
  const int kt_begin = pid_s * a.tiles_per_split;
  const int kt_end = min(kt_begin + a.tiles_per_split, a.tk);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  uint16_t* as = as_all + warp * 32 * AS_STRIDE;


  float acc[2][NT][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

  const XCopies<NT> xc(a);
  Staged cur{0, 0, 0}, next{0, 0, 0};
  if (kt_begin < kt_end)
    cur = stage_tile<NT>(a, xc, pid_m * a.tk + kt_begin, kt_begin, sv_of(0), sl_of(0), so_of(0), xs_of(0));
  cp_async_commit();
  for (int kt = kt_begin; kt < kt_end; ++kt) {
    const int st = (kt - kt_begin) & 1;
    if (kt + 1 < kt_end)
      next = stage_tile<NT>(a, xc, pid_m * a.tk + kt + 1, kt + 1, sv_of(st ^ 1), sl_of(st ^ 1), so_of(st ^ 1),
                            xs_of(st ^ 1));
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const uint16_t* sv = sv_of(st);
    const uint8_t* sl = sl_of(st);
    const int16_t* so = so_of(st);
    const uint16_t* xs = xs_of(st);

    zero_slab(as, lane);
    __syncwarp();
    scatter(as, sv, sl, so, cur, warp, lane);
    __syncwarp();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t bf[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint16_t* xr = xs + (nt * 8 + g) * XS_STRIDE + 16 * kk + 2 * t;
        bf[nt][0] = *reinterpret_cast<const uint32_t*>(xr);
        bf[nt][1] = *reinterpret_cast<const uint32_t*>(xr + 8);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        uint32_t af[4];
        ldmatrix_x4(af, as + (mt * 16 + (lane & 15)) * AS_STRIDE + 16 * kk + (lane >> 4) * 8);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma16816<BF16>(acc[mt][nt], af, bf[nt][0], bf[nt][1]);
      }
    }
    __syncwarp();  // the slab's reads are done before the next tile zeroes it
    __syncthreads();  // this stage is overwritten by the copy issued in the next iteration
    cur = next;
  }
  cp_async_wait<0>();
  write_output<NT, T>(acc, pid_m * BM + warp * 32, pid_m * BM, BM, a.m, a.n, a.bias, a.y, a.sy, a.split_k, a.ws,
                      a.locks, pid_m, THREADS);
}

template <int NT, bool BF16>
int launch_t(const Args& a, int grid_m, int grid_s, cudaStream_t stream) {
  const int stage_bytes = 2 * a.vcap + a.lcap + 2 * N_SUB + 2 * NT * 8 * XS_STRIDE;
  return launch_one<NT, BF16>(spmm_csl_mma_kernel<NT, BF16>, a, 2 * stage_bytes + 2 * 4 * 32 * AS_STRIDE, dim3(grid_m, grid_s), THREADS, stream);
}

}  // namespace

extern "C" {

int sparsetrain_spmm_csl(long long x, long long values, long long locs, long long sub_off, long long tile_off,
                         long long bias, long long y, long long ws, long long locks, long long nnz, int n, int m,
                         int k, int sx, int sy, int tm, int tk, int tiles_per_split, int split_k, int max_tile_len,
                         int bf16, long long stream) {
  if (n < 1 || n > 64 || (sx & 7) || (x & 15) || (values & 15) || (locs & 15) || (sub_off & 15)) return -1;
  Args a;
  static_cast<SkinnyArgs&>(a) = skinny_args(x, tile_off, bias, y, ws, locks, nnz, n, m, k, sx, sy, tm, tk,
                                            tiles_per_split, split_k);
  a.values = reinterpret_cast<const uint16_t*>(values);
  a.locs = reinterpret_cast<const uint8_t*>(locs);
  a.sub_off = reinterpret_cast<const int16_t*>(sub_off);
  a.vcap = ((max_tile_len + 7 + 7) / 8) * 8 + 8;
  a.lcap = ((max_tile_len + 15 + 15) / 16) * 16 + 16;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  return dispatch_tokens(n, bf16, [&]<int NT, bool BF16>() { return launch_t<NT, BF16>(a, tm, split_k, s); });
}

}  // extern "C"
