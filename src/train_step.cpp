#include "graphed/train_step.h"

#include "graphed/check.h"

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

}  // namespace

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
  CaptureOptions capture_options;
  capture_options.warmup_iters = options_.warmup_iters;
  capture_options.pool = options_.pool;
  capture_options.error_mode = options_.error_mode;
  capture_options.clone_outputs = options_.clone_loss;
  capture_options.input_names = options_.batch_names;
  capture_options.state = options_.state;
  capture_options.description = options_.description;
  capture_options.autograd = true;
  train_ = std::make_unique<CapturedFunction>(
      capture(std::move(iteration), std::move(sample_batch), std::move(capture_options)));
}

at::Tensor TrainStep::step(const std::vector<c10::IValue>& batch) {
  return (*train_)(batch).toTensor();
}

void TrainStep::capture_eval(CapturableFunction evaluate, std::vector<c10::IValue> sample_inputs,
                             int warmup_iters) {
  CaptureOptions capture_options;
  capture_options.warmup_iters = warmup_iters;
  capture_options.pool = train_->graph().pool();
  capture_options.error_mode = options_.error_mode;
  capture_options.state = options_.state;
  capture_options.description = "the evaluation of " + options_.description;
  eval_ = std::make_unique<CapturedFunction>(
      capture(std::move(evaluate), std::move(sample_inputs), std::move(capture_options)));
}

c10::IValue TrainStep::evaluate(const std::vector<c10::IValue>& inputs) {
  GRAPHED_CHECK(eval_ != nullptr, "No evaluation graph: call capture_eval() first.");
  return (*eval_)(inputs);
}

const CapturedFunction& TrainStep::eval_graph() const {
  GRAPHED_CHECK(eval_ != nullptr, "No evaluation graph: call capture_eval() first.");
  return *eval_;
}

}  // namespace graphed
