// CPU attention of T new tokens against one layer's KV cache (decode, verify, trees, prefill).
//
//   out[b, t, n, :] = softmax_s(q[b, t, n, :] . k[b, n / G, s, :] / sqrt(H)) v[b, n / G, s, :]
//
// over the slots s that token t sees: every committed slot s < lengths[b], and
// window slot lengths[b] + j iff mask[b, t, j] (the semantics of
// ``specjax.attention``: mask is [B, T, W], W >= T, and the T new tokens are the
// last T of the W window slots, whose keys and values are already in the
// cache; W = T but while a drafter extends a tree). Slots past lengths[b] + W
// are never read, so the cost follows the
// rows' real lengths, not the static cache size, and each (row, kv head)'s
// keys and values stream from memory once for all T x G queries that share
// them (G = N / K query heads per kv head). XLA's CPU attention over the
// static [B, K, S, H] cache runs small batched products whose overheads cost
// several times that read at decode shapes (``benchmarks/cpu_attention.py``).
//
// Per (row, kv head): scores for all its query rows while each key is in
// registers, a softmax per query row (max, exp, sum; a row that sees no slot
// gives zeros), then the values weighted by the probabilities. Every query
// row's arithmetic runs in the same order whatever T, W, the batch or the
// thread count (unseen slots add exact zeros): a query's output is
// bit-identical whatever else is in the call, so a verify step scores a token
// exactly as a decode step would.
// (row, kv head) pairs are shared out over XLA's intra-op thread pool.
//
// Vectors are GCC vector extensions of 8 floats (AVX2 registers; split or
// joined by the compiler on other ISAs), so H must be a multiple of 8.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8 __attribute__((vector_size(32), aligned(4)));
constexpr int kLanes = 8;
constexpr int kMaxH = 256;  // head dims up to this many floats (32 vectors)
constexpr int kRows = 4;    // query rows scored together against each key
constexpr int kChunk = 8;   // vectors of a value row accumulated in registers at a time

inline v8 Load(const float* p) { return *reinterpret_cast<const v8*>(p); }
inline void Store(float* p, v8 x) { *reinterpret_cast<v8*>(p) = x; }
inline v8 Splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

// The four horizontal sums of a0..a3, in a fixed order: [sum a0, sum a1, sum a2, sum a3, ...].
inline v8 Sum4(v8 a0, v8 a1, v8 a2, v8 a3) {
  // Fold each vector's halves: s01 = [a0 lo + a0 hi | a1 lo + a1 hi].
  const v8 s01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8 s23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
  // Pairs: [a0 01, a0 23, a1 01, a1 23 | a2 01, a2 23, a3 01, a3 23] (partial sums).
  const v8 p = __builtin_shufflevector(s01, s23, 0, 2, 4, 6, 8, 10, 12, 14) +
               __builtin_shufflevector(s01, s23, 1, 3, 5, 7, 9, 11, 13, 15);
  return __builtin_shufflevector(p, p, 0, 2, 4, 6, 0, 2, 4, 6) +
         __builtin_shufflevector(p, p, 1, 3, 5, 7, 1, 3, 5, 7);
}

// exp(x) for x <= 0 (softmax arguments), -inf -> 0: Cody-Waite reduction
// x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r (relative
// error about 2e-7, like XLA's), then 2^n through the exponent bits.
inline v8 Exp(v8 x) {
  const v8 lo = Splat(-87.3f);  // below this e^x is under float's normal range: 0
  const i8 tiny = x < lo;
  x = x < lo ? lo : x;
  const v8 n = __builtin_convertvector(
      __builtin_convertvector(x * Splat(1.44269504088896341f) + Splat(-0.5f), i8), v8);
  // Rounding to nearest: trunc(y - 0.5) for y <= 0 (x <= 0 here).
  v8 r = x - n * Splat(0.693359375f);
  r = r - n * Splat(-2.12194440e-4f);
  v8 p = Splat(1.9875691500e-4f);
  p = p * r + Splat(1.3981999507e-3f);
  p = p * r + Splat(8.3334519073e-3f);
  p = p * r + Splat(4.1665795894e-2f);
  p = p * r + Splat(1.6666665459e-1f);
  p = p * r + Splat(5.0000001201e-1f);
  p = p * r * r + r + Splat(1.0f);
  const i8 bits = (__builtin_convertvector(n, i8) + 127) << 23;
  const v8 y = p * (v8)bits;  // a same-size vector cast reinterprets the bits
  return tiny ? Splat(0.0f) : y;
}

struct Shapes {
  int64_t B, T, N, K, S, H, G, W;  // W >= T: the new tokens are the last T of W window slots
};

// Scratch of one worker: gathered queries, scores, per-row normalisers.
struct Scratch {
  std::vector<float> q, scores, inv_sum;
};

