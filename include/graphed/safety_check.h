#pragma once

/// \file safety_check.h
/// graphed::check_safety: runs a function once, eagerly, and names every
/// operation in it that would break or spoil CUDA graph capture (host reads,
/// data-dependent shapes, explicit syncs, host-device copies, CPU tensors in
/// GPU work, unregistered random generators, the autocast weight cache), with
/// its inputs, why it breaks capture, the fix and the user's source line. It
/// works on CPU tensors too and then reports what would break on a GPU, so it
/// runs in CI and on laptops.

#include "graphed/capture_blockers.h"
#include "graphed/source_location.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace graphed {

/// One kind of operation, seen at one place in the user's code.
struct SafetyFinding {
  /// What breaks capture; see capture_blockers.h.
  BlockerKind kind = BlockerKind::kOther;
  /// The operation: an ATen operator ("aten::item") or a host-language call
  /// ("torch.cuda.synchronize").
  std::string op;
  /// The operator (or autograd node) `op` ran inside, when it did not come
  /// straight from the user's program, e.g. "IndexBackward0"; "" otherwise.
  std::string inside;
  /// The tensor inputs of the first occurrence, e.g. "(4,) float32 cpu".
  std::string inputs;
  /// What exactly was seen, e.g. "copies cuda:0 to cpu".
  std::string detail;
  /// The innermost frame of the user's code when it ran; nullopt when no
  /// SourceLocator is installed or the stack holds no user frame (autograd's
  /// worker threads run backward operators without a host stack).
  std::optional<SourceFrame> location;
  /// True when the finding rests on CPU tensors only: it says what would
  /// break once these tensors live on the GPU. See Note [Checking on CPU
  /// tensors] in safety_check.cpp.
  bool predicted = false;
  /// How many times it happened at this place.
  int64_t count = 1;
  /// What it does to a capture; see Note [Finding severity] in
  /// capture_blockers.h.
  FindingSeverity severity = FindingSeverity::kBreaksCapture;

  /// The catalogue's explanation of `kind`: label, why and fix.
  const BlockerInfo& info() const { return blocker_info(kind); }
  /// `file:line in function`, or "" without a location.
  std::string where() const;
  /// True when it happened in an installed package (transformers, timm...)
  /// rather than the user's own code: code the user cannot edit, and whose
  /// findings a trial capture decides (Note [Capture is the verdict]).
  bool in_installed_package() const { return location && location->is_installed_package; }
};

/// The result of check_safety().
class SafetyReport {
 public:
  /// An empty report of nothing checked.
  SafetyReport() = default;
  /// A report of `findings` (in the order they first happened) for what
  /// `description` names.
  SafetyReport(std::string description, std::vector<SafetyFinding> findings, bool ran_on_gpu,
               int64_t operators_observed);
  /// As above, with the findings that affect no capture kept apart.
  SafetyReport(std::string description, std::vector<SafetyFinding> findings,
               std::vector<SafetyFinding> harmless, bool ran_on_gpu, int64_t operators_observed);

  /// What was checked, e.g. "function `step`".
  const std::string& description() const { return description_; }
  /// The findings, in the order they first happened.
  const std::vector<SafetyFinding>& findings() const { return findings_; }
  /// Operations the pass saw that look like blockers but affect no capture
  /// (FindingSeverity::kHarmless, e.g. copies of zero bytes); not among
  /// findings().
  const std::vector<SafetyFinding>& harmless() const { return harmless_; }
  /// True when nothing would break or spoil capture.
  bool empty() const { return findings_.empty(); }
  /// True when some finding spoils replay (FindingSeverity::kSpoilsReplay):
  /// a capture would succeed and compute with frozen values.
  bool spoils_replay() const;
  /// True when the pass ran work on a CUDA device; false for a pass on CPU
  /// tensors only, whose findings are predictions.
  bool ran_on_gpu() const { return ran_on_gpu_; }
  /// Operators the pass observed (outermost and nested).
  int64_t operators_observed() const { return operators_observed_; }
  /// The report for people: one numbered entry per finding with its
  /// operation, inputs, source line, why and fix.
  std::string to_string() const;

