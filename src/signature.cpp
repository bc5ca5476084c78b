#include "graphed/signature.h"

#include "graphed/check.h"

#include <c10/core/ScalarType.h>

#include <cstring>
#include <iomanip>
#include <sstream>

namespace graphed {
namespace {

std::string format_sizes(c10::IntArrayRef sizes) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < sizes.size(); ++i) {
    out << (i == 0 ? "" : ", ") << sizes[i];
  }
  out << (sizes.size() == 1 ? ",)" : ")");
  return out.str();
}

std::string dtype_name(c10::ScalarType dtype) {
  // c10 prints "Float"; users know torch's spelling, "float32".
  switch (dtype) {
    case c10::kFloat: return "float32";
    case c10::kDouble: return "float64";
    case c10::kHalf: return "float16";
    case c10::kBFloat16: return "bfloat16";
    case c10::kLong: return "int64";
    case c10::kInt: return "int32";
    case c10::kShort: return "int16";
    case c10::kChar: return "int8";
    case c10::kByte: return "uint8";
    case c10::kBool: return "bool";
    case c10::kComplexFloat: return "complex64";
    case c10::kComplexDouble: return "complex128";
    default: return c10::toString(dtype);
  }
}

std::string child_path(const std::string& parent, const c10::IValue& key) {
  if (key.isString()) {
    return c10::str(parent, "['", key.toStringRef(), "']");
  }
  std::ostringstream out;
  out << parent << "[" << key << "]";
  return out.str();
}

std::string index_path(const std::string& parent, size_t index) {
  return c10::str(parent, "[", index, "]");
}

}  // namespace

TensorSpec TensorSpec::of(const at::Tensor& tensor) {
  TensorSpec spec;
  spec.sizes = tensor.sizes().vec();
  spec.dtype = tensor.scalar_type();
  spec.device = tensor.device();
  spec.requires_grad = tensor.requires_grad();
  return spec;
}

bool TensorSpec::matches(const at::Tensor& tensor, bool check_requires_grad) const {
  return tensor.defined() && tensor.scalar_type() == dtype && tensor.device() == device &&
         tensor.sizes().equals(sizes) &&
         (!check_requires_grad || tensor.requires_grad() == requires_grad);
}

std::string TensorSpec::describe() const {
  return c10::str(format_sizes(sizes), " ", dtype_name(dtype), " ", device.str(),
                  requires_grad ? " requires_grad" : "");
}

std::string describe_tensor(const at::Tensor& tensor) {
  if (!tensor.defined()) {
    return "an undefined tensor";
  }
  return TensorSpec::of(tensor).describe();
}

std::string describe_value(const c10::IValue& value) {
  if (value.isTensor()) {
    return describe_tensor(value.toTensor());
  }
  if (value.isTuple()) {
    return c10::str("a tuple of ", value.toTupleRef().elements().size());
  }
  if (value.isList()) {
    return c10::str("a list of ", value.toListRef().size());
  }
  if (value.isGenericDict()) {
    std::ostringstream out;
    out << "a dict with keys {";
    bool first = true;
    for (const auto& entry : value.toGenericDict()) {
      out << (first ? "" : ", ") << entry.key();
      first = false;
    }
    out << "}";
    return out.str();
  }
  if (value.isNone()) {
    return "None";
  }
  if (value.isPyObject()) {
    return value.toPyObjectHolder()->toStr();
  }
  // Constants read as Python writes them; a float always shows its point, so
  // that 2 and 2.0 (different signatures) look different.
  if (value.isBool()) {
    return value.toBool() ? "True" : "False";
  }
  if (value.isInt()) {
    return std::to_string(value.toInt());
  }
  if (value.isDouble()) {
    std::ostringstream out;
    out << std::setprecision(17) << value.toDouble();
    std::string text = out.str();
    if (text.find_first_of(".eni") == std::string::npos) {
      text += ".0";
    }
    return text;
  }
  if (value.isString()) {
    return c10::str("'", value.toStringRef(), "'");
  }
  if (value.isDevice()) {
    return c10::str("device '", value.toDevice().str(), "'");
  }
  std::ostringstream out;
  out << value << " (" << value.tagKind() << ")";
  return out.str();
}

