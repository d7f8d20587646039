// How kernels/ ask for parallelism without knowing who provides it.
//
// A kernel splits its work into `num_tasks` independent tasks and calls `run(num_tasks, task)`.
// The XLA adapter (ffi/thread_pool.h) runs them on XLA's intra-op thread pool; unit tests and
// the serial fallback run them in a loop. Tasks must not depend on the order they run in.
#pragma once

#include <cstdint>
#include <functional>

namespace jaxcomp {

using Task = std::function<void(int64_t task_index)>;

struct Parallel {
  // Upper bound on tasks that can usefully run at once (>= 1).
  int64_t concurrency = 1;
  // Runs task(0) ... task(num_tasks - 1), returns when all are done.
  std::function<void(int64_t num_tasks, const Task& task)> run = [](int64_t num_tasks, const Task& task) {
    for (int64_t i = 0; i < num_tasks; ++i) task(i);
  };
};

// [begin, end) of part `part` when `total` items are cut into `parts` nearly equal parts,
// every boundary a multiple of `align` (except the last end, which is `total`).
inline void split_range(int64_t total, int64_t parts, int64_t part, int64_t align, int64_t* begin, int64_t* end) {
  const int64_t units = (total + align - 1) / align;
  const int64_t lo = units * part / parts, hi = units * (part + 1) / parts;
  *begin = lo * align < total ? lo * align : total;
  *end = hi * align < total ? hi * align : total;
}

}  // namespace jaxcomp
