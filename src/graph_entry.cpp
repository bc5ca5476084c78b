#include "graphed/graph_entry.h"

#include "graphed/check.h"
#include "graphed/graphed_callable.h"
#include "graphed/static_io.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <chrono>
#include <optional>

namespace graphed {

// Note [Training entries]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A call in grad mode whose inputs or parameters require grad needs outputs
// with autograd history: a forward graph and a backward graph joined by an
// autograd function (as make_graphed_callables builds them). GraphManager
// treats such an entry like any other GraphEntry -- keyed by signature and
// mode, replayed through run(), evicted by the budget -- and asks
// GraphEntryFactories::training to capture it. That factory is the single
// integration point of the training path: while it is unset, training calls
// run eagerly and are counted as fallbacks with the reason
// kTrainingGraphsUnavailable (see GraphManager::call_locked), never silently.
// make_training_entry is the factory graphed.auto plugs in.
//
// A training entry made on demand (a new signature after the first capture, a
// module left out of the group of Note [Training graphs captured together])
// captures its forward and its backward
// graph at once, in a pool of its own. Sharing a pool with graphs captured
// at other times would be wrong: module 2's forward captured after module 1's
// backward could reuse the activations module 1's backward frees at capture,
// which at run time are still waiting for that backward (forward 1,
// forward 2, backward 2, backward 1).

namespace {

double elapsed_ms(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since)
      .count();
}

// Bytes of `tensors`, leaving out those in the storage of one of `shared`
// (memory another graph holds and counts: Note [Bucket graphs share their buffers]).
int64_t tensor_bytes(const std::vector<at::Tensor>& tensors,
                     const std::vector<at::Tensor>& shared = {}) {
  int64_t bytes = 0;
  for (const at::Tensor& tensor : tensors) {
    if (!tensor.defined()) continue;
    const bool in_shared =
        tensor.unsafeGetTensorImpl()->has_storage() &&
        std::any_of(shared.begin(), shared.end(), [&](const at::Tensor& other) {
          return other.defined() && other.storage().data() == tensor.storage().data();
        });
    if (!in_shared) bytes += static_cast<int64_t>(tensor.nbytes());
  }
  return bytes;
}

// An entry captured with graphed::capture; see make_inference_entry.
class InferenceEntry final : public GraphEntry {
 public:
  InferenceEntry(CapturedFunction function, int64_t bytes, double capture_ms)
      : function_(std::move(function)), bytes_(bytes), capture_ms_(capture_ms) {}

  c10::IValue run(const std::vector<c10::IValue>& inputs, const BucketPlan& plan) override {
    if (!plan.pads()) {
      return function_(inputs);
    }
    // Write each short input into the front of its static buffer and pass the
    // buffer itself, so that the captured function copies nothing more.
    const std::vector<at::Tensor>& buffers = function_.static_inputs();
    std::vector<at::Tensor> originals;
    std::vector<c10::IValue> padded;
    padded.reserve(inputs.size());
    {
      c10::NoGradGuard no_grad;
      for (const c10::IValue& input : inputs) {
        padded.push_back(map_tensors(input, [&](const at::Tensor& tensor) {
          const at::Tensor& buffer = buffers.at(originals.size());
          originals.push_back(tensor);
          if (tensor.sizes().equals(buffer.sizes())) {
            return tensor;
          }
          front_of(buffer, tensor.sizes()).copy_(tensor, /*non_blocking=*/true);
          return buffer;
        }));
      }
    }
    c10::IValue outputs = function_(padded);
    if (!function_.mutated_inputs().empty()) {
      c10::NoGradGuard no_grad;
      for (size_t index : function_.mutated_inputs()) {
        const at::Tensor& original = originals[index];
        if (!original.sizes().equals(buffers[index].sizes())) {
          original.copy_(front_of(buffers[index], original.sizes()), /*non_blocking=*/true);
        }
      }
    }
    return slice_to_call(outputs, plan);
  }

