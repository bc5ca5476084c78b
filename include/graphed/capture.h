#pragma once

/// \file capture.h
/// graphed::capture: record a function once as a CUDA graph and replay it on
/// every call. The inference path: warm-up on graphed's capture stream,
/// capture, then each call checks its inputs against the captured signature,
/// copies new input tensors into the static buffers and replays.

#include "graphed/graph.h"
#include "graphed/signature.h"
#include "graphed/static_io.h"
#include "graphed/tensor_identity.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace graphed {

/// A function to capture: takes the inputs (one value per input name) and
/// returns its outputs as one value (a tensor, or tuples, lists and dicts of
/// tensors and constants).
using CapturableFunction = std::function<c10::IValue(const std::vector<c10::IValue>& inputs)>;

/// A named value that must read the same on every call as at capture, e.g. a
/// module's training flag. Guards catch state the inputs do not show.
struct CaptureGuard {
  /// Shown in messages, e.g. "module.training".
  std::string name;
  /// Reads the current value.
  std::function<c10::IValue()> read;
};

/// How a call brings an input tensor that is not the static buffer into the
/// graph; see Note [Re-pointing a graph] in src/graph_update.cpp.
enum class InputUpdate {
  /// Copy it into the static buffer.
  kCopy,
  /// Re-point the graph's kernels at the tensor (copy when the graph cannot
  /// be re-pointed at that input, or the tensor's layout differs).
  kRepoint,
  /// Re-point inputs of at least CaptureOptions::repoint_min_bytes and inputs
  /// that arrive where the previous call's did (re-pointed once, free
  /// afterwards); copy the rest.
  kAuto,
};

/// Parses "copy", "repoint" or "auto".
InputUpdate parse_input_update(std::string_view name);

/// Options of capture().
struct CaptureOptions {
  /// Eager runs before capture, on the capture stream (>= 1). They initialise
  /// lazy state (cuBLAS handles and workspaces, autotuning) outside the graph.
  int warmup_iters = 3;
  /// Pool to capture into; a private pool when unset. See new_pool().
  std::optional<PoolId> pool;
  /// See CaptureErrorMode.
  CaptureErrorMode error_mode = CaptureErrorMode::kGlobal;
  /// Return clones of the outputs, valid beyond the next call, instead of the
  /// static output tensors themselves.
  bool clone_outputs = false;
  /// Names of the inputs in messages; "args[0]", "args[1]"... when empty.
  std::vector<std::string> input_names;
  /// Tensors the function may modify (e.g. module buffers): restored after
  /// warm-up and capture, so that capturing changes nothing. Every call also
  /// checks that they keep the address, dtype and sizes they had at capture
  /// (Note [Tensors a graph reads in place]).
  std::vector<at::Tensor> state;
  /// Reads, as they are now, the tensors the function reads in place besides
  /// its inputs (a module's parameters and buffers, from the module). Read
  /// once after capture and on every call: a call whose tensors were
  /// replaced or moved (`.double()`, `.to()`, `.data =`) raises instead of
  /// replaying on stale or freed memory (Note [Tensors a graph reads in
  /// place]). Unset to skip the check.
  std::function<std::vector<at::Tensor>()> read_parameters;
  /// Values checked on every call; see CaptureGuard.
  std::vector<CaptureGuard> guards;
  /// What is captured, for messages, e.g. "function `forward`".
  std::string description = "the function";
  /// See InputUpdate. Inputs the function writes in place, and inputs that an
  /// output is (a view of), are always copied: re-pointed, the graph would
  /// leave them, and so the output, with an earlier call's values.
  InputUpdate input_update = InputUpdate::kCopy;
  /// The size from which InputUpdate::kAuto re-points rather than copies.
  int64_t repoint_min_bytes = int64_t{4} << 20;
  /// Memory the static input buffers may live in, per input tensor in
  /// signature order: a buffer is the front of its arena where it fits
  /// (arena_front), else memory of its own. Inference only. GraphManager
  /// passes the buffers of a module's largest bucket graph (Note [Bucket
  /// graphs share their buffers] in src/graph_manager_buckets.cpp).
  std::vector<at::Tensor> input_arenas;
  /// Likewise for the outputs, per output tensor in for_each_tensor order:
  /// the graph ends by copying each contiguous output that fits into the
  /// front of its arena and returns that front, so that the output the
  /// function allocated is scratch memory after capture. Outputs that are
  /// (views of) inputs keep their own memory.
  std::vector<at::Tensor> output_arenas;
  /// Record autograd too: warm-up and capture run with grad mode enabled, so a
  /// function that calls backward() (a training step) is captured whole.
  /// When false (inference), they run under no_grad and calls refuse inputs
  /// that require grad.
  bool autograd = false;
};

