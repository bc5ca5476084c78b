#include "graphed/safety_check.h"

#include "graphed/check.h"
#include "graphed/operator_rules.h"
#include "graphed/signature.h"
#include "graphed/state_snapshot.h"

#include <ATen/record_function.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <sstream>
#include <utility>

namespace graphed {

// Note [How the safety check observes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// check_safety runs the function once, eagerly, under a thread-local
// RecordFunction callback that needs inputs (the CaptureWatcher's approach).
// Every operator reaches the callback before its kernel runs, with all of its
// arguments: tensors (devices, dtypes, shapes), generators, the target device
// of a copy. The callback classifies the operator by the rules of
// classify_operator(). Nothing is captured, so one pass sees every blocker,
// where a real capture stops at the first. Torch carries thread-local
// callbacks into autograd's worker threads, so a function that calls
// backward() is checked there too (without a source line: those threads run
// no Python).
//
// Some blockers never reach the dispatcher: torch.cuda.synchronize,
// Tensor.tolist, a CUDA tensor built from a Python list. The host language
// reports them through record_host_blocker() and
// record_tensor_from_host_data(); the Python adapter wraps those functions
// for the duration of the pass.

// Note [One finding per user call]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// One call in the user's program often runs a chain of operators: `.item()`
// is aten::item calling aten::_local_scalar_dense, `x[mask]` is aten::index
// calling aten::nonzero, `.to("cuda")` is aten::to calling _to_copy and
// copy_. Only the outermost operator that blocks capture is reported, and the
// operators it runs are not inspected; nor are those of a host call already
// recorded (QuietOperatorsGuard). Findings are then counted per (kind,
// operation, source line), so a loop calling `.item()` a hundred times is one
// finding with count 100. The autocast cache is one finding for the whole
// pass: it has one cause (cache_enabled of the autocast region) and one fix.

// Note [Checking on CPU tensors]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A pass on CPU tensors cannot copy between host and device and cannot mix
// CPU tensors into GPU work. What it does see is everything whose effect
// depends on the operation rather than the device: host reads,
// data-dependent shapes, explicit syncs, non-default generators, the autocast
// cache. These are reported as predictions (SafetyFinding::predicted): they
// break capture once the tensors live on the GPU. Explicit moves to the host
// (`.cpu()`, `.to("cpu")` with the device spelled out; reported by the host
// language) are predictions too: device-to-host copies on a GPU, no-ops on
// the CPU. `.to(x.device)` is not reported on the CPU: device-agnostic code
// passes the tensor's own device, which is a no-op on either.
//
// A pass that ran work on a CUDA device sees the real copies and syncs, so
// there the predictions resting on CPU tensors are dropped from the report:
// `.item()` of a CPU step counter, or `.cpu()` of a CPU tensor, costs a
// captured GPU graph nothing.

// Note [Checking the path taken under capture]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Libraries that know about graphs ask torch.cuda.is_current_stream_capturing()
// and take another branch while a stream captures: transformers' attention
// masks skip their `torch.all(mask == 1)` shortcut (a host read) under
// capture. An eager pass would report the branch a capture never takes. So
// while a pass runs, the host language answers that question as a capture
// would (True) for every caller outside torch itself, whose own uses of it
// (an optimizer's capture health check) must see the truth. The check then
// walks the path a capture walks, and what it reports is what a capture meets.

// Note [Capture is the verdict]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The check runs eagerly, so it is a diagnosis, not the ground truth: a
// trial capture is, and graphed's captures are recoverable (a failed one
// changes nothing). capture_verdict() says when the check alone may decide:
//  - Nothing found (harmless findings aside): capture.
//  - A finding that spoils replay: blocked, wherever it is. A capture would
//    succeed, so only the check sees it.
//  - Findings that break capture, all in the user's own code: blocked. They
//    are on the path a capture takes (Note [Checking the path taken under
//    capture]), the capture would fail on the first, and the check's report
//    names every one with its line.
//  - Findings without a source line (autograd's backward threads run no
//    Python; a LibTorch program installs no locator): blocked, as the check
//    cannot say whose code they are in.
//  - Otherwise every finding lies inside installed packages, which the user
//    cannot edit and which may depend on state the eager pass saw
//    differently: try the capture; CUDA refuses what really breaks it, and
//    the caller verifies the result against eager. What the check found and
//    the capture never met is then reported as a false finding.

namespace {

// An operator or autograd node running on this thread.
struct RunningRecord {
  std::string name;
  // An operator (FUNCTION scope) rather than an autograd node.
  bool is_operator = false;
  // Operators running inside this record are not inspected: this record was
  // reported, or runs inside one that was. See Note [One finding per user call].
  bool silences_nested = false;
};

thread_local std::vector<RunningRecord> running_records;
thread_local int quiet_depth = 0;

// Collects the findings of one pass; shared with autograd's worker threads.
class Recorder {
 public:
  void add(SafetyFinding finding) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (SafetyFinding& seen : findings_) {
      if (same_place(seen, finding)) {
        ++seen.count;
        return;
      }
    }
    findings_.push_back(std::move(finding));
  }

