// Streaming small-M matmul for CPU decoding: y[M, P*W] = x[M, K] @ panels[P, K, W].
// The panels hold float32, or IEEE float16 widened to float32 in registers as they are
// loaded (half the bytes to stream; the products and sums stay float32, so a float16
// panel gives the bits of the float32 kernel on the same values).
//
// Decode and verify steps multiply a handful of rows (M = batch x new tokens)
// by every weight matrix. Library GEMMs pack their operands for large M, which
// on many CPUs makes M = 2..16 cost 2-3x the bandwidth-bound M = 1 GEMV. Here
// the weight is stored once, at load, as column panels of W values so that
// each panel is one contiguous [K, W] stream; every panel is read from memory
// once and reused from cache for all M rows, so the cost of a matmul stays
// close to one read of the weights for M up to a few dozen.
//
// Register tiles: blocks of up to 6 rows x the whole panel row (kVecs vectors)
// are accumulated in registers while k runs over K; the weight vectors loaded
// for one k serve every row of the block. The panel width W is four vectors on
// AVX-512 (64 floats: 6 x 4 blocks, 24 of 32 zmm) and two on AVX2/FMA (16
// floats, one cache line per panel row: 6 x 2 blocks, 12 of 16 ymm beside two
// weight vectors and a broadcast). So up to 6 rows read each panel once, in
// one contiguous pass from memory, its FMAs overlapping the stream; further
// row blocks re-read it from cache. The portable path (GCC vector extensions)
// takes AVX-512's shape, the compiler splitting the vectors. The library
// reports W (``SpecjaxStreamingMatmulPanel``) and packing follows it.
//
// Prefetch (the ``prefetch`` attribute: 0 off; 1 or 2, every prefetch it turns on hinted
// into L2 (prefetcht1) or non-temporal (prefetchnta)): for M > 6 a panel is read several
// times (one pass per row block); the passes share out the lines of each row of
// the panel this thread will probably claim next and software-prefetch them
// (on AVX2 a panel row is one line, or half of one in float16: all in the first
// pass); on AVX-512 the row blocks instead take turns over k-blocks of the panel (32
// rows, 8 KB of float32, in L1),
// sharing out the next k-block's prefetch (PanelBlocked). There the
// attribute also makes the streaming pass (the first, from memory) prefetch the
// panel kAhead rows ahead for any M (AVX2 always does, into L1, for M > 1). Whether
// either pays, and with which hint, depends on the host (the next-panel prefetch was
// 12-22% faster on one AVX2 EPYC and 5-40% slower on another, the streaming pass's 12-16%
// faster at M = 3-6 on an Intel Xeon into L1 and 7-12% more into L2, while on a Zen 5
// EPYC the non-temporal hint took 0.92-0.98x L2's time at M = 2-16:
// benchmarks/kernel_variants/README.md), so ``policy.py`` times the modes like the kernel
// itself and picks the hint, then per M whether to prefetch, from the first M the attribute
// changes (``SpecjaxStreamingMatmulPrefetchRows``).
//
// Each (row, column) accumulates over k = 0..K-1 in order with one fused
// multiply-add per step, whatever the tile, M, panel split, prefetch or thread count:
// row m of the result is bit-identical whatever else is in the batch. Panels
// are shared out dynamically over XLA's intra-op thread pool.
//
// Build variants: -march=native picks the best path of the build machine;
// defining SPECJAX_ISA_AVX2 (with -mavx2 -mfma -mf16c) forces the AVX2 path so it is
// tested on AVX-512 machines too.

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

#if defined(SPECJAX_ISA_AVX2)
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "SPECJAX_ISA_AVX2 needs -mavx2 -mfma -mf16c"
#endif
#define SPECJAX_AVX2 1
#elif defined(__AVX512F__)
#define SPECJAX_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECJAX_AVX2 1
#endif

#if defined(SPECJAX_AVX512) || defined(SPECJAX_AVX2)
#include <immintrin.h>
#endif

// __builtin_prefetch's locality for the L2 cache (prefetcht1 on x86), and the non-temporal
// hint (prefetchnta): the two hints the ``prefetch`` attribute chooses between (1 and 2).
constexpr int kPrefetchL2 = 2;
constexpr int kPrefetchNta = 0;

namespace ffi = xla::ffi;

