#include "graphed/capture_watcher.h"

#include "graphed/capture_blockers.h"
#include "graphed/check.h"
#include "graphed/signature.h"

#include <ATen/record_function.h>

#include <atomic>
#include <exception>
#include <sstream>

namespace graphed {
namespace {

// The watcher observing the current capture. RecordFunction callbacks are
// plain function pointers, so the observer finds its watcher here. A global
// rather than thread-local pointer: the callbacks are registered thread-local,
// and torch carries them into autograd's worker threads, which must reach the
// same watcher.
std::atomic<CaptureWatcher*> active_watcher{nullptr};

// Names of the operators running on this thread, outermost first.
thread_local std::vector<std::string> running_operators;

std::unique_ptr<at::ObserverContext> on_operator_start(const at::RecordFunction& fn) {
  running_operators.emplace_back(fn.name());
  return nullptr;
}

std::string describe_inputs(const at::RecordFunction& fn) {
  std::ostringstream out;
  bool first = true;
  for (const c10::IValue& input : fn.inputs()) {
    if (input.isTensor()) {
      out << (first ? "" : ", ") << describe_tensor(input.toTensor());
      first = false;
    }
  }
  return out.str();
}

void on_operator_end(const at::RecordFunction& fn, at::ObserverContext* /*unused*/) {
  if (!running_operators.empty()) {
    running_operators.pop_back();
  }
  CaptureWatcher* watcher = active_watcher.load(std::memory_order_acquire);
  if (watcher == nullptr || watcher->has_culprit()) {
    return;
  }
  // An operator that raised ends while its exception unwinds the stack.
  const bool raised = std::uncaught_exceptions() > 0;
  if (!raised && !watcher->capture_invalidated()) {
    watcher->note_good_operator(fn.name());
    return;
  }
  CaptureCulprit culprit;
  culprit.op = fn.name();
  culprit.callers.assign(running_operators.rbegin(), running_operators.rend());
  culprit.inputs = describe_inputs(fn);
  culprit.raised = raised;
  try {
    culprit.stack = current_source_stack();
  } catch (...) {
    // A locator that fails leaves the message without a source line.
  }
  watcher->blame(std::move(culprit));
}

std::string first_line(std::string_view text) {
  const size_t end = text.find('\n');
  return std::string(text.substr(0, end));
}

// The blocker kind that explains `culprit`: its own name, an enclosing
// operator's name (x[mask] fails inside aten::nonzero, called by aten::index),
// or what it did to its inputs.
BlockerKind classify(const CaptureCulprit& culprit, std::string_view underlying) {
  if (auto kind = blocker_kind_of_operator(culprit.op)) {
    return *kind;
  }
  for (const std::string& caller : culprit.callers) {
    if (auto kind = blocker_kind_of_operator(caller)) {
      return *kind;
    }
  }
  const bool is_copy = culprit.op == "aten::copy_" || culprit.op == "aten::_to_copy" ||
                       culprit.op == "aten::to" || culprit.op == "aten::_copy_from";
  if (is_copy && culprit.inputs.find("cpu") != std::string::npos) {
    return BlockerKind::kHostDeviceCopy;
  }
  if (underlying.find("enerator") != std::string_view::npos) {
    return BlockerKind::kUnregisteredGenerator;
  }
  return BlockerKind::kOther;
}

}  // namespace

CaptureWatcher::CaptureWatcher(cudaStream_t capture_stream) : capture_stream_(capture_stream) {
  CaptureWatcher* expected = nullptr;
  if (!active_watcher.compare_exchange_strong(expected, this)) {
    return;  // A capture inside a capture: the outer watcher keeps watching.
  }
  active_ = true;
  running_operators.clear();
  callback_handle_ = at::addThreadLocalCallback(
      at::RecordFunctionCallback(on_operator_start, on_operator_end)
          .needsInputs(true)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION,
                   at::RecordScope::USER_SCOPE}));
}

CaptureWatcher::~CaptureWatcher() {
  if (!active_) {
    return;
  }
  at::removeCallback(callback_handle_);
  running_operators.clear();
  active_watcher.store(nullptr, std::memory_order_release);
}

std::optional<CaptureCulprit> CaptureWatcher::culprit() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return culprit_;
}

std::string CaptureWatcher::last_good_operator() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_good_operator_;
}

bool CaptureWatcher::has_culprit() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return culprit_.has_value();
}

void CaptureWatcher::blame(CaptureCulprit culprit) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!culprit_) {
    culprit_ = std::move(culprit);
  }
}

void CaptureWatcher::note_good_operator(std::string_view op) {
  std::lock_guard<std::mutex> lock(mutex_);
  last_good_operator_.assign(op);
}

bool CaptureWatcher::capture_invalidated() const {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(capture_stream_, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return status == cudaStreamCaptureStatusInvalidated;
}

std::string explain_capture_failure(std::string_view what,
                                    const std::optional<CaptureCulprit>& culprit,
                                    std::string_view last_good_op, std::string_view underlying,
                                    const std::vector<SourceFrame>& exception_stack) {
  std::ostringstream out;
  BlockerKind kind = BlockerKind::kOther;
  out << "Capturing " << what << " into a CUDA graph failed ";
  if (culprit) {
    kind = classify(*culprit, underlying);
    out << "at `" << culprit->op << "`";
    if (!culprit->callers.empty()) {
      out << " (inside `" << culprit->callers.front() << "`)";
    }
    if (!culprit->inputs.empty()) {
      out << " on " << culprit->inputs;
    }
    std::string where = describe_user_frame(culprit->stack);
    if (where.empty()) {
      where = describe_user_frame(exception_stack);
    }
    if (!where.empty()) {
      out << ", called at " << where;
    }
    out << ": " << blocker_info(kind).label << ".";
  } else {
    const std::string library_call = describe_library_frame(exception_stack);
    if (!exception_stack.empty() && !exception_stack.front().is_user_code) {
      if (auto host_kind = blocker_kind_of_host_function(exception_stack.front().function)) {
        kind = *host_kind;
      }
    }
    out << "outside any ATen operator";
    if (!library_call.empty()) {
      out << ", in " << library_call;
    }
    const std::string where = describe_user_frame(exception_stack);
    if (!where.empty()) {
      out << ", called at " << where;
    }
    if (!last_good_op.empty()) {
      out << " (the last operator that captured cleanly was `" << last_good_op << "`)";
    }
    out << ": " << blocker_info(kind).label << ".";
  }
  const BlockerInfo& info = blocker_info(kind);
  out << "\nWhy: " << info.why << ".";
  out << "\nFix: " << info.fix << ".";
  if (!underlying.empty()) {
    out << "\nReported error: " << first_line(underlying);
  }
  out << "\nThe graph's memory pool was released and the stream is usable again.";
  return out.str();
}

}  // namespace graphed
