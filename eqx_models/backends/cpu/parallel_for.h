// Runs `task(i)` for i in [0, count) on the calling thread and a few helper threads.
//
// The helpers are this library's own, started once, one per core beyond the
// first. After each job they spin for a short while before sleeping: a decode
// step issues a kernel every few tens of microseconds, and waking a sleeping
// thread (XLA's pool included) costs about as much, which was measured as ~15%
// of the bandwidth of a matrix-vector product. The spin yields the core at every
// check: XLA runs some small fusions between kernels on its own pool, and a helper
// spinning on `pause` kept those threads off the core (~70 us per fusion, 15% of a
// bfloat16 decode step). Tasks are handed out from a shared
// counter and the calling thread takes them too, so a job finishes even when no
// helper gets a core. `parallel_for_on` runs a job on a pool the caller names
// instead (XLA's, for work that lasts milliseconds).

#ifndef EQX_MODELS_KERNELS_PARALLEL_FOR_H_
#define EQX_MODELS_KERNELS_PARALLEL_FOR_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif

namespace eqx_models {

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

class HelperPool {
 public:
  static HelperPool& instance() {
    static HelperPool* pool = new HelperPool();  // never destroyed: helpers outlive exit paths
    return *pool;
  }

  template <typename Task>
  void run(int64_t count, const Task& task) {
    std::lock_guard<std::mutex> one_job_at_a_time(job_mutex_);
    // An odd generation means "being written". Announce it before checking that
    // no helper is inside a job, while helpers register before checking the
    // generation: whichever comes second sees the other (Dekker, seq_cst).
    const uint64_t published = generation_.load() + 2;
    generation_.store(published - 1);
    while (active_.load() > 0) cpu_relax();
    task_ = std::cref(task);
    count_ = count;
    next_.store(0);
    finished_.store(0);
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      generation_.store(published);
    }
    wake_.notify_all();
    drain();
    while (finished_.load(std::memory_order_acquire) < count) cpu_relax();
  }

  // The calling thread and the helpers.
  int threads() const { return threads_; }

 private:
  HelperPool() : threads_(usable_cores()) {
    for (int i = 1; i < threads_; ++i) std::thread([this] { loop(); }).detach();
  }

  // The cores this process may run on (its affinity mask, which containers and
  // `taskset` narrow), or EQX_MODELS_KERNEL_THREADS if set.
  static int usable_cores() {
    if (const char* forced = std::getenv("EQX_MODELS_KERNEL_THREADS")) {
      const int n = std::atoi(forced);
      if (n > 0) return n;
    }
#if defined(__linux__)
    cpu_set_t mask;
    if (sched_getaffinity(0, sizeof(mask), &mask) == 0) return CPU_COUNT(&mask) > 0 ? CPU_COUNT(&mask) : 1;
#endif
    const unsigned cores = std::thread::hardware_concurrency();
    return cores > 0 ? static_cast<int>(cores) : 1;
  }

  void drain() {
    for (int64_t i = next_.fetch_add(1); i < count_; i = next_.fetch_add(1)) {
      task_(i);
      finished_.fetch_add(1, std::memory_order_release);
    }
  }

  void loop() {
    uint64_t seen = 0;
    auto is_new = [&](uint64_t g) { return g != seen && g % 2 == 0; };
    for (;;) {
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
      while (!is_new(generation_.load()) && std::chrono::steady_clock::now() < spin_until)
        std::this_thread::yield();
      if (!is_new(generation_.load())) {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        wake_.wait(lock, [&] { return is_new(generation_.load()); });
      }
      const uint64_t job = generation_.load();
      if (!is_new(job)) continue;
      seen = job;
      active_.fetch_add(1);
      // Still the job we saw? Then its state is complete and stays put until we
      // leave (the next `run` waits for `active_` to drop). If it is already
      // over, the exhausted counter sends us straight back.
      if (generation_.load() == job) drain();
      active_.fetch_sub(1);
    }
  }

  const int threads_;
  std::mutex job_mutex_, sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> next_{0}, finished_{0}, active_{0};
  int64_t count_ = 0;
  std::function<void(int64_t)> task_;
};

// How many threads parallel_for runs a job on.
inline int64_t parallel_threads() { return HelperPool::instance().threads(); }

template <typename Task>
void parallel_for(int64_t count, const Task& task) {
  HelperPool::instance().run(count, task);
}

// Runs `task(i)` for i in [0, count) on the calling thread and on the threads of
// `pool`, a pool with `Schedule(f)` and `num_threads()` (XLA's own, `ffi::ThreadPool`).
// The scheduled closures share the job's counters, not the caller's stack: one that
// starts after the job is over finds no work and touches nothing else.
template <typename Pool, typename Task>
void parallel_for_on(Pool& pool, int64_t count, const Task& task) {
  struct Counters {
    std::atomic<int64_t> next{0}, finished{0};
  };
  auto counters = std::make_shared<Counters>();
  const Task* work = &task;
  auto drain = [counters, work, count] {
    for (int64_t i = counters->next.fetch_add(1); i < count; i = counters->next.fetch_add(1)) {
      (*work)(i);
      counters->finished.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t others = std::min<int64_t>(pool.num_threads(), count) - 1;
  for (int64_t i = 0; i < others; ++i) pool.Schedule(decltype(drain)(drain));
  drain();
  while (counters->finished.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

}  // namespace eqx_models

#endif  // EQX_MODELS_KERNELS_PARALLEL_FOR_H_
