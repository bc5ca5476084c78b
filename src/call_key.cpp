#include "graphed/call_key.h"

#include "graphed/static_io.h"

#include <ATen/autocast_mode.h>
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
      // As BucketPlan::padded_sizes: a broadcast size of 1 stays.
      if (d.dim < tensor.dim() && sizes[d.dim] == d.size) {
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

// The path of the `target`-th defined tensor of `value` (counted by
// `seen`), e.g. "kwargs['position_ids']"; empty when not inside `value`.
// Only the reported tensors' paths are ever built.
std::string path_of(const c10::IValue& value, const std::string& path, size_t target,
                    size_t& seen) {
  if (value.isTensor()) {
    if (!value.toTensor().defined()) return "";
    return seen++ == target ? path : "";
  }
  if (value.isTuple() || value.isList()) {
    const bool tuple = value.isTuple();
    const size_t count = tuple ? value.toTupleRef().elements().size() : value.toListRef().size();
    for (size_t i = 0; i < count; ++i) {
      const c10::IValue& element =
          tuple ? value.toTupleRef().elements()[i] : value.toListRef()[i];
      if (std::string found = path_of(element, c10::str(path, "[", i, "]"), target, seen);
          !found.empty()) {
        return found;
      }
    }
  } else if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict()) {
      std::ostringstream key;
      if (entry.key().isString()) {
        key << "'" << entry.key().toStringRef() << "'";
      } else {
        key << entry.key();
      }
      if (std::string found = path_of(entry.value(), c10::str(path, "[", key.str(), "]"), target,
                                      seen);
          !found.empty()) {
        return found;
      }
    }
  }
  return "";
}

std::string input_path(const std::vector<c10::IValue>& inputs, size_t target) {
  size_t seen = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string root = i < 2 ? (i == 0 ? "args" : "kwargs") : c10::str("inputs[", i, "]");
    if (std::string found = path_of(inputs[i], root, target, seen); !found.empty()) {
      return found;
    }
  }
  return c10::str("input tensor ", target);
}

}  // namespace

// Note [Autocast is part of the key]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A graph captured under torch.autocast replays the kernels autocast chose
// then (bf16 GEMMs, fp32 reductions) whatever the caller's autocast state
// is now: a module trained under bf16 autocast and evaluated without it
// would silently keep computing in bf16. So CUDA autocast's state (off, or
// on with its dtype) is the first code after the mode, and a call in another
// state needs (and gets) a graph of its own. Reading it is two thread-local
// loads.
namespace {

int64_t autocast_code() {
  if (!at::autocast::is_autocast_enabled(at::kCUDA)) return 0;
  return 1 + static_cast<int64_t>(at::autocast::get_autocast_dtype(at::kCUDA));
}

}  // namespace

CallKey key_of(const std::vector<c10::IValue>& inputs, const BucketPlan& plan, CallMode mode) {
  CallKey key;
  key.codes.push_back(static_cast<int64_t>(mode));
  key.codes.push_back(autocast_code());
  for (const c10::IValue& input : inputs) encode(input, plan, key);
  return key;
}

void collect_input_tensors(const std::vector<c10::IValue>& inputs,
                           std::vector<at::Tensor>& tensors) {
  for (const c10::IValue& input : inputs) {
    for_each_tensor(input, [&](const at::Tensor& tensor) {
      if (tensor.defined()) tensors.push_back(tensor);
    });
  }
}

std::optional<BucketPlan> plan_collected_buckets(const BucketPolicy& buckets,
                                                 const std::vector<c10::IValue>& inputs,
                                                 const std::vector<at::Tensor>& tensors,
                                                 std::string* why, BucketMiss* miss) {
  if (buckets.empty()) {
    return BucketPlan();
  }
  std::vector<c10::IntArrayRef> sizes;
  sizes.reserve(tensors.size());
  for (const at::Tensor& tensor : tensors) sizes.push_back(tensor.sizes());
  BucketMiss found;
  std::optional<BucketPlan> planned = buckets.plan_sizes(sizes, &found);
  if (!planned) {
    // The tensors are named only now (and not at all when the caller knows
    // this miss already and passed no `why`).
    if (miss != nullptr) *miss = found;
    if (why != nullptr) {
      *why = buckets.describe_miss(
          found, input_path(inputs, found.first),
          found.kind == BucketMiss::Kind::kDisagree ? input_path(inputs, found.other) : "");
    }
  }
  return planned;
}

std::optional<BucketPlan> plan_call_buckets(const BucketPolicy& buckets,
                                            const std::vector<c10::IValue>& inputs,
                                            std::vector<at::Tensor>& tensors, std::string* why,
                                            BucketMiss* miss) {
  std::vector<at::Tensor> collected;
  collect_input_tensors(inputs, collected);
  std::optional<BucketPlan> planned = plan_collected_buckets(buckets, inputs, collected, why, miss);
  tensors.insert(tensors.end(), collected.begin(), collected.end());
  return planned;
}

}  // namespace graphed
