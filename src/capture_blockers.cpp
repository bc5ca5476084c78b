#include "graphed/capture_blockers.h"

#include "graphed/check.h"

#include <array>
#include <string>

namespace graphed {
namespace {

constexpr std::array<BlockerInfo, 8> kBlockers{{
    {BlockerKind::kHostRead, "host read",
     "it copies a GPU value to the host, and the host must wait for the GPU to produce it; a "
     "stream under capture records work without running it, so there is nothing to wait for",
     "keep the value on the GPU (use torch.where or masking instead of a Python `if` on it), or "
     "move the read out of the captured code and pass the result in as an input"},
    {BlockerKind::kDataDependentShape, "data-dependent shape",
     "its output size depends on the values of its input, so the host must read the size back "
     "from the GPU before it can allocate the output; a graph needs every size fixed at capture",
     "use a fixed-size formulation: torch.where(mask, x, 0) instead of x[mask], "
     "torch.nonzero_static / masked_fill with a known bound, or move the operation out of the "
     "captured code"},
    {BlockerKind::kExplicitSync, "explicit synchronization",
     "it waits on the host for GPU work, and work recorded into a graph never runs during "
     "capture",
     "remove the synchronize call from the captured code; synchronize after replay if you need "
     "the results on the host"},
    {BlockerKind::kHostDeviceCopy, "host-device copy",
     "copying between pageable host memory and the GPU synchronizes with the host, and a graph "
     "would replay the copy from the same host address with whatever it then holds",
     "create GPU tensors once, outside the captured code, and pass them in as inputs; copy "
     "results to the host after replay"},
    {BlockerKind::kCpuTensor, "CPU tensor in GPU work",
     "the graph records the value the CPU tensor had at capture and never reads it again",
     "move the tensor to the GPU before capture and pass it in as an input, so its current value "
     "is copied in on every call"},
    {BlockerKind::kUnregisteredGenerator, "unregistered random generator",
     "a generator that the graph does not know about would produce the same numbers on every "
     "replay",
     "use the default CUDA generator, or register your generator with the graph "
     "(graph.register_generator_state) before capture"},
    {BlockerKind::kAutocastCache, "autocast weight cache",
     "autocast caches the low-precision copies of weights it makes during capture; the cache "
     "then holds tensors from the graph's private memory pool, which later replays overwrite",
     "use torch.autocast(..., cache_enabled=False) around captured code"},
    {BlockerKind::kOther, "operation not capturable",
     "CUDA refused to record it into a graph",
     "move the operation out of the captured code, or run graphed.check() on the function to "
     "see every operation that blocks capture"},
}};

}  // namespace

const BlockerInfo& blocker_info(BlockerKind kind) {
  for (const BlockerInfo& info : kBlockers) {
    if (info.kind == kind) {
      return info;
    }
  }
  GRAPHED_INTERNAL_ASSERT(false, "no catalogue entry for blocker kind ", static_cast<int>(kind));
}

std::string_view severity_label(FindingSeverity severity) {
  switch (severity) {
    case FindingSeverity::kBreaksCapture: return "breaks capture";
    case FindingSeverity::kSpoilsReplay: return "spoils replay";
    case FindingSeverity::kHarmless: return "harmless";
  }
  GRAPHED_INTERNAL_ASSERT(false, "no label for severity ", static_cast<int>(severity));
}

std::string_view severity_name(FindingSeverity severity) {
  switch (severity) {
    case FindingSeverity::kBreaksCapture: return "breaks_capture";
    case FindingSeverity::kSpoilsReplay: return "spoils_replay";
    case FindingSeverity::kHarmless: return "harmless";
  }
  GRAPHED_INTERNAL_ASSERT(false, "no name for severity ", static_cast<int>(severity));
}

FindingSeverity default_severity(BlockerKind kind) {
  switch (kind) {
    case BlockerKind::kCpuTensor:
    case BlockerKind::kUnregisteredGenerator:
    case BlockerKind::kAutocastCache:
      return FindingSeverity::kSpoilsReplay;
    case BlockerKind::kHostRead:
    case BlockerKind::kDataDependentShape:
    case BlockerKind::kExplicitSync:
    case BlockerKind::kHostDeviceCopy:
    case BlockerKind::kOther:
      return FindingSeverity::kBreaksCapture;
  }
  GRAPHED_INTERNAL_ASSERT(false, "no severity for blocker kind ", static_cast<int>(kind));
}

std::string_view blocker_kind_name(BlockerKind kind) {
  switch (kind) {
    case BlockerKind::kHostRead: return "host_read";
    case BlockerKind::kDataDependentShape: return "data_dependent_shape";
    case BlockerKind::kExplicitSync: return "explicit_sync";
    case BlockerKind::kHostDeviceCopy: return "host_device_copy";
    case BlockerKind::kCpuTensor: return "cpu_tensor";
    case BlockerKind::kUnregisteredGenerator: return "unregistered_generator";
    case BlockerKind::kAutocastCache: return "autocast_cache";
    case BlockerKind::kOther: return "other";
  }
  GRAPHED_INTERNAL_ASSERT(false, "no name for blocker kind ", static_cast<int>(kind));
}

BlockerKind blocker_kind_from_name(std::string_view name) {
  std::string valid;
  for (const BlockerInfo& info : kBlockers) {
    if (blocker_kind_name(info.kind) == name) {
      return info.kind;
    }
    valid += c10::str(valid.empty() ? "" : ", ", "'", blocker_kind_name(info.kind), "'");
  }
  GRAPHED_THROW(Error, "Expected a capture blocker kind, one of ", valid, "; got '", name, "'.");
}

std::optional<BlockerKind> blocker_kind_of_operator(std::string_view op_name) {
  static constexpr std::array<std::string_view, 5> kHostReads{
      "aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal",
      "aten::allclose"};
  static constexpr std::array<std::string_view, 12> kDataDependent{
      "aten::nonzero",          "aten::nonzero_numpy",          "aten::argwhere",
      "aten::masked_select",    "aten::unique",                 "aten::_unique",
      "aten::_unique2",         "aten::unique_dim",             "aten::unique_consecutive",
      "aten::unique_dim_consecutive", "aten::repeat_interleave", "aten::bincount"};
  for (std::string_view name : kHostReads) {
    if (op_name == name) {
      return BlockerKind::kHostRead;
    }
  }
  for (std::string_view name : kDataDependent) {
    if (op_name == name) {
      return BlockerKind::kDataDependentShape;
    }
  }
  if (op_name == "aten::_cuda_synchronize" || op_name == "cudaDeviceSynchronize") {
    return BlockerKind::kExplicitSync;
  }
  return std::nullopt;
}

std::optional<BlockerKind> blocker_kind_of_host_function(std::string_view function_name) {
  if (function_name == "synchronize" || function_name == "query" ||
      function_name == "elapsed_time") {
    return BlockerKind::kExplicitSync;
  }
  if (function_name == "tolist" || function_name == "item" || function_name == "__bool__") {
    return BlockerKind::kHostRead;
  }
  return std::nullopt;
}

}  // namespace graphed
