#pragma once

/// \file graph_entry.h
/// The graphs GraphManager replays, behind one interface: a GraphEntry is the
/// captured graph (or forward and backward graph pair) of one module for one
/// signature. Inference entries are captured with graphed::capture
/// (make_inference_entry); training entries with make_graphed_callables, one
/// module at a time (make_training_entry) or the modules of a recorded step
/// together (make_training_group). GraphManager asks for entries through
/// GraphEntryFactories, so that its tests can plug in fakes.

#include "graphed/bucket_policy.h"
#include "graphed/capture.h"
#include "graphed/graph.h"
#include "graphed/signature.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace graphed {

/// One captured graph (or graph pair) of one module for one signature.
/// GraphManager only replays through this interface: the inference entry
/// (make_inference_entry) captures with graphed::capture; a training entry
/// (forward and backward graphs) plugs in through GraphEntryFactories::training.
class GraphEntry {
 public:
  virtual ~GraphEntry() = default;
  /// Replays on `inputs`, which match signature() except along the padded
  /// dimensions of `plan` (each input tensor then holds the call's size;
  /// the entry pads it up and slices its outputs back, see Note [Bucket
  /// padding]). Returns the outputs.
  virtual c10::IValue run(const std::vector<c10::IValue>& inputs, const BucketPlan& plan) = 0;
  /// Device memory this graph holds: see Note [Graph memory accounting].
  virtual int64_t memory_bytes() const = 0;
  /// The inputs it was captured with (at bucket sizes).
  virtual const Signature& signature() const = 0;
  /// Bytes the shared pool holds now (segments), or 0 when unknown.
  virtual int64_t pool_reserved_bytes() const = 0;
  /// Wall time of its capture, warm-up included, in milliseconds.
  virtual double capture_ms() const = 0;
  /// The static input buffers (signature order) of an inference graph, in
  /// whose fronts later graphs of the module may keep theirs (Note [Bucket
  /// graphs share their buffers]); empty where they are private.
  virtual std::vector<at::Tensor> static_inputs() const { return {}; }
  /// Its static output tensors (for_each_tensor order), likewise.
  virtual std::vector<at::Tensor> static_outputs() const { return {}; }
};

/// A module GraphManager manages.
struct ModuleSpec {
  /// Qualified name, for stats and messages.
  std::string name;
  /// Class name, for messages.
  std::string type;
  /// Runs the module's own forward (never the managed one) on the inputs of
  /// a call.
  CapturableFunction forward;
  /// Tensors the forward may modify (buffers): restored after warm-up and
  /// capture (Invariant 1).
  std::vector<at::Tensor> state;
  /// The module's parameters: a call in grad mode needs training graphs when
  /// any of them requires grad.
  std::vector<at::Tensor> parameters;
  /// Read the module's parameters and its buffers as they are now (from the
  /// module, so that replaced tensors are seen too). When both are set, every
  /// call after warm-up compares them with what its graphs were captured on
  /// and, on a difference, releases the module's graphs, takes the new
  /// tensors as `parameters` and `state`, and warms the module up again
  /// (Note [Modules whose tensors moved] in graph_manager.cpp). Unset to skip.
  std::function<std::vector<at::Tensor>()> read_parameters;
  /// See read_parameters.
  std::function<std::vector<at::Tensor>()> read_buffers;
  /// The managed module this one is a part of, graphed because that one
  /// cannot be (Note [Graphing the parts of a block] in module_selection.h);
  /// empty for a module chosen directly.
  std::string part_of;
  /// Fall back for good when two warm-up calls come at different shapes
  /// (an expert fed a different token count every call) instead of
  /// capturing a graph per shape; set for parts (see part_of).
  bool steady_shapes = false;
};

