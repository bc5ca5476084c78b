// GradientGuard and clipping: no host syncs, results equal torch's formulas.

#include "graphed/check.h"
#include "graphed/grad_guard.h"
#include "test_support.h"

#include <ATen/ATen.h>

namespace graphed {
namespace {

TEST(GradGuard, GroupsByDtypeKeepingOrder) {
  const at::Tensor a = at::ones({1});
  const at::Tensor b = at::ones({1}, at::kDouble);
  const at::Tensor c = at::zeros({1});
  const auto groups = group_by_dtype({a, b, c});
  ASSERT_EQ(groups.size(), 2u);
  size_t floats = groups[0][0].scalar_type() == at::kFloat ? 0 : 1;
  ASSERT_EQ(groups[floats].size(), 2u);
  EXPECT_TRUE(groups[floats][0].is_same(a));
  EXPECT_TRUE(groups[floats][1].is_same(c));
}

TEST(GradGuard, CpuDeviceIsRefused) {
  EXPECT_THROW_WITH(GradientGuard(c10::Device(c10::kCPU), {}), Error, "Expected a CUDA device");
}

at::TensorOptions cuda_floats() { return at::TensorOptions().device(at::kCUDA).dtype(at::kFloat); }

TEST(GradGuardOnGpu, ClippingMatchesTorchsFormula) {
  GRAPHED_REQUIRE_GPU();
  at::manual_seed(0);
  std::vector<at::Tensor> grads{at::randn({10}, cuda_floats()) * 3,
                                at::randn({5, 5}, cuda_floats())};
  const std::vector<at::Tensor> original{grads[0].clone(), grads[1].clone()};
  const double norm = at::cat({original[0].flatten(), original[1].flatten()}).norm().item<double>();
  const at::Tensor reported = clip_grad_norm(grads, 1.0);
  EXPECT_NEAR(reported.item<double>(), norm, 1e-4 * norm);
  const double coefficient = std::min(1.0, 1.0 / (norm + 1e-6));
  EXPECT_TRUE(at::allclose(grads[0], original[0] * coefficient, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(grads[1], original[1] * coefficient, 1e-5, 1e-6));
}

TEST(GradGuardOnGpu, NonFiniteGradientOrLossIsFlaggedAndCounted) {
  GRAPHED_REQUIRE_GPU();
  GradientGuardOptions options;
  options.skip_nonfinite = true;
  GradientGuard guard(c10::Device(c10::kCUDA, 0), options);
  const at::Tensor finite_loss = at::ones({}, cuda_floats());
  std::vector<at::Tensor> grads{at::ones({4}, cuda_floats())};
  EXPECT_EQ(guard.process(finite_loss, grads).item<float>(), 0.0f);
  grads[0][2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(guard.process(finite_loss, grads).item<float>(), 1.0f);
  grads[0].fill_(1);
  EXPECT_EQ(guard.process(at::full({}, INFINITY, cuda_floats()), grads).item<float>(), 1.0f);
  EXPECT_EQ(guard.skipped_steps(), 2);
}

TEST(GradGuardOnGpu, LossScalingUnscalesAndBacksOff) {
  GRAPHED_REQUIRE_GPU();
  GradientGuardOptions options;
  options.loss_scaling = LossScaling{1024.0, 2.0, 0.5, 2};
  GradientGuard guard(c10::Device(c10::kCUDA, 0), options);
  EXPECT_TRUE(guard.can_skip());
  const at::Tensor loss = at::full({}, 3.0, cuda_floats());
  EXPECT_EQ(guard.scale_loss(loss).item<float>(), 3072.0f);
  std::vector<at::Tensor> grads{at::full({4}, 2048.0, cuda_floats())};
  EXPECT_EQ(guard.process(loss, grads).item<float>(), 0.0f);
  EXPECT_TRUE(at::equal(grads[0], at::full({4}, 2.0, cuda_floats())));
  guard.after_step();
  grads[0].fill_(INFINITY);
  EXPECT_EQ(guard.process(loss, grads).item<float>(), 1.0f);
  guard.after_step();
  EXPECT_EQ(guard.loss_scale(), 512.0);
  grads[0].fill_(1);
  for (int i = 0; i < 2; ++i) {
    guard.process(loss, grads);
    guard.after_step();
  }
  EXPECT_EQ(guard.loss_scale(), 1024.0) << "two finite steps in a row grow the scale";
}

}  // namespace
}  // namespace graphed
