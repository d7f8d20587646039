// AllocateScratch (ffi/cuda_common.h), the CUDA adapters' scratch helper, against a stand-in of
// XLA's FFI device-memory API that keeps XLA's rule: an alignment must be a power of two of at
// most 16 bytes (kMaxAlignment in xla/ffi/ffi_api.cc), or the allocation fails. The helper once
// asked for 256, so on an H200 (jax 0.11.2) every CUDA top-k call failed with "could not
// allocate N bytes of GPU scratch memory". Plain C++ over XLA's FFI headers: no GPU, no CUDA.
//
//   g++ -std=c++17 -I. -isystem "$(python -c 'import jax.ffi; print(jax.ffi.include_dir())')"
//       tests/native/cuda_scratch_test.cc -o cuda_scratch_test && ./cuda_scratch_test
// (ci/compile_cuda.sh runs it.)
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>

#include "ffi/cuda_common.h"
#include "xla/ffi/api/ffi.h"

namespace {

namespace ffi = xla::ffi;

constexpr size_t kXlaMaxAlignment = 16;
constexpr size_t kKernelAlignment = 256;  // what the kernels carve their scratch at

struct FakeError {
  std::string message;
};

struct Block {
  void* raw;
  size_t size;
};

std::map<void*, Block> live;  // handed-out address -> its block
int allocations = 0;
bool fail_next = false;
int failures = 0;

void Check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
    ++failures;
  }
}

XLA_FFI_Error* Allocate(XLA_FFI_DeviceMemory_Allocate_Args* args) {
  const size_t alignment = args->alignment;
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > kXlaMaxAlignment) {
    return reinterpret_cast<XLA_FFI_Error*>(
        new FakeError{"Unsupported alignment: " + std::to_string(alignment)});
  }
  if (fail_next) {
    fail_next = false;
    return reinterpret_cast<XLA_FFI_Error*>(new FakeError{"out of memory"});
  }
  ++allocations;
  // Memory that meets the alignment asked for and no more: 16-aligned, never 256-aligned, so a
  // helper that relies on the allocator's own alignment fails the checks below.
  void* raw = std::aligned_alloc(256, (args->size + 511) / 256 * 256 + 256);
  void* data = static_cast<char*>(raw) + 16 * (1 + allocations % 15);
  live[data] = Block{raw, args->size};
  args->data = data;
  return nullptr;
}

XLA_FFI_Error* Free(XLA_FFI_DeviceMemory_Free_Args* args) {
  auto it = live.find(args->data);
  Check(it != live.end(), "Free of an address that Allocate did not hand out");
  if (it != live.end()) {
    Check(it->second.size == args->size, "Free with another size than allocated");
    std::free(it->second.raw);
    live.erase(it);
  }
  return nullptr;
}

void GetMessage(XLA_FFI_Error_GetMessage_Args* args) {
  args->message = reinterpret_cast<FakeError*>(args->error)->message.c_str();
}

void Destroy(XLA_FFI_Error_Destroy_Args* args) { delete reinterpret_cast<FakeError*>(args->error); }

XLA_FFI_Api FakeApi() {
  XLA_FFI_Api api{};
  api.struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api.XLA_FFI_DeviceMemory_Allocate = Allocate;
  api.XLA_FFI_DeviceMemory_Free = Free;
  api.XLA_FFI_Error_GetMessage = GetMessage;
  api.XLA_FFI_Error_Destroy = Destroy;
  return api;
}

// One AllocateScratch of `bytes` in its own ScratchAllocator (freed at the end of the scope).
void CheckOneAllocation(const XLA_FFI_Api& api, size_t bytes) {
  ffi::DiagnosticEngine diagnostic;
  std::optional<ffi::ScratchAllocator> scratch =
      ffi::CtxDecoding<ffi::ScratchAllocator>::Decode(&api, nullptr, diagnostic);
  ffi::ErrorOr<void*> memory = jaxcomp_ffi::AllocateScratch(*scratch, bytes);
  const std::string what = std::to_string(bytes) + " bytes";
  Check(memory.has_value(), what + ": AllocateScratch failed");
  if (!memory.has_value()) return;
  const auto address = reinterpret_cast<uintptr_t>(memory.value());
  Check(address % kKernelAlignment == 0, what + ": not 256-byte aligned");
  // Inside one block that XLA handed out.
  bool inside = false;
  for (const auto& [data, block] : live) {
    const auto start = reinterpret_cast<uintptr_t>(data);
    inside |= address >= start && address + bytes <= start + block.size;
  }
  Check(inside, what + ": the aligned range leaves the allocation");
}

}  // namespace

int main() {
  const XLA_FFI_Api api = FakeApi();
  for (size_t bytes : {size_t{1}, size_t{255}, size_t{256}, size_t{13312}, size_t{24832},
                       size_t{5261568}}) {
    CheckOneAllocation(api, bytes);
  }
  Check(live.empty(), "scratch not freed when its ScratchAllocator went away");
  // A failed allocation comes back as an ffi::Error, not an abort.
  {
    ffi::DiagnosticEngine diagnostic;
    std::optional<ffi::ScratchAllocator> scratch =
        ffi::CtxDecoding<ffi::ScratchAllocator>::Decode(&api, nullptr, diagnostic);
    fail_next = true;
    ffi::ErrorOr<void*> memory = jaxcomp_ffi::AllocateScratch(*scratch, 1000);
    Check(!memory.has_value(), "a failed allocation returned memory");
    if (!memory.has_value()) {
      Check(memory.error().errc() == ffi::ErrorCode::kResourceExhausted, "error code");
      Check(memory.error().message().find("1000 bytes of GPU scratch") != std::string::npos,
            "error message: " + memory.error().message());
    }
  }
  if (failures == 0) {
    std::printf("cuda_scratch_test: AllocateScratch keeps XLA's alignment rule: OK\n");
  }
  return failures == 0 ? 0 : 1;
}
