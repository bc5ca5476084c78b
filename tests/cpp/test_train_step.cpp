// graphed::TrainStep from LibTorch: a captured iteration with CapturableAdamW
// trains exactly like eager, capture changes nothing, failures restore state.

#include "graphed/check.h"
#include "graphed/optim.h"
#include "graphed/train_step.h"
#include "test_support.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <limits>
#include <utility>

namespace graphed {
namespace {

using c10::IValue;

TEST(TrainStepValidation, StateIsRequired) {
  EXPECT_THROW_WITH(TrainStep([](const std::vector<IValue>&) -> IValue { return IValue(); },
                              {at::ones({2})}),
                    Error, "TrainStepOptions::state");
}

struct Regression {
  torch::nn::Linear layer{nullptr};
  std::unique_ptr<CapturableAdamW> optimizer;

  explicit Regression(uint64_t seed) {
    torch::manual_seed(seed);
    layer = torch::nn::Linear(8, 1);
    layer->to(torch::kCUDA);
    optimizer = std::make_unique<CapturableAdamW>(layer->parameters(), AdamWOptions{1e-2});
  }

  IValue iteration(const std::vector<IValue>& batch) {
    const auto& pair = batch[0].toTupleRef().elements();
    optimizer->zero_grad();
    const at::Tensor loss = torch::mse_loss(layer->forward(pair[0].toTensor()), pair[1].toTensor());
    loss.backward();
    optimizer->step();
    return loss.detach();
  }

  std::vector<at::Tensor> state() const {
    std::vector<at::Tensor> tensors = layer->parameters();
    for (const at::Tensor& t : optimizer->state()) {
      tensors.push_back(t);
    }
    return tensors;
  }
};

IValue batch_of(const at::Tensor& x, const at::Tensor& y) {
  return c10::ivalue::Tuple::create({x, y});
}

TEST(TrainStepOnGpu, ReplaysEqualEagerAndCaptureChangesNothing) {
  GRAPHED_REQUIRE_GPU();
  Regression graphed_model(0);
  Regression eager_model(0);
  const auto options = at::TensorOptions().device(at::kCUDA);
  const at::Tensor x0 = at::randn({16, 8}, options);
  const at::Tensor y0 = at::randn({16, 1}, options);
  const at::Tensor weight_before = graphed_model.layer->weight.detach().clone();

  TrainStepOptions step_options;
  step_options.state = graphed_model.state();
  TrainStep step([&](const std::vector<IValue>& b) { return graphed_model.iteration(b); },
                 {batch_of(x0, y0)}, step_options);
  EXPECT_TRUE(at::equal(graphed_model.layer->weight.detach(), weight_before));

  for (int i = 0; i < 20; ++i) {
    const at::Tensor x = at::randn({16, 8}, options);
    const at::Tensor y = at::randn({16, 1}, options);
    const at::Tensor loss = step.step({batch_of(x, y)});
    const at::Tensor eager_loss = eager_model.iteration({batch_of(x, y)}).toTensor();
    EXPECT_TRUE(at::allclose(loss, eager_loss, 1e-6, 0)) << "step " << i;
  }
  EXPECT_TRUE(at::allclose(graphed_model.layer->weight, eager_model.layer->weight, 1e-6, 1e-7));
  EXPECT_EQ(step.steps(), 20);
}

TEST(TrainStepOnGpu, FailedCaptureRestoresEverything) {
  GRAPHED_REQUIRE_GPU();
  Regression model(1);
  const auto options = at::TensorOptions().device(at::kCUDA);
  const at::Tensor weight = model.layer->weight.detach().clone();
  TrainStepOptions step_options;
  step_options.state = model.state();
  EXPECT_THROW_WITH(TrainStep(
                        [&](const std::vector<IValue>& b) {
                          IValue loss = model.iteration(b);
                          (void)loss.toTensor().item<float>();
                          return loss;
                        },
                        {batch_of(at::randn({4, 8}, options), at::randn({4, 1}, options))},
                        step_options),
                    CaptureError, "aten::_local_scalar_dense");
  EXPECT_TRUE(at::equal(model.layer->weight.detach(), weight));
  for (const at::Tensor& t : model.optimizer->state()) {
    if (t.dim() > 0) {
      EXPECT_TRUE(at::equal(t, at::zeros_like(t))) << "optimizer moments must be restored";
    }
  }
}

TEST(TrainStepOnGpu, LossMustBeATensor) {
  GRAPHED_REQUIRE_GPU();
  Regression model(2);
  TrainStepOptions step_options;
  step_options.state = model.state();
  EXPECT_THROW_WITH(TrainStep([](const std::vector<IValue>&) -> IValue { return IValue(1.0); },
                              {at::ones({2}, at::TensorOptions().device(at::kCUDA))},
                              step_options),
                    Error, "must return the loss as a CUDA tensor with one element, got 1.0");
}

TEST(TrainStepValidation, FromPartsNeedsALossAndAnOptimizer) {
  EXPECT_THROW_WITH(TrainStep::from_parts(TrainStepParts{}, {at::ones({2})}), Error,
                    "TrainStepParts::loss is empty");
  TrainStepParts parts;
  parts.loss = [](const std::vector<IValue>&) -> IValue { return IValue(); };
  EXPECT_THROW_WITH(TrainStep::from_parts(parts, {at::ones({2})}), Error,
                    "TrainStepParts::optimizer is null");
}

TEST(TrainStepOnGpu, FromPartsAccumulatesMicrobatchesAndSkipsNonFiniteSteps) {
  GRAPHED_REQUIRE_GPU();
  const auto options = at::TensorOptions().device(at::kCUDA);
  torch::manual_seed(3);
  torch::nn::Linear layer(8, 1);
  layer->to(torch::kCUDA);
  torch::nn::Linear eager_layer(8, 1);
  eager_layer->to(torch::kCUDA);
  {
    c10::NoGradGuard no_grad;
    eager_layer->weight.copy_(layer->weight);
    eager_layer->bias.copy_(layer->bias);
  }
  auto optimizer = std::make_shared<CapturableAdamW>(layer->parameters(), AdamWOptions{1e-2});
  CapturableAdamW eager_optimizer(eager_layer->parameters(), AdamWOptions{1e-2});

  TrainStepParts parts;
  parts.loss = [&](const std::vector<IValue>& batch) -> IValue {
    const auto& pair = batch[0].toTupleRef().elements();
    return torch::mse_loss(layer->forward(pair[0].toTensor()), pair[1].toTensor());
  };
  parts.optimizer = optimizer;
  parts.microbatches = 2;
  parts.guard.skip_nonfinite = true;
  parts.guard.clip_grad_norm = 10.0;
  TrainStep step = TrainStep::from_parts(
      parts, {batch_of(at::randn({8, 8}, options), at::randn({8, 1}, options))});
  ASSERT_NE(step.guard(), nullptr);

  for (int i = 0; i < 5; ++i) {
    const at::Tensor x = at::randn({8, 8}, options);
    const at::Tensor y = at::randn({8, 1}, options);
    const at::Tensor loss = step.step({batch_of(x, y)});
    eager_optimizer.zero_grad();
    at::Tensor total;
    for (int m = 0; m < 2; ++m) {
      const at::Tensor micro =
          torch::mse_loss(eager_layer->forward(x.chunk(2)[m]), y.chunk(2)[m]) / 2;
      micro.backward();
      total = total.defined() ? total + micro.detach() : micro.detach();
    }
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : eager_layer->parameters()) {
      grads.push_back(p.grad());
    }
    clip_grad_norm(grads, 10.0);
    eager_optimizer.step();
    EXPECT_TRUE(at::allclose(loss, total, 1e-6, 0)) << "step " << i;
  }
  EXPECT_TRUE(at::allclose(layer->weight, eager_layer->weight, 1e-6, 1e-7));