 private:
  std::string description_;
  std::vector<SafetyFinding> findings_;
  std::vector<SafetyFinding> harmless_;
  bool ran_on_gpu_ = false;
  int64_t operators_observed_ = 0;
};

/// Options of check_safety().
struct SafetyCheckOptions {
  /// Tensors the function may modify (e.g. a module's buffers): restored
  /// afterwards, as are the default random generators, so that checking
  /// changes nothing.
  std::vector<at::Tensor> state;
  /// What is checked, for the report, e.g. "module `Net`".
  std::string description = "the function";
};

/// Runs `run_once` once, eagerly, on the calling thread (and the autograd
/// threads it starts), observing every ATen operator, and returns what would
/// break or spoil capturing it. Restores SafetyCheckOptions::state and the
/// default generators afterwards, also when `run_once` throws; its exception
/// then propagates unchanged. One check runs at a time in a process: a second
/// concurrent or nested one throws graphed::Error.
SafetyReport check_safety(const std::function<void()>& run_once,
                          const SafetyCheckOptions& options = {});

/// What a check's report leaves to decide before capturing; see Note
/// [Capture is the verdict] in safety_check.cpp.
enum class CaptureVerdict {
  /// Nothing found: capture.
  kClean,
  /// Findings that a capture may never meet, all inside installed packages
  /// (transformers...): capture, and let CUDA's answer decide.
  kTryCapture,
  /// Findings in the user's own code (or without a source line) that break
  /// capture, or any finding that spoils replay: do not capture until they
  /// are fixed.
  kBlocked,
};

/// The verdict on `report`; see CaptureVerdict.
CaptureVerdict capture_verdict(const SafetyReport& report);

/// "clean", "try_capture" or "blocked".
std::string_view capture_verdict_name(CaptureVerdict verdict);

/// Records a blocker that the host program hit outside any ATen operator
/// (e.g. torch.cuda.synchronize, Tensor.tolist) into the running check, at
/// the current source location. `tensors` are the tensors the call acts on
/// (empty for a sync); when all of them are CPU tensors the finding is a
/// prediction. Returns false, recording nothing, when no check is running.
/// `severity` overrides the kind's default_severity().
bool record_host_blocker(BlockerKind kind, std::string_view call,
                         const std::vector<at::Tensor>& tensors, std::string detail = "",
                         std::optional<FindingSeverity> severity = std::nullopt);

/// Records a tensor of `elements` elements built from host data (a Python
/// list, a NumPy array) by `call` (e.g. "torch.tensor") for `target` into the
/// running check: a host-device copy on every call when `target` is a CUDA
/// device (harmless when it copies no element); ordinary host work otherwise.
/// Returns true when it recorded a finding.
bool record_tensor_from_host_data(std::string_view call, c10::Device target,
                                  int64_t elements = -1);

/// Runs every check pass: a host language installs what its pass needs
/// around `pass` (Python wraps the host calls that never reach ATen, and
/// answers capture queries as a capture would; see Note [Checking the path
/// taken under capture] in safety_check.cpp) and calls it exactly once.
using CheckPassWrapper = std::function<void(const std::function<void()>& pass)>;

/// Installs the process-wide wrapper of check passes (replacing any earlier
/// one); an empty function removes it.
void set_check_pass_wrapper(CheckPassWrapper wrapper);

/// While alive, the running check ignores the operators this thread runs:
/// a host call recorded with record_host_blocker() runs them, and one finding
/// per call is enough. Nests.
class QuietOperatorsGuard {
 public:
  /// Starts ignoring this thread's operators.
  QuietOperatorsGuard();
  /// Stops ignoring them (unless an outer guard is alive).
  ~QuietOperatorsGuard();
  QuietOperatorsGuard(const QuietOperatorsGuard&) = delete;
  QuietOperatorsGuard& operator=(const QuietOperatorsGuard&) = delete;
};

}  // namespace graphed
