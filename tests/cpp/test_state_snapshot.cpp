// StateSnapshot: values and generators come back exactly (CPU tensors and the CPU
// generator here; the CUDA generator in test_capture).

#include "graphed/state_snapshot.h"
#include "test_support.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

namespace graphed {
namespace {

TEST(StateSnapshot, RestoresTensorValuesInPlace) {
  at::Tensor running_mean = at::arange(4, at::kFloat);
  const void* address = running_mean.data_ptr();
  const at::Tensor expected = running_mean.clone();
  const StateSnapshot snapshot = StateSnapshot::take({running_mean}, std::nullopt);
  running_mean.mul_(3).add_(1);
  snapshot.restore();
  EXPECT_TRUE(at::equal(running_mean, expected));
  EXPECT_EQ(running_mean.data_ptr(), address);
}

TEST(StateSnapshot, RestoresTheCpuGenerator) {
  at::manual_seed(1234);
  const StateSnapshot snapshot = StateSnapshot::take({}, std::nullopt);
  const at::Tensor first = at::randn({8});
  (void)at::randn({100});
  snapshot.restore();
  EXPECT_TRUE(at::equal(at::randn({8}), first));
}

TEST(StateSnapshot, RestoresParametersThatRequireGrad) {
  at::Tensor weight = at::ones({3}).requires_grad_();
  const StateSnapshot snapshot = StateSnapshot::take({weight}, std::nullopt);
  {
    c10::NoGradGuard no_grad;
    weight.zero_();
  }
  snapshot.restore();
  EXPECT_TRUE(at::equal(weight.detach(), at::ones({3})));
  EXPECT_TRUE(weight.requires_grad());
}

TEST(StateSnapshot, EmptySnapshotRestoresNothing) {
  const StateSnapshot snapshot;
  EXPECT_NO_THROW(snapshot.restore());
  EXPECT_EQ(snapshot.bytes(), 0);
}

}  // namespace
}  // namespace graphed