  const at::Tensor weight = layer->weight.detach().clone();
  at::Tensor bad_x = at::randn({8, 8}, options);
  bad_x[0][0] = std::numeric_limits<float>::quiet_NaN();
  (void)step.step({batch_of(bad_x, at::randn({8, 1}, options))});
  EXPECT_TRUE(at::equal(layer->weight.detach(), weight));
  EXPECT_EQ(step.guard()->skipped_steps(), 1);
}

// Note [Buffers of a skipped step]: TrainStepParts::buffers (BatchNorm's
// statistics and counter) come out of a skipped step bit-identical.
TEST(TrainStepOnGpu, FromPartsSkippedStepLeavesTheBuffersAlone) {
  GRAPHED_REQUIRE_GPU();
  const auto options = at::TensorOptions().device(at::kCUDA);
  torch::manual_seed(5);
  torch::nn::Linear layer(8, 4);
  torch::nn::BatchNorm1d norm(4);
  layer->to(torch::kCUDA);
  norm->to(torch::kCUDA);
  std::vector<at::Tensor> params = layer->parameters();
  for (const at::Tensor& p : norm->parameters()) {
    params.push_back(p);
  }
  TrainStepParts parts;
  parts.loss = [&](const std::vector<IValue>& batch) -> IValue {
    const auto& pair = batch[0].toTupleRef().elements();
    return torch::mse_loss(norm->forward(layer->forward(pair[0].toTensor())),
                           pair[1].toTensor());
  };
  parts.optimizer = std::make_shared<CapturableAdamW>(params, AdamWOptions{1e-2});
  parts.buffers = norm->buffers();
  parts.guard.skip_nonfinite = true;
  TrainStep step = TrainStep::from_parts(
      parts, {batch_of(at::randn({16, 8}, options), at::randn({16, 4}, options))});
  ASSERT_EQ(step.guard()->protected_buffers().size(), 3u);
  (void)step.step({batch_of(at::randn({16, 8}, options), at::randn({16, 4}, options))});
  std::vector<at::Tensor> before;
  for (const at::Tensor& b : norm->buffers()) {
    before.push_back(b.clone());
  }
  const at::Tensor weight = layer->weight.detach().clone();
  at::Tensor bad_x = at::randn({16, 8}, options);
  bad_x[3][1] = std::numeric_limits<float>::quiet_NaN();
  (void)step.step({batch_of(bad_x, at::randn({16, 4}, options))});
  EXPECT_EQ(step.guard()->skipped_steps(), 1);
  EXPECT_TRUE(at::equal(layer->weight.detach(), weight));
  const std::vector<at::Tensor> after = norm->buffers();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_TRUE(at::equal(after[i], before[i])) << "buffer " << i;
  }
  EXPECT_EQ(norm->num_batches_tracked.item<int64_t>(), 1);
}

