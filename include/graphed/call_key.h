#pragma once

/// \file call_key.h
/// What identifies the graph a call of a managed module needs: the structure
/// of its inputs, their tensors' properties at bucket sizes, their constants,
/// and the call's mode (CallMode). GraphManager builds a CallKey on every call
/// and looks its graphs up by it, so a key is flat: codes for everything but
/// constants, compared as vectors.

#include "graphed/bucket_policy.h"
#include "graphed/signature.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace graphed {

/// What a call needs from a graph.
enum class CallMode {
  /// No autograd history: grad mode off, or nothing requires grad.
  kInference,
  /// Grad mode on and an input or parameter requires grad: outputs must
  /// carry autograd history (forward and backward graphs).
  kTraining,
};

/// "inference" or "training".
std::string_view call_mode_name(CallMode mode);

/// What identifies the graph a call needs: the structure, tensor properties at
/// bucket sizes and constants of its inputs, and its mode. Built on every call,
/// so it is flat: codes for everything but constants, compared as vectors.
struct CallKey {
  /// The mode, then per input value its kind and, for tensors, dtype, device,
  /// requires_grad and sizes (bucketed dimensions at their buckets).
  std::vector<int64_t> codes;
  /// Non-tensor values and dict keys, in order.
  std::vector<c10::IValue> constants;

  /// Same codes and equal constants (constants_equal).
  bool operator==(const CallKey& other) const {
    if (codes != other.codes || constants.size() != other.constants.size()) {
      return false;
    }
    for (size_t i = 0; i < constants.size(); ++i) {
      if (!constants_equal(constants[i], other.constants[i])) return false;
    }
    return true;
  }
};

/// The key of a call on `inputs` in `mode`, its sizes along the dimensions of
/// `plan` taken at their padded (bucket) sizes.
CallKey key_of(const std::vector<c10::IValue>& inputs, const BucketPlan& plan, CallMode mode);

/// Plans the bucket padding of a call on `inputs` (GraphManager's `(args,
/// kwargs, module.training)`): appends the inputs' defined tensors to
/// `tensors` and returns the plan of `buckets` for their sizes, or nullopt
/// when they cannot be bucketed: then `miss` (when not null) says which
/// tensors, and `why` (when not null) gives the reason naming them (e.g.
/// "args[0]"), built only then. Without buckets the plan pads nothing.
std::optional<BucketPlan> plan_call_buckets(const BucketPolicy& buckets,
                                            const std::vector<c10::IValue>& inputs,
                                            std::vector<at::Tensor>& tensors, std::string* why,
                                            BucketMiss* miss = nullptr);

/// Appends the defined tensors of `inputs` to `tensors`, in for_each_tensor
/// order: what plan_collected_buckets takes.
void collect_input_tensors(const std::vector<c10::IValue>& inputs,
                           std::vector<at::Tensor>& tensors);

/// plan_call_buckets for `tensors` collected from `inputs` before
/// (collect_input_tensors), so that a caller planning with several policies
/// collects them once.
std::optional<BucketPlan> plan_collected_buckets(const BucketPolicy& buckets,
                                                 const std::vector<c10::IValue>& inputs,
                                                 const std::vector<at::Tensor>& tensors,
                                                 std::string* why, BucketMiss* miss = nullptr);

}  // namespace graphed