namespace {

#if defined(SPECJAX_AVX512)
constexpr const char* kIsa = "avx512";
constexpr int kLanes = 16;
typedef __m512 vf;
inline vf Load(const float* p) { return _mm512_loadu_ps(p); }
inline vf Load(const uint16_t* p) {  // IEEE half -> float32, exact
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void Store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf Zero() { return _mm512_setzero_ps(); }
inline vf Fma(vf acc, vf w, float x) { return _mm512_fmadd_ps(w, _mm512_set1_ps(x), acc); }
constexpr int kVecs = 4;  // vectors per panel row
constexpr int kUnroll = 1;  // 2 and 4 measured the same on an Intel Xeon
// With the prefetch attribute, the streaming pass prefetches 32 panel rows ahead (8 KB of
// float32, 4 of float16) with the attribute's hint: into L1 at 16 rows it took 0.84-0.88x
// the pass without it at M = 3-6 on an Intel Xeon, into L2 at 24-64 rows 0.88-0.93x of that
// at M = 4-6; on a Zen 5 EPYC the non-temporal hint took 0.95-0.98x L2's at M = 2-6 in the
// host's fast memory spells, 64 or 128 rows ahead into L2 1.01-1.07x 32 rows'
// (benchmarks/kernel_variants/README.md; float32 panels).
constexpr int kAhead = 32;
constexpr int kAheadLocality = kPrefetchL2;  // not read: this path takes the attribute's hint
constexpr bool kAheadByAttribute = true;
// With the prefetch attribute, more than B rows run in k-blocks (PanelBlocked): 0.90-0.95x
// the per-panel passes at M = 7-17 and 0.84x at M = 32 on an Intel Xeon.
constexpr bool kBlocked = true;
#elif defined(SPECJAX_AVX2)
constexpr const char* kIsa = "avx2";
constexpr int kLanes = 8;
typedef __m256 vf;
inline vf Load(const float* p) { return _mm256_loadu_ps(p); }
inline vf Load(const uint16_t* p) {  // IEEE half -> float32, exact (F16C)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void Store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf Zero() { return _mm256_setzero_ps(); }
inline vf Fma(vf acc, vf w, float x) { return _mm256_fmadd_ps(w, _mm256_set1_ps(x), acc); }
constexpr int kVecs = 2;
// k unrolled 4x: four cache lines of the panel in flight per iteration.
constexpr int kUnroll = 4;
// A pass that streams a panel for several rows prefetches the line 16 rows (1 KB) ahead.
constexpr int kAhead = 16;
constexpr int kAheadLocality = 3;  // prefetcht0 (L1): the only hint measured on AVX2 (Zen 3)
constexpr bool kAheadByAttribute = false;  // always, for M > 1
constexpr bool kBlocked = false;  // whole-panel passes, as measured on Zen 3 (k-blocks unmeasured)
#else  // portable: GCC vector extensions (AVX pairs, NEON quads, ...)
constexpr const char* kIsa = "portable";
constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
inline vf Load(const float* p) { vf v; __builtin_memcpy(&v, p, sizeof v); return v; }
// IEEE half bits -> the float32 of the same value (normals, subnormals, zeros, inf, NaN).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = 113;
    uint32_t m = man;
    while (!(m & 0x400)) { m <<= 1; --e; }
    bits = sign | (uint32_t(e) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}
inline vf Load(const uint16_t* p) {
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = HalfToFloat(p[i]);
  return v;
}
inline void Store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
inline vf Zero() { return vf{}; }
inline vf Fma(vf acc, vf w, float x) { return acc + w * x; }  // FMA via -ffp-contract=fast
constexpr int kVecs = 4;
constexpr int kUnroll = 1;
constexpr int kAhead = 0;
constexpr int kAheadLocality = 3;
constexpr bool kAheadByAttribute = false;
constexpr bool kBlocked = false;
#endif

constexpr int kPanel = kVecs * kLanes;  // columns per panel (W)
constexpr int kGroup = 64 / kPanel;     // panels per work item

// 64-byte cache lines per panel row of weights of type T (float, or uint16_t: IEEE half
// bits); a row of less than a line (AVX2's 16 halves) counts as one.
template <typename T>
constexpr int kLines = std::max<int>(1, kPanel * sizeof(T) / 64);

// Prefetches line ``l`` of panel row ``row`` (of T weights) into the cache of ``locality``.
template <typename T, int Locality>
inline void PrefetchLine(const T* panel, int64_t row, int l) {
  __builtin_prefetch(reinterpret_cast<const char*>(panel + row * kPanel) + l * 64, 0, Locality);
}

// One k step of a tile: C weight vectors serve R rows.
template <int R, int C, typename T>
__attribute__((always_inline)) inline void Step(vf (&acc)[R][C], const float* __restrict x,
                                                int64_t K, const T* __restrict w,
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

// What each pass over a panel prefetches: the streaming pass, panel rows kAhead ahead of
// its own (AVX-512: with the attribute, at any M; AVX2: always, when several rows are
// computed); the passes from cache, lines of the next panel.
template <typename T>
struct Prefetch {
  const T* next = nullptr;  // the next panel this thread will likely compute, or null
  bool ahead = false;       // the first pass prefetches kAhead panel rows ahead
  int pass = 0;             // passes over the current panel so far
  int passes = 1;           // passes in all (row blocks)
  // Lines [lo, hi) of each next-panel row fall to this pass; none with a single pass.
  void Lines(int* lo, int* hi) const {
    const int per = (kLines<T> + passes - 1) / passes;  // every line falls to some pass
    *lo = std::min(pass * per, kLines<T>);
    *hi = std::min(*lo + per, kLines<T>);
    if (next == nullptr || passes < 2) *lo = *hi = 0;
  }
};

// R rows x C vectors (columns [0, C * kLanes) of ``panel``), accumulated in registers.
// U unrolls the k loop (more loads in flight while the panel streams from memory).
template <int R, int C, int U, int Hint, typename T>
inline void Tile(const float* __restrict x, int64_t K, const T* __restrict panel,
                 float* __restrict y, int64_t ldy, Prefetch<T>& pf) {
  int lo, hi;
  pf.Lines(&lo, &hi);
  const bool ahead = kAhead > 0 && pf.ahead && pf.pass == 0;
  ++pf.pass;
  vf acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) acc[r][j] = Zero();
  int64_t k = 0;
  for (; k + U <= K; k += U) {
    if (ahead)
      for (int u = 0; u < U; ++u)
        if (k + u + kAhead < K)  // within the panel
          for (int l = 0; l < kLines<T>; ++l)
            PrefetchLine<T, kAheadByAttribute ? Hint : kAheadLocality>(panel, k + u + kAhead, l);
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) Step<R, C>(acc, x, K, panel + (k + u) * kPanel, k + u);
    for (int l = lo; l < hi; ++l)
      for (int u = 0; u < U; ++u) PrefetchLine<T, Hint>(pf.next, k + u, l);
  }
  for (; k < K; ++k) Step<R, C>(acc, x, K, panel + k * kPanel, k);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) Store(y + r * ldy + j * kLanes, acc[r][j]);
}

constexpr int B = 6;  // rows per register block: ONE_PASS_ROWS in streaming_matmul.py

// Calls block(std::integral_constant<int, R>(), m) for the row blocks [m, m + R) of [0, M):
// blocks of B rows, then one of the M % B rows left (R is a template argument of the tiles).
template <typename F>
inline void ForRowBlocks(int64_t M, F&& block) {
  static_assert(B == 6, "the remainders below are 1 to B - 1");
  int64_t m = 0;
  for (; m + B <= M; m += B) block(std::integral_constant<int, B>(), m);
  switch (M - m) {
    case 1: block(std::integral_constant<int, 1>(), m); break;
    case 2: block(std::integral_constant<int, 2>(), m); break;
    case 3: block(std::integral_constant<int, 3>(), m); break;
    case 4: block(std::integral_constant<int, 4>(), m); break;
    case 5: block(std::integral_constant<int, 5>(), m); break;
    default: break;
  }
}

constexpr int64_t kKBlock = 32;  // panel rows per k-block of PanelBlocked (8 KB of float32)

// Rows [0, R) over panel rows [k0, k1): the accumulators start from y (zero at k0 = 0) and go
// back to it, so each output is still one FMA per k in k order (float32 stores and loads are
// exact). Meanwhile it prefetches ``rows`` panel rows from ``pre`` with ``Hint``, one per k
// step (on an Intel Xeon, into L1: 1.00-1.04x the per-panel passes at M = 7-17, into L2
// 0.90-0.95x).
template <int R, int C, int Hint, typename T>
inline void TileRange(const float* __restrict x, int64_t K, const T* __restrict panel,
                      float* __restrict y, int64_t ldy, int64_t k0, int64_t k1,
                      const T* pre, int64_t rows) {
  vf acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) acc[r][j] = k0 == 0 ? Zero() : Load(y + r * ldy + j * kLanes);
  for (int64_t k = k0; k < k1; ++k) {
    const int64_t i = k - k0;
    if (i < rows)
      for (int l = 0; l < kLines<T>; ++l) PrefetchLine<T, Hint>(pre, i, l);
    Step<R, C>(acc, x, K, panel + k * kPanel, k);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) Store(y + r * ldy + j * kLanes, acc[r][j]);
}

