#include "graphed/capture.h"

#include "graphed/check.h"
#include "graphed/nvtx.h"
#include "graphed/state_snapshot.h"

#include "graphed/cuda_handles.h"
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/ScopeExit.h>

#include <algorithm>
#include <chrono>
#include <sstream>

namespace graphed {
namespace {

std::vector<std::string> default_input_names(size_t count) {
  std::vector<std::string> names;
  for (size_t i = 0; i < count; ++i) {
    names.push_back(c10::str("args[", i, "]"));
  }
  return names;
}

// The device of the sample tensors, which must all be CUDA tensors on one
// device; nullopt when there are none. Other tensors are refused with the reason.
std::optional<c10::Device> input_device(const Signature& signature) {
  std::optional<c10::Device> device;
  for (size_t i = 0; i < signature.num_tensors(); ++i) {
    const TensorSpec& spec = signature.tensor_specs()[i];
    GRAPHED_CHECK(spec.device.is_cuda(), "Expected every input tensor on a CUDA device, but ",
                  signature.tensor_path(i), " is ", spec.describe(),
                  ". A graph only replays GPU work: a CPU input would be read once, at capture, "
                  "and never again. Move it to the GPU before capture (.cuda()).");
    GRAPHED_CHECK(!device || *device == spec.device, "Expected every input tensor on one device, "
                  "but ", signature.tensor_path(0), " is on ", device->str(), " and ",
                  signature.tensor_path(i), " is on ", spec.device.str(),
                  ". A graph runs on one device: move the inputs to the same GPU.");
    device = spec.device;
  }
  return device;
}

// True when `tensor` shares storage with one of `others`.
bool shares_storage_with_any(const at::Tensor& tensor, const std::vector<at::Tensor>& others) {
  if (!tensor.defined() || !tensor.unsafeGetTensorImpl()->has_storage()) {
    return false;
  }
  const void* address = tensor.storage().data();
  return std::any_of(others.begin(), others.end(), [&](const at::Tensor& other) {
    return other.defined() && other.unsafeGetTensorImpl()->has_storage() &&
           other.storage().data() == address;
  });
}

void check_outputs(const StaticOutputs& outputs, const std::string& description) {
  for (const at::Tensor& tensor : outputs.tensors()) {
    GRAPHED_CHECK_AS(CaptureError, !tensor.defined() || tensor.is_cuda(), description,
                     " returned a tensor on ", tensor.device().str(), " (", describe_tensor(tensor),
                     "). A graph only replays GPU work, so that output would keep its value from "
                     "capture forever. Return GPU tensors, and move results to the host after "
                     "the call.");
  }
}

// `output` with each contiguous tensor that fits its arena copied into the
// arena's front (inside the capture, so every replay copies), see
// CaptureOptions::output_arenas.
c10::IValue into_output_arenas(const c10::IValue& output, const std::vector<at::Tensor>& arenas,
                               const std::vector<at::Tensor>& input_buffers) {
  size_t index = 0;
  return map_tensors(output, [&](const at::Tensor& tensor) {
    const size_t position = index++;
    if (position >= arenas.size() || !tensor.defined() || !tensor.is_contiguous() ||
        shares_storage_with_any(tensor, input_buffers) ||
        shares_storage_with_any(arenas[position], input_buffers)) {
      return tensor;
    }
    at::Tensor front = arena_front(arenas[position], tensor);
    if (!front.defined()) return tensor;
    front.copy_(tensor);
    return front;
  });
}

double elapsed_ms(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since)
      .count();
}

}  // namespace

InputUpdate parse_input_update(std::string_view name) {
  if (name == "copy") return InputUpdate::kCopy;
  if (name == "repoint") return InputUpdate::kRepoint;
  if (name == "auto") return InputUpdate::kAuto;
  GRAPHED_THROW(Error, "Expected input_update to be \"copy\", \"repoint\" or \"auto\", got \"",
                name, "\".");
}