// Note [Tensors a graph reads in place]: a state tensor given other storage
// after capture (what module.to(dtype) does) makes the step raise.
TEST(TrainStepOnGpu, StateMovedAfterCaptureRaisesInsteadOfReplaying) {
  GRAPHED_REQUIRE_GPU();
  Regression model(1);
  const auto options = at::TensorOptions().device(at::kCUDA);
  const IValue batch = batch_of(at::randn({16, 8}, options), at::randn({16, 1}, options));
  TrainStepOptions step_options;
  step_options.state = model.state();
  TrainStep step([&](const std::vector<IValue>& b) { return model.iteration(b); }, {batch},
                 step_options);
  (void)step.step({batch});
  {
    c10::NoGradGuard no_grad;
    model.layer->weight.set_data(model.layer->weight.detach().to(at::kDouble));
  }
  EXPECT_THROW_WITH(step.step({batch}), Error, "at another address");
}

// Note [Capturing collectives]: the options are checked before any warm-up,
// so these need no GPU (the step function would fail if it ran).
TrainStepOptions collective_options(CaptureErrorMode mode, int warmup) {
  TrainStepOptions options;
  options.state = {at::ones({1})};
  options.error_mode = mode;
  options.warmup_iters = warmup;
  options.collectives = CollectiveCapture{};
  return options;
}

IValue never_called(const std::vector<IValue>&) {
  ADD_FAILURE() << "the iteration ran although the options were invalid";
  return IValue();
}

TEST(TrainStepValidation, CollectivesRefuseTheGlobalCaptureMode) {
  EXPECT_THROW_WITH(TrainStep(never_called, {at::ones({2})},
                              collective_options(CaptureErrorMode::kGlobal, 11)),
                    Error, "capture_error_mode=\"thread_local\"");
}

TEST(TrainStepValidation, CollectivesNeedElevenWarmupIterations) {
  EXPECT_THROW_WITH(TrainStep(never_called, {at::ones({2})},
                              collective_options(CaptureErrorMode::kThreadLocal, 3)),
                    Error, "at least 11 warm-up iterations before capture, got 3");
}

// What DDP does at construction: create (and keep) each parameter's gradient
// accumulator, on the stream current at that moment.
// A shared_ptr in torch 2.11, an intrusive_ptr in 2.14.
using AccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<at::Tensor>()));

std::vector<AccumulatorPtr> keep_accumulators(const std::vector<at::Tensor>& params) {
  std::vector<AccumulatorPtr> kept;
  for (const at::Tensor& p : params) {
    kept.emplace_back(torch::autograd::impl::grad_accumulator(p));
  }
  return kept;
}

TEST(TrainStepOnGpu, CollectivesNeedAccumulatorsOnTheCaptureStream) {
  GRAPHED_REQUIRE_GPU();
  Regression model(0);
  const auto options = at::TensorOptions().device(at::kCUDA);
  const IValue batch = batch_of(at::randn({16, 8}, options), at::randn({16, 1}, options));
  auto step_options = collective_options(CaptureErrorMode::kThreadLocal, 11);
  step_options.state = model.state();
  step_options.collectives->hooked_params = model.layer->parameters();
  const auto iteration = [&](const std::vector<IValue>& b) { return model.iteration(b); };
  {
    const auto on_default_stream = keep_accumulators(model.layer->parameters());
    EXPECT_THROW_WITH(TrainStep(iteration, {batch}, step_options), Error,
                      "runs on the default stream of cuda:0");
  }
  c10::cuda::CUDAStreamGuard on_capture_stream(capture_stream(0));
  const auto on_capture = keep_accumulators(model.layer->parameters());
  TrainStep step(iteration, {batch}, step_options);
  EXPECT_EQ(step.steps(), 0);
}

TEST(TrainStepOnGpu, ReleaseDestroysTheGraphsAndLaterStepsRaise) {
  GRAPHED_REQUIRE_GPU();
  Regression model(0);
  const auto options = at::TensorOptions().device(at::kCUDA);
  const IValue batch = batch_of(at::randn({16, 8}, options), at::randn({16, 1}, options));
  TrainStepOptions step_options;
  step_options.state = model.state();
  TrainStep step([&](const std::vector<IValue>& b) { return model.iteration(b); }, {batch},
                 step_options);
  (void)step.step({batch});
  (void)step.step({batch});
  step.release();
  EXPECT_TRUE(step.released());
  EXPECT_EQ(step.steps(), 2);
  EXPECT_THROW_WITH(step.step({batch}), Error, "was released");
  step.release();  // a second release does nothing
}

}  // namespace
}  // namespace graphed