// Rows [0, M) of one panel, M > B, in k-blocks of kKBlock panel rows: every row block's pass
// over a k-block reads it from L1, and the passes share out the prefetch of the next k-block
// (of this panel, or the first of ``next``, with ``Hint``), so the stream from memory goes on
// while the later row blocks compute (in per-panel passes, each pass after the first re-reads
// the whole panel from cache, and only the next-panel prefetch streams meanwhile).
template <int Hint, typename T>
void PanelBlocked(const float* x, int64_t M, int64_t K, const T* panel, float* y,
                  int64_t ldy, const T* next) {
  const int passes = (M + B - 1) / B;
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
    const int64_t k1 = std::min(K, k0 + kKBlock);
    const T* pre = nullptr;
    int64_t pre_rows = 0;
    if (k1 < K) { pre = panel + k1 * kPanel; pre_rows = std::min(kKBlock, K - k1); }
    else if (next != nullptr) { pre = next; pre_rows = std::min(kKBlock, K); }
    const int64_t per = (pre_rows + passes - 1) / passes;
    int pass = 0;
    ForRowBlocks(M, [&](auto rows, int64_t m) {
      const int64_t lo = std::min(pre_rows, pass++ * per);
      TileRange<decltype(rows)::value, kVecs, Hint>(
          x + m * K, K, panel, y + m * ldy, ldy, k0, k1,
          pre == nullptr ? nullptr : pre + lo * kPanel, std::min(pre_rows, lo + per) - lo);
    });
  }
}