CapturedFunction capture(CapturableFunction function, std::vector<c10::IValue> sample,
                         CaptureOptions options) {
  GRAPHED_CHECK(static_cast<bool>(function), "Expected a function to capture, got an empty one.");
  GRAPHED_CHECK(options.warmup_iters >= 1, "Expected warmup_iters >= 1, got ",
                options.warmup_iters, ". Warm-up runs create what capture cannot (cuBLAS handles "
                "and workspaces, lazily initialised modules); use at least 1.");
  if (options.input_names.empty()) {
    options.input_names = default_input_names(sample.size());
  }
  GRAPHED_CHECK(options.input_names.size() == sample.size(), "Expected one input name per "
                "sample input, got ", options.input_names.size(), " names for ", sample.size(),
                " inputs.");

  CapturedFunction captured;
  std::vector<std::string> names = options.input_names;
  std::vector<c10::IValue> guarded_sample = sample;
  for (const CaptureGuard& guard : options.guards) {
    GRAPHED_CHECK(static_cast<bool>(guard.read), "Guard `", guard.name, "` has no read function.");
    c10::IValue value = guard.read();
    GRAPHED_CHECK(flatten_tensors(value).empty(), "Guard `", guard.name, "` returned ",
                  describe_value(value), ", which holds tensors. Guards check host state such as "
                  "a module's training flag; pass tensors as inputs instead.");
    names.push_back(guard.name);
    guarded_sample.push_back(std::move(value));
  }
  captured.signature_ = Signature(guarded_sample, names);
  const std::optional<c10::Device> sample_device = input_device(captured.signature_);
  GRAPHED_CHECK(c10::cuda::device_count() > 0, "Capturing ", options.description, " needs an NVIDIA "
                "GPU, but CUDA reports no device (torch.cuda.is_available() is False).");
  const c10::Device device =
      sample_device.value_or(c10::Device(c10::kCUDA, c10::cuda::current_device()));
  c10::cuda::CUDAGuard device_guard(device);
  std::optional<c10::NoGradGuard> no_grad;
  if (!options.autograd) {
    no_grad.emplace();
  }

  const std::string subject = nvtx_subject(options.description);
  captured.replay_range_ = nvtx_range_name(NvtxPhase::kReplay, subject);
  // Warm-up and capture must change nothing the caller can see (Invariant 1).
  const StateSnapshot snapshot = StateSnapshot::take(options.state, device);
  GRAPHED_CHECK(!options.autograd || (options.input_arenas.empty() && options.output_arenas.empty()),
                "Expected no input or output arenas when capturing with autograd, got ",
                options.input_arenas.size(), " input and ", options.output_arenas.size(),
                " output arenas. Arenas share the buffers of inference graphs; capture "
                "training graphs without them.");
  captured.inputs_ = StaticInputs(std::vector<c10::IValue>(sample.begin(), sample.end()),
                                  options.input_arenas);
  try {
    const auto warmup_started = std::chrono::steady_clock::now();
    const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device.index());
    const c10::cuda::CUDAStream stream = capture_stream(device.index());
    {
      // Warm up on the stream that will capture: see Note [One capture stream per device].
      stream_wait(stream.stream(), caller.stream());
      c10::cuda::CUDAStreamGuard on_capture_stream(stream);
      const NvtxRange range(NvtxPhase::kWarmup, subject);
      captured.inputs_.start_mutation_watch();
      for (int i = 0; i < options.warmup_iters; ++i) {
        (void)function(captured.inputs_.tree());
      }
      captured.inputs_.finish_mutation_watch();
      stream_wait(caller.stream(), stream.stream());
    }
    captured.stats_.warmup_ms = elapsed_ms(warmup_started);

    c10::IValue output;
    GraphCaptureOptions graph_options;
    graph_options.pool = options.pool;
    graph_options.error_mode = options.error_mode;
    graph_options.description = options.description;
    {
      const NvtxRange range(NvtxPhase::kCapture, subject);
      captured.graph_.capture(
          [&] {
            output = function(captured.inputs_.tree());
            if (!options.output_arenas.empty()) {
              output = into_output_arenas(output, options.output_arenas,
                                          captured.inputs_.buffers());
            }
          },
          graph_options);
    }
    captured.outputs_ = StaticOutputs(std::move(output));
    check_outputs(captured.outputs_, options.description);
    if (options.input_update != InputUpdate::kCopy) {
      const std::vector<at::Tensor>& buffers = captured.inputs_.buffers();
      const std::vector<size_t>& mutated = captured.inputs_.mutated();
      captured.sites_.assign(buffers.size(), std::nullopt);
      for (size_t i = 0; i < buffers.size(); ++i) {
        captured.bound_.push_back(buffers[i].data_ptr());
        // An output that is (a view of) the buffer must see the call's value:
        // such inputs are copied, never re-pointed.
        if (std::find(mutated.begin(), mutated.end(), i) == mutated.end() &&
            buffers[i].nbytes() > 0 &&
            !shares_storage_with_any(buffers[i], captured.outputs_.tensors())) {
          captured.sites_[i] = captured.graph_.find_references(buffers[i].data_ptr(),
                                                               buffers[i].nbytes());
          captured.stats_.repointable_inputs += captured.sites_[i] ? 1 : 0;
        }
      }
      captured.last_seen_.assign(buffers.size(), nullptr);
    }
  } catch (c10::Error& error) {
    snapshot.restore();
    error.add_context("Capture changed nothing: buffers and random generators were restored "
                      "to their state before warm-up.");
    throw;
  } catch (...) {
    snapshot.restore();
    throw;
  }
  snapshot.restore();
  captured.state_identity_ = TensorIdentities(options.state);
  if (options.read_parameters) {
    captured.parameter_identity_ = TensorIdentities(options.read_parameters());
  }
  captured.function_ = std::move(function);
  captured.options_ = std::move(options);
  return captured;
}

std::vector<c10::IValue> CapturedFunction::guarded_inputs(
    const std::vector<c10::IValue>& inputs) const {
  std::vector<c10::IValue> guarded;
  guarded.reserve(inputs.size() + options_.guards.size());
  guarded.insert(guarded.end(), inputs.begin(), inputs.end());
  for (const CaptureGuard& guard : options_.guards) {
    guarded.push_back(guard.read());
  }
  return guarded;
}

