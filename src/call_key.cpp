#include "graphed/call_key.h"

#include "graphed/static_io.h"

#include <c10/util/StringUtil.h>

#include <sstream>

namespace graphed {

std::string_view call_mode_name(CallMode mode) {
  return mode == CallMode::kTraining ? "training" : "inference";
}

namespace {

enum KeyCode : int64_t { kTensorCode = -1, kTupleCode = -2, kListCode = -3, kDictCode = -4,
                         kConstantCode = -5, kUndefinedCode = -6 };

void encode(const c10::IValue& value, const BucketPlan& plan, CallKey& key) {
  if (value.isTensor()) {
    const at::Tensor& tensor = value.toTensor();
    if (!tensor.defined()) {
      key.codes.push_back(kUndefinedCode);
      return;
    }
    key.codes.push_back(kTensorCode);
    key.codes.push_back(static_cast<int64_t>(tensor.scalar_type()));
    key.codes.push_back(static_cast<int64_t>(tensor.device().type()));
    key.codes.push_back(tensor.device().index());
    key.codes.push_back(tensor.requires_grad() ? 1 : 0);
    key.codes.push_back(tensor.dim());
    const c10::IntArrayRef sizes = tensor.sizes();
    const size_t first = key.codes.size();
    key.codes.insert(key.codes.end(), sizes.begin(), sizes.end());
    for (const BucketedDim& d : plan.dims()) {
      if (d.dim < tensor.dim()) {
        key.codes[first + d.dim] = d.padded;
      }
    }
  } else if (value.isTuple()) {
    const auto& elements = value.toTupleRef().elements();
    key.codes.push_back(kTupleCode);
    key.codes.push_back(static_cast<int64_t>(elements.size()));
    for (const c10::IValue& element : elements) encode(element, plan, key);
  } else if (value.isList()) {
    const auto list = value.toListRef();
    key.codes.push_back(kListCode);
    key.codes.push_back(static_cast<int64_t>(list.size()));
    for (const c10::IValue& element : list) encode(element, plan, key);
  } else if (value.isGenericDict()) {
    const auto dict = value.toGenericDict();
    key.codes.push_back(kDictCode);
    key.codes.push_back(static_cast<int64_t>(dict.size()));
    for (const auto& entry : dict) {
      key.constants.push_back(entry.key());
      encode(entry.value(), plan, key);
    }
  } else {
    key.codes.push_back(kConstantCode);
    key.constants.push_back(value);
  }
}

// The tensors of the inputs with their paths, for bucket planning.
void collect(const c10::IValue& value, const std::string& path, std::vector<at::Tensor>& tensors,
             std::vector<std::string>& paths) {
  if (value.isTensor()) {
    if (value.toTensor().defined()) {
      tensors.push_back(value.toTensor());
      paths.push_back(path);
    }
  } else if (value.isTuple()) {
    const auto& elements = value.toTupleRef().elements();
    for (size_t i = 0; i < elements.size(); ++i) {
      collect(elements[i], c10::str(path, "[", i, "]"), tensors, paths);
    }
  } else if (value.isList()) {
    const auto list = value.toListRef();
    for (size_t i = 0; i < list.size(); ++i) {
      collect(list[i], c10::str(path, "[", i, "]"), tensors, paths);
    }
  } else if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict()) {
      std::ostringstream key;
      if (entry.key().isString()) {
        key << "'" << entry.key().toStringRef() << "'";
      } else {
        key << entry.key();
      }
      collect(entry.value(), c10::str(path, "[", key.str(), "]"), tensors, paths);
    }
  }
}

}  // namespace

CallKey key_of(const std::vector<c10::IValue>& inputs, const BucketPlan& plan, CallMode mode) {
  CallKey key;
  key.codes.push_back(static_cast<int64_t>(mode));
  for (const c10::IValue& input : inputs) encode(input, plan, key);
  return key;
}

std::optional<BucketPlan> plan_call_buckets(const BucketPolicy& buckets,
                                            const std::vector<c10::IValue>& inputs,
                                            std::vector<at::Tensor>& tensors, std::string* why) {
  if (buckets.empty()) {
    // The replay path: no input paths to build, they only name uncovered sizes.
    for (const c10::IValue& input : inputs) {
      for_each_tensor(input, [&](const at::Tensor& tensor) { tensors.push_back(tensor); });
    }
    return BucketPlan();
  }
  std::vector<std::string> paths;
  for (size_t i = 0; i < inputs.size(); ++i) {
    collect(inputs[i], i < 2 ? (i == 0 ? "args" : "kwargs") : c10::str("inputs[", i, "]"),
            tensors, paths);
  }
  std::vector<c10::IntArrayRef> sizes;
  sizes.reserve(tensors.size());
  for (const at::Tensor& tensor : tensors) sizes.push_back(tensor.sizes());
  return buckets.plan(sizes, paths, why);
}

}  // namespace graphed
