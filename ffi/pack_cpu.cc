// XLA FFI adapter of the CPU packing kernel (kernels/pack.h): validate, then run on XLA's
// intra-op thread pool.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "ffi/common.h"
#include "ffi/handlers.h"
#include "ffi/thread_pool.h"
#include "kernels/pack.h"

namespace ffi = xla::ffi;

namespace {

// The PackStats values the stats result holds, in their declaration order.
constexpr int64_t kStats = 5;

// Operands: the gradients of `parts` leaves, then (with `residual` = 1) their residuals, each
// float32 of any shape (the residual shaped like its gradient).
ffi::ErrorOr<std::vector<jaxcomp::PackPart>> DecodeParts(const ffi::RemainingArgs& args, int64_t residual) {
  const int64_t operands = static_cast<int64_t>(args.size());
  const int64_t parts = residual ? operands / 2 : operands;
  if (parts < 1 || (residual && operands % 2 != 0)) {
    return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(
        "pack needs at least one gradient" + std::string(residual ? " and one residual per gradient" : "") +
        ", got " + std::to_string(operands) + " operands"));
  }
  std::vector<jaxcomp::PackPart> out(parts);
  for (int64_t i = 0; i < parts; ++i) {
    auto grad = args.get<ffi::Buffer<ffi::F32>>(i);
    if (grad.has_error()) return ffi::Unexpected<ffi::Error>(grad.error());
    out[i].grad = grad.value().typed_data();
    out[i].size = static_cast<int64_t>(grad.value().element_count());
    if (!residual) continue;
    auto res = args.get<ffi::Buffer<ffi::F32>>(parts + i);
    if (res.has_error()) return ffi::Unexpected<ffi::Error>(res.error());
    if (static_cast<int64_t>(res.value().element_count()) != out[i].size) {
      return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(
          "residual " + std::to_string(i) + " must have its gradient's " + std::to_string(out[i].size) +
          " values, got " + std::to_string(res.value().element_count())));
    }
    out[i].residual = res.value().typed_data();
  }
  return out;
}

ffi::Error Pack(ffi::ThreadPool pool, ffi::RemainingArgs args, int64_t residual, float energy_scale,
                ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> stats) {
  if (ffi::Error e = jaxcomp_ffi::CheckRange(residual, 0, 1, "residual"); e.failure()) return e;
  if (!std::isfinite(energy_scale) || !(energy_scale > 0)) {
    return ffi::Error::InvalidArgument("energy_scale must be finite and > 0, got " + std::to_string(energy_scale));
  }
  auto parts = DecodeParts(args, residual);
  if (parts.has_error()) return parts.error();
  int64_t n = 0;
  for (const auto& p : parts.value()) n += p.size;
  if (static_cast<int64_t>(out->element_count()) != n || out->dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("out (the result) must be 1-D with the " + std::to_string(n) +
                                       " values of the gradients, got " + std::to_string(out->element_count()));
  }
  if (stats->element_count() != kStats) {
    return ffi::Error::InvalidArgument("stats (the result) must hold " + std::to_string(kStats) + " values");
  }
  const auto& p = parts.value();
  jaxcomp::PackStats s;
  ffi::Error e = jaxcomp_ffi::ToError(jaxcomp::pack_error_fed(p.data(), static_cast<int64_t>(p.size()), energy_scale,
                                                              out->typed_data(), &s, jaxcomp_ffi::PoolParallel(pool)));
  if (e.failure()) return e;
  const double values[kStats] = {s.nonfinite, s.gradient, s.fed, s.fed_scaled, s.fed_nonfinite};
  for (int64_t i = 0; i < kStats; ++i) stats->typed_data()[i] = static_cast<float>(values[i]);
  return e;
}

ffi::Error Energies(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, float energy_scale,
                    ffi::ResultBuffer<ffi::F32> stats) {
  if (!std::isfinite(energy_scale) || !(energy_scale > 0)) {
    return ffi::Error::InvalidArgument("energy_scale must be finite and > 0, got " + std::to_string(energy_scale));
  }
  if (stats->element_count() != 3) return ffi::Error::InvalidArgument("stats (the result) must hold 3 values");
  jaxcomp::PackStats s;
  ffi::Error e = jaxcomp_ffi::ToError(jaxcomp::vector_energies(
      x.typed_data(), static_cast<int64_t>(x.element_count()), energy_scale, &s, jaxcomp_ffi::PoolParallel(pool)));
  if (e.failure()) return e;
  const double values[3] = {s.fed, s.fed_scaled, s.fed_nonfinite};
  for (int i = 0; i < 3; ++i) stats->typed_data()[i] = static_cast<float>(values[i]);
  return e;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompEnergiesCpu, Energies,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // pool: XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x: any shape
                                  .Attr<float>("energy_scale")     // the scaled sum's factor
                                  .Ret<ffi::Buffer<ffi::F32>>());  // stats: sum x^2, scaled, non-finite

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompPackCpu, Pack,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // pool: XLA's intra-op threads
                                  .RemainingArgs()                 // the gradients, then their residuals
                                  .Attr<int64_t>("residual")       // 1: residuals follow the gradients
                                  .Attr<float>("energy_scale")     // PackStats::fed_scaled's factor
                                  .Ret<ffi::Buffer<ffi::F32>>()    // out: the flat error-fed vector
                                  .Ret<ffi::Buffer<ffi::F32>>());  // stats: kernels/pack.h's PackStats, in order
