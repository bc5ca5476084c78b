#pragma once

/// \file signature.h
/// What identifies the inputs of a graph. A captured graph reads fixed
/// addresses with fixed shapes, so every call must present the same nested
/// structure (tuples, lists, dicts), the same tensor shapes, dtypes and
/// devices, and equal non-tensor values. A Signature records that at capture
/// and checks it on every call; when a call differs it spells out where and how.

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace graphed {

/// The properties of a tensor that a graph depends on.
struct TensorSpec {
  /// Sizes of every dimension.
  std::vector<int64_t> sizes;
  /// Element type.
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  /// Device the tensor lives on.
  c10::Device device = c10::Device(c10::kCPU);
  /// Whether the tensor requires grad.
  bool requires_grad = false;

  /// The spec of `tensor`.
  static TensorSpec of(const at::Tensor& tensor);
  /// True when `tensor` has these sizes, dtype and device (and requires_grad
  /// too when `check_requires_grad`).
  bool matches(const at::Tensor& tensor, bool check_requires_grad) const;
  /// E.g. "(32, 512) float32 cuda:0".
  std::string describe() const;
};

/// Describes a tensor as TensorSpec::describe does.
std::string describe_tensor(const at::Tensor& tensor);

/// Describes any input value for a message: a tensor's spec, a container's
/// kind and size, or a constant's value.
std::string describe_value(const c10::IValue& value);

/// Where `inputs` (named by `input_names`) hold a host-language object that
/// holds tensors or state a module updates (transformers' DynamicCache, say),
/// as "kwargs['past_key_values'] (DynamicCache(...))", or nullopt. See Note
/// [Host objects holding tensors] in signature.cpp.
std::optional<std::string> find_stateful_host_object(const std::vector<c10::IValue>& inputs,
                                                     const std::vector<std::string>& input_names);

/// Options of a Signature.
struct SignatureOptions {
  /// Also require each tensor's requires_grad to match the sample's.
  bool match_requires_grad = false;
};

/// The structure, tensor specs and constants of a list of named inputs.
class Signature {
 public:
  /// An empty signature (no inputs).
  Signature() = default;
  /// Records the signature of `inputs`; `input_names[i]` names `inputs[i]` in
  /// messages (e.g. "args", "kwargs"). Tensors are numbered in depth-first
  /// order; dict entries in the order of the sample's keys.
  Signature(const std::vector<c10::IValue>& inputs, std::vector<std::string> input_names,
            SignatureOptions options = {});

  /// Appends the tensors of `inputs` to `tensors` in signature order and
  /// returns true, or returns false (leaving `tensors` partly filled) when
  /// `inputs` do not match. The fast path of every call.
  bool collect_tensors(const std::vector<c10::IValue>& inputs,
                       std::vector<at::Tensor>& tensors) const;

  /// Every difference between `inputs` and this signature, one line each
  /// (e.g. "args[0]: expected (32, 512) float32 cuda:0, got (16, 512) float32
  /// cuda:0"), at most `limit` lines. Empty when they match.
  std::vector<std::string> differences(const std::vector<c10::IValue>& inputs,
                                       size_t limit = 8) const;

  /// Number of tensors in the signature.
  size_t num_tensors() const { return tensor_specs_.size(); }
  /// The spec of each tensor, in signature order.
  const std::vector<TensorSpec>& tensor_specs() const { return tensor_specs_; }
  /// Where tensor `index` sits in the inputs, e.g. "kwargs['mask']".
  const std::string& tensor_path(size_t index) const { return tensor_paths_.at(index); }
  /// Names of the inputs.
  const std::vector<std::string>& input_names() const { return input_names_; }
  /// One line per leaf: "args[0]: (32, 512) float32 cuda:0".
  std::string describe() const;

 private:
  enum class NodeKind : uint8_t { kTensor, kTuple, kList, kDict, kConstant };
  struct Node {
    NodeKind kind;
    // Children of a container; index into tensor_specs_ for a tensor.
    uint32_t count = 0;
    // The value of a constant; unused otherwise.
    c10::IValue constant;
    // Keys of a dict, in the sample's order.
    std::vector<c10::IValue> keys;
  };

  void record(const c10::IValue& value, const std::string& path);
  bool match(const c10::IValue& value, size_t& node, std::vector<at::Tensor>& tensors) const;
  void diff(const c10::IValue& value, size_t& node, const std::string& path,
            std::vector<std::string>& out, size_t limit) const;
  size_t skip(size_t node) const;
  std::string describe_node(size_t node) const;

  std::vector<Node> nodes_;
  std::vector<TensorSpec> tensor_specs_;
  std::vector<std::string> tensor_paths_;
  std::vector<std::string> leaf_descriptions_;
  std::vector<std::string> input_names_;
  SignatureOptions options_;
};

/// True when two non-tensor input values are the same for a graph: equal
/// numbers, strings, booleans and devices of the same type; the same object
/// for opaque host-language objects.
bool constants_equal(const c10::IValue& a, const c10::IValue& b);

}  // namespace graphed