  int64_t memory_bytes() const override { return bytes_; }
  const Signature& signature() const override { return function_.signature(); }
  int64_t pool_reserved_bytes() const override {
    return function_.graph().stats().pool_reserved_bytes;
  }
  double capture_ms() const override { return capture_ms_; }
  std::vector<at::Tensor> static_inputs() const override { return function_.static_inputs(); }
  std::vector<at::Tensor> static_outputs() const override {
    return function_.static_output_tensors();
  }

 private:
  static at::Tensor front_of(const at::Tensor& buffer, c10::IntArrayRef sizes) {
    at::Tensor view = buffer;
    for (int64_t dim = 0; dim < view.dim(); ++dim) {
      if (view.size(dim) != sizes[dim]) view = view.narrow(dim, 0, sizes[dim]);
    }
    return view;
  }

  CapturedFunction function_;
  int64_t bytes_;
  double capture_ms_;
};

// A training entry: forward and backward graphs of one module for one
// signature, built by make_graphed_callables; see make_training_entry and
// make_training_group.
class TrainingEntry final : public GraphEntry {
 public:
  TrainingEntry(std::shared_ptr<GraphedCallable> callable, int64_t bytes, double capture_ms)
      : callable_(std::move(callable)), bytes_(bytes), capture_ms_(capture_ms) {}

  c10::IValue run(const std::vector<c10::IValue>& inputs, const BucketPlan& plan) override {
    GRAPHED_CHECK(!plan.pads(), "Expected a training call of ", callable_->description(),
                  " at the exact size of its graphs, but its inputs would be padded to a "
                  "bucket. Padding would change the loss (padded rows get gradients); train "
                  "at bucket sizes, or leave buckets for inference.");
    return callable_->call(inputs, std::nullopt);
  }

  int64_t memory_bytes() const override { return bytes_; }
  const Signature& signature() const override { return callable_->signature(); }
  int64_t pool_reserved_bytes() const override { return pool_bytes(*callable_); }
  double capture_ms() const override { return capture_ms_; }

  // Bytes the callable's pool holds now.
  static int64_t pool_bytes(const GraphedCallable& callable) {
    int64_t bytes = 0;
    for (const GraphedPassInfo& info : callable.graphs()) {
      bytes = std::max(bytes, info.graph.pool_reserved_bytes);
    }
    return bytes;
  }

 private:
  std::shared_ptr<GraphedCallable> callable_;
  int64_t bytes_;
  double capture_ms_;
};

// The module of a training request as make_graphed_callables takes it.
GraphableCallable graphable_request(const GraphEntryRequest& request) {
  GRAPHED_CHECK(request.module != nullptr, "A training entry needs its module.");
  for (const c10::IValue& input : request.sample) {
    for_each_tensor(input, [&](const at::Tensor& tensor) {
      GRAPHED_CHECK_AS(CaptureError, tensor.is_cuda(), "Cannot graph ",
                       request.description, " for training: an input is ",
                       describe_tensor(tensor), ", and graphs replay GPU work only. Move the "
                       "model and its inputs to the GPU.");
    });
  }
  GraphableCallable callable;
  callable.function = request.module->forward;
  callable.parameters = request.module->parameters;
  callable.state = request.module->state;
  callable.description = request.description;
  return callable;
}

// Bytes of the static input buffers of a callable (outside the pool).
int64_t static_input_bytes(const GraphedCallable& callable) {
  int64_t bytes = 0;
  for (const TensorSpec& spec : callable.signature().tensor_specs()) {
    int64_t elements = 1;
    for (int64_t size : spec.sizes) elements *= size;
    bytes += elements * static_cast<int64_t>(c10::elementSize(spec.dtype));
  }
  return bytes;
}

GraphedCallablesOptions training_options(const GraphEntryRequest& request) {
  GraphedCallablesOptions options;
  options.warmup_iters = request.warmup_iters;
  options.error_mode = request.error_mode;
  options.input_names = request.input_names;
  if (options.input_names.size() != request.sample.size()) {
    options.input_names.clear();
  }
  return options;
}

}  // namespace

