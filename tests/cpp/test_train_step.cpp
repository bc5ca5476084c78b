// graphed::TrainStep from LibTorch: a captured iteration with CapturableAdamW
// trains exactly like eager, capture changes nothing, failures restore state.

#include "graphed/check.h"
#include "graphed/optim.h"
#include "graphed/train_step.h"
#include "test_support.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/torch.h>

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

}  // namespace
}  // namespace graphed