  void note_operator() { operators_.fetch_add(1, std::memory_order_relaxed); }
  void note_gpu_work() { ran_on_gpu_.store(true, std::memory_order_relaxed); }

  SafetyReport report(std::string description) {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool ran_on_gpu = ran_on_gpu_.load();
    std::vector<SafetyFinding> kept;
    std::vector<SafetyFinding> harmless;
    for (SafetyFinding& finding : findings_) {
      // See Note [Checking on CPU tensors].
      if (ran_on_gpu && finding.predicted) {
        continue;
      }
      // See Note [Finding severity] in capture_blockers.h.
      (finding.severity == FindingSeverity::kHarmless ? harmless : kept)
          .push_back(std::move(finding));
    }
    return SafetyReport(std::move(description), std::move(kept), std::move(harmless), ran_on_gpu,
                        operators_.load());
  }

 private:
  static bool same_place(const SafetyFinding& a, const SafetyFinding& b) {
    if (a.kind != b.kind || a.predicted != b.predicted || a.severity != b.severity) {
      return false;
    }
    if (a.kind == BlockerKind::kAutocastCache) {
      return true;  // See Note [One finding per user call].
    }
    return a.op == b.op && a.where() == b.where();
  }

  std::mutex mutex_;
  std::vector<SafetyFinding> findings_;
  std::atomic<int64_t> operators_{0};
  std::atomic<bool> ran_on_gpu_{false};
};

// The recorder of the running check. A global rather than thread-local
// pointer for the reason the CaptureWatcher gives: autograd's worker threads
// run the callbacks of the thread that started backward().
std::atomic<Recorder*> active_recorder{nullptr};

std::optional<SourceFrame> innermost_user_frame() {
  std::vector<SourceFrame> stack;
  try {
    stack = current_source_stack();
  } catch (const std::exception&) {
    return std::nullopt;  // A locator that fails leaves the finding without a line.
  }
  for (SourceFrame& frame : stack) {
    if (frame.is_user_code) {
      return std::move(frame);
    }
  }
  return std::nullopt;
}

void inspect_operator(const at::RecordFunction& fn, Recorder& recorder, bool silenced,
                      bool inside_operator) {
  OperatorCall call;
  call.name = fn.name();
  call.inputs = fn.inputs();
  for (const c10::IValue& input : call.inputs) {
    collect_operator_tensors(input, call.tensors);
  }
  call.on_gpu = is_gpu_work(call);
  call.inside_operator = inside_operator;
  if (call.on_gpu) {
    recorder.note_gpu_work();
  }
  if (silenced) {
    return;
  }
  std::vector<SafetyFinding> findings = classify_operator(call);
  if (findings.empty()) {
    return;
  }
  running_records.back().silences_nested = true;
  const std::optional<SourceFrame> location = innermost_user_frame();
  const size_t depth = running_records.size();
  const std::string inside = depth >= 2 ? running_records[depth - 2].name : "";
  for (SafetyFinding& found : findings) {
    found.location = location;
    found.inside = inside;
    recorder.add(std::move(found));
  }
}

std::unique_ptr<at::ObserverContext> on_record_start(const at::RecordFunction& fn) {
  const bool is_operator = fn.scope() == at::RecordScope::FUNCTION;
  const bool inside_operator = !running_records.empty() && running_records.back().is_operator;
  const bool silenced =
      quiet_depth > 0 || (!running_records.empty() && running_records.back().silences_nested);
  running_records.push_back(RunningRecord{fn.name(), is_operator, silenced});
  Recorder* recorder = active_recorder.load(std::memory_order_acquire);
  if (recorder == nullptr || !is_operator) {
    return nullptr;
  }
  recorder->note_operator();
  try {
    inspect_operator(fn, *recorder, silenced, inside_operator);
  } catch (const std::exception& error) {
    // Never break the user's operator: the check misses this one and says so.
    TORCH_WARN_ONCE("graphed.check could not inspect operator ", fn.name(), ": ", error.what());
  }
  return nullptr;
}

void on_record_end(const at::RecordFunction& /*fn*/, at::ObserverContext* /*unused*/) {
  if (!running_records.empty()) {
    running_records.pop_back();
  }
}

// Observes this thread's operators (and the autograd threads it starts) while
// alive. See Note [How the safety check observes].
class ObservedPass {
 public:
  explicit ObservedPass(Recorder& recorder) {
    Recorder* expected = nullptr;
    GRAPHED_CHECK(active_recorder.compare_exchange_strong(expected, &recorder),
                  "Expected one safety check at a time, but a check is already running (nested "
                  "in the function being checked, or on another thread). Run checks one after "
                  "another.");
    running_records.clear();
    callback_handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(on_record_start, on_record_end)
            .needsInputs(true)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
  }
  ~ObservedPass() {
    at::removeCallback(callback_handle_);
    running_records.clear();
    active_recorder.store(nullptr, std::memory_order_release);
  }
  ObservedPass(const ObservedPass&) = delete;
  ObservedPass& operator=(const ObservedPass&) = delete;