// Note [Host objects holding tensors]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A graph sees the tensors of its inputs; a host-language object among them
// (transformers' DynamicCache, passed to every layer of a causal LM) is a
// constant of the signature, compared by identity. When the module reads or
// updates tensors inside it (a cache appends this step's keys), a replay
// would neither read the new ones nor append: silently wrong results. The
// host language says which objects hold such state (its
// PyObjectHolder::extractTensors lists their tensors, and names caches that
// are still empty); such inputs are refused for capture, and graphed.auto
// runs those calls eagerly with the reason.
namespace {

std::optional<std::string> find_stateful(const c10::IValue& value, const std::string& path) {
  if (value.isPyObject()) {
    const auto holder = value.toPyObjectHolder();
    if (!holder->extractTensors().empty()) {
      std::string text = holder->toStr();
      constexpr size_t kShown = 80;
      if (text.size() > kShown) text = text.substr(0, kShown) + "...";
      return c10::str(path, " (", text, ")");
    }
    return std::nullopt;
  }
  if (value.isTuple()) {
    const auto& elements = value.toTupleRef().elements();
    for (size_t i = 0; i < elements.size(); ++i) {
      if (auto found = find_stateful(elements[i], index_path(path, i))) return found;
    }
  } else if (value.isList()) {
    const auto list = value.toListRef();
    for (size_t i = 0; i < list.size(); ++i) {
      if (auto found = find_stateful(list[i], index_path(path, i))) return found;
    }
  } else if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict()) {
      if (auto found = find_stateful(entry.value(), child_path(path, entry.key()))) return found;
    }
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::string> find_stateful_host_object(const std::vector<c10::IValue>& inputs,
                                                     const std::vector<std::string>& input_names) {
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string name = i < input_names.size() ? input_names[i] : c10::str("inputs[", i, "]");
    if (auto found = find_stateful(inputs[i], name)) return found;
  }
  return std::nullopt;
}

bool constants_equal(const c10::IValue& a, const c10::IValue& b) {
  if (a.tagKind() != b.tagKind()) {
    return false;
  }
  if (a.isNone()) return true;
  if (a.isBool()) return a.toBool() == b.toBool();
  if (a.isInt()) return a.toInt() == b.toInt();
  if (a.isDouble()) {
    // Bitwise, so that NaN equals NaN and -0.0 differs from 0.0: the graph
    // baked in exactly this value.
    const double x = a.toDouble();
    const double y = b.toDouble();
    return std::memcmp(&x, &y, sizeof(double)) == 0;
  }
  if (a.isString()) return a.toStringRef() == b.toStringRef();
  if (a.isDevice()) return a.toDevice() == b.toDevice();
  if (a.isPyObject()) {
    return a.toPyObjectHolder()->getPyObject() == b.toPyObjectHolder()->getPyObject();
  }
  // Other IValue kinds (scalars of exotic types, objects) compare by identity.
  return a.isSameIdentity(b);
}

Signature::Signature(const std::vector<c10::IValue>& inputs,
                     std::vector<std::string> input_names, SignatureOptions options)
    : input_names_(std::move(input_names)), options_(options) {
  GRAPHED_CHECK(input_names_.size() == inputs.size(), "Expected one name per input, got ",
                input_names_.size(), " names for ", inputs.size(), " inputs.");
  for (size_t i = 0; i < inputs.size(); ++i) {
    record(inputs[i], input_names_[i]);
  }
}

