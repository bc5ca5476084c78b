#pragma once

/// \file graphed_callable.h
/// graphed::make_graphed_callables: callables (modules or functions) graphed
/// for training. Each gets a forward graph and a backward graph; calling it
/// replays the forward graph and records one autograd node whose backward
/// replays the backward graph. The LibTorch counterpart of
/// torch.cuda.make_graphed_callables, with keyword arguments, pipeline
/// orders, shared static buffers and gradients that are never aliased.

#include "graphed/capture.h"
#include "graphed/graph.h"
#include "graphed/graph_schedule.h"
#include "graphed/signature.h"
#include "graphed/tensor_identity.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace graphed {

/// One callable to graph and what graphed needs to know about it.
struct GraphableCallable {
  /// Runs the callable eagerly on its inputs (as many values as the sample
  /// has, e.g. {args tuple, kwargs dict} from Python) and returns its outputs.
  CapturableFunction function;
  /// Tensors the callable reads besides its inputs that may require grad (a
  /// module's parameters): the graph's gradients include theirs.
  std::vector<at::Tensor> parameters;
  /// Tensors the callable may modify (a module's buffers, e.g. BatchNorm
  /// statistics): restored after warm-up and capture (Invariant 1).
  std::vector<at::Tensor> state;
  /// The training flag the callable has now (a module's `training`); calls
  /// with a different flag run eagerly. Unset for plain functions.
  std::optional<bool> training;
  /// Reads the training flag as it is now, for calls that do not pass it
  /// (GraphedCallable::operator()); unset to use `training`.
  std::function<bool()> read_training;
  /// Reads the callable's parameters as they are now, to detect parameters
  /// added, removed, replaced or moved (`.double()`, `.to()`, `.data =`)
  /// after graphing (Note [Tensors a graph reads in place]); unset to skip
  /// the check. `state` is checked for moves on every call too.
  std::function<std::vector<at::Tensor>()> read_parameters;
  /// Names the callable in messages, e.g. "module `Block`".
  std::string description = "the callable";
};

/// A LibTorch module as a GraphableCallable: `forward` runs it, its
/// parameters and buffers are read from the module, and its training flag is
/// checked on every call.
GraphableCallable graphable_module(std::shared_ptr<torch::nn::Module> module,
                                   CapturableFunction forward, std::string description = "");

/// Options of make_graphed_callables.
struct GraphedCallablesOptions {
  /// Eager forward and backward runs of each graph before capture (>= 1).
  /// DistributedDataParallel needs 11.
  int warmup_iters = 3;
  /// Allow inputs and parameters that require grad but receive none (their
  /// gradient is then None) instead of raising.
  bool allow_unused_input = false;
  /// Pool shared by all graphs; a fresh one when unset.
  std::optional<PoolId> pool;
  /// Pipeline order; see Note [Pipeline order]. Empty: forwards in order,
  /// backwards reversed, one microbatch.
  std::vector<int64_t> order;
  /// See CaptureErrorMode.
  CaptureErrorMode error_mode = CaptureErrorMode::kGlobal;
  /// Names of the sample inputs in messages; {"args", "kwargs"} from Python.
  std::vector<std::string> input_names;
};

/// Counters of one graphed callable.
struct GraphedCallableStats {
  /// Calls that replayed the forward graph.
  int64_t forward_replays = 0;
  /// Backward passes that replayed the backward graph.
  int64_t backward_replays = 0;
  /// Input tensors copied into static buffers.
  int64_t input_copies = 0;
  /// Incoming gradients copied into static gradient buffers.
  int64_t grad_copies = 0;
  /// Calls that ran the callable eagerly instead, by reason.
  std::map<std::string, int64_t> eager_calls;
};

/// What one forward or backward graph holds.
struct GraphedPassInfo {
  /// The microbatch it serves.
  size_t microbatch = 0;
  /// True for the forward graph.
  bool forward = true;
  /// The graph's node counts and capture time (pool figures cover the whole
  /// shared pool).
  GraphStats graph;
  /// Forward graphs: FP8 weight casts the graph makes (graphed.fp8 layers),
  /// and casts of an earlier forward graph of the same call it reads instead
  /// of casting (Note [Weight casts shared by the graphs of a scope]). 0 for
  /// backward graphs.
  int64_t float8_weight_casts = 0;
  /// See float8_weight_casts.
  int64_t float8_weight_cast_reads = 0;
};

namespace detail {
struct GraphPair;
struct GraphedCallablesShared;
}  // namespace detail

/// A callable replaced by graphs. Calls check their inputs against the
/// sample's signature, copy new input tensors into static buffers and replay
/// the forward graph; outputs are the graph's static tensors (detached
/// aliases, overwritten by the next replay of the same graph, Invariant 3).
/// With grad mode on, the outputs carry one autograd node whose backward
/// replays the backward graph.
class GraphedCallable {
 public:
  /// Runs the graphs, or the callable eagerly when `training` (the module's
  /// flag now) differs from the flag at capture; that is counted in stats().
  /// Throws InputMismatchError when `inputs` do not match the sample, and
  /// graphed::Error when parameters changed since graphing.
  c10::IValue call(const std::vector<c10::IValue>& inputs, std::optional<bool> training);
  /// call() with the training flag read from the callable (LibTorch modules).
  c10::IValue operator()(const std::vector<c10::IValue>& inputs);

  /// Call counters and eager calls by reason.
  GraphedCallableStats stats() const;
  /// One entry per graph of this callable (forward and backward per microbatch).
  std::vector<GraphedPassInfo> graphs() const;
  /// The signature calls must match.
  const Signature& signature() const;
  /// What is graphed, for messages.
  const std::string& description() const;
  /// The pool all graphs of this make_graphed_callables call share.
  PoolId pool() const;
  /// Number of microbatch graph pairs; calls cycle through them in order.
  size_t num_microbatches() const { return pairs_.size(); }

  /// Internal: built by make_graphed_callables.
  GraphedCallable(GraphableCallable callable, std::vector<std::shared_ptr<detail::GraphPair>> pairs,
                  std::shared_ptr<detail::GraphedCallablesShared> shared);
  ~GraphedCallable();
  GraphedCallable(const GraphedCallable&) = delete;
  GraphedCallable& operator=(const GraphedCallable&) = delete;

 private:
  void check_parameters() const;

  GraphableCallable callable_;
  std::vector<std::shared_ptr<detail::GraphPair>> pairs_;
  std::shared_ptr<detail::GraphedCallablesShared> shared_;
  // Note [Tensors a graph reads in place].
  TensorIdentities parameter_identity_;
  TensorIdentities state_identity_;
  size_t next_microbatch_ = 0;
  GraphedCallableStats stats_;
  std::vector<at::Tensor> scratch_;
};

/// Warms up and captures forward and backward graphs for `callables` on
/// `samples` (one sample per callable, or per callable and microbatch with an
/// order; each sample is a list of input values such as {args, kwargs}).
/// Sample tensors must be CUDA tensors; those that require grad get
/// gradients, as do parameters that require grad. All graphs share one pool
/// and are captured in replay order (Note [Pipeline order]).
/// Throws CaptureError when a callable cannot be captured, graphed::Error for
/// bad arguments; either way the callables, their gradients, buffers and the
/// random generators are left as they were and the pool is released.
std::vector<std::shared_ptr<GraphedCallable>> make_graphed_callables(
    std::vector<GraphableCallable> callables, std::vector<std::vector<c10::IValue>> samples,
    GraphedCallablesOptions options = {});

}  // namespace graphed