std::unique_ptr<GraphEntry> make_training_entry(const GraphEntryRequest& request) {
  const auto started = std::chrono::steady_clock::now();
  GraphableCallable callable = graphable_request(request);
  // A private pool: see Note [Training entries].
  auto graphed = make_graphed_callables({std::move(callable)}, {request.sample},
                                        training_options(request));
  const GraphedCallable& only = *graphed.front();
  const int64_t bytes = static_input_bytes(only) + TrainingEntry::pool_bytes(only);
  return std::make_unique<TrainingEntry>(std::move(graphed.front()), bytes, elapsed_ms(started));
}

std::vector<std::unique_ptr<GraphEntry>> make_training_group(
    const std::vector<GraphEntryRequest>& requests, const std::vector<int64_t>& order) {
  GRAPHED_CHECK(!requests.empty(), "A training group needs at least one module.");
  const auto started = std::chrono::steady_clock::now();
  std::vector<GraphableCallable> callables;
  std::vector<std::vector<c10::IValue>> samples;
  for (const GraphEntryRequest& request : requests) {
    callables.push_back(graphable_request(request));
    samples.push_back(request.sample);
  }
  // One pool, captured in the recorded order: Note [Training graphs captured together].
  GraphedCallablesOptions options = training_options(requests.front());
  options.order = order;
  auto graphed = make_graphed_callables(std::move(callables), std::move(samples), options);
  const double ms = elapsed_ms(started);
  const auto count = static_cast<int64_t>(graphed.size());
  const int64_t pool = TrainingEntry::pool_bytes(*graphed.front());
  std::vector<std::unique_ptr<GraphEntry>> entries;
  for (int64_t i = 0; i < count; ++i) {
    // Shares of the pool that sum to it: the first entry takes the remainder.
    const int64_t share = pool / count + (i == 0 ? pool % count : 0);
    const int64_t bytes = static_input_bytes(*graphed[i]) + share;
    entries.push_back(std::make_unique<TrainingEntry>(std::move(graphed[i]), bytes,
                                                      ms / static_cast<double>(count)));
  }
  return entries;
}

std::unique_ptr<GraphEntry> make_inference_entry(const GraphEntryRequest& request) {
  GRAPHED_INTERNAL_ASSERT(request.module != nullptr, "request without a module");
  CaptureOptions options;
  options.warmup_iters = request.warmup_iters;
  options.pool = request.pool();
  options.error_mode = request.error_mode;
  options.input_names = request.input_names;
  options.state = request.module->state;
  options.description = request.description;
  options.input_update = request.input_update;
  options.input_arenas = request.input_arenas;
  options.output_arenas = request.output_arenas;
  std::optional<c10::Device> device;
  for (const c10::IValue& input : request.sample) {
    for_each_tensor(input, [&](const at::Tensor& tensor) {
      if (!tensor.defined()) return;
      GRAPHED_CHECK_AS(CaptureError, tensor.is_cuda(), "Cannot graph ", request.description,
                       " for inference: an input is ", describe_tensor(tensor),
                       ", and graphs replay GPU work only. Move the model and its inputs to "
                       "the GPU.");
      if (!device) device = tensor.device();
    });
  }
  const c10::DeviceIndex index = device ? device->index() : c10::cuda::current_device();
  const PoolMemory before = pool_memory(*options.pool, index);
  const auto started = std::chrono::steady_clock::now();
  CapturedFunction function = capture(request.module->forward, request.sample, options);
  const double ms = elapsed_ms(started);
  const PoolMemory after = pool_memory(*options.pool, index);
  std::vector<at::Tensor> arenas = request.input_arenas;
  arenas.insert(arenas.end(), request.output_arenas.begin(), request.output_arenas.end());
  const int64_t outputs = tensor_bytes(function.static_output_tensors(), arenas);
  const int64_t bytes = tensor_bytes(function.static_inputs(), arenas) +
                        std::max(outputs, after.reserved_bytes - before.reserved_bytes);
  return std::make_unique<InferenceEntry>(std::move(function), bytes, ms);
}

}  // namespace graphed
