// GradientGuard and clipping: no host syncs, results equal torch's formulas.

#include "graphed/check.h"
#include "graphed/grad_guard.h"
#include "test_support.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

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

// Note [Buffers of a skipped step]: the snapshot and the device-side restore
// are plain ATen work, so they are checked here on CPU tensors.
std::vector<at::Tensor> bn_like_buffers() {
  at::Tensor mean = at::arange(4, at::kFloat);
  at::Tensor var = at::ones({4}, at::kFloat);
  at::Tensor tracked = at::full({}, 7, at::kLong);
  at::Tensor half = at::full({3}, 0.5, at::kHalf);
  at::Tensor mask = at::zeros({2}, at::kBool);
  mask[0] = true;
  return {mean, var, tracked, half, mask};
}

std::vector<at::Tensor> shadows_of(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> shadows;
  for (const at::Tensor& t : tensors) {
    shadows.push_back(at::empty_like(t));
  }
  return shadows;
}

// What a bad forward does to BatchNorm's buffers: NaN statistics, one more batch.
void poison(const std::vector<at::Tensor>& buffers) {
  buffers[0].fill_(std::numeric_limits<float>::quiet_NaN());
  buffers[1][2] = INFINITY;
  buffers[2].add_(1);
  buffers[3].fill_(std::numeric_limits<float>::quiet_NaN());
  buffers[4].logical_not_();
}

TEST(GradGuard, SkippedStepRestoresBuffersBitForBit) {
  const std::vector<at::Tensor> buffers = bn_like_buffers();
  std::vector<at::Tensor> before;
  for (const at::Tensor& b : buffers) {
    before.push_back(b.clone());
  }
  const std::vector<at::Tensor> shadows = shadows_of(buffers);
  snapshot_tensors(buffers, shadows);
  poison(buffers);
  const std::vector<void*> addresses{buffers[0].data_ptr(), buffers[2].data_ptr()};
  restore_tensors_if(at::ones({}, at::kFloat), buffers, shadows);
  for (size_t i = 0; i < buffers.size(); ++i) {
    EXPECT_TRUE(at::equal(buffers[i], before[i])) << "buffer " << i;
  }
  EXPECT_EQ(buffers[2].item<int64_t>(), 7) << "int64 counters are restored exactly";
  EXPECT_EQ(buffers[0].data_ptr(), addresses[0]) << "restored in place: the graph's address";
  EXPECT_EQ(buffers[2].data_ptr(), addresses[1]);
}

TEST(GradGuard, GoodStepKeepsTheNewBufferValuesBitForBit) {
  const std::vector<at::Tensor> buffers = bn_like_buffers();
  const std::vector<at::Tensor> shadows = shadows_of(buffers);
  snapshot_tensors(buffers, shadows);
  poison(buffers);  // a good step's update, here with NaNs, must survive as it is
  std::vector<at::Tensor> updated;
  for (const at::Tensor& b : buffers) {
    updated.push_back(b.clone());
  }
  restore_tensors_if(at::zeros({}, at::kFloat), buffers, shadows);
  for (size_t i = 0; i < buffers.size(); ++i) {
    // NaN != NaN: compare the bits.
    EXPECT_TRUE(at::equal(buffers[i].reshape({-1}).view(at::kByte),
                          updated[i].reshape({-1}).view(at::kByte)))
        << "buffer " << i;
  }
  EXPECT_EQ(buffers[2].item<int64_t>(), 8);
}

TEST(GradGuard, RestoreTakesBoolAndOneElementFlags) {
  at::Tensor counter = at::full({2}, 3, at::kLong);
  const std::vector<at::Tensor> tensors{counter};
  const std::vector<at::Tensor> shadows = shadows_of(tensors);
  snapshot_tensors(tensors, shadows);
  counter.add_(5);
  restore_tensors_if(at::zeros({1}, at::kBool), tensors, shadows);
  EXPECT_TRUE(at::equal(counter, at::full({2}, 8, at::kLong)));
  restore_tensors_if(at::ones({1}, at::kBool), tensors, shadows);
  EXPECT_TRUE(at::equal(counter, at::full({2}, 3, at::kLong)));
}

TEST(GradGuard, MismatchedShadowsAndFlagsAreExplained) {
  const std::vector<at::Tensor> tensors{at::zeros({4})};
  EXPECT_THROW_WITH(snapshot_tensors(tensors, {}), Error, "Expected one shadow per tensor");
  EXPECT_THROW_WITH(snapshot_tensors(tensors, {at::zeros({4}, at::kDouble)}), Error,
                    "Allocate the shadows with empty_like(tensor)");
  EXPECT_THROW_WITH(restore_tensors_if(at::zeros({2}), tensors, {at::zeros({4})}), Error,
                    "Expected the skip flag to be a tensor with one element");
}

TEST(GradGuardOnGpu, ProtectedBuffersComeBackAfterASkippedStep) {
  GRAPHED_REQUIRE_GPU();
  GradientGuardOptions options;
  options.skip_nonfinite = true;
  GradientGuard guard(c10::Device(c10::kCUDA, 0), options);
  at::Tensor mean = at::zeros({4}, cuda_floats());
  at::Tensor tracked = at::zeros({}, at::TensorOptions().device(at::kCUDA).dtype(at::kLong));
  at::Tensor cpu_buffer = at::zeros({2});
  guard.protect_buffers({mean, tracked, mean, cpu_buffer});
  ASSERT_EQ(guard.protected_buffers().size(), 2u) << "repeats and CPU buffers are left out";
  std::vector<at::Tensor> grads{at::ones({4}, cuda_floats())};
  const at::Tensor loss = at::ones({}, cuda_floats());

  guard.begin_step();  // a good step: its updates stay
  mean.add_(1);
  tracked.add_(1);
  EXPECT_EQ(guard.process(loss, grads).item<float>(), 0.0f);
  EXPECT_TRUE(at::equal(mean, at::ones({4}, cuda_floats())));
  EXPECT_EQ(tracked.item<int64_t>(), 1);

  guard.begin_step();  // a bad step: undone
  mean.fill_(std::numeric_limits<float>::quiet_NaN());
  tracked.add_(1);
  EXPECT_EQ(guard.process(at::full({}, NAN, cuda_floats()), grads).item<float>(), 1.0f);
  EXPECT_TRUE(at::equal(mean, at::ones({4}, cuda_floats())));
  EXPECT_EQ(tracked.item<int64_t>(), 1);
}

TEST(GradGuardOnGpu, GuardsThatCannotSkipProtectNothing) {
  GRAPHED_REQUIRE_GPU();
  GradientGuardOptions options;
  options.clip_grad_norm = 1.0;
  GradientGuard guard(c10::Device(c10::kCUDA, 0), options);
  guard.protect_buffers({at::zeros({4}, cuda_floats())});
  EXPECT_TRUE(guard.protected_buffers().empty());
}

}  // namespace
}  // namespace graphed
