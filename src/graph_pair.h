#pragma once

// Private to libgraphed: the forward and backward graphs of one callable for
// one microbatch (GraphPair), the state the pairs of one
// make_graphed_callables call share, and the steps that capture a pair
// (graph_pair.cpp). graphed_callable.cpp builds the pairs in schedule order
// and replays them through an autograd node.

#include "graphed/fp8_linear.h"
#include "graphed/graph.h"
#include "graphed/graph_schedule.h"
#include "graphed/graphed_callable.h"
#include "graphed/signature.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace graphed::detail {

// State shared by every graph of one make_graphed_callables call: the pool,
// the schedule, and where replays are in it.
//
// Note [Replays follow the capture order]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// All graphs of one call share a pool, and a graph captured later may reuse
// memory that an earlier graph freed during its own capture: the activations a
// backward graph consumed, the temporaries of a forward graph. That is safe
// only while replays follow the order of capture (Note [Pipeline order]). A
// forward replayed out of turn would overwrite activations that a pending
// backward still has to read, and gradients would be silently wrong; PyTorch
// does not detect this. So replays walk a cursor through the schedule: within
// a cycle (from the first forward after every backward has run until all have
// run again) each replay must come later in the schedule than the one before,
// else the call raises. A call under no_grad while backwards are pending runs
// eagerly (counted), since it needs no graph and must not disturb one.
struct GraphedCallablesShared {
  PoolId pool{0, 0};
  c10::Device device{c10::kCUDA};
  GraphSchedule schedule;
  std::mutex mutex;
  // Position in schedule.passes() of the last replay in this cycle, or -1.
  int64_t last_position = -1;
  // Pairs whose forward replayed with autograd and whose backward has not run.
  int64_t pending_backwards = 0;
  // The FP8 weight casts the forward graphs captured (Note [Weight casts
  // shared by the graphs of a scope] in fp8_linear.cpp): held here so that
  // their memory lives as long as the graphs. Null without FP8 layers.
  std::shared_ptr<const Float8ScopeCasts> float8_casts;
  // Per cast of float8_casts that a later forward graph reads: the weight's
  // version when its caster last replayed
  // (see Note [Readers of a shared cast replay after its caster]).
  std::vector<int64_t> float8_cast_versions;
};

// A weight cast one forward graph makes and another one reads
// (see Note [Readers of a shared cast replay after its caster]).
struct Float8SharedCast {
  size_t slot = 0;      // in GraphedCallablesShared::float8_cast_versions
  at::Tensor weight;    // the weight cast
  std::string caster;   // the description of the pair whose forward graph casts it
};

// The static buffers a pair's graphs read their inputs from. Pairs whose
// lifetimes do not overlap share one set (GraphSchedule::shared_inputs).
struct InputBuffers {
  std::vector<at::Tensor> tensors;
};

// The forward and backward graphs of one callable for one microbatch.
struct GraphPair {
  size_t index = 0;  // in the schedule
  size_t microbatch = 0;
  std::string description;
  // The subject of its NVTX ranges and the names of its replay ranges, built
  // once (Note [NVTX ranges cost nothing without a profiler]).
  std::string nvtx_subject;
  std::string forward_range;
  std::string backward_range;
  Signature signature;
  std::shared_ptr<InputBuffers> inputs;
  std::vector<c10::IValue> input_tree;  // the sample, tensors replaced by buffers
  // Signature positions of inputs that require grad, then the parameters that
  // require grad: the tensors the backward graph differentiates.
  std::vector<size_t> grad_input_positions;
  std::vector<at::Tensor> grad_parameters;
  Graph forward;
  Graph backward;
  bool has_backward = false;
  c10::IValue output_tree;                   // as captured, tensors detached
  std::vector<at::Tensor> outputs;           // flattened, detached
  std::vector<bool> output_differentiable;   // per output
  std::vector<at::Tensor> grad_outputs;      // per differentiable output
  std::vector<at::Tensor> grad_results;      // per grad target; undefined when unused
  // FP8 weight casts the forward graph makes, and kept casts of earlier
  // forward graphs it reads (GraphedPassInfo).
  int64_t float8_weight_casts = 0;
  int64_t float8_weight_cast_reads = 0;
  // Of those, the casts later forward graphs read, and the ones it reads.
  std::vector<Float8SharedCast> float8_casts_made;
  std::vector<Float8SharedCast> float8_casts_read;
  // Replay bookkeeping, under shared->mutex.
  uint64_t generation = 0;
  bool backward_pending = false;
  std::atomic<int64_t> backward_replays{0};
  std::atomic<int64_t> grad_copies{0};
  std::shared_ptr<GraphedCallablesShared> shared;
};

// How gradient target `target` of `pair` is named in messages: an input's
// path, or "parameter i (shape dtype device)".
std::string describe_target(const GraphPair& pair, size_t target);

// The tensors the backward graph differentiates: the static inputs that
// require grad, then the parameters that do.
std::vector<at::Tensor> grad_targets(const GraphPair& pair);

// One eager forward and backward of a pair on its static inputs: what warm-up
// repeats, and how the graphs' structure (which outputs are differentiable,
// which targets get gradients) is learnt.
void run_eagerly_once(const GraphableCallable& callable, GraphPair& pair, bool allow_unused);

// Captures the pair's forward graph and keeps its outputs, with their autograd
// graph, for the backward capture.
void capture_forward(const GraphableCallable& callable, GraphPair& pair,
                     const GraphCaptureOptions& graph_options);

// Captures the pair's backward graph (when it has differentiable outputs and
// gradient targets); incoming gradients of one spec share one buffer in
// `grad_output_buffers` across all graphs of the call.
void capture_backward(GraphPair& pair, const GraphCaptureOptions& graph_options,
                      std::unordered_map<std::string, at::Tensor>& grad_output_buffers);

// Refuses graphing while autocast's weight cache is on.
void check_no_autocast_cache();

// Detaches stale gradient accumulators of the pairs' parameters and refuses
// live ones on another stream (Note [Gradient accumulators on the capture
// stream] in graph_pair.cpp).
void check_gradient_accumulators(const std::vector<std::shared_ptr<GraphPair>>& pairs,
                                 const c10::cuda::CUDAStream& capture);

}  // namespace graphed::detail