/// What a GraphEntryFactory is asked to capture.
struct GraphEntryRequest {
  /// The module.
  const ModuleSpec* module = nullptr;
  /// Sample inputs at the bucket sizes of `plan`.
  std::vector<c10::IValue> sample;
  /// The buckets this graph serves (all sizes at their buckets).
  BucketPlan plan;
  /// Names of the inputs in messages.
  std::vector<std::string> input_names;
  /// The pool every graph of the manager shares; created on first use.
  std::function<PoolId()> pool;
  /// Eager runs on the capture stream before capture.
  int warmup_iters = 1;
  /// See CaptureErrorMode.
  CaptureErrorMode error_mode = CaptureErrorMode::kGlobal;
  /// E.g. "module `blocks.0` (GPTBlock)".
  std::string description;
  /// How replays bring inputs in; see InputUpdate.
  InputUpdate input_update = InputUpdate::kAuto;
  /// Where the inference graph keeps its buffers where they fit: the static
  /// inputs and outputs of the module's largest bucket graph (see
  /// CaptureOptions::input_arenas and Note [Bucket graphs share their
  /// buffers]); empty for memory of its own.
  std::vector<at::Tensor> input_arenas;
  /// Likewise for its outputs (CaptureOptions::output_arenas).
  std::vector<at::Tensor> output_arenas;
};

/// Captures one entry; throws CaptureError when the module cannot be captured.
using GraphEntryFactory = std::function<std::unique_ptr<GraphEntry>(const GraphEntryRequest&)>;

/// Captures the training entries of several modules together: one pool,
/// forward and backward graphs captured in `order` (TrainingGroupPlan::order
/// over the requests). Returns one entry per request, in request order;
/// throws like GraphEntryFactory, having captured none.
using GraphGroupFactory = std::function<std::vector<std::unique_ptr<GraphEntry>>(
    const std::vector<GraphEntryRequest>& requests, const std::vector<int64_t>& order)>;

/// The factories GraphManager captures with, per call mode.
struct GraphEntryFactories {
  /// Inference graphs; make_inference_entry when unset.
  GraphEntryFactory inference;
  /// Training graphs (forward and backward). Unset until the training path
  /// lands: calls that need it fall back to eager execution with the reason
  /// kTrainingGraphsUnavailable. See Note [Training entries] in
  /// graph_entry.cpp.
  GraphEntryFactory training;
  /// Training graphs of the modules recorded in one warm-up step, captured
  /// together (Note [Training graphs captured together] in
  /// training_group.cpp); unset: every training entry comes from `training`.
  GraphGroupFactory training_group;
};

/// The fallback reason of a training call while GraphEntryFactories::training is unset.
inline constexpr std::string_view kTrainingGraphsUnavailable = "training graphs not available yet";

/// Captures an inference entry with graphed::capture (no autograd; buffers in
/// ModuleSpec::state restored after warm-up and capture).
///
/// Note [Graph memory accounting]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// Graphs of one manager share one pool, so a graph's memory is not a pool
/// of its own. An entry counts its static input buffers (outside the pool)
/// plus the larger of its static outputs and the growth of the shared pool
/// during its capture: a graph that reused memory freed by earlier captures
/// still pins its outputs; one that needed more made the pool grow by that
/// much. Buffers kept in another graph's (Note [Bucket graphs share their
/// buffers]) are that graph's and count there. The sum over live entries is
/// what the memory budget limits; the pool itself is reported as
/// pool_reserved_bytes.
std::unique_ptr<GraphEntry> make_inference_entry(const GraphEntryRequest& request);

/// Captures a training entry: the module's forward and backward graphs for
/// the request's signature, through make_graphed_callables (an autograd node
/// per call), in a pool of its own (Note [Training entries]). Calls must come
/// at the exact sizes of the sample: bucket padding is refused for training.
std::unique_ptr<GraphEntry> make_training_entry(const GraphEntryRequest& request);

/// Captures the training entries of several modules with one
/// make_graphed_callables call: one pool, graphs captured in `order`, and
/// replays checked against it. Each entry's memory is its static inputs plus
/// its share of the pool (split evenly, so that the entries sum to the pool).
std::vector<std::unique_ptr<GraphEntry>> make_training_group(
    const std::vector<GraphEntryRequest>& requests, const std::vector<int64_t>& order);

}  // namespace graphed
