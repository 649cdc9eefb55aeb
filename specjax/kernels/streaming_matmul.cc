// Streaming small-M matmul for CPU decoding: y[M, P*64] = x[M, K] @ panels[P, K, 64].
//
// Decode and verify steps multiply a handful of rows (M = batch x new tokens)
// by every weight matrix. Library GEMMs pack their operands for large M, which
// on many CPUs makes M = 2..16 cost 2-3x the bandwidth-bound M = 1 GEMV. Here
// the weight is stored once, at load, as column panels of 64 floats so that
// each panel is one contiguous [K, 64] stream; every panel is read from memory
// once and reused from cache for all M rows, so the cost of a matmul stays
// close to one read of the weights for M up to a few dozen.
//
// Register tiles: R rows x C vectors of one panel's columns are accumulated in
// registers while k runs over K; the weight vectors loaded for one k serve all
// R rows. The tile shapes depend on the instruction set (ISA below):
//   AVX-512 (32 zmm, 16 lanes): R <= 6 rows x the whole panel (4 vectors).
//   AVX2/FMA (16 ymm, 8 lanes): below 24 rows, row 0 alone over the whole
//     panel (1 x 8, one contiguous stream from memory), then the other rows
//     in 3 x 4 blocks from L2; from 24 rows on, 6 x 2 blocks; remainders
//     1 x 8, 2 x 4, 4 x 2, 5 x 2 (at most 12 accumulators beside the weight
//     vectors and a broadcast), k unrolled 4x; the panel's columns are
//     walked in chunks of C vectors. A chunk of 16 or 32 floats is one or
//     two whole cache lines of every panel row, so the chunks touch
//     disjoint lines; further passes re-read the panel from L2.
//   portable (GCC vector extensions): as AVX-512, the compiler splits vectors.
//
// Prefetch (the ``prefetch`` attribute): for M > 1 a panel is read several
// times (row blocks x column chunks); while it is computed from cache, each
// pass also software-prefetches a share of the lines of the panel this thread
// will probably claim next into L2 (on AVX2 below 24 rows: every pass after
// row 0's, which streams the panel and prefetches nothing). Whether that pays
// depends on the host (it was 12-22% faster on one AVX2 EPYC and 5-40% slower
// on another: benchmarks/kernel_variants/README.md), so ``policy.py`` times it
// like the kernel itself and turns it on per M.
//
// Each (row, column) accumulates over k = 0..K-1 in order with one fused
// multiply-add per step, whatever the tile, M, panel split, prefetch or thread count:
// row m of the result is bit-identical whatever else is in the batch. Panels
// are shared out dynamically over XLA's intra-op thread pool.
//
// Build variants: -march=native picks the best path of the build machine;
// defining SPECJAX_ISA_AVX2 (with -mavx2 -mfma) forces the AVX2 path so it is
// tested on AVX-512 machines too.

#include <algorithm>
#include <cstdint>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

#if defined(SPECJAX_ISA_AVX2)
#if !defined(__AVX2__) || !defined(__FMA__)
#error "SPECJAX_ISA_AVX2 needs -mavx2 -mfma"
#endif
#define SPECJAX_AVX2 1
#elif defined(__AVX512F__)
#define SPECJAX_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define SPECJAX_AVX2 1
#endif

#if defined(SPECJAX_AVX512) || defined(SPECJAX_AVX2)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kPanel = 64;  // columns per panel

#if defined(SPECJAX_AVX512)
constexpr const char* kIsa = "avx512";
constexpr int kLanes = 16;
typedef __m512 vf;
inline vf Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf Zero() { return _mm512_setzero_ps(); }
inline vf Fma(vf acc, vf w, float x) { return _mm512_fmadd_ps(w, _mm512_set1_ps(x), acc); }
#elif defined(SPECJAX_AVX2)
constexpr const char* kIsa = "avx2";
constexpr int kLanes = 8;
typedef __m256 vf;
inline vf Load(const float* p) { return _mm256_loadu_ps(p); }
inline void Store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf Zero() { return _mm256_setzero_ps(); }
inline vf Fma(vf acc, vf w, float x) { return _mm256_fmadd_ps(w, _mm256_set1_ps(x), acc); }
#else  // portable: GCC vector extensions (AVX pairs, NEON quads, ...)
constexpr const char* kIsa = "portable";
constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
inline vf Load(const float* p) { vf v; __builtin_memcpy(&v, p, sizeof v); return v; }
inline void Store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
inline vf Zero() { return vf{}; }
inline vf Fma(vf acc, vf w, float x) { return acc + w * x; }  // FMA via -ffp-contract=fast
#endif