void CapturedFunction::raise_mismatch(const std::vector<c10::IValue>& inputs) const {
  std::ostringstream message;
  message << "The inputs do not match those " << options_.description
          << " was captured with:";
  for (const std::string& difference : signature_.differences(inputs)) {
    message << "\n  " << difference;
  }
  message << "\nA graph replays fixed shapes, dtypes and devices: call it with inputs like the "
             "sample it was captured with, or capture again with a sample of the new shape.";
  GRAPHED_THROW(InputMismatchError, message.str());
}

void CapturedFunction::check_tensors_in_place() const {
  // See Note [Tensors a graph reads in place].
  static constexpr const char* kWhy =
      ". The graph reads and writes the memory these tensors had at capture: changing a "
      "module's dtype or device (.double(), .half(), .to()), assigning `.data` or replacing a "
      "parameter or buffer leaves the graph on freed or stale memory, so it was not replayed. "
      "Capture again after such a change; change values in place (load_state_dict, "
      "param.data.copy_(...)) to keep the graph.";
  const std::string state = state_identity_.first_difference(options_.state, "state tensor");
  GRAPHED_CHECK(state.empty(), "Expected the tensors ", options_.description,
                " updates in place (its state: buffers, parameters, optimizer state) to be "
                "those it was captured with, but ", state, kWhy);
  if (options_.read_parameters) {
    const std::string parameters =
        parameter_identity_.first_difference(options_.read_parameters(), "parameter or buffer");
    GRAPHED_CHECK(parameters.empty(), "Expected the parameters and buffers of ",
                  options_.description, " to be those it was captured with, but ", parameters,
                  kWhy);
  }
}

void CapturedFunction::bring_inputs() {
  // See Note [Re-pointing a graph].
  const std::vector<at::Tensor>& buffers = inputs_.buffers();
  c10::NoGradGuard no_grad;
  // See Note [Inputs that alias other static buffers]; scratch_ keeps the
  // caller's tensors for store_back().
  std::vector<at::Tensor> unaliased;
  if (any_cross_alias(scratch_, buffers)) {
    unaliased = scratch_;
    clone_cross_aliases(unaliased, buffers);
  }
  const std::vector<at::Tensor>& sources = unaliased.empty() ? scratch_ : unaliased;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const at::Tensor& tensor = sources[i];
    const at::Tensor& buffer = buffers[i];
    const void* address = tensor.data_ptr();
    bool repoint = false;
    if (sites_[i] && address != buffer.data_ptr() && tensor.strides().equals(buffer.strides())) {
      repoint = options_.input_update == InputUpdate::kRepoint || address == bound_[i] ||
                address == last_seen_[i] ||
                static_cast<int64_t>(tensor.nbytes()) >= options_.repoint_min_bytes;
    }
    last_seen_[i] = address;
    if (repoint) {
      if (bound_[i] != address) {
        graph_.repoint(*sites_[i], address);
        bound_[i] = address;
        ++stats_.input_repoints;
      }
      continue;
    }
    if (sites_[i] && bound_[i] != buffer.data_ptr()) {
      graph_.repoint(*sites_[i], buffer.data_ptr());
      bound_[i] = buffer.data_ptr();
    }
    if (!tensor.is_same(buffer)) {
      buffer.copy_(tensor, /*non_blocking=*/true);
      ++stats_.input_copies;
    }
  }
}

c10::IValue CapturedFunction::operator()(const std::vector<c10::IValue>& call_inputs) {
  // The whole call: graphed's checks and copies are part of what it costs.
  const NvtxRange range(replay_range_);
  std::vector<c10::IValue> with_guards;
  const std::vector<c10::IValue>* inputs = &call_inputs;
  if (!options_.guards.empty()) {
    with_guards = guarded_inputs(call_inputs);
    inputs = &with_guards;
  }
  // The call's inputs are not kept past it (their memory would stay pinned).
  const auto release_inputs = c10::make_scope_exit([this] { scratch_.clear(); });
  if (!signature_.collect_tensors(*inputs, scratch_)) {
    raise_mismatch(*inputs);
  }
  if (!options_.autograd && c10::GradMode::is_enabled()) {
    for (size_t i = 0; i < scratch_.size(); ++i) {
      GRAPHED_CHECK(!scratch_[i].requires_grad(), signature_.tensor_path(i),
                    " requires grad, but ", options_.description, " was captured for "
                    "inference and its graph records no autograd history. Pass a tensor that "
                    "does not require grad (x.detach()), call under torch.no_grad(), or use "
                    "graphed.make_graphed_callables for training.");
    }
  }
  check_tensors_in_place();
  c10::cuda::CUDAGuard device_guard(graph_.device());
  if (sites_.empty()) {
    stats_.input_copies += static_cast<int64_t>(inputs_.load(scratch_));
  } else {
    bring_inputs();
  }
  graph_.replay();
  inputs_.store_back(scratch_);
  ++stats_.replays;
  return outputs_.materialize(options_.clone_outputs);
}

}  // namespace graphed
