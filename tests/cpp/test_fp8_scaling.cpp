// FP8 scaling arithmetic (fp8_scaling.h): formats, the scale from an amax, the
// saturating cast, and DelayedScaling's history, on CPU tensors (the same
// tensor operations a captured graph replays on the GPU).

#include "graphed/check.h"
#include "graphed/fp8_scaling.h"
#include "test_support.h"

#include <ATen/ATen.h>

#include <limits>
#include <vector>

namespace graphed {
namespace {

const c10::Device kCpu(c10::kCPU);

at::Tensor scalar(double value) {
  return at::full({1}, value, at::TensorOptions().dtype(at::kFloat));
}

float value_of(const at::Tensor& t) {
  return t.reshape({-1})[0].item<float>();
}

TEST(Float8Formats, LargestValuesAndDtypesAreTheHardwares) {
  EXPECT_EQ(float8_max(Float8Format::kE4M3), 448.0);
  EXPECT_EQ(float8_max(Float8Format::kE5M2), 57344.0);
  EXPECT_EQ(float8_dtype(Float8Format::kE4M3), at::kFloat8_e4m3fn);
  EXPECT_EQ(float8_dtype(Float8Format::kE5M2), at::kFloat8_e5m2);
}

TEST(ScaleFromAmax, MapsTheAmaxOntoTheFormatsRangeWithItsMargin) {
  const at::Tensor previous = scalar(3.0);
  EXPECT_FLOAT_EQ(value_of(scale_from_amax(scalar(2.0), previous, Float8Format::kE4M3, 0)), 224.0f);
  EXPECT_FLOAT_EQ(value_of(scale_from_amax(scalar(2.0), previous, Float8Format::kE4M3, 1)), 112.0f);
  EXPECT_FLOAT_EQ(value_of(scale_from_amax(scalar(0.5), previous, Float8Format::kE5M2, 0)),
                  114688.0f);
}

TEST(ScaleFromAmax, KeepsThePreviousScaleWhereTheAmaxSaysNothing) {
  const at::Tensor previous = scalar(3.0);
  for (double amax : {0.0, std::numeric_limits<double>::infinity(),
                      std::numeric_limits<double>::quiet_NaN(), 1e-45}) {
    EXPECT_FLOAT_EQ(value_of(scale_from_amax(scalar(amax), previous, Float8Format::kE4M3, 0)), 3.0f)
        << "amax " << amax;
  }
}

TEST(CastToFloat8, SaturatesAndRoundTripsWithTheInverseScale) {
  const at::Tensor x = at::tensor({1000.0f, -1000.0f, 0.5f, -3.0f});
  const at::Tensor cast = cast_to_float8(x, scalar(1.0), Float8Format::kE4M3);
  EXPECT_EQ(cast.scalar_type(), at::kFloat8_e4m3fn);
  const at::Tensor back = cast.to(at::kFloat);
  EXPECT_FLOAT_EQ(back[0].item<float>(), 448.0f);
  EXPECT_FLOAT_EQ(back[1].item<float>(), -448.0f);
  // In range, x * scale survives the cast to within E4M3's precision.
  const at::Tensor scale = current_scale(x.narrow(0, 2, 2), Float8Format::kE4M3);
  EXPECT_FLOAT_EQ(value_of(scale), 448.0f / 3.0f);
  const at::Tensor restored =
      cast_to_float8(x.narrow(0, 2, 2), scale, Float8Format::kE4M3).to(at::kFloat) / scale;
  EXPECT_TRUE(at::allclose(restored, x.narrow(0, 2, 2), /*rtol=*/0.07, /*atol=*/0));
  // A bf16 input is scaled in float32, not in bf16.
  EXPECT_EQ(cast_to_float8(x.to(at::kBFloat16), scalar(1.0), Float8Format::kE5M2).scalar_type(),
            at::kFloat8_e5m2);
}

TEST(CurrentScale, IsOneForATensorOfZeros) {
  EXPECT_FLOAT_EQ(value_of(current_scale(at::zeros({4}), Float8Format::kE4M3)), 1.0f);
  EXPECT_FLOAT_EQ(value_of(current_scale(at::tensor({-8.0f, 2.0f}), Float8Format::kE4M3, 2)),
                  448.0f / 8.0f / 4.0f);
}

TEST(DelayedScaling, StartsAtScaleOneAndFollowsTheLargestAmaxOfItsHistory) {
  DelayedScaling scaling(Float8Format::kE4M3, {/*history_len=*/2, AmaxReduction::kMax, 0}, kCpu);
  EXPECT_FLOAT_EQ(value_of(scaling.scale()), 1.0f);
  // Steps record amaxes 1, 4, 2, 1; the history keeps the last two.
  const std::vector<float> amaxes = {1, 4, 2, 1};
  const std::vector<float> expected_max = {1, 4, 4, 2};
  for (size_t step = 0; step < amaxes.size(); ++step) {
    scaling.record_amax(at::tensor({-amaxes[step], 0.5f}));
    scaling.update_scale();
    EXPECT_FLOAT_EQ(value_of(scaling.scale()), 448.0f / expected_max[step]) << "step " << step;
    EXPECT_FLOAT_EQ(value_of(scaling.scale_inv()), expected_max[step] / 448.0f) << "step " << step;
  }
  EXPECT_TRUE(at::equal(scaling.amax_history(), at::tensor({2.0f, 1.0f})));
}

TEST(DelayedScaling, MostRecentFollowsTheLastStepAndZeroStepsKeepTheScale) {
  DelayedScaling scaling(Float8Format::kE5M2, {4, AmaxReduction::kMostRecent, 1}, kCpu);
  scaling.record_amax_value(at::tensor(8.0f));
  scaling.update_scale();
  EXPECT_FLOAT_EQ(value_of(scaling.scale()), 57344.0f / 8.0f / 2.0f);
  scaling.record_amax_value(scalar(2.0));
  scaling.update_scale();
  EXPECT_FLOAT_EQ(value_of(scaling.scale()), 57344.0f / 2.0f / 2.0f);
  scaling.record_amax(at::zeros({3}));  // a step of zeros says nothing about the range
  scaling.update_scale();
  EXPECT_FLOAT_EQ(value_of(scaling.scale()), 57344.0f / 2.0f / 2.0f);
  scaling.record_amax_value(scalar(std::numeric_limits<double>::infinity()));  // overflowed step
  scaling.update_scale();
  EXPECT_FLOAT_EQ(value_of(scaling.scale()), 57344.0f / 2.0f / 2.0f);
}

TEST(DelayedScaling, CastsWithTheScaleOfTheStepsBefore) {
  DelayedScaling scaling(Float8Format::kE4M3, {}, kCpu);
  const at::Tensor x = at::tensor({896.0f, 1.0f});
  // The first step casts with scale 1 (nothing recorded yet): 896 saturates.
  EXPECT_FLOAT_EQ(scaling.cast(x).to(at::kFloat)[0].item<float>(), 448.0f);
  scaling.record_amax(x);
  scaling.update_scale();
  EXPECT_FLOAT_EQ((scaling.cast(x).to(at::kFloat) * scaling.scale_inv())[0].item<float>(), 896.0f);
}

TEST(DelayedScaling, StateListsItsTensorsOnItsDevice) {
  DelayedScaling scaling(Float8Format::kE4M3, {8, AmaxReduction::kMax, 0}, kCpu);
  const std::vector<at::Tensor> state = scaling.state();
  ASSERT_EQ(state.size(), 4u);
  EXPECT_EQ(state[0].numel(), 8);
  for (const at::Tensor& t : state) {
    EXPECT_EQ(t.device(), kCpu);
  }
  // The state is the live tensors: a restored snapshot restores the scaling.
  state[2].fill_(5.0f);
  EXPECT_FLOAT_EQ(value_of(scaling.scale()), 5.0f);
}

TEST(DelayedScalingValidation, RefusesOptionsOutOfRange) {
  EXPECT_THROW_WITH(DelayedScaling(Float8Format::kE4M3, {0, AmaxReduction::kMax, 0}, kCpu), Error,
                    "Expected history_len >= 1");
  EXPECT_THROW_WITH(DelayedScaling(Float8Format::kE4M3, {4, AmaxReduction::kMax, -1}, kCpu), Error,
                    "Expected margin in 0..64");
  DelayedScaling scaling(Float8Format::kE4M3, {}, kCpu);
  EXPECT_THROW_WITH(scaling.record_amax_value(at::ones({2})), Error,
                    "Expected one amax (a scalar or one-element tensor), got a tensor of shape [2]");
}

}  // namespace
}  // namespace graphed
