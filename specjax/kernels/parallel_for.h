// Sharing a kernel's independent work items over XLA's intra-op thread pool.
//
//   ParallelFor(pool, n, [&](int64_t i) { ... });
//
// runs body(i) once for every i in [0, n): the calling thread and up to
// Workers(pool, n) - 1 pool helpers claim items from one atomic counter
// (dynamic scheduling: a slow core takes fewer), and the call returns when
// every item is done. Helpers hold the shared state by shared_ptr, so one
// that starts after the call returned finds no items left and never touches
// the caller's data. Which thread runs an item must not change its result:
// each kernel makes every item's arithmetic independent of the others.
//
// Included by streaming_matmul.cc and cpu_attention.cc (``build.py`` keys
// their cached libraries by this file too).

#ifndef SPECJAX_KERNELS_PARALLEL_FOR_H_
#define SPECJAX_KERNELS_PARALLEL_FOR_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace specjax {

// How many threads ParallelFor(pool, n, ...) runs items on (the caller included), >= 1.
inline int64_t Workers(xla::ffi::ThreadPool& pool, int64_t n) {
  return std::max<int64_t>(std::min<int64_t>(pool.num_threads(), n), 1);
}

template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, Body body) {
  struct Shared {
    Body body;
    int64_t n;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    Shared(Body b, int64_t count) : body(std::move(b)), n(count) {}
    void Work() {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        body(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto shared = std::make_shared<Shared>(std::move(body), n);
  for (int64_t h = 1; h < Workers(pool, n); ++h) pool.Schedule([shared] { shared->Work(); });
  shared->Work();
  // Every item was claimed; wait for the ones still being computed by helpers.
  while (shared->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace specjax

#endif  // SPECJAX_KERNELS_PARALLEL_FOR_H_