void Signature::record(const c10::IValue& value, const std::string& path) {
  Node node;
  if (value.isTensor()) {
    node.kind = NodeKind::kTensor;
    node.count = static_cast<uint32_t>(tensor_specs_.size());
    tensor_specs_.push_back(TensorSpec::of(value.toTensor()));
    tensor_paths_.push_back(path);
    leaf_descriptions_.push_back(c10::str(path, ": ", tensor_specs_.back().describe()));
    nodes_.push_back(std::move(node));
    return;
  }
  if (value.isTuple()) {
    const auto& elements = value.toTupleRef().elements();
    node.kind = NodeKind::kTuple;
    node.count = static_cast<uint32_t>(elements.size());
    nodes_.push_back(std::move(node));
    for (size_t i = 0; i < elements.size(); ++i) {
      record(elements[i], index_path(path, i));
    }
    return;
  }
  if (value.isList()) {
    const auto list = value.toListRef();
    node.kind = NodeKind::kList;
    node.count = static_cast<uint32_t>(list.size());
    nodes_.push_back(std::move(node));
    for (size_t i = 0; i < list.size(); ++i) {
      record(list[i], index_path(path, i));
    }
    return;
  }
  if (value.isGenericDict()) {
    const auto dict = value.toGenericDict();
    node.kind = NodeKind::kDict;
    node.count = static_cast<uint32_t>(dict.size());
    for (const auto& entry : dict) {
      node.keys.push_back(entry.key());
    }
    const std::vector<c10::IValue> keys = node.keys;
    nodes_.push_back(std::move(node));
    for (const c10::IValue& key : keys) {
      record(dict.at(key), child_path(path, key));
    }
    return;
  }
  if (value.isPyObject()) {
    // See Note [Host objects holding tensors].
    const std::optional<std::string> stateful = find_stateful(value, path);
    GRAPHED_CHECK(!stateful, "Expected the inputs of a graph to hold their tensors in tuples, "
                  "lists and dicts, but ", *stateful, " is a host object holding tensors or state "
                  "the function updates: a replay would neither see nor update them. Pass the "
                  "tensors themselves, or leave that object out of the captured call (for a "
                  "transformers model, use_cache=False).");
  }
  node.kind = NodeKind::kConstant;
  node.constant = value;
  leaf_descriptions_.push_back(c10::str(path, ": ", describe_value(value)));
  nodes_.push_back(std::move(node));
}

bool Signature::collect_tensors(const std::vector<c10::IValue>& inputs,
                                std::vector<at::Tensor>& tensors) const {
  if (inputs.size() != input_names_.size()) {
    return false;
  }
  size_t node = 0;
  for (const c10::IValue& input : inputs) {
    if (!match(input, node, tensors)) {
      return false;
    }
  }
  return true;
}

bool Signature::match(const c10::IValue& value, size_t& node_index,
                      std::vector<at::Tensor>& tensors) const {
  const Node& node = nodes_[node_index++];
  switch (node.kind) {
    case NodeKind::kTensor: {
      if (!value.isTensor()) return false;
      const at::Tensor& tensor = value.toTensor();
      if (!tensor_specs_[node.count].matches(tensor, options_.match_requires_grad)) return false;
      tensors.push_back(tensor);
      return true;
    }
    case NodeKind::kTuple: {
      if (!value.isTuple()) return false;
      const auto& elements = value.toTupleRef().elements();
      if (elements.size() != node.count) return false;
      for (const c10::IValue& element : elements) {
        if (!match(element, node_index, tensors)) return false;
      }
      return true;
    }
    case NodeKind::kList: {
      if (!value.isList()) return false;
      const auto list = value.toListRef();
      if (list.size() != node.count) return false;
      for (const c10::IValue& element : list) {
        if (!match(element, node_index, tensors)) return false;
      }
      return true;
    }
    case NodeKind::kDict: {
      if (!value.isGenericDict()) return false;
      const auto dict = value.toGenericDict();
      if (dict.size() != node.count) return false;
      for (const c10::IValue& key : node.keys) {
        auto found = dict.find(key);
        if (found == dict.end() || !match(found->value(), node_index, tensors)) return false;
      }
      return true;
    }
    case NodeKind::kConstant:
      return constants_equal(value, node.constant);
  }
  return false;
}

std::string Signature::describe_node(size_t node_index) const {
  const Node& node = nodes_[node_index];
  switch (node.kind) {
    case NodeKind::kTensor: return tensor_specs_[node.count].describe();
    case NodeKind::kTuple: return c10::str("a tuple of ", node.count);
    case NodeKind::kList: return c10::str("a list of ", node.count);
    case NodeKind::kDict: return c10::str("a dict of ", node.count);
    case NodeKind::kConstant: return describe_value(node.constant);
  }
  return "";
}

