#pragma once

/// \file capture_blockers.h
/// The catalogue of things that break or spoil CUDA graph capture, with the
/// reason and the fix for each. Capture-failure messages (graph.h) and the
/// safety check both explain a blocker from this one table, so the advice a
/// user reads is the same wherever it is found.

#include <optional>
#include <string_view>

namespace graphed {

/// The kinds of capture blockers.
enum class BlockerKind {
  /// A GPU value is read on the host (`.item()`, `bool(tensor)`, `tolist`).
  kHostRead,
  /// An operator whose output shape depends on data (`nonzero`, boolean
  /// indexing, `masked_select`, `unique`): it must read a size on the host.
  kDataDependentShape,
  /// An explicit synchronization (`torch.cuda.synchronize`, event or stream
  /// synchronize).
  kExplicitSync,
  /// A copy between host and GPU memory (`.cpu()`, `.to("cpu")`, a CPU tensor
  /// moved to the GPU inside the function).
  kHostDeviceCopy,
  /// A CPU tensor used in GPU work: its value is frozen into the graph.
  kCpuTensor,
  /// Random numbers from a generator that is not registered with the graph:
  /// every replay would repeat the same numbers.
  kUnregisteredGenerator,
  /// Autocast with its weight cache enabled: the cache holds tensors created
  /// during capture.
  kAutocastCache,
  /// Anything else that makes CUDA refuse the capture.
  kOther,
};

/// What a finding of the safety check does to a capture.
///
/// Note [Finding severity]
/// ~~~~~~~~~~~~~~~~~~~~~~~
/// The check runs the function eagerly, and not everything it sees there
/// matters to a graph. A finding breaks capture when CUDA refuses to record
/// it (a host read, a data-dependent shape, a sync, a copy from pageable host
/// memory): the capture fails and says so, nothing goes wrong silently. It
/// spoils replay when the capture succeeds but replays are wrong: a value or a
/// host address is frozen into the graph (a CPU tensor in GPU work, a pinned
/// host buffer, an unregistered generator, the autocast weight cache); these
/// are the dangerous ones, since only a check can see them. It is harmless
/// when it does neither: a copy of zero bytes (`torch.tensor([])` moved to the
/// GPU: transformers' caches start so) issues no transfer at all. Harmless
/// findings are kept apart from the report's findings (SafetyReport::harmless)
/// so that a clean report means a clean capture.
enum class FindingSeverity {
  /// CUDA refuses to record it: the capture fails with an error.
  kBreaksCapture,
  /// The capture succeeds but a value or host buffer is frozen into the
  /// graph, so replays can compute with stale data.
  kSpoilsReplay,
  /// Neither (a copy of zero bytes, say).
  kHarmless,
};

/// "breaks capture", "spoils replay" or "harmless".
std::string_view severity_label(FindingSeverity severity);

/// "breaks_capture", "spoils_replay" or "harmless": the stable identifier for
/// programs (JSON reports, the Python API).
std::string_view severity_name(FindingSeverity severity);

/// The severity of a finding of `kind` with no further detail: host reads,
/// data-dependent shapes, syncs, host-device copies and `kOther` break
/// capture; CPU tensors in GPU work, unregistered generators and the autocast
/// cache spoil replay. The safety check refines it from what it saw (a copy of
/// zero bytes is harmless, a copy from pinned memory spoils replay).
FindingSeverity default_severity(BlockerKind kind);

/// The explanation of one blocker kind.
struct BlockerInfo {
  /// The kind this entry explains.
  BlockerKind kind;
  /// A short label, e.g. "host read".
  std::string_view label;
  /// Why this breaks capture or makes replays wrong.
  std::string_view why;
  /// What to change.
  std::string_view fix;
};

/// The explanation for `kind`.
const BlockerInfo& blocker_info(BlockerKind kind);

/// The stable identifier of `kind` for programs (JSON reports, the Python
/// API): "host_read", "data_dependent_shape", "explicit_sync",
/// "host_device_copy", "cpu_tensor", "unregistered_generator",
/// "autocast_cache" or "other".
std::string_view blocker_kind_name(BlockerKind kind);

/// The kind whose blocker_kind_name() is `name`. Throws graphed::Error listing
/// the valid names when there is none.
BlockerKind blocker_kind_from_name(std::string_view name);

/// The blocker kind an ATen operator belongs to by its name alone
/// (e.g. "aten::_local_scalar_dense" is kHostRead), or nullopt when the name
/// alone does not make it a blocker. Operators whose effect depends on their
/// arguments (copies, indexing) are classified by the callers that see them.
std::optional<BlockerKind> blocker_kind_of_operator(std::string_view op_name);

/// The blocker kind suggested by the name of a host-language function that
/// was running when capture failed outside any operator (e.g. "synchronize"),
/// or nullopt.
std::optional<BlockerKind> blocker_kind_of_host_function(std::string_view function_name);

}  // namespace graphed