 private:
  at::CallbackHandle callback_handle_ = 0;
};

std::mutex& wrapper_mutex() {
  static std::mutex mutex;
  return mutex;
}

CheckPassWrapper& installed_wrapper_slot() {
  static CheckPassWrapper wrapper;
  return wrapper;
}

CheckPassWrapper installed_wrapper() {
  std::lock_guard<std::mutex> lock(wrapper_mutex());
  return installed_wrapper_slot();
}

}  // namespace

std::string SafetyFinding::where() const {
  return location ? describe_user_frame({*location}) : "";
}

SafetyReport::SafetyReport(std::string description, std::vector<SafetyFinding> findings,
                           bool ran_on_gpu, int64_t operators_observed)
    : SafetyReport(std::move(description), std::move(findings), {}, ran_on_gpu,
                   operators_observed) {}

SafetyReport::SafetyReport(std::string description, std::vector<SafetyFinding> findings,
                           std::vector<SafetyFinding> harmless, bool ran_on_gpu,
                           int64_t operators_observed)
    : description_(std::move(description)),
      findings_(std::move(findings)),
      harmless_(std::move(harmless)),
      ran_on_gpu_(ran_on_gpu),
      operators_observed_(operators_observed) {}

bool SafetyReport::spoils_replay() const {
  return std::any_of(findings_.begin(), findings_.end(), [](const SafetyFinding& finding) {
    return finding.severity == FindingSeverity::kSpoilsReplay;
  });
}

std::string SafetyReport::to_string() const {
  std::ostringstream out;
  out << "graphed.check of " << description_ << ": ";
  if (findings_.empty()) {
    out << "no capture blockers among " << operators_observed_ << " operators.";
  } else {
    int64_t occurrences = 0;
    for (const SafetyFinding& finding : findings_) {
      occurrences += finding.count;
    }
    out << findings_.size() << " capture blocker" << (findings_.size() == 1 ? "" : "s") << " ("
        << occurrences << " occurrence" << (occurrences == 1 ? "" : "s") << ") among "
        << operators_observed_ << " operators.";
  }
  for (size_t i = 0; i < findings_.size(); ++i) {
    const SafetyFinding& finding = findings_[i];
    const BlockerInfo& info = finding.info();
    out << "\n\n" << i + 1 << ". " << info.label << " (" << severity_label(finding.severity)
        << "): `" << finding.op << "`";
    if (!finding.inside.empty()) {
      out << " (inside `" << finding.inside << "`)";
    }
    const std::string where = finding.where();
    out << (where.empty() ? " (no source line: no user code on the stack)" : " at " + where);
    if (finding.count > 1) {
      out << ", " << finding.count << " times";
    }
    if (!finding.inputs.empty()) {
      out << "\n   inputs: " << finding.inputs;
    }
    if (!finding.detail.empty()) {
      out << "\n   seen:   " << finding.detail;
    }
    out << "\n   why:    " << info.why;
    out << "\n   fix:    " << info.fix;
  }
  if (!harmless_.empty()) {
    out << "\n\nNot counted (harmless, see Note [Finding severity]): ";
    for (size_t i = 0; i < harmless_.size(); ++i) {
      const SafetyFinding& finding = harmless_[i];
      const std::string where = finding.where();
      out << (i == 0 ? "" : "; ") << "`" << finding.op << "`"
          << (where.empty() ? "" : " at " + where) << ": " << finding.detail;
    }
    out << ".";
  }
  if (!ran_on_gpu_) {
    out << "\n\nThis pass ran on CPU tensors only: it reports what would break once they live on "
           "the GPU. Host-device copies and CPU tensors mixed into GPU work show up only in a "
           "pass on the GPU.";
  }
  return out.str();
}

