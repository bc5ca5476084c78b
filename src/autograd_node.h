#pragma once

// Private to libgraphed: creating autograd nodes on every supported torch.
//
// Note [Autograd node ownership]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch 2.11 owns autograd nodes through std::shared_ptr<Node> (created with
// torch::autograd::deleteNode as deleter, which only avoids deep recursion on
// long chains); torch 2.14 made Node an intrusive_ptr_target owned through
// c10::intrusive_ptr<Node>. Edge::function has the owning type of the version
// at hand, so make_node picks the matching factory at compile time.

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace graphed::detail {

// The owning pointer type autograd uses for nodes in this torch version.
using NodePtr = decltype(torch::autograd::Edge::function);

template <typename NodeType, typename... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::shared_ptr<NodeType>(new NodeType(std::forward<Args>(args)...));
  } else {
    return c10::make_intrusive<NodeType>(std::forward<Args>(args)...);
  }
}

template <typename Strong>
auto no_accumulator(const Strong& /*names autograd's owning pointer type*/) {
  if constexpr (std::is_same_v<Strong, std::shared_ptr<torch::autograd::Node>>) {
    return std::weak_ptr<torch::autograd::Node>();
  } else {
    return c10::weak_intrusive_ptr<torch::autograd::Node>(Strong());
  }
}

// Detaches `parameter` from its live AccumulateGrad node when that node was
// created on a stream other than `capture` and has no hooks of its own (a
// node kept alive by the user's previous loss, not DistributedDataParallel's);
// warm-up on the capture stream then creates a fresh one there. Returns true
// when it did. See Note [Gradient accumulators on the capture stream] in
// graph_pair.cpp.
inline bool detach_stale_gradient_accumulator(const at::Tensor& parameter, c10::Stream capture) {
  if (!parameter.defined() || !parameter.requires_grad() || !parameter.is_leaf()) {
    return false;
  }
  const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(parameter);
  if (!accumulator || accumulator->num_inputs() == 0 ||
      accumulator->input_metadata(0).stream() == capture || !accumulator->pre_hooks().empty() ||
      !accumulator->post_hooks().empty()) {
    return false;
  }
  torch::autograd::impl::set_grad_accumulator(parameter, no_accumulator(accumulator));
  return true;
}

}  // namespace graphed::detail
