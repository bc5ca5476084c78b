#include "graphed/operator_rules.h"

#include "graphed/signature.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <c10/util/StringUtil.h>

#include <sstream>
#include <utility>

namespace graphed {

// Note [Operators inside CPU kernels]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A CPU kernel is host code: it may read its inputs with `.item()` or size
// its output from their values (index_put_'s CPU path reads its scalar value
// through aten::item), and that says nothing about the CUDA kernel of the
// same operator. So a host read or a data-dependent operator on CPU tensors
// that runs inside another operator is not reported. The same inside an
// operator on CUDA tensors is (a CUDA kernel that reads a value back syncs).
// Operators called by the user's program, or by autograd for a backward node,
// are judged on their own.

void collect_operator_tensors(const c10::IValue& value, std::vector<at::Tensor>& tensors,
                              int depth) {
  if (value.isTensor()) {
    if (value.toTensor().defined()) {
      tensors.push_back(value.toTensor());
    }
    return;
  }
  // Operators take tensors directly or in one list (cat, index's indices);
  // deeper nesting does not occur in ATen schemas.
  if (depth > 1) {
    return;
  }
  if (value.isList()) {
    for (const c10::IValue& element : value.toListRef()) {
      collect_operator_tensors(element, tensors, depth + 1);
    }
  } else if (value.isTuple()) {
    for (const c10::IValue& element : value.toTupleRef().elements()) {
      collect_operator_tensors(element, tensors, depth + 1);
    }
  }
}

std::string describe_tensors(const std::vector<at::Tensor>& tensors) {
  constexpr size_t kMaxDescribed = 4;
  std::ostringstream out;
  for (size_t i = 0; i < tensors.size() && i < kMaxDescribed; ++i) {
    out << (i == 0 ? "" : ", ") << describe_tensor(tensors[i]);
  }
  if (tensors.size() > kMaxDescribed) {
    out << " and " << tensors.size() - kMaxDescribed << " more";
  }
  return out.str();
}

bool any_cuda(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& tensor : tensors) {
    if (tensor.is_cuda()) {
      return true;
    }
  }
  return false;
}

