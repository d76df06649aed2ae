// Skinny SpMM Y[N, M] = X[N, K] · W[M, K]ᵀ (+ bias) with W in tiled CSL with byte locations
// (sparsetrain/kernels/spmm_csl.py: 128 x 64 tiles of 32 sub-tiles 16 x 16; per nonzero a value and a one-byte
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
constexpr int SUB = 16;  // sub-tile side

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
__global__ void __launch_bounds__(THREADS, NT <= 2 ? SPT_MIN_BLOCKS_SMALL_N : SPT_MIN_BLOCKS) spmm_csl_mma_kernel(const Args a) {
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

// ---- Round 8 kernel (default): vectorised chunk reads, un-scatter instead of zeroing ----
//
// The staged kernel above spends most of its shared-memory bandwidth on work that does not shrink with
// sparsity (Nsight Compute, round 5): zeroing each warp's [32, 64] slab every tile (16 KB of stores per tile),
// one 2-byte read per value and per location, and bank conflicts. This kernel stages the tile the same way
// (cp.async, double-buffered), then:
//   - zeroes the slab once; after the tile's MMAs each lane writes zeros back where it scattered;
//   - each lane reads 8 consecutive nonzeros of its warp's run at once (one 16-byte value read, one 8-byte
//     location read);
//   - finds an element's sub-tile without a search: the sub-tile starts inside a chunk of 8 are counted into
//     nibbles, whose prefix sums (one multiply by 0x11111111) give each element's sub-tile.
// Elements of a chunk outside the warp's run go to a padding column (TRASH), so no store is predicated.
constexpr int CH = 8;         // nonzeros per lane per round
constexpr int WS = 8;         // sub-tiles per warp (32 rows x 64 columns)
constexpr int TRASH = BK;     // slab row 0, first padding column: ldmatrix never reads it

struct Run {        // a warp's run of nonzeros in the staged tile, in value-window indices relative to w0
  int w0;           // window index of chunk 0: the run's first, rounded down to 8 (16-byte aligned)
  int rel[WS + 1];  // rel[q]: first nonzero of the warp's sub-tile q; rel[WS]: the run's end
};

__device__ __forceinline__ Run warp_run(const Staged& st, const int16_t* so, int warp) {
  Run r;
  const uint4 raw = *reinterpret_cast<const uint4*>(so + WS * warp);
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  r.w0 = (st.v0 + static_cast<int>(w[0] & 0xFFFF)) & ~(CH - 1);
#pragma unroll
  for (int q = 0; q < WS; ++q) r.rel[q] = st.v0 + static_cast<int>((w[q >> 1] >> (16 * (q & 1))) & 0xFFFF) - r.w0;
  r.rel[WS] = st.v0 + (warp < 3 ? so[WS * warp + WS] : st.len) - r.w0;
  return r;
}

// Slab addresses (halves) of chunk c's 8 elements, packed two per word; TRASH for elements outside the run.
__device__ __forceinline__ void chunk_addrs(const Run& r, int c, uint2 locs, uint32_t (&addr)[CH / 2]) {
  const int c0 = CH * c;
  int base = 0;
  uint32_t inc = 0;
#pragma unroll
  for (int q = 1; q < WS; ++q) {
    const int d = r.rel[q] - c0;
    base += d <= 0;
    inc += static_cast<unsigned>(d - 1) < static_cast<unsigned>(CH - 1) ? (1u << (4 * d)) : 0u;
  }
  const uint32_t pref = inc * 0x11111111u;  // nibble e: sub-tile starts in (c0, c0 + e]
#pragma unroll
  for (int e = 0; e < CH; ++e) {
    const int sub = base + ((pref >> (4 * e)) & 15);
    const int l = ((e < 4 ? locs.x : locs.y) >> (8 * (e & 3))) & 255;
    // row (sub / 4) * 16 + l / 16, column (sub % 4) * 16 + l % 16
    int ad = (sub >> 2) * (SUB * AS_STRIDE) + (sub & 3) * SUB + (l >> 4) * AS_STRIDE + (l & 15);
    ad = (c0 + e >= r.rel[0] && c0 + e < r.rel[WS]) ? ad : TRASH;
    if (e & 1) addr[e >> 1] |= static_cast<uint32_t>(ad) << 16;
    else addr[e >> 1] = static_cast<uint32_t>(ad);
  }
}

__device__ __forceinline__ void store_chunk(uint16_t* as, const uint32_t (&addr)[CH / 2], uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int e = 0; e < CH; ++e) as[(addr[e >> 1] >> (16 * (e & 1))) & 0xFFFF] = (w[e >> 1] >> (16 * (e & 1))) & 0xFFFF;
}

