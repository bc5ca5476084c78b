#pragma once

/// \file check.h
/// The one error-macro family of graphed. Every failure is a `c10::Error`
/// subclass, so LibTorch code can catch `c10::Error` and Python receives a
/// `graphed.GraphedError` (a `RuntimeError`). Messages follow one rule: say what
/// was expected, what was found, and how to fix it.

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <cuda_runtime_api.h>

#include <string>

namespace graphed {

/// A user-facing error raised by graphed: bad arguments, unsupported input,
/// misuse of an object. Python sees it as `graphed.GraphedError`.
class Error : public c10::Error {
 public:
  using c10::Error::Error;
};

/// Capturing a CUDA graph failed. The message names the operation that was
/// running when capture broke, why it breaks capture and how to fix it.
/// Python sees it as `graphed.CaptureError`.
class CaptureError : public Error {
 public:
  using Error::Error;
};

/// A call's inputs do not match the inputs a graph was captured with.
/// Python sees it as `graphed.InputMismatchError` (also a `ValueError`).
class InputMismatchError : public Error {
 public:
  using Error::Error;
};

/// A graphed callable was called out of the order its graphs were captured
/// in, while backward passes of its pool were pending (Note [Replays follow
/// the capture order]). Nothing ran; the call can run eagerly instead.
/// Python sees it as `graphed.GraphedError`.
class ReplayOrderError : public Error {
 public:
  using Error::Error;
};

/// A CUDA runtime call returned an error status.
class CudaError : public Error {
 public:
  using Error::Error;
};

namespace detail {

/// Throws `ErrorType` at `location` with `message`. Out of line of the macros
/// so that the fast path of a check stays one compare and one branch.
template <typename ErrorType>
[[noreturn]] C10_NOINLINE void throw_error(const c10::SourceLocation& location,
                                           std::string message) {
  throw ErrorType(location, std::move(message));
}

/// Builds the message for a failed CUDA call: the call, CUDA's name for the
/// status, CUDA's description, and a hint for the statuses users meet most.
std::string describe_cuda_failure(const char* call, cudaError_t status);

}  // namespace detail
}  // namespace graphed

/// The c10::SourceLocation of the line that expands it (function, file, line).
#define GRAPHED_SOURCE_LOCATION \
  ::c10::SourceLocation { __func__, __FILE__, static_cast<uint32_t>(__LINE__) }

/// Throws `ErrorType` (a graphed::Error subclass) with the message built from
/// the remaining arguments, as c10::str does.
#define GRAPHED_THROW(ErrorType, ...)                                 \
  ::graphed::detail::throw_error<ErrorType>(GRAPHED_SOURCE_LOCATION, \
                                            ::c10::str(__VA_ARGS__))

/// Checks a condition that depends on user input and throws `ErrorType`.
#define GRAPHED_CHECK_AS(ErrorType, cond, ...) \
  do {                                         \
    if (C10_UNLIKELY(!(cond))) {               \
      GRAPHED_THROW(ErrorType, __VA_ARGS__);   \
    }                                          \
  } while (false)

/// Checks a condition that depends on user input; throws graphed::Error.
#define GRAPHED_CHECK(cond, ...) GRAPHED_CHECK_AS(::graphed::Error, cond, __VA_ARGS__)

/// Checks an invariant of graphed itself. A failure is a bug in graphed.
#define GRAPHED_INTERNAL_ASSERT(cond, ...)                                      \
  do {                                                                          \
    if (C10_UNLIKELY(!(cond))) {                                                \
      GRAPHED_THROW(::c10::Error, "Internal error in graphed: `" #cond          \
                    "` does not hold. ", ::c10::str(__VA_ARGS__),               \
                    " This is a bug in graphed; please report it with this message."); \
    }                                                                           \
  } while (false)

/// Checks the status of a CUDA runtime call; throws graphed::CudaError.
#define GRAPHED_CHECK_CUDA(expr)                                                \
  do {                                                                          \
    const cudaError_t graphed_cuda_status_ = (expr);                            \
    if (C10_UNLIKELY(graphed_cuda_status_ != cudaSuccess)) {                    \
      (void)cudaGetLastError(); /* clear the error so later calls are clean */  \
      GRAPHED_THROW(::graphed::CudaError,                                       \
                    ::graphed::detail::describe_cuda_failure(#expr,             \
                                                             graphed_cuda_status_)); \
    }                                                                           \
  } while (false)

/// Checks the status of a CUDA runtime call in code that must not throw
/// (destructors, cleanup after another failure): warns instead.
#define GRAPHED_WARN_CUDA(expr)                                                 \
  do {                                                                          \
    const cudaError_t graphed_cuda_status_ = (expr);                            \
    if (C10_UNLIKELY(graphed_cuda_status_ != cudaSuccess)) {                    \
      (void)cudaGetLastError();                                                 \
      TORCH_WARN(::graphed::detail::describe_cuda_failure(#expr,                \
                                                          graphed_cuda_status_)); \
    }                                                                           \
  } while (false)