SafetyReport check_safety(const std::function<void()>& run_once,
                          const SafetyCheckOptions& options) {
  GRAPHED_CHECK(static_cast<bool>(run_once),
                "Expected a function to check, got an empty std::function.");
  std::optional<c10::Device> cuda_device;
  if (c10::cuda::device_count() > 0) {
    cuda_device = c10::Device(c10::kCUDA, c10::cuda::current_device());
  }
  const StateSnapshot snapshot = StateSnapshot::take(options.state, cuda_device);
  Recorder recorder;
  const CheckPassWrapper wrapper = installed_wrapper();
  try {
    ObservedPass pass(recorder);
    if (wrapper) {
      bool ran = false;
      wrapper([&] {
        GRAPHED_INTERNAL_ASSERT(!ran, "a check pass wrapper ran the pass twice");
        ran = true;
        run_once();
      });
      GRAPHED_INTERNAL_ASSERT(ran, "a check pass wrapper did not run the pass");
    } else {
      run_once();
    }
  } catch (...) {
    snapshot.restore();
    throw;
  }
  snapshot.restore();
  return recorder.report(options.description);
}

CaptureVerdict capture_verdict(const SafetyReport& report) {
  if (report.empty()) {
    return CaptureVerdict::kClean;
  }
  if (report.spoils_replay()) {
    return CaptureVerdict::kBlocked;
  }
  for (const SafetyFinding& finding : report.findings()) {
    if (!finding.in_installed_package()) {
      return CaptureVerdict::kBlocked;
    }
  }
  return CaptureVerdict::kTryCapture;
}

std::string_view capture_verdict_name(CaptureVerdict verdict) {
  switch (verdict) {
    case CaptureVerdict::kClean: return "clean";
    case CaptureVerdict::kTryCapture: return "try_capture";
    case CaptureVerdict::kBlocked: return "blocked";
  }
  GRAPHED_INTERNAL_ASSERT(false, "no name for capture verdict ", static_cast<int>(verdict));
}

bool record_host_blocker(BlockerKind kind, std::string_view call,
                         const std::vector<at::Tensor>& tensors, std::string detail,
                         std::optional<FindingSeverity> severity) {
  Recorder* recorder = active_recorder.load(std::memory_order_acquire);
  if (recorder == nullptr || quiet_depth > 0) {
    return false;  // No check, or inside a host call recorded already.
  }
  const bool on_gpu = any_cuda(tensors);
  if (on_gpu) {
    recorder->note_gpu_work();
  }
  SafetyFinding found;
  found.kind = kind;
  found.op = std::string(call);
  found.inputs = describe_tensors(tensors);
  found.detail = std::move(detail);
  // See Note [Checking on CPU tensors]; a sync acts on no tensor and is real anywhere.
  found.predicted = !tensors.empty() && !on_gpu;
  found.severity = severity.value_or(default_severity(kind));
  found.location = innermost_user_frame();
  recorder->add(std::move(found));
  return true;
}

bool record_tensor_from_host_data(std::string_view call, c10::Device target, int64_t elements) {
  if (!target.is_cuda()) {
    // A CPU tensor from host data is host work; if it meets GPU work later,
    // that operator is reported (kCpuTensor, kHostDeviceCopy).
    return false;
  }
  if (elements == 0) {
    return record_host_blocker(BlockerKind::kHostDeviceCopy, call, {},
                               c10::str("builds an empty tensor on ", target,
                                        " from host data (zero bytes: no transfer)"),
                               FindingSeverity::kHarmless);
  }
  return record_host_blocker(BlockerKind::kHostDeviceCopy, call, {},
                             c10::str("builds a tensor on ", target,
                                      " from host data (a Python list or number, a NumPy array) "
                                      "on every call"));
}

void set_check_pass_wrapper(CheckPassWrapper wrapper) {
  std::lock_guard<std::mutex> lock(wrapper_mutex());
  installed_wrapper_slot() = std::move(wrapper);
}

QuietOperatorsGuard::QuietOperatorsGuard() { ++quiet_depth; }

QuietOperatorsGuard::~QuietOperatorsGuard() { --quiet_depth; }

}  // namespace graphed
