// Streaming small-M matmul for CPU decoding: y[M, P*W] = x[M, K] @ panels[P, K, W].
//
// Decode and verify steps multiply a handful of rows (M = batch x new tokens)
// by every weight matrix. Library GEMMs pack their operands for large M, which
// on this class of CPU makes M = 2..16 cost 2-3x the bandwidth-bound M = 1
// GEMV. Here the weight is stored once, at load, as column panels of width
// W = 64 so that each panel is one contiguous [K, W] stream; every panel is read
// from memory once and reused from cache for all M rows, so the cost of a
// matmul stays close to one read of the weights for M up to a few dozen.
//
// Each (row, column) accumulates over k = 0..K-1 in order with one fused
// multiply-add per step, independent of M, of the panel split and of the
// number of threads: row m of the result is bit-identical whatever else is in
// the batch. Panels are shared out dynamically over XLA's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kPanel = 64;   // columns per panel
constexpr int kLanes = 16;   // floats per vector
constexpr int kVecs = kPanel / kLanes;
constexpr int kMaxRows = 6;  // rows per register block: 6 x 4 accumulators + 4 weight vectors

#if defined(__AVX512F__)
typedef __m512 vf;
inline vf Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf Zero() { return _mm512_setzero_ps(); }
inline vf Fma(vf acc, vf w, float x) { return _mm512_fmadd_ps(w, _mm512_set1_ps(x), acc); }
#else  // portable: GCC vector extensions (AVX2 pairs, NEON quads, ...)
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
inline vf Load(const float* p) { vf v; __builtin_memcpy(&v, p, sizeof v); return v; }
inline void Store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
inline vf Zero() { return vf{}; }
inline vf Fma(vf acc, vf w, float x) { return acc + w * x; }  // FMA via -ffp-contract=fast
#endif

// R rows x one panel; the R x 4 accumulators live in registers.
template <int R>
inline void PanelBlock(const float* __restrict x, int64_t K, const float* __restrict panel,
                       float* __restrict y, int64_t ldy) {
  vf acc[R][kVecs];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) acc[r][j] = Zero();
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kPanel;
    const vf w0 = Load(w), w1 = Load(w + kLanes), w2 = Load(w + 2 * kLanes),
             w3 = Load(w + 3 * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * K + k];
      acc[r][0] = Fma(acc[r][0], w0, xv);
      acc[r][1] = Fma(acc[r][1], w1, xv);
      acc[r][2] = Fma(acc[r][2], w2, xv);
      acc[r][3] = Fma(acc[r][3], w3, xv);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) Store(y + r * ldy + j * kLanes, acc[r][j]);
}

// Rows [0, M) of one panel, in register blocks of up to kMaxRows rows.
void Panel(const float* x, int64_t M, int64_t K, const float* panel, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows)
    PanelBlock<kMaxRows>(x + m * K, K, panel, y + m * ldy, ldy);
  const float* xr = x + m * K;
  float* yr = y + m * ldy;
  switch (M - m) {
    case 1: PanelBlock<1>(xr, K, panel, yr, ldy); break;
    case 2: PanelBlock<2>(xr, K, panel, yr, ldy); break;
    case 3: PanelBlock<3>(xr, K, panel, yr, ldy); break;
    case 4: PanelBlock<4>(xr, K, panel, yr, ldy); break;
    case 5: PanelBlock<5>(xr, K, panel, yr, ldy); break;
    default: break;
  }
}

// Work shared by the calling thread and the pool helpers. Helpers hold it by
// shared_ptr: one that starts after the caller returned finds no panels left.
struct Job {
  const float* x;
  const float* panels;
  float* y;
  int64_t M, K, P;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    for (int64_t p; (p = next.fetch_add(1, std::memory_order_relaxed)) < P;) {
      Panel(x, M, K, panels + p * K * kPanel, y + p * kPanel, P * kPanel);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error StreamingMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                               ffi::Buffer<ffi::F32> panels, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto pd = panels.dimensions();
  if (xd.size() != 2 || pd.size() != 3 || pd[2] != kPanel || pd[1] != xd[1])
    return ffi::Error::InvalidArgument("streaming_matmul: want x [M, K] and panels [P, K, 64]");
  const auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != pd[0] * kPanel)
    return ffi::Error::InvalidArgument("streaming_matmul: want y [M, P * 64]");
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->panels = panels.typed_data();
  job->y = y->typed_data();
  job->M = xd[0];
  job->K = xd[1];
  job->P = pd[0];
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->P) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->Work(); });
  job->Work();
  // Every panel was claimed; wait for the ones still being computed by helpers.
  while (job->done.load(std::memory_order_acquire) < job->P) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxStreamingMatmul, StreamingMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
