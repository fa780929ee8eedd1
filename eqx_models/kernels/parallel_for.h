// Runs `task(i)` for i in [0, count) on the calling thread and XLA's intra-op pool.
//
// Tasks are handed out from a shared counter. The calling thread takes tasks too,
// so the call finishes even if no pool thread ever starts a helper; a helper that
// starts late finds the counter exhausted and touches only the shared,
// reference-counted counters, never the caller's buffers (which `task` captures).

#ifndef EQX_MODELS_KERNELS_PARALLEL_FOR_H_
#define EQX_MODELS_KERNELS_PARALLEL_FOR_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace eqx_models {

template <typename Task>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t count, const Task& task) {
  struct Counters {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> finished{0};
    std::function<void(int64_t)> task;
  };
  auto shared = std::make_shared<Counters>();
  shared->task = std::cref(task);
  auto drain = [](const std::shared_ptr<Counters>& c, int64_t count) {
    for (int64_t i = c->next.fetch_add(1, std::memory_order_relaxed); i < count;
         i = c->next.fetch_add(1, std::memory_order_relaxed)) {
      c->task(i);
      c->finished.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = pool.num_threads() - 1;
  for (int64_t h = 0; h < helpers && h + 1 < count; ++h) pool.Schedule([shared, count, drain] { drain(shared, count); });
  drain(shared, count);
  while (shared->finished.load(std::memory_order_acquire) < count) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

}  // namespace eqx_models

#endif  // EQX_MODELS_KERNELS_PARALLEL_FOR_H_