__device__ __forceinline__ void zero_chunk(uint16_t* as, const uint32_t (&addr)[CH / 2]) {
#pragma unroll
  for (int e = 0; e < CH; ++e) as[(addr[e >> 1] >> (16 * (e & 1))) & 0xFFFF] = 0;
}

// Reads lane chunk c (8 values, 8 locations) from the staged windows and scatters it; returns its addresses.
__device__ __forceinline__ void scatter_chunk(uint16_t* as, const uint16_t* sv, const uint8_t* sl, int lshift,
                                              const Run& r, int c, uint32_t (&addr)[CH / 2]) {
  const int i = r.w0 + CH * c;
  const uint2 l = *reinterpret_cast<const uint2*>(sl + i + lshift);
  chunk_addrs(r, c, l, addr);
  store_chunk(as, addr, *reinterpret_cast<const uint4*>(sv + i));
}

#ifndef SPT_CSL_MIN_BLOCKS
#define SPT_CSL_MIN_BLOCKS 8  // register cap for N <= 16 (8 blocks per SM: 64 registers)
#endif
#ifndef SPT_CSL_ROUNDS
#define SPT_CSL_ROUNDS 1  // rounds of chunk addresses kept in registers for the un-scatter (more: recomputed)
#endif

template <int NT, bool BF16>
__global__ void __launch_bounds__(THREADS, NT <= 2 ? SPT_CSL_MIN_BLOCKS : SPT_MIN_BLOCKS) spmm_csl_reg_kernel(const Args a) {
  using T = typename std::conditional<BF16, __nv_bfloat16, __half>::type;
  constexpr int R = SPT_CSL_ROUNDS;
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
  zero_slab(as, lane);

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
    const uint16_t* xs = xs_of(st);
    const int lshift = cur.l0 - cur.v0;  // 0 or 8: the location window starts 16-aligned, the value window 8
    const Run run = warp_run(cur, so_of(st), warp);

    uint32_t addr[R][CH / 2];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (CH * (32 * r + lane) < run.rel[WS]) {
        scatter_chunk(as, sv, sl, lshift, run, 32 * r + lane, addr[r]);
      } else {
#pragma unroll
        for (int i = 0; i < CH / 2; ++i) addr[r][i] = TRASH | (TRASH << 16);
      }
    }
    for (int r = R; CH * 32 * r < run.rel[WS]; ++r) {
      uint32_t ad[CH / 2];
      if (CH * (32 * r + lane) < run.rel[WS]) scatter_chunk(as, sv, sl, lshift, run, 32 * r + lane, ad);
    }
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
    __syncwarp();  // the slab's reads are done before it is un-scattered
#pragma unroll
    for (int r = 0; r < R; ++r) zero_chunk(as, addr[r]);
    for (int r = R; CH * 32 * r < run.rel[WS]; ++r) {
      if (CH * (32 * r + lane) < run.rel[WS]) {
        uint32_t ad[CH / 2];
        chunk_addrs(run, 32 * r + lane, *reinterpret_cast<const uint2*>(sl + run.w0 + CH * (32 * r + lane) + lshift), ad);
        zero_chunk(as, ad);
      }
    }
    __syncthreads();  // this stage is overwritten by the copy issued in the next iteration
    cur = next;
  }
  cp_async_wait<0>();
  write_output<NT, T>(acc, pid_m * BM + warp * 32, pid_m * BM, BM, a.m, a.n, a.bias, a.y, a.sy, a.split_k, a.ws,
                      a.locks, pid_m, THREADS);
}

#ifndef SPT_CSL_KERNEL
#define SPT_CSL_KERNEL 3  // 3: the register kernel; 2: the staged kernel (kept for A/B runs)
#endif

inline int csl_smem(const Args& a, int nt) {
  return 2 * (2 * a.vcap + a.lcap + 2 * N_SUB + 2 * nt * 8 * XS_STRIDE) + 2 * 4 * 32 * AS_STRIDE;
}

template <int NT, bool BF16>
int launch_t(const Args& a, int grid_m, int grid_s, cudaStream_t stream) {
  return launch_one<NT, BF16>(spmm_csl_mma_kernel<NT, BF16>, a, csl_smem(a, NT), dim3(grid_m, grid_s), THREADS, stream);
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
#if SPT_CSL_KERNEL == 3
  return dispatch_tokens(n, bf16, [&]<int NT, bool BF16>() {
    return launch_one<NT, BF16>(spmm_csl_reg_kernel<NT, BF16>, a, csl_smem(a, NT), dim3(tm, split_k), THREADS, s);
  });
#else
  return dispatch_tokens(n, bf16, [&]<int NT, bool BF16>() { return launch_t<NT, BF16>(a, tm, split_k, s); });
#endif
}

}  // extern "C"
