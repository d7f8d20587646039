// Host stand-in for the CUDA runtime, so that kernels/*.cu compile as plain C++ and their kernels
// run on the host (ci/cuda_host.sh, tests/native/cuda_host_test.cc). Not a simulator of timing
// or of the memory model: it runs every thread of every block of a launch as a fiber on one OS
// thread and checks what the CUDA programming model guarantees and nothing more:
//
// * blocks run one at a time, in a shuffled order (no kernel may depend on block order);
// * the threads of a block run until they reach a barrier, in a freshly shuffled order after
//   every barrier, so a read that misses its barrier sees a stale value in some order;
// * __syncthreads() waits for every thread of the block that has not exited; warp collectives
//   (__syncwarp, __shfl_xor_sync, __reduce_add_sync, __ballot_sync, full mask only) for all 32 lanes of the
//   warp. A lane that exits or waits at another barrier while its warp is in a collective, or a
//   barrier some threads never reach, is reported as divergence and fails the run;
// * __shared__ variables are one static copy per kernel: a block sees the previous block's
//   leftovers, never zeros it did not write;
// * atomics are real atomics; cudaMemsetAsync is memset; launches run synchronously.
//
// Built only with JAXCOMP_CUDA_HOST_EMULATION (kernels/cuda_launch.h then takes launch() from
// here). Each launch fails (returns an error) for grids the hardware rejects.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __shared__ static
#define __constant__

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint32_t max(uint32_t a, uint32_t b) { return a > b ? a : b; }

enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9 };
using cudaStream_t = struct CUstream_st*;

inline const char* cudaGetErrorName(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
  }
  return "cudaErrorUnknown";
}
inline const char* cudaGetErrorString(cudaError_t err) { return cudaGetErrorName(err); }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
// A small GPU: kernels that size persistent grids by it loop over many items per block here.
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
constexpr int kEmulatedMultiprocessors = 2;
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
  if (attribute != cudaDevAttrMultiProcessorCount || device != 0) return cudaErrorInvalidValue;
  *value = kEmulatedMultiprocessors;
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t) {
  std::memset(ptr, value, bytes);
  return cudaSuccess;
}

// Switching fibers: saves the callee-saved registers on the current stack, stores its pointer in
// *save and continues on the stack `load` (as left by a previous switch or by new_stack). Plain
// register moves: ucontext's swapcontext makes a system call per switch, ten times slower here.
extern "C" void cuda_host_switch(void** save, void* load);

#if defined(CUDA_HOST_MAIN)  // defined by the one translation unit that holds main()
#if !defined(__x86_64__)
#error "tests/native/cuda_host runs on x86-64 only (its fiber switch is x86-64 assembly)"
#endif
asm(R"(
  .text
  .globl cuda_host_switch
  .type cuda_host_switch, @function
cuda_host_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuda_host_switch, .-cuda_host_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");
#endif

namespace cuda_host {

constexpr int kWarp = 32;
constexpr size_t kStackBytes = size_t{64} << 10;

enum class State { kReady, kBlockBarrier, kWarpBarrier, kDone };

struct Thread {
  void* stack_pointer = nullptr;
  State state = State::kReady;
  unsigned index = 0;
  uint64_t deposit = 0;  // this lane's operand of the warp collective it waits in
};

// The emulator's state: one launch at a time, on the calling OS thread.
struct Machine {
  std::vector<Thread> threads;
  std::vector<std::unique_ptr<char[]>> stacks;
  std::vector<uint64_t> released;  // per lane: the operands of the warp collective last released
  void* scheduler = nullptr;
  Thread* current = nullptr;
  uint3 block_index{0, 0, 0};
  dim3 grid_dim, block_dim;
  const std::function<void()>* body = nullptr;
  std::mt19937_64 rng{0x5eed};
  const char* failure = nullptr;  // set when the kernel broke the programming model
  unsigned long long launches = 0, blocks = 0, barriers = 0;
};

inline Machine& machine() {
  static Machine m;
  return m;
}

// Seeds the block and thread orders (the test driver varies it between runs).
inline void seed(uint64_t value) { machine().rng.seed(value); }

inline uint3 current_thread_index() { return {machine().current->index, 0, 0}; }

inline void yield(State state) {
  Machine& m = machine();
  m.current->state = state;
  cuda_host_switch(&m.current->stack_pointer, m.scheduler);
}

[[noreturn]] inline void thread_entry() {
  Machine& m = machine();
  (*m.body)();
  m.current->state = State::kDone;
  cuda_host_switch(&m.current->stack_pointer, m.scheduler);  // never resumed
  __builtin_unreachable();
}

// A fresh fiber stack whose first switch "returns" into thread_entry: six zero registers for
// cuda_host_switch to pop, then thread_entry's address, then a null return address, with the
// stack aligned as the ABI wants at a function's entry.
inline void* new_stack(char* base, size_t bytes) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(base) + bytes) & ~uintptr_t{15};
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;
  *--sp = reinterpret_cast<void*>(&thread_entry);
  for (int i = 0; i < 6; ++i) *--sp = nullptr;
  return sp;
}

// A warp collective: every lane deposits `value` and waits for the whole warp; returns the
// lanes' deposits (released[lane]) once all 32 have arrived.
inline const uint64_t* warp_collective(unsigned mask, uint64_t value) {
  Machine& m = machine();
  if (mask != 0xFFFFFFFFu) {
    m.failure = "a warp collective with a partial mask (the emulator supports full warps only)";
  }
  m.current->deposit = value;
  yield(State::kWarpBarrier);
  return m.released.data() + (m.current->index / kWarp) * kWarp;
}

