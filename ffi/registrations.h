// The target names of jaxcomp's ops, in one place: both nanobind modules (_jaxcomp_cpu and
// _jaxcomp_cuda) hand XLA their handlers under these names, as PyCapsules.
#pragma once

#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace jaxcomp_ffi {

inline nanobind::dict Registrations(XLA_FFI_Handler* topk, XLA_FFI_Handler* find_threshold,
                                    XLA_FFI_Handler* threshold_topk, XLA_FFI_Handler* zfp_encode,
                                    XLA_FFI_Handler* zfp_decode, XLA_FFI_Handler* sign_pack,
                                    XLA_FFI_Handler* sign_unpack, XLA_FFI_Handler* hadamard = nullptr,
                                    XLA_FFI_Handler* pack = nullptr, XLA_FFI_Handler* sign_unpack_sum = nullptr,
                                    XLA_FFI_Handler* energies = nullptr,
                                    XLA_FFI_Handler* scatter_leaves = nullptr,
                                    XLA_FFI_Handler* split_leaves = nullptr,
                                    XLA_FFI_Handler* merge_indices = nullptr) {
  auto capsule = [](XLA_FFI_Handler* fn) { return nanobind::capsule(reinterpret_cast<void*>(fn)); };
  nanobind::dict targets;
  targets["jaxcomp_topk"] = capsule(topk);
  targets["jaxcomp_find_threshold"] = capsule(find_threshold);
  targets["jaxcomp_threshold_topk"] = capsule(threshold_topk);
  targets["jaxcomp_zfp_encode"] = capsule(zfp_encode);
  targets["jaxcomp_zfp_decode"] = capsule(zfp_decode);
  targets["jaxcomp_sign_pack"] = capsule(sign_pack);
  targets["jaxcomp_sign_unpack"] = capsule(sign_unpack);
  // CPU only: elsewhere jaxcomp.hadamard runs its XLA path (the same butterflies).
  if (hadamard != nullptr) targets["jaxcomp_hadamard"] = capsule(hadamard);
  // CPU only: elsewhere the flat vector is XLA's (jaxcomp.flat.pack_error_fed's XLA path).
  if (pack != nullptr) targets["jaxcomp_pack"] = capsule(pack);
  // CPU only: elsewhere the all-gathered signs are decoded and added row by row in XLA.
  if (sign_unpack_sum != nullptr) targets["jaxcomp_sign_unpack_sum"] = capsule(sign_unpack_sum);
  // CPU only: elsewhere XLA's variadic reduce (jaxcomp.ops.flat.energies' XLA path).
  if (energies != nullptr) targets["jaxcomp_energies"] = capsule(energies);
  // CPU only: elsewhere XLA zeroes a dense vector, scatters into it and slices the leaves out.
  if (scatter_leaves != nullptr) targets["jaxcomp_scatter_leaves"] = capsule(scatter_leaves);
  // CPU only: elsewhere XLA slices each leaf out of the dense vector (fused into its consumers).
  if (split_leaves != nullptr) targets["jaxcomp_split_leaves"] = capsule(split_leaves);
  // CPU only: elsewhere XLA sorts the gathered indices (jaxcomp.ops.topk.merged_indices).
  if (merge_indices != nullptr) targets["jaxcomp_merge_indices"] = capsule(merge_indices);
  return targets;
}

}  // namespace jaxcomp_ffi