// One (row b, kv head kh): its G query heads for all T new tokens (M = T x G query rows).
void Head(const Shapes& d, const float* q, const float* k, const float* v, int64_t length,
          const bool* mask, float* out, Scratch& w) {
  const int64_t T = d.T, W = d.W, G = d.G, H = d.H, M = T * G, nv = H / kLanes;
  const int64_t L = std::min<int64_t>(std::max<int64_t>(length, 0), d.S);
  const int64_t hi = std::min<int64_t>(L + W, d.S);  // slots [0, hi) may be visible
  const int64_t ld = (hi + kLanes - 1) / kLanes * kLanes;  // score row stride
  const int64_t Mp = (M + kRows - 1) / kRows * kRows;
  const float scale = 1.0f / std::sqrt(static_cast<float>(H));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  w.q.assign(Mp * H, 0.0f);
  w.scores.resize(Mp * ld);
  w.inv_sum.resize(M);
  // Query row m = (t, g) is q[t, kh * G + g, :], i.e. q + (t * N + g) * H here.
  for (int64_t m = 0; m < M; ++m)
    std::copy_n(q + ((m / G) * d.N + (m % G)) * H, H, w.q.data() + m * H);

  // Scores, kRows query rows at a time against each key.
  for (int64_t m0 = 0; m0 < Mp; m0 += kRows) {
    const float* q0 = w.q.data() + m0 * H;
    float* sc = w.scores.data() + m0 * ld;
    for (int64_t s = 0; s < hi; ++s) {
      const float* ks = k + s * H;
      v8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t i = 0; i < H; i += kLanes) {
        const v8 kv = Load(ks + i);
        a0 += Load(q0 + i) * kv;
        a1 += Load(q0 + H + i) * kv;
        a2 += Load(q0 + 2 * H + i) * kv;
        a3 += Load(q0 + 3 * H + i) * kv;
      }
      const v8 dots = Sum4(a0, a1, a2, a3) * Splat(scale);
      sc[s] = dots[0];
      sc[ld + s] = dots[1];
      sc[2 * ld + s] = dots[2];
      sc[3 * ld + s] = dots[3];
    }
  }
  // Softmax per query row; unseen new slots and the padding to ld are -inf.
  for (int64_t m = 0; m < M; ++m) {
    float* row = w.scores.data() + m * ld;
    const bool* seen = mask + (m / G) * W;
    for (int64_t s = L; s < hi; ++s)
      if (!seen[s - L]) row[s] = neg_inf;
    for (int64_t s = hi; s < ld; ++s) row[s] = neg_inf;
    v8 mx = Splat(neg_inf);
    for (int64_t s = 0; s < ld; s += kLanes) {
      const v8 x = Load(row + s);
      mx = x > mx ? x : mx;
    }
    float peak = neg_inf;
    for (int j = 0; j < kLanes; ++j) peak = std::max(peak, mx[j]);
    if (peak == neg_inf) {  // sees nothing: zeros
      std::fill_n(row, ld, 0.0f);
      w.inv_sum[m] = 0.0f;
      continue;
    }
    v8 total = {};
    for (int64_t s = 0; s < ld; s += kLanes) {
      const v8 e = Exp(Load(row + s) - Splat(peak));
      Store(row + s, e);
      total += e;
    }
    const v8 t4 = Sum4(total, v8{}, v8{}, v8{});
    w.inv_sum[m] = 1.0f / t4[0];
  }
  // Values: one query row and up to kChunk vectors of H at a time, in registers.
  for (int64_t m = 0; m < M; ++m) {
    const float* p = w.scores.data() + m * ld;
    float* o = out + ((m / G) * d.N + (m % G)) * H;
    for (int64_t c0 = 0; c0 < nv; c0 += kChunk) {
      const int64_t nc = std::min<int64_t>(kChunk, nv - c0);
      v8 a[kChunk] = {};
      for (int64_t s = 0; s < hi; ++s) {
        if (s >= L && p[s] == 0.0f) continue;  // an unseen window slot
        const v8 ps = Splat(p[s]);
        const float* vs = v + s * H + c0 * kLanes;
        if (nc == kChunk) {
#pragma GCC unroll 8
          for (int i = 0; i < kChunk; ++i) a[i] += ps * Load(vs + i * kLanes);
        } else {
          for (int64_t i = 0; i < nc; ++i) a[i] += ps * Load(vs + i * kLanes);
        }
      }
      const v8 r = Splat(w.inv_sum[m]);
      for (int64_t i = 0; i < nc; ++i) Store(o + (c0 + i) * kLanes, a[i] * r);
    }
  }
}

ffi::Error CpuAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                            ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                            ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::PRED> mask,
                            ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), md = mask.dimensions();
  const auto vd = v.dimensions(), od = out->dimensions();
  if (qd.size() != 4 || kd.size() != 4 || md.size() != 3 || vd.size() != 4 || od.size() != 4 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) ||
      !std::equal(qd.begin(), qd.end(), od.begin()))
    return ffi::Error::InvalidArgument(
        "cpu_attention: want q [B, T, N, H], k and v [B, K, S, H], mask [B, T, W]");
  Shapes d{qd[0], qd[1], qd[2], kd[1], kd[2], qd[3], 0, md[2]};
  if (kd[0] != d.B || kd[3] != d.H || d.K <= 0 || d.N % d.K != 0 || d.H % kLanes != 0 ||
      d.H > kMaxH || md[0] != d.B || md[1] != d.T || d.W < d.T ||
      lengths.element_count() != static_cast<size_t>(d.B))
    return ffi::Error::InvalidArgument("cpu_attention: inconsistent shapes");
  d.G = d.N / d.K;
  const float *qs = q.typed_data(), *ks = k.typed_data(), *vs = v.typed_data();
  const int32_t* lens = lengths.typed_data();
  const bool* masks = mask.typed_data();
  float* outs = out->typed_data();
  specjax::ParallelFor(pool, d.B * d.K, [=](int64_t i) {
    thread_local Scratch scratch;
    const int64_t b = i / d.K, kh = i % d.K;
    const int64_t kv = (b * d.K + kh) * d.S * d.H;
    Head(d, qs + (b * d.T * d.N + kh * d.G) * d.H, ks + kv, vs + kv, lens[b],
         masks + b * d.T * d.W, outs + (b * d.T * d.N + kh * d.G) * d.H, scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuAttention, CpuAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