// Runs one block to completion; false (with machine().failure set) on divergence.
inline bool run_block(unsigned threads) {
  Machine& m = machine();
  for (unsigned t = 0; t < threads; ++t) {
    Thread& th = m.threads[t];
    th.state = State::kReady;
    th.index = t;
    th.stack_pointer = new_stack(m.stacks[t].get(), kStackBytes);
  }
  std::vector<unsigned> order(threads);
  for (unsigned t = 0; t < threads; ++t) order[t] = t;
  const unsigned warps = (threads + kWarp - 1) / kWarp;
  for (;;) {
    std::shuffle(order.begin(), order.end(), m.rng);
    for (unsigned t : order) {
      Thread& th = m.threads[t];
      if (th.state != State::kReady) continue;
      m.current = &th;
      cuda_host_switch(&m.scheduler, th.stack_pointer);
      if (m.failure) return false;
    }
    // Everyone is done or waiting: release what can be released.
    bool released = false, block_waiting = false, all_block = true, any_live = false;
    for (unsigned w = 0; w < warps; ++w) {
      const unsigned first = w * kWarp, last = std::min(threads, first + kWarp);
      unsigned waiting = 0, done = 0;
      for (unsigned t = first; t < last; ++t) {
        waiting += m.threads[t].state == State::kWarpBarrier;
        done += m.threads[t].state == State::kDone;
      }
      if (waiting == 0) continue;
      if (waiting != last - first) {
        m.failure = done ? "a warp collective that some lanes of the warp never reach (they exited)"
                         : "a warp collective that some lanes of the warp never reach (they wait at __syncthreads)";
        return false;
      }
      for (unsigned t = first; t < last; ++t) {
        m.released[t] = m.threads[t].deposit;
        m.threads[t].state = State::kReady;
      }
      released = true;
    }
    if (released) continue;
    for (unsigned t = 0; t < threads; ++t) {
      const State s = m.threads[t].state;
      if (s == State::kDone) continue;
      any_live = true;
      block_waiting |= s == State::kBlockBarrier;
      all_block &= s == State::kBlockBarrier;
    }
    if (!any_live) return true;
    if (!all_block || !block_waiting) {
      m.failure = "a deadlock: threads wait at barriers that others never reach";
      return false;
    }
    ++m.barriers;
    for (unsigned t = 0; t < threads; ++t) {
      if (m.threads[t].state == State::kBlockBarrier) m.threads[t].state = State::kReady;
    }
  }
}

// kernel<<<grid, threads, 0, stream>>>(args...), run now over the whole grid. A kernel that
// breaks the programming model stops the test program with a message.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), unsigned grid, unsigned threads, cudaStream_t, Args&&... args) {
  if (grid == 0 || grid > 0x7FFFFFFFu || threads == 0 || threads > 1024) return cudaErrorInvalidConfiguration;
  Machine& m = machine();
  const std::function<void()> body = [&] { kernel(args...); };
  m.body = &body;
  m.grid_dim = dim3{grid, 1, 1};
  m.block_dim = dim3{threads, 1, 1};
  if (m.threads.size() < threads) {
    m.threads.resize(threads);
    m.released.resize(threads);
    while (m.stacks.size() < threads) m.stacks.emplace_back(new char[kStackBytes]);
  }
  std::vector<unsigned> blocks(grid);
  for (unsigned b = 0; b < grid; ++b) blocks[b] = b;
  std::shuffle(blocks.begin(), blocks.end(), m.rng);
  for (unsigned b : blocks) {
    m.block_index = uint3{b, 0, 0};
    if (!run_block(threads)) {
      std::fprintf(stderr, "cuda_host: block %u of a %u x %u launch: %s\n", b, grid, threads, m.failure);
      std::exit(2);
    }
    ++m.blocks;
  }
  ++m.launches;
  return cudaSuccess;
}

}  // namespace cuda_host

#define threadIdx (::cuda_host::current_thread_index())
#define blockIdx (::cuda_host::machine().block_index)
#define blockDim (::cuda_host::machine().block_dim)
#define gridDim (::cuda_host::machine().grid_dim)

inline void __syncthreads() { ::cuda_host::yield(::cuda_host::State::kBlockBarrier); }
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu) { ::cuda_host::warp_collective(mask, 0); }
inline uint32_t __reduce_add_sync(unsigned mask, uint32_t value) {
  const uint64_t* lanes = ::cuda_host::warp_collective(mask, value);
  uint32_t sum = 0;
  for (int lane = 0; lane < ::cuda_host::kWarp; ++lane) sum += static_cast<uint32_t>(lanes[lane]);
  return sum;
}
inline uint32_t __ballot_sync(unsigned mask, bool predicate) {
  const uint64_t* lanes = ::cuda_host::warp_collective(mask, predicate ? 1 : 0);
  uint32_t bits = 0;
  for (int lane = 0; lane < ::cuda_host::kWarp; ++lane) bits |= static_cast<uint32_t>(lanes[lane] != 0) << lane;
  return bits;
}
inline uint32_t __shfl_xor_sync(unsigned mask, uint32_t value, int lane_mask) {
  const uint64_t* lanes = ::cuda_host::warp_collective(mask, value);
  return static_cast<uint32_t>(lanes[(threadIdx.x % ::cuda_host::kWarp) ^ static_cast<unsigned>(lane_mask)]);
}

template <typename T>
inline T atomicAdd(T* address, T value) {
  return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
}
inline uint32_t atomicOr(uint32_t* address, uint32_t value) {
  return __atomic_fetch_or(address, value, __ATOMIC_RELAXED);
}
inline uint32_t atomicMax(uint32_t* address, uint32_t value) {
  uint32_t seen = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (seen < value && !__atomic_compare_exchange_n(address, &seen, value, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return seen;
}
