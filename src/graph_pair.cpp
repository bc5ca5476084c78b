#include "graph_pair.h"

#include "autograd_node.h"
#include "graphed/check.h"
#include "graphed/static_io.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

namespace graphed::detail {

std::string describe_target(const GraphPair& pair, size_t target) {
  if (target < pair.grad_input_positions.size()) {
    return pair.signature.tensor_path(pair.grad_input_positions[target]);
  }
  return c10::str("parameter ", target - pair.grad_input_positions.size(), " (",
                  describe_tensor(pair.grad_parameters[target - pair.grad_input_positions.size()]),
                  ")");
}

std::vector<at::Tensor> grad_targets(const GraphPair& pair) {
  std::vector<at::Tensor> targets;
  for (size_t position : pair.grad_input_positions) {
    targets.push_back(pair.inputs->tensors[position]);
  }
  targets.insert(targets.end(), pair.grad_parameters.begin(), pair.grad_parameters.end());
  return targets;
}

void run_eagerly_once(const GraphableCallable& callable, GraphPair& pair, bool allow_unused) {
  const c10::IValue output = callable.function(pair.input_tree);
  std::vector<at::Tensor> differentiable;
  for (const at::Tensor& tensor : flatten_tensors(output)) {
    if (tensor.defined() && tensor.requires_grad()) {
      differentiable.push_back(tensor);
    }
  }
  const std::vector<at::Tensor> targets = grad_targets(pair);
  if (differentiable.empty() || targets.empty()) {
    return;
  }
  std::vector<at::Tensor> seeds;
  for (const at::Tensor& tensor : differentiable) {
    seeds.push_back(at::empty_like(tensor));
  }
  const std::vector<at::Tensor> grads = torch::autograd::grad(
      differentiable, targets, seeds, /*retain_graph=*/false, /*create_graph=*/false,
      /*allow_unused=*/true);
  if (!allow_unused) {
    for (size_t i = 0; i < grads.size(); ++i) {
      GRAPHED_CHECK(grads[i].defined(), "Expected every input and parameter of ",
                    pair.description, " that requires grad to receive a gradient, but ",
                    describe_target(pair, i), " is not used by its differentiable outputs. "
                    "Pass allow_unused_input=True to accept a None gradient for it, or stop "
                    "it requiring grad.");
    }
  }
}

void capture_forward(const GraphableCallable& callable, GraphPair& pair,
                     const GraphCaptureOptions& graph_options) {
  c10::IValue output;
  pair.forward.capture([&] { output = callable.function(pair.input_tree); }, graph_options);
  const std::vector<at::Tensor> tensors = flatten_tensors(output);
  for (const at::Tensor& tensor : tensors) {
    GRAPHED_CHECK_AS(CaptureError, !tensor.defined() || tensor.is_cuda(), pair.description,
                     " returned a tensor on ", tensor.device().str(), " (",
                     describe_tensor(tensor), "). A graph only replays GPU work, so that output "
                     "would keep its value from capture forever. Return GPU tensors.");
    pair.output_differentiable.push_back(tensor.defined() && tensor.requires_grad());
  }
  // Keep the autograd graph of the capture alive until the backward capture.
  pair.outputs = tensors;
  pair.output_tree = std::move(output);
}

void capture_backward(GraphPair& pair, const GraphCaptureOptions& graph_options,
                      std::unordered_map<std::string, at::Tensor>& grad_output_buffers) {
  std::vector<at::Tensor> differentiable;
  for (size_t i = 0; i < pair.outputs.size(); ++i) {
    if (!pair.output_differentiable[i]) {
      continue;
    }
    const at::Tensor& output = pair.outputs[i];
    differentiable.push_back(output);
    // Incoming gradients live only from the copy into the buffer to the end
    // of the backward replay, so outputs of one spec share one buffer across
    // all graphs of the call.
    const std::string key = describe_tensor(output) + c10::str(output.strides());
    auto [it, inserted] = grad_output_buffers.try_emplace(key);
    if (inserted) {
      it->second = at::empty_like(output, at::MemoryFormat::Preserve).detach();
    }
    pair.grad_outputs.push_back(it->second);
  }
  const std::vector<at::Tensor> targets = grad_targets(pair);
  pair.has_backward = !differentiable.empty() && !targets.empty();
  if (pair.has_backward) {
    pair.backward.capture(
        [&] {
          pair.grad_results = torch::autograd::grad(differentiable, targets, pair.grad_outputs,
                                                    /*retain_graph=*/false,
                                                    /*create_graph=*/false, /*allow_unused=*/true);
        },
        graph_options);
  } else {
    pair.grad_outputs.clear();
  }
  // Drop the capture's autograd graph; callers get detached aliases.
  for (at::Tensor& output : pair.outputs) {
    output = output.defined() ? output.detach() : output;
  }
  size_t next = 0;
  pair.output_tree = map_tensors(pair.output_tree, [&](const at::Tensor&) {
    return pair.outputs.at(next++);
  });
}

void check_no_autocast_cache() {
  for (const c10::DeviceType type : {c10::DeviceType::CUDA, c10::DeviceType::CPU}) {
    GRAPHED_CHECK(!(at::autocast::is_autocast_enabled(type) &&
                    at::autocast::is_autocast_cache_enabled()),
                  "Expected autocast's weight cache to be off while graphing, but autocast is "
                  "enabled for ", c10::DeviceTypeName(type), " with cache_enabled=True. The "
                  "cache holds casts of the weights made during capture, which would be freed "
                  "with the capture's memory and read by every replay. Use "
                  "torch.autocast(..., cache_enabled=False) around graphing and the calls.");
  }
}

// Note [Gradient accumulators on the capture stream]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The backward capture differentiates with respect to the parameters, so
// autograd routes their gradients through the parameters' AccumulateGrad
// nodes, and makes each node's stream (the stream current when the node was
// created) wait for the capture stream. A node created on the default stream
// cannot wait for a capturing stream: CUDA rejects the capture ("operation
// would make the legacy stream depend on a capturing blocking stream").
// AccumulateGrad nodes normally die with the autograd graph that made them and
// warm-up creates fresh ones on the capture stream. Two things keep one alive:
//  - The user's previous loss. The everyday loop `loss = model(x).loss;
//    loss.backward()` still holds last step's loss, and with it last step's
//    autograd graph (its buffers freed by backward, its nodes not), while the
//    next forward runs, which is when graphed.auto captures. Such a node has
//    no hooks of its own (a tensor's hooks live on the tensor, and
//    AccumulateGrad reads them from there) and accumulates into its own
//    variable whoever points at it, so the parameter is simply detached from
//    it (set_grad_accumulator to nothing) and warm-up creates a fresh one on
//    the capture stream. Nothing the user can observe changes.
//  - DistributedDataParallel, which keeps them from its construction and
//    hangs its all-reduce hooks on them. Such a node must stay the
//    parameter's, so the parameter is refused before any warm-up, with the
//    fix (build DDP on graphed's capture stream).
void check_gradient_accumulators(const std::vector<std::shared_ptr<GraphPair>>& pairs,
                                 const c10::cuda::CUDAStream& capture) {
  for (const auto& pair : pairs) {
    for (size_t i = 0; i < pair->grad_parameters.size(); ++i) {
      const auto accumulator =
          torch::autograd::impl::try_get_grad_accumulator(pair->grad_parameters[i]);
      if (!accumulator || accumulator->num_inputs() == 0) {
        continue;
      }
      if (detach_stale_gradient_accumulator(pair->grad_parameters[i], capture)) {
        continue;
      }
      const c10::Stream found = accumulator->input_metadata(0).stream();
      GRAPHED_CHECK(found == c10::Stream(capture), "Expected the gradient accumulator of ",
                    pair->description, "'s parameter ", i, " (",
                    describe_tensor(pair->grad_parameters[i]), ") on graphed's capture stream, "
                    "but it was created on stream ", found.id(), " of ", found.device().str(),
                    " and is still alive (DistributedDataParallel keeps them from its "
                    "construction), so the backward capture would make that stream wait on "
                    "the capturing one, which CUDA refuses. Build the DDP model with "
                    "graphed.distributed.prepare_ddp(module), which constructs it on the "
                    "capture stream (Note [Gradient accumulators on the capture stream]).");
    }
  }
}

}  // namespace graphed::detail
