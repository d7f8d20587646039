// Runs a kernel's tasks on XLA's CPU thread pool (the ffi::ThreadPool execution context).
//
// The calling thread takes part: every thread, the caller included, claims tasks from a shared
// counter until none are left, and the caller only waits for tasks already *claimed*. That
// matters when XLA runs several handlers at once (8 virtual devices inside one shard_map):
// if every pool thread is busy in a handler, tasks scheduled behind them never start, and a
// handler that waited for them would deadlock. Closures that start late find the counter
// exhausted and return at once; they share ownership of the state, so it outlives the handler.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>

#include "kernels/parallel.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomp_ffi {

inline jaxcomp::Parallel PoolParallel(xla::ffi::ThreadPool pool) {
  jaxcomp::Parallel parallel;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  parallel.concurrency = threads;
  parallel.run = [pool, threads](int64_t num_tasks, const jaxcomp::Task& task) mutable {
    if (num_tasks <= 0) return;
    if (num_tasks == 1 || threads <= 1) {
      for (int64_t i = 0; i < num_tasks; ++i) task(i);
      return;
    }
    struct State {
      std::atomic<int64_t> next{0};
      std::atomic<int64_t> finished{0};
      int64_t total = 0;
      const jaxcomp::Task* task = nullptr;  // valid while some task index is still unclaimed
      std::mutex mu;
      std::condition_variable cv;
    };
    auto state = std::make_shared<State>();
    state->total = num_tasks;
    state->task = &task;
    auto work = [](State& s) {
      for (int64_t i; (i = s.next.fetch_add(1)) < s.total;) {
        (*s.task)(i);
        if (s.finished.fetch_add(1) + 1 == s.total) {
          std::lock_guard<std::mutex> lock(s.mu);
          s.cv.notify_all();
        }
      }
    };
    const int64_t helpers = std::min<int64_t>(threads, num_tasks) - 1;
    for (int64_t h = 0; h < helpers; ++h) pool.Schedule([state, work] { work(*state); });
    work(*state);
    std::unique_lock<std::mutex> lock(state->mu);
    state->cv.wait(lock, [&] { return state->finished.load() == state->total; });
  };
  return parallel;
}

}  // namespace jaxcomp_ffi
