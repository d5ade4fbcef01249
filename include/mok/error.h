// Error type and can_implement-style status of the mok API.
//
// Every check in mok returns (or throws) a message that names the argument, the value it had,
// and what would have been valid, e.g.
//   "forward: argument `w_gate` has shape [8, 128, 256]; expected [E_loc=8, I=128, H=512]".
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace mok {

enum class ErrorCode {
  kOk = 0,
  kInvalidArgument,  // a value the caller passed is wrong (shape, dtype, range, pointer)
  kUnsupported,      // valid in principle, not implemented by this build (e.g. FP8 today)
  kOutOfMemory,      // host or device allocation failed, or the problem cannot fit
  kCudaError,        // a CUDA runtime call failed
  kDeviceFault,      // the GPU reported bad input data at a synchronization point
  kTimeout,          // a device-side wait timed out (see wait_until)
  kInternal,         // a bug in mok
  kCommError,        // an NCCL call failed (the message names the call and NCCL's reason)
};

const char* error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

// The result of a check: ok, or a code and a message. Cheap to pass around; `throw_if_error`
// turns it into an Error for callers that prefer exceptions.
struct Status {
  ErrorCode code = ErrorCode::kOk;
  std::string message;

  static Status Ok() { return {}; }
  static Status invalid(std::string msg) { return {ErrorCode::kInvalidArgument, std::move(msg)}; }
  static Status unsupported(std::string msg) { return {ErrorCode::kUnsupported, std::move(msg)}; }

  bool ok() const { return code == ErrorCode::kOk; }
  explicit operator bool() const { return ok(); }
  void throw_if_error() const {
    if (!ok()) throw Error(code, message);
  }
};

// Returns early from the enclosing function with `status` when it is not ok.
#define MOK_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::mok::Status mok_status_ = (expr);        \
    if (!mok_status_.ok()) return mok_status_; \
  } while (0)

}  // namespace mok