namespace {

std::vector<at::Tensor> tensors_of(const c10::IValue& value) {
  std::vector<at::Tensor> tensors;
  collect_operator_tensors(value, tensors);
  return tensors;
}

bool crosses_host_and_device(c10::Device a, c10::Device b) {
  return (a.is_cpu() && b.is_cuda()) || (a.is_cuda() && b.is_cpu());
}

bool is_boolean_mask(const at::Tensor& tensor) {
  return tensor.scalar_type() == at::kBool || tensor.scalar_type() == at::kByte;
}

bool any_boolean_mask(const c10::IValue& indices) {
  for (const at::Tensor& index : tensors_of(indices)) {
    if (is_boolean_mask(index)) {
      return true;
    }
  }
  return false;
}

bool is_copy_operator(std::string_view name) {
  return name == "aten::copy_" || name == "aten::to" || name == "aten::_to_copy" ||
         name == "aten::_copy_from" || name == "aten::_copy_from_and_resize";
}

SafetyFinding finding(BlockerKind kind, const OperatorCall& call, std::string detail,
                      bool predicted) {
  SafetyFinding result;
  result.kind = kind;
  result.op = std::string(call.name);
  result.inputs = describe_tensors(call.tensors);
  result.detail = std::move(detail);
  result.predicted = predicted;
  result.severity = default_severity(kind);
  return result;
}

// repeat_interleave sizes its output from the values of a repeats tensor,
// unless output_size says the total; with an integer repeats it is static.
bool repeat_interleave_reads_sizes(const OperatorCall& call) {
  const auto& inputs = call.inputs;
  // Overloads: (Tensor repeats, output_size), (Tensor self, Tensor repeats,
  // dim, output_size), (Tensor self, int repeats, dim, output_size).
  const bool tensor_repeats = (inputs.size() == 2 && inputs[0].isTensor()) ||
                              (inputs.size() == 4 && inputs[1].isTensor());
  return tensor_repeats && inputs.back().isNone();
}

// Host reads, data-dependent shapes and syncs: by the operator's name, with
// boolean-mask indexing and one-argument torch.where by their arguments.
std::optional<SafetyFinding> host_dependency(const OperatorCall& call) {
  std::optional<BlockerKind> kind = blocker_kind_of_operator(call.name);
  std::string detail;
  if (kind == BlockerKind::kDataDependentShape && call.name == "aten::repeat_interleave" &&
      !repeat_interleave_reads_sizes(call)) {
    kind.reset();
  }
  if (!kind && call.name == "aten::index" && call.inputs.size() >= 2 &&
      any_boolean_mask(call.inputs[1])) {
    kind = BlockerKind::kDataDependentShape;
    detail = "indexes with a boolean mask (x[mask]): the result has one row per True value";
  }
  if (!kind &&
      (call.name == "aten::index_put_" || call.name == "aten::index_put" ||
       call.name == "aten::_index_put_impl_") &&
      call.inputs.size() >= 3 && call.inputs[2].isTensor() && any_boolean_mask(call.inputs[1])) {
    // x[mask] = scalar becomes masked_fill_, which keeps shapes static; only
    // assigning a tensor of values needs the positions of the True values.
    const at::Tensor& values = call.inputs[2].toTensor();
    if (!(values.numel() == 1 && values.is_cpu())) {
      kind = BlockerKind::kDataDependentShape;
      detail = "assigns through a boolean mask (x[mask] = values): it must count the True values";
    }
  }
  if (!kind && call.name == "aten::where" && call.inputs.size() == 1) {
    kind = BlockerKind::kDataDependentShape;
    detail = "torch.where(condition) with one argument returns the positions of True values";
  }
  if (!kind) {
    return std::nullopt;
  }
  if (call.inside_operator && !call.on_gpu) {
    return std::nullopt;  // See Note [Operators inside CPU kernels].
  }
  return finding(*kind, call, std::move(detail), /*predicted=*/!call.on_gpu);
}

// A copy between host and device memory. How it affects a capture depends
// on the bytes and the host memory: see Note [Finding severity].
SafetyFinding copy_finding(const OperatorCall& call, const at::Tensor& source,
                           c10::Device destination, const at::Tensor& host_side_candidate) {
  SafetyFinding found = finding(BlockerKind::kHostDeviceCopy, call,
                                c10::str("copies ", source.device(), " to ", destination), false);
  const at::Tensor& host = source.is_cpu() ? source : host_side_candidate;
  if (source.numel() == 0) {
    found.severity = FindingSeverity::kHarmless;
    found.detail += " (zero bytes: no transfer)";
  } else if (host.is_cpu() && host.is_pinned()) {
    // A pinned buffer is recorded by address: replays read or write it as it
    // is then, not as it was at capture.
    found.severity = FindingSeverity::kSpoilsReplay;
    found.detail += " (pinned host memory: the graph keeps its address)";
  }
  return found;
}

std::optional<SafetyFinding> host_device_copy(const OperatorCall& call) {
  const auto& inputs = call.inputs;
  if (inputs.empty() || !inputs[0].isTensor() || !inputs[0].toTensor().defined()) {
    return std::nullopt;
  }
  const c10::Device source_or_destination = inputs[0].toTensor().device();
  if (call.name == "aten::copy_" && inputs.size() >= 2 && inputs[1].isTensor()) {
    const at::Tensor& source = inputs[1].toTensor();
    if (crosses_host_and_device(source.device(), source_or_destination)) {
      return copy_finding(call, source, source_or_destination, inputs[0].toTensor());
    }
    return std::nullopt;
  }
  if (call.name != "aten::to" && call.name != "aten::_to_copy") {
    return std::nullopt;
  }
  std::optional<c10::Device> target;
  for (size_t i = 1; i < inputs.size() && !target; ++i) {
    if (inputs[i].isDevice()) {
      target = inputs[i].toDevice();
    }
  }
  if (!target && inputs.size() >= 2 && inputs[1].isTensor()) {
    target = inputs[1].toTensor().device();  // x.to(other)
  }
  if (target && crosses_host_and_device(source_or_destination, *target)) {
    return copy_finding(call, inputs[0].toTensor(), *target, inputs[0].toTensor());
  }
  return std::nullopt;
}

std::optional<SafetyFinding> cpu_tensor_in_gpu_work(const OperatorCall& call) {
  if (!call.on_gpu || is_copy_operator(call.name)) {
    return std::nullopt;
  }
  c10::Device gpu(c10::kCUDA);
  for (const at::Tensor& tensor : call.tensors) {
    if (tensor.is_cuda()) {
      gpu = tensor.device();
      break;
    }
  }
  for (const at::Tensor& tensor : call.tensors) {
    // Torch accepts 0-dim CPU tensors in GPU work as scalar arguments.
    if (tensor.is_cpu() && tensor.dim() > 0) {
      return finding(BlockerKind::kCpuTensor, call,
                     c10::str("the CPU tensor ", describe_tensor(tensor), " is an input of work on ",
                              gpu),
                     false);
    }
  }
  return std::nullopt;
}

std::optional<SafetyFinding> unregistered_generator(const OperatorCall& call) {
  for (const c10::IValue& input : call.inputs) {
    if (!input.isGenerator()) {
      continue;
    }
    const at::Generator generator = input.toGenerator();
    if (!generator.defined()) {
      continue;
    }
    const c10::Device device = generator.device();
    if (generator == at::globalContext().defaultGenerator(device)) {
      continue;
    }
    return finding(BlockerKind::kUnregisteredGenerator, call,
                   c10::str("draws from a torch.Generator on ", device,
                            " that is not the default generator"),
                   /*predicted=*/device.is_cpu());
  }
  return std::nullopt;
}

// Autocast caches its low-precision copy of a float32 leaf tensor that
// requires grad (a weight) while the cache is enabled; see cached_cast in
// ATen/autocast_mode.h. Judged at the operator the program called, before
// autocast's own casts run inside it.
std::optional<SafetyFinding> autocast_cache(const OperatorCall& call) {
  if (call.inside_operator || !at::autocast::is_autocast_cache_enabled()) {
    return std::nullopt;
  }
  for (const at::Tensor& tensor : call.tensors) {
    if (!(tensor.is_cpu() || tensor.is_cuda()) || tensor.scalar_type() != at::kFloat ||
        !tensor.requires_grad() || !tensor.is_leaf()) {
      continue;
    }
    const c10::DeviceType device_type = tensor.device().type();
    if (!at::autocast::is_autocast_enabled(device_type)) {
      continue;
    }
    return finding(BlockerKind::kAutocastCache, call,
                   c10::str("runs under torch.autocast(\"", c10::DeviceTypeName(device_type, true),
                            "\") with cache_enabled=True, which caches a low-precision copy of the "
                            "weight ",
                            describe_tensor(tensor)),
                   /*predicted=*/tensor.is_cpu());
  }
  return std::nullopt;
}

using Rule = std::optional<SafetyFinding> (*)(const OperatorCall&);
constexpr Rule kRules[] = {host_dependency, host_device_copy, cpu_tensor_in_gpu_work,
                           unregistered_generator, autocast_cache};

}  // namespace

std::vector<SafetyFinding> classify_operator(const OperatorCall& call) {
  std::vector<SafetyFinding> findings;
  for (Rule rule : kRules) {
    if (std::optional<SafetyFinding> found = rule(call)) {
      findings.push_back(std::move(*found));
    }
  }
  return findings;
}

bool is_gpu_work(const OperatorCall& call) {
  if (any_cuda(call.tensors)) {
    return true;
  }
  for (const c10::IValue& input : call.inputs) {
    if ((input.isDevice() && input.toDevice().is_cuda()) ||
        (input.isGenerator() && input.toGenerator().defined() &&
         input.toGenerator().device().is_cuda())) {
      return true;
    }
  }
  return false;
}

}  // namespace graphed
