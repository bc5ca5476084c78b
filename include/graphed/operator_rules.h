#pragma once

/// \file operator_rules.h
/// The rules of the safety check (safety_check.h): which ATen operator calls
/// break or spoil CUDA graph capture, judged from the operator's name and
/// arguments as a RecordFunction callback sees them before the kernel runs
/// (Note [How the safety check observes] in safety_check.cpp). Pure functions
/// of one call: check_safety feeds them every operator of its pass and keeps
/// the findings; they need no GPU to be tested.

#include "graphed/capture_blockers.h"
#include "graphed/safety_check.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>

#include <string>
#include <string_view>
#include <vector>

namespace graphed {

/// One operator as the start callback sees it.
struct OperatorCall {
  /// The operator's name, e.g. "aten::item".
  std::string_view name;
  /// Its arguments, as the callback received them.
  c10::ArrayRef<const c10::IValue> inputs;
  /// The tensors among `inputs` (collect_operator_tensors).
  std::vector<at::Tensor> tensors;
  /// True when it works on a CUDA device (is_gpu_work).
  bool on_gpu = false;
  /// True when it runs inside another operator rather than straight from the
  /// user's program or from autograd (Note [Operators inside CPU kernels] in
  /// operator_rules.cpp).
  bool inside_operator = false;
};

/// Appends the defined tensors of an operator argument to `tensors`: a
/// tensor, or the tensors of one list or tuple (cat, index's indices; ATen
/// schemas nest no deeper). `depth` is the nesting reached so far.
void collect_operator_tensors(const c10::IValue& value, std::vector<at::Tensor>& tensors,
                              int depth = 0);

/// The first four of `tensors` described ("(4,) float32 cpu, ..."), and how
/// many more there are.
std::string describe_tensors(const std::vector<at::Tensor>& tensors);

/// True when one of `tensors` is a CUDA tensor.
bool any_cuda(const std::vector<at::Tensor>& tensors);

/// Every rule that `call` breaks, as findings without a location: host reads,
/// data-dependent shapes and syncs, host-device copies, CPU tensors in GPU
/// work, non-default generators, the autocast weight cache. Findings on CPU
/// tensors are predictions (Note [Checking on CPU tensors] in
/// safety_check.cpp).
std::vector<SafetyFinding> classify_operator(const OperatorCall& call);

/// True when `call` works on a CUDA device: a CUDA tensor among its
/// arguments, a CUDA target device or a CUDA generator.
bool is_gpu_work(const OperatorCall& call);

}  // namespace graphed
