// The one way kernels/ report failure: a code and a message, no exceptions, no XLA headers.
// ffi/common.h maps it to ffi::Error in one place (ToError), so every handler reports a kernel's
// failure the same way; the sanitizer fuzz test (tests/native) reads it directly.
#pragma once

#include <string>
#include <utility>

namespace jaxcomp {

enum class StatusCode {
  kOk,
  kInvalidArgument,    // the caller passed something the kernel cannot run on (names the argument)
  kResourceExhausted,  // scratch or result memory could not be had
  kInternal,           // the device refused the work (a CUDA launch error, with its message)
};

class [[nodiscard]] Status {
 public:
  Status() = default;  // success

  static Status InvalidArgument(std::string message) { return {StatusCode::kInvalidArgument, std::move(message)}; }
  static Status ResourceExhausted(std::string message) {
    return {StatusCode::kResourceExhausted, std::move(message)};
  }
  static Status Internal(std::string message) { return {StatusCode::kInternal, std::move(message)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace jaxcomp