/// Counters of a captured function.
struct CapturedFunctionStats {
  /// Calls that replayed the graph.
  int64_t replays = 0;
  /// Input tensors copied into static buffers, over all calls.
  int64_t input_copies = 0;
  /// Times the graph was re-pointed at an input's new address.
  int64_t input_repoints = 0;
  /// Inputs the graph can be re-pointed at (InputUpdate other than kCopy).
  int64_t repointable_inputs = 0;
  /// Wall time of the warm-up runs, in milliseconds.
  double warmup_ms = 0.0;
};

/// A function captured as a CUDA graph. Calling it replays the graph on the
/// current stream. Outputs are the graph's static tensors, overwritten by the
/// next call, unless CaptureOptions::clone_outputs is set (Invariant 3).
class CapturedFunction {
 public:
  /// Checks `inputs` against the signature, refreshes the static inputs,
  /// replays and returns the outputs. Throws InputMismatchError listing every
  /// difference when `inputs` do not match.
  c10::IValue operator()(const std::vector<c10::IValue>& inputs);

  /// The captured graph.
  const Graph& graph() const { return graph_; }
  /// What the inputs must look like.
  const Signature& signature() const { return signature_; }
  /// The static input buffers, in signature order. Passing them as inputs
  /// (after writing into them) skips the copies.
  const std::vector<at::Tensor>& static_inputs() const { return inputs_.buffers(); }
  /// The static output tensors, as the last replay left them.
  c10::IValue static_outputs() const { return outputs_.materialize(/*clone=*/false); }
  /// The static output tensors, in for_each_tensor order.
  const std::vector<at::Tensor>& static_output_tensors() const { return outputs_.tensors(); }
  /// Indices (in signature order) of inputs the function writes in place.
  const std::vector<size_t>& mutated_inputs() const { return inputs_.mutated(); }
  /// Call counters and warm-up time.
  const CapturedFunctionStats& stats() const { return stats_; }
  /// The options it was captured with.
  const CaptureOptions& options() const { return options_; }

 private:
  friend CapturedFunction capture(CapturableFunction function, std::vector<c10::IValue> sample,
                                  CaptureOptions options);
  CapturedFunction() = default;
  [[noreturn]] void raise_mismatch(const std::vector<c10::IValue>& inputs) const;
  void check_tensors_in_place() const;
  std::vector<c10::IValue> guarded_inputs(const std::vector<c10::IValue>& inputs) const;
  void bring_inputs();

  // Kept alive because the graph reads the memory the function owns (a
  // module's parameters).
  CapturableFunction function_;
  CaptureOptions options_;
  Signature signature_;
  StaticInputs inputs_;
  StaticOutputs outputs_;
  Graph graph_;
  CapturedFunctionStats stats_;
  std::vector<at::Tensor> scratch_;
  // The NVTX range of a call, "graphed/replay:<name>" (include/graphed/nvtx.h).
  std::string replay_range_;
  // Note [Tensors a graph reads in place].
  TensorIdentities state_identity_;
  TensorIdentities parameter_identity_;
  // Per input: its re-pointing site in graph_ (none: always copied), where
  // the graph reads it now, and where the previous call's tensor lived.
  std::vector<std::optional<size_t>> sites_;
  std::vector<const void*> bound_;
  std::vector<const void*> last_seen_;
};

/// Warms `function` up on `sample`, captures it and returns the captured
/// function. Sample tensors must be CUDA tensors on one device; non-tensor
/// values become part of the signature. Runs without autograd (inference)
/// unless CaptureOptions::autograd is set.
/// Restores CaptureOptions::state and the random generators afterwards, on
/// success and on failure. Throws CaptureError (with the operation that broke
/// capture and the fix) when the function cannot be captured.
CapturedFunction capture(CapturableFunction function, std::vector<c10::IValue> sample,
                         CaptureOptions options = {});

}  // namespace graphed
