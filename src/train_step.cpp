#include "graphed/train_step.h"

#include "autograd_node.h"

#include "graphed/check.h"
#include "graphed/static_io.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

namespace graphed {
namespace {

std::vector<std::string> default_batch_names(size_t count) {
  if (count == 1) {
    return {"batch"};
  }
  std::vector<std::string> names;
  for (size_t i = 0; i < count; ++i) {
    names.push_back(c10::str("batch[", i, "]"));
  }
  return names;
}

// Microbatch `index` of `count`: every tensor split along dim 0.
std::vector<c10::IValue> microbatch(const std::vector<c10::IValue>& batch, int64_t index,
                                    int64_t count) {
  if (count == 1) {
    return batch;
  }
  std::vector<c10::IValue> part;
  for (const c10::IValue& value : batch) {
    part.push_back(map_tensors(value, [&](const at::Tensor& tensor) {
      GRAPHED_CHECK(tensor.dim() > 0 && tensor.size(0) % count == 0, "Expected every batch "
                    "tensor to split into ", count, " microbatches along dim 0, got ",
                    describe_tensor(tensor), ".");
      return tensor.chunk(count)[index];
    }));
  }
  return part;
}

// The C++ split of TrainStep::from_parts: every tensor of the batch values
// split evenly along dim 0.
std::vector<std::vector<c10::IValue>> split_microbatches(const std::vector<c10::IValue>& batch,
                                                         int count) {
  std::vector<std::vector<c10::IValue>> parts;
  for (int i = 0; i < count; ++i) {
    parts.push_back(microbatch(batch, i, count));
  }
  return parts;
}

std::string describe_stream(const c10::Stream& stream) {
  if (stream.id() == 0) {
    return c10::str("the default stream of ", stream.device().str());
  }
  return c10::str("stream ", stream.id(), " of ", stream.device().str());
}

// Checks what Note [Capturing collectives] asks of the options and of the
// hooked parameters' gradient accumulators, before any warm-up runs (a
// warm-up would launch collectives the other ranks may not match).
void check_collective_capture(const TrainStepOptions& options) {
  const CollectiveCapture& collectives = *options.collectives;
  GRAPHED_CHECK(options.error_mode != CaptureErrorMode::kGlobal, options.description,
                " runs ", collectives.issuer, "'s collectives, which cannot be captured in the "
                "\"global\" capture error mode: NCCL's watchdog thread queries CUDA events while "
                "the capture runs, and in that mode the query invalidates the capture. Use "
                "capture_error_mode=\"thread_local\" (the default for DistributedDataParallel).");
  GRAPHED_CHECK(options.warmup_iters >= kCollectiveWarmupIters, options.description, " runs ",
                collectives.issuer, "'s collectives and needs at least ", kCollectiveWarmupIters,
                " warm-up iterations before capture, got ", options.warmup_iters,
                ": DDP rebuilds its gradient buckets after the first iteration and times "
                "iterations 1 to 10 with CUDA events it synchronizes on, neither of which can be "
                "captured. Use warmup >= ", kCollectiveWarmupIters, " (the default for "
                "DistributedDataParallel).");
  for (size_t i = 0; i < collectives.hooked_params.size(); ++i) {
    const at::Tensor& param = collectives.hooked_params[i];
    if (!param.defined() || !param.is_cuda() || !param.requires_grad()) {
      continue;
    }
    const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(param);
    if (!accumulator || accumulator->num_inputs() == 0) {
      // Created by the first backward of warm-up, on the capture stream.
      continue;
    }
    const c10::Stream found = accumulator->input_metadata(0).stream();
    const c10::Stream expected = capture_stream(param.device().index()).unwrap();
    GRAPHED_CHECK(found == expected, collectives.issuer, " launches its all-reduces from the "
                  "gradient accumulator of parameter ", i, " (", describe_tensor(param),
                  "), which runs on ", describe_stream(found), ", the stream that was current "
                  "when ", collectives.issuer, " was constructed; capture needs it on graphed's "
                  "capture stream (", describe_stream(expected), "), or the captured backward "
                  "would make the other stream wait on captured work. Construct the model with "
                  "graphed.distributed.prepare_ddp(module), or under "
                  "`with torch.cuda.stream(graphed.capture_stream()):`.");
  }
}

}  // namespace

TrainStep TrainStep::from_parts(TrainStepParts parts, std::vector<c10::IValue> sample_batch,
                                TrainStepOptions options) {
  GRAPHED_CHECK(static_cast<bool>(parts.loss), "TrainStepParts::loss is empty: expected the "
                "function computing a microbatch's loss.");
  GRAPHED_CHECK(parts.optimizer != nullptr, "TrainStepParts::optimizer is null: expected a "
                "CapturableAdamW or CapturableSGD.");
  // The sequence itself lives in TrainingIteration (Note [One training
  // iteration]); these are its LibTorch pieces.
  std::shared_ptr<CapturableOptimizer> optimizer = parts.optimizer;
  TrainingIterationParts pieces;
  static_cast<TrainingIterationOptions&>(pieces) = parts;
  pieces.loss = std::move(parts.loss);
  pieces.split = split_microbatches;
  pieces.zero_grad = [optimizer] { optimizer->zero_grad(/*set_to_none=*/true); };
  pieces.step = [optimizer](const at::Tensor& found_inf) { optimizer->step(found_inf); };
  pieces.params = optimizer->params();
  auto iteration = std::make_shared<TrainingIteration>(std::move(pieces));

  for (const at::Tensor& p : iteration->params()) {
    options.state.push_back(p);
    if (p.grad().defined()) {
      options.state.push_back(p.grad());
    }
  }
  options.state.insert(options.state.end(), parts.buffers.begin(), parts.buffers.end());
  for (const at::Tensor& t : optimizer->state()) {
    options.state.push_back(t);
  }
  for (const at::Tensor& t : iteration->guard()->state()) {
    options.state.push_back(t);
  }

  TrainStepFunction run = [iteration](const std::vector<c10::IValue>& batch) -> c10::IValue {
    return (*iteration)(batch);
  };
  TrainStep step(std::move(run), std::move(sample_batch), std::move(options));
  step.guard_ = iteration->guard();
  return step;
}

TrainStep::TrainStep(TrainStepFunction step, std::vector<c10::IValue> sample_batch,
                     TrainStepOptions options)
    : options_(std::move(options)) {
  GRAPHED_CHECK(static_cast<bool>(step), "Expected a training step function, got an empty one.");
  GRAPHED_CHECK(!options_.state.empty(), "TrainStep expected the state the iteration changes "
                "(parameters, optimizer state, buffers) in TrainStepOptions::state, got none. "
                "Without it warm-up would train the model before the first step().");
  if (options_.batch_names.empty()) {
    options_.batch_names = default_batch_names(sample_batch.size());
  }
  if (options_.collectives) {
    check_collective_capture(options_);
  }
  const std::string description = options_.description;
  CapturableFunction iteration = [step = std::move(step),
                                  description](const std::vector<c10::IValue>& batch) {
    const c10::IValue result = step(batch);
    GRAPHED_CHECK(result.isTensor() && result.toTensor().defined() &&
                      result.toTensor().is_cuda() && result.toTensor().numel() == 1,
                  description, " must return the loss as a CUDA tensor with one element, got ",
                  describe_value(result), ". Return the loss tensor itself (not loss.item()).");
    return c10::IValue(result.toTensor().detach());
  };
  // A loss of an eager step before this one may still hold the parameters'
  // gradient accumulators (Note [Gradient accumulators on the capture stream]).
  for (const at::Tensor& tensor : options_.state) {
    if (tensor.defined() && tensor.is_cuda()) {
      (void)detail::detach_stale_gradient_accumulator(tensor,
                                                      capture_stream(tensor.device().index()));
    }
  }
  CaptureOptions capture_options;
  capture_options.warmup_iters = options_.warmup_iters;
  capture_options.pool = options_.pool;
  capture_options.error_mode = options_.error_mode;
  capture_options.clone_outputs = options_.clone_loss;
  capture_options.input_names = options_.batch_names;
  capture_options.state = options_.state;
  capture_options.read_parameters = options_.read_parameters;
  capture_options.description = options_.description;
  capture_options.autograd = true;
  train_ = std::make_unique<CapturedFunction>(
      capture(std::move(iteration), std::move(sample_batch), std::move(capture_options)));
}

at::Tensor TrainStep::step(const std::vector<c10::IValue>& batch) {
  return train_graph_mutable()(batch).toTensor();
}

const CapturedFunction& TrainStep::train_graph() const {
  GRAPHED_CHECK(train_ != nullptr, options_.description, " was released (release()): its graphs "
                "are gone. Create a new TrainStep to train again.");
  return *train_;
}

CapturedFunction& TrainStep::train_graph_mutable() {
  (void)train_graph();
  return *train_;
}

void TrainStep::release() {
  if (train_ == nullptr) {
    return;
  }
  // Replays still running on the device read the graphs' memory; and a graph
  // that captured NCCL work keeps the communicator alive until it is
  // destroyed (Note [Capturing collectives], point 4).
  {
    c10::cuda::CUDAGuard device_guard(train_->graph().device());
    c10::cuda::device_synchronize();
  }
  steps_before_release_ = train_->stats().replays;
  eval_.reset();
  train_.reset();
}

void TrainStep::capture_eval(CapturableFunction evaluate, std::vector<c10::IValue> sample_inputs,
                             int warmup_iters) {
  CaptureOptions capture_options;
  capture_options.warmup_iters = warmup_iters;
  capture_options.pool = train_graph().graph().pool();
  capture_options.error_mode = options_.error_mode;
  capture_options.state = options_.state;
  capture_options.read_parameters = options_.read_parameters;
  capture_options.description = "the evaluation of " + options_.description;
  eval_ = std::make_unique<CapturedFunction>(
      capture(std::move(evaluate), std::move(sample_inputs), std::move(capture_options)));
}

c10::IValue TrainStep::evaluate(const std::vector<c10::IValue>& inputs) {
  (void)train_graph();
  GRAPHED_CHECK(eval_ != nullptr, "No evaluation graph: call capture_eval() first.");
  return (*eval_)(inputs);
}

const CapturedFunction& TrainStep::eval_graph() const {
  GRAPHED_CHECK(eval_ != nullptr, "No evaluation graph: call capture_eval() first.");
  return *eval_;
}

}  // namespace graphed
