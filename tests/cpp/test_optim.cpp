// Capturable AdamW and SGD: validation (no GPU needed), the update rule against
// a reference written out in full, and skipping on found_inf.

#include "graphed/check.h"
#include "graphed/optim.h"
#include "test_support.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>

namespace graphed {
namespace {

TEST(OptimValidation, CpuParametersAreRefused) {
  EXPECT_THROW_WITH(CapturableAdamW({at::ones({2}).requires_grad_()}), Error,
                    "expected CUDA floating-point parameters");
  EXPECT_THROW_WITH(CapturableSGD({}), Error, "at least one parameter");
}

at::TensorOptions cuda_floats() { return at::TensorOptions().device(at::kCUDA).dtype(at::kFloat); }

TEST(OptimOnGpu, SgdRefusesDampenedMomentum) {
  GRAPHED_REQUIRE_GPU();
  SGDOptions options;
  options.momentum = 0.9;
  options.dampening = 0.1;
  EXPECT_THROW_WITH(CapturableSGD({at::ones({2}, cuda_floats()).requires_grad_()}, options),
                    Error, "dampening");
}

TEST(OptimOnGpu, AdamWFollowsTheReferenceUpdate) {
  GRAPHED_REQUIRE_GPU();
  at::manual_seed(0);
  at::Tensor p = at::randn({64}, cuda_floats()).requires_grad_();
  AdamWOptions options;
  options.lr = 1e-2;
  options.weight_decay = 0.1;
  CapturableAdamW adamw({p}, options);
  at::Tensor reference = p.detach().to(at::kDouble);
  at::Tensor m = at::zeros_like(reference);
  at::Tensor v = at::zeros_like(reference);
  for (int t = 1; t <= 3; ++t) {
    const at::Tensor grad = at::randn({64}, cuda_floats());
    p.mutable_grad() = grad.clone();
    adamw.step();
    const at::Tensor g = grad.to(at::kDouble);
    reference = reference * (1 - options.lr * options.weight_decay);
    m = options.beta1 * m + (1 - options.beta1) * g;
    v = options.beta2 * v + (1 - options.beta2) * g * g;
    const double bias1 = 1 - std::pow(options.beta1, t);
    const double bias2 = 1 - std::pow(options.beta2, t);
    reference = reference - options.lr / bias1 * m / ((v / bias2).sqrt() + options.eps);
    EXPECT_TRUE(at::allclose(p.detach().to(at::kDouble), reference, 1e-5, 1e-6)) << "step " << t;
  }
}

TEST(OptimOnGpu, FoundInfSkipsTheStepBitIdentically) {
  GRAPHED_REQUIRE_GPU();
  at::Tensor p = at::randn({32}, cuda_floats()).requires_grad_();
  CapturableAdamW adamw({p});
  p.mutable_grad() = at::randn({32}, cuda_floats());
  adamw.step();
  const at::Tensor weights = p.detach().clone();
  std::vector<at::Tensor> state;
  for (const at::Tensor& t : adamw.state()) {
    state.push_back(t.clone());
  }
  adamw.step(at::ones({1}, cuda_floats()));
  EXPECT_TRUE(at::equal(p.detach(), weights));
  const std::vector<at::Tensor> after = adamw.state();
  for (size_t i = 0; i < state.size(); ++i) {
    EXPECT_TRUE(at::equal(after[i], state[i])) << "state tensor " << i;
  }
  adamw.step(at::zeros({1}, cuda_floats()));
  EXPECT_FALSE(at::equal(p.detach(), weights));
}

TEST(OptimOnGpu, SgdMomentumMatchesEagerFromTheFirstStep) {
  GRAPHED_REQUIRE_GPU();
  at::Tensor p = at::randn({16}, cuda_floats()).requires_grad_();
  SGDOptions options;
  options.lr = 0.1;
  options.momentum = 0.9;
  CapturableSGD sgd({p}, options);
  at::Tensor reference = p.detach().clone();
  at::Tensor buffer;
  for (int t = 0; t < 3; ++t) {
    const at::Tensor grad = at::randn({16}, cuda_floats());
    p.mutable_grad() = grad.clone();
    sgd.step();
    buffer = t == 0 ? grad.clone() : buffer * options.momentum + grad;  // eager SGD
    reference = reference - options.lr * buffer;
    EXPECT_TRUE(at::allclose(p.detach(), reference, 1e-6, 1e-6)) << "step " << t;
  }
  sgd.set_lr(0.0);
  const at::Tensor frozen = p.detach().clone();
  p.mutable_grad() = at::randn({16}, cuda_floats());
  sgd.step();
  EXPECT_TRUE(at::equal(p.detach(), frozen)) << "set_lr must reach the device";
}

TEST(OptimOnGpu, ZeroGradDropsOrZeroes) {
  GRAPHED_REQUIRE_GPU();
  at::Tensor p = at::randn({4}, cuda_floats()).requires_grad_();
  CapturableSGD sgd({p});
  p.mutable_grad() = at::ones({4}, cuda_floats());
  sgd.zero_grad(/*set_to_none=*/false);
  EXPECT_TRUE(at::equal(p.grad(), at::zeros({4}, cuda_floats())));
  sgd.zero_grad();
  EXPECT_FALSE(p.grad().defined());
}

}  // namespace
}  // namespace graphed
