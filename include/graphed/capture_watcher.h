#pragma once

/// \file capture_watcher.h
/// Names the operation that broke a capture. CUDA only reports "operation not
/// permitted when stream is capturing"; the watcher observes every ATen
/// operator run during capture (a RecordFunction observer) and remembers the
/// innermost one that raised, or after which the capture became invalid,
/// together with its inputs and the user's source line.

#include "graphed/source_location.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace graphed {

/// The operation that was running when a capture broke.
struct CaptureCulprit {
  /// The operator's name, e.g. "aten::_local_scalar_dense".
  std::string op;
  /// The operators that called it, innermost first, e.g. {"aten::item"}.
  std::vector<std::string> callers;
  /// Its tensor inputs, e.g. "(1,) float32 cuda:0".
  std::string inputs;
  /// The host program's stack when it ran, innermost first.
  std::vector<SourceFrame> stack;
  /// True when the operator raised; false when it returned but left the
  /// capture invalidated.
  bool raised = false;
};

/// Observes ATen operators while a capture is under way on one stream.
/// Construct it just before capture begins; destroy it after capture ends.
/// One watcher is active at a time: a nested watcher is inert.
class CaptureWatcher {
 public:
  /// Starts observing operators for the capture on `capture_stream`.
  explicit CaptureWatcher(cudaStream_t capture_stream);
  /// Stops observing.
  ~CaptureWatcher();
  CaptureWatcher(const CaptureWatcher&) = delete;
  CaptureWatcher& operator=(const CaptureWatcher&) = delete;
  CaptureWatcher(CaptureWatcher&&) = delete;
  CaptureWatcher& operator=(CaptureWatcher&&) = delete;

  /// The operation that broke the capture, if an operator did.
  std::optional<CaptureCulprit> culprit() const;
  /// The last operator that finished while the capture was still valid.
  std::string last_good_operator() const;

  /// True once an operation has been blamed.
  bool has_culprit() const;
  /// Records `culprit` unless an operation was blamed already (the first,
  /// innermost one wins).
  void blame(CaptureCulprit culprit);
  /// Records that `op` finished with the capture still valid.
  void note_good_operator(std::string_view op);
  /// True when CUDA reports the capture on the watched stream as invalidated.
  bool capture_invalidated() const;

 private:
  cudaStream_t capture_stream_;
  bool active_ = false;
  uint64_t callback_handle_ = 0;
  mutable std::mutex mutex_;
  std::optional<CaptureCulprit> culprit_;
  std::string last_good_operator_;
};

/// Composes the message of a failed capture.
/// \param what            what was being captured, e.g. "function `forward`"
/// \param culprit         the operation the watcher blamed, if any
/// \param last_good_op    the last operator that finished before the failure
/// \param underlying      the error that CUDA or torch reported
/// \param exception_stack the host stack of the exception, innermost first
std::string explain_capture_failure(std::string_view what,
                                    const std::optional<CaptureCulprit>& culprit,
                                    std::string_view last_good_op, std::string_view underlying,
                                    const std::vector<SourceFrame>& exception_stack);

}  // namespace graphed
