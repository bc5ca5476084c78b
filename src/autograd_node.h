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

}  // namespace graphed::detail