constexpr int kVecs = kPanel / kLanes;  // vectors per panel row

// One k step of a tile: C weight vectors serve R rows.
template <int R, int C>
__attribute__((always_inline)) inline void Step(vf (&acc)[R][C], const float* __restrict x,
                                                int64_t K, const float* __restrict w,
                                                int64_t k) {
  vf wv[C];
#pragma GCC unroll 8
  for (int j = 0; j < C; ++j) wv[j] = Load(w + j * kLanes);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const float xv = x[r * K + k];
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) acc[r][j] = Fma(acc[r][j], wv[j], xv);
  }
}

// R rows x C vectors (columns [0, C * kLanes) of ``panel``), accumulated in registers.
// U unrolls the k loop (more loads in flight while the panel streams from memory).
// The next panel's lines this pass prefetches into L2 while it computes from cache.
struct Prefetch {
  const float* next = nullptr;  // the next panel this thread will likely compute, or null
  int pass = 0;                 // passes over the current panel so far
  int passes = 1;               // passes in all (row blocks x column chunks)
  bool cached = false;          // an earlier pass streamed the panel: all passes are from cache
  // Lines [lo, hi) of each next-panel row fall to this pass.
  void Lines(int* lo, int* hi) const {
    constexpr int kLines = kPanel / 16;
    const int per = (kLines + passes - 1) / passes;  // every line falls to some pass
    *lo = std::min(pass * per, kLines);
    *hi = std::min(*lo + per, kLines);
    if (next == nullptr || (passes < 2 && !cached)) *lo = *hi = 0;
  }
};

template <int R, int C, int U>
inline void Tile(const float* __restrict x, int64_t K, const float* __restrict panel,
                 float* __restrict y, int64_t ldy, Prefetch& pf) {
  int lo, hi;
  pf.Lines(&lo, &hi);
  ++pf.pass;
  vf acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) acc[r][j] = Zero();
  int64_t k = 0;
  for (; k + U <= K; k += U) {
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) Step<R, C>(acc, x, K, panel + (k + u) * kPanel, k + u);
    for (int l = lo; l < hi; ++l)
      for (int u = 0; u < U; ++u)
        __builtin_prefetch(pf.next + (k + u) * kPanel + l * 16, 0, 2);
  }
  for (; k < K; ++k) Step<R, C>(acc, x, K, panel + k * kPanel, k);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) Store(y + r * ldy + j * kLanes, acc[r][j]);
}

// R rows x the whole panel, in column chunks of C vectors.
template <int R, int C, int U>
inline void RowBlock(const float* x, int64_t K, const float* panel, float* y, int64_t ldy,
                     Prefetch& pf) {
  static_assert(kVecs % C == 0, "chunks must tile the panel");
  for (int c = 0; c < kVecs; c += C)
    Tile<R, C, U>(x, K, panel + c * kLanes, y + c * kLanes, ldy, pf);
}