// Rows [0, M) of one panel: blocks of B rows and a remainder block, each one pass
// over the whole panel (the first from memory, the others from cache), or with
// ``prefetch`` past B rows on AVX-512 PanelBlocked's turns. ``next``: the panel to
// prefetch during the passes from cache, or null.
template <int Hint, typename T>
void Panel(const float* x, int64_t M, int64_t K, const T* panel, float* y, int64_t ldy,
           const T* next, bool prefetch) {
  if (kBlocked && prefetch && M > B) return PanelBlocked<Hint>(x, M, K, panel, y, ldy, next);
  Prefetch<T> pf;
  pf.next = next;
  pf.ahead = kAheadByAttribute ? prefetch : M > 1;
  pf.passes = (M + B - 1) / B;
  ForRowBlocks(M, [&](auto rows, int64_t m) {
    Tile<decltype(rows)::value, kVecs, kUnroll, Hint>(x + m * K, K, panel, y + m * ldy, ldy, pf);
  });
}

// Panels of float32 (F32) or IEEE float16 (F16: uint16_t bits, widened as they load).
template <ffi::DataType D>
ffi::Error StreamingMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                               ffi::Buffer<D> panels, ffi::ResultBuffer<ffi::F32> y,
                               int32_t prefetch) {
  using T = ffi::NativeType<D>;
  const auto xd = x.dimensions();
  const auto pd = panels.dimensions();
  if (xd.size() != 2 || pd.size() != 3 || pd[2] != kPanel || pd[1] != xd[1])
    return ffi::Error::InvalidArgument("streaming_matmul: want x [M, K] and panels [P, K, W] (W: the library's panel width)");
  const auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != pd[0] * kPanel)
    return ffi::Error::InvalidArgument("streaming_matmul: want y [M, P * W]");
  if (prefetch < 0 || prefetch > 2)
    return ffi::Error::InvalidArgument(
        "streaming_matmul: prefetch must be 0 (off), 1 (into L2) or 2 (non-temporal)");
  const float* xs = x.typed_data();
  const T* ps = panels.typed_data();
  float* ys = y->typed_data();
  const int64_t M = xd[0], K = xd[1], P = pd[0];
  if (M == 0) return ffi::Error::Success();  // nothing to read or write
  // A work item is kGroup consecutive panels (64 columns: one contiguous stream per item
  // whatever the panel width); claims alternate between workers.
  const int64_t items = (P + kGroup - 1) / kGroup;
  const int64_t workers = specjax::Workers(pool, items);
  specjax::ParallelFor(pool, items, [=](int64_t i) {
    const int64_t end = std::min(P, (i + 1) * kGroup);
    for (int64_t p = i * kGroup; p < end; ++p) {
      const int64_t guess = p + 1 < end ? p + 1 : (i + workers) * kGroup;
      const T* next = prefetch && guess < P ? ps + guess * K * kPanel : nullptr;
      if (prefetch == 2)
        Panel<kPrefetchNta>(xs, M, K, ps + p * K * kPanel, ys + p * kPanel, P * kPanel, next,
                            true);
      else
        Panel<kPrefetchL2>(xs, M, K, ps + p * K * kPanel, ys + p * kPanel, P * kPanel, next,
                           prefetch != 0);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

// The instruction-set path this library was built with ("avx512", "avx2", "portable").
extern "C" const char* SpecjaxStreamingMatmulIsa() { return kIsa; }

// The panel width W (columns per panel) the library's panels must have.
extern "C" int SpecjaxStreamingMatmulPanel() { return kPanel; }

// The fewest rows M at which the ``prefetch`` attribute changes what the kernel does:
// any where it drives the streaming pass's prefetch, else past one pass (B + 1).
extern "C" int SpecjaxStreamingMatmulPrefetchRows() { return kAheadByAttribute ? 1 : B + 1; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxStreamingMatmul, StreamingMatmulImpl<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("prefetch"));

// The same with float16 panels.
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxStreamingMatmulF16, StreamingMatmulImpl<ffi::F16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("prefetch"));