size_t Signature::skip(size_t node_index) const {
  const Node& node = nodes_[node_index++];
  if (node.kind == NodeKind::kTuple || node.kind == NodeKind::kList ||
      node.kind == NodeKind::kDict) {
    for (uint32_t i = 0; i < node.count; ++i) {
      node_index = skip(node_index);
    }
  }
  return node_index;
}

std::vector<std::string> Signature::differences(const std::vector<c10::IValue>& inputs,
                                                size_t limit) const {
  std::vector<std::string> out;
  if (inputs.size() != input_names_.size()) {
    out.push_back(c10::str("expected ", input_names_.size(), " inputs, got ", inputs.size()));
    return out;
  }
  size_t node = 0;
  for (size_t i = 0; i < inputs.size() && out.size() < limit; ++i) {
    diff(inputs[i], node, input_names_[i], out, limit);
  }
  return out;
}

void Signature::diff(const c10::IValue& value, size_t& node_index, const std::string& path,
                     std::vector<std::string>& out, size_t limit) const {
  if (out.size() >= limit) {
    node_index = skip(node_index);
    return;
  }
  const size_t this_node = node_index;
  const Node& node = nodes_[node_index];
  auto mismatch = [&](const std::string& expected) {
    out.push_back(c10::str(path, ": expected ", expected, ", got ", describe_value(value)));
    node_index = skip(this_node);
  };
  switch (node.kind) {
    case NodeKind::kTensor: {
      const TensorSpec& spec = tensor_specs_[node.count];
      if (!value.isTensor() || !spec.matches(value.toTensor(), options_.match_requires_grad)) {
        return mismatch(spec.describe());
      }
      ++node_index;
      return;
    }
    case NodeKind::kTuple:
    case NodeKind::kList: {
      const bool is_tuple = node.kind == NodeKind::kTuple;
      const char* kind = is_tuple ? "a tuple of " : "a list of ";
      if (is_tuple ? !value.isTuple() : !value.isList()) {
        return mismatch(c10::str(kind, node.count));
      }
      const std::vector<c10::IValue> elements =
          is_tuple ? value.toTupleRef().elements().vec() : value.toListRef().vec();
      if (elements.size() != node.count) {
        return mismatch(c10::str(kind, node.count));
      }
      ++node_index;
      for (size_t i = 0; i < elements.size(); ++i) {
        diff(elements[i], node_index, index_path(path, i), out, limit);
      }
      return;
    }
    case NodeKind::kDict: {
      if (!value.isGenericDict()) {
        return mismatch("a dict");
      }
      const auto dict = value.toGenericDict();
      ++node_index;
      for (const c10::IValue& key : node.keys) {
        auto found = dict.find(key);
        if (found == dict.end()) {
          if (out.size() < limit) {
            out.push_back(c10::str(child_path(path, key), ": missing (captured with ",
                                   describe_node(node_index), ")"));
          }
          node_index = skip(node_index);
          continue;
        }
        diff(found->value(), node_index, child_path(path, key), out, limit);
      }
      for (const auto& entry : dict) {
        bool known = false;
        for (const c10::IValue& key : node.keys) {
          known = known || constants_equal(key, entry.key());
        }
        if (!known && out.size() < limit) {
          out.push_back(c10::str(child_path(path, entry.key()),
                                 ": not present when the graph was captured"));
        }
      }
      return;
    }
    case NodeKind::kConstant:
      if (!constants_equal(value, node.constant)) {
        return mismatch(describe_value(node.constant));
      }
      ++node_index;
      return;
  }
}

std::string Signature::describe() const {
  std::ostringstream out;
  for (size_t i = 0; i < leaf_descriptions_.size(); ++i) {
    out << (i == 0 ? "" : "\n") << leaf_descriptions_[i];
  }
  return out.str();
}

}  // namespace graphed
