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