// Rows [0, M) of one panel, in register blocks of B rows and a remainder block.
// AVX2 (16 ymm): at most 12 accumulators (R x C) beside C weight vectors and a
// broadcast; 3 x 4 blocks for verify-sized M (two column chunks), 6 x 2 blocks
// (four chunks, the BLIS Haswell shape) for prefill-sized M. The split at 24 rows
// and the 4x unroll below were chosen with a throwaway microbenchmark (the
// model's matmul chain, one AMD EPYC Zen 3): 3 x 4 was 20-30% faster than 6 x 2
// at M = 4..8, 6 x 2 10-20% faster from M = 32, the unroll 15-25% faster at
// M = 3..64. What the repo keeps is the end-to-end effect:
// benchmarks/results/streaming_matmul.md.
// AVX-512 and portable: blocks of 6 rows x the whole panel.
template <int B, int U>
void Rows(const float* x, int64_t M, int64_t K, const float* panel, float* y, int64_t ldy,
          const float* next, bool cached) {
#if defined(SPECJAX_AVX2)
#define SPECJAX_ROWS(R, C) RowBlock<R, C, U>(xr, K, panel, yr, ldy, pf)
  constexpr int kChunks = B == 6 ? kVecs / 2 : kVecs / 4;
  static const int kRemChunks[6] = {0, 1, 2, 2, 4, 4};
#else
#define SPECJAX_ROWS(R, C) RowBlock<R, kVecs, U>(xr, K, panel, yr, ldy, pf)
  constexpr int kChunks = 1;
  static const int kRemChunks[6] = {0, 1, 1, 1, 1, 1};
#endif
  Prefetch pf;
  pf.next = next;
  pf.cached = cached;
  pf.passes = (M / B) * kChunks + kRemChunks[M % B];
  int64_t m = 0;
  for (; m + B <= M; m += B) {
    const float* xr = x + m * K;
    float* yr = y + m * ldy;
    if (B == 6) SPECJAX_ROWS(6, 2); else SPECJAX_ROWS(3, 4);
  }
  const float* xr = x + m * K;
  float* yr = y + m * ldy;
  switch (M - m) {
    case 1: SPECJAX_ROWS(1, 8); break;
    case 2: SPECJAX_ROWS(2, 4); break;
    case 3: SPECJAX_ROWS(3, 4); break;
    case 4: SPECJAX_ROWS(4, 2); break;
    case 5: SPECJAX_ROWS(5, 2); break;
    default: break;
  }
#undef SPECJAX_ROWS
}

#if defined(SPECJAX_AVX2)
constexpr int64_t kLargeM = 24;  // from here on, 6 x 2 blocks
// k unrolled 4x (more panel loads in flight while the first row block streams).
constexpr int kUnroll = 4;
#else
constexpr int64_t kLargeM = 1;   // always 6 x 4 blocks (24 of 32 zmm accumulators)
constexpr int kUnroll = 1;       // unmeasured on AVX-512 since the AVX2 path's tuning
#endif

void Panel(const float* x, int64_t M, int64_t K, const float* panel, float* y, int64_t ldy,
           const float* next) {
  if (M >= kLargeM) {
    Rows<6, kUnroll>(x, M, K, panel, y, ldy, next, false);
    return;
  }
#if defined(SPECJAX_AVX2)
  // Row 0 alone (1 x 8) streams the whole panel from memory contiguously; the other rows
  // then reuse it from L2 in 3 x 4 blocks. This was 3-17% faster for M = 2..17 on an AVX2
  // EPYC (Zen 3) than letting the first 3 x 4 block stream it (half of every 256-byte
  // panel row per pass): benchmarks/kernel_variants/README.md.
  Prefetch first;
  RowBlock<1, kVecs, kUnroll>(x, K, panel, y, ldy, first);
  if (M > 1) Rows<3, kUnroll>(x + K, M - 1, K, panel, y + ldy, ldy, next, true);
#else
  Rows<3, kUnroll>(x, M, K, panel, y, ldy, next, false);
#endif
}

ffi::Error StreamingMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                               ffi::Buffer<ffi::F32> panels, ffi::ResultBuffer<ffi::F32> y,
                               int32_t prefetch) {
  const auto xd = x.dimensions();
  const auto pd = panels.dimensions();
  if (xd.size() != 2 || pd.size() != 3 || pd[2] != kPanel || pd[1] != xd[1])
    return ffi::Error::InvalidArgument("streaming_matmul: want x [M, K] and panels [P, K, 64]");
  const auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != pd[0] * kPanel)
    return ffi::Error::InvalidArgument("streaming_matmul: want y [M, P * 64]");
  const float* xs = x.typed_data();
  const float* ps = panels.typed_data();
  float* ys = y->typed_data();
  const int64_t M = xd[0], K = xd[1], P = pd[0];
  if (M == 0) return ffi::Error::Success();  // nothing to read or write
  const int64_t workers = specjax::Workers(pool, P);
  specjax::ParallelFor(pool, P, [=](int64_t p) {
    const int64_t guess = p + workers;  // claims alternate between workers
    Panel(xs, M, K, ps + p * K * kPanel, ys + p * kPanel, P * kPanel,
          prefetch && guess < P ? ps + guess * K * kPanel : nullptr);
  });
  return ffi::Error::Success();
}

}  // namespace

// The instruction-set path this library was built with ("avx512", "avx2", "portable").
extern "C" const char* SpecjaxStreamingMatmulIsa() { return kIsa; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxStreamingMatmul, StreamingMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("prefetch"));
