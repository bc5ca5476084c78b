// graphed's RMSNorm in three kernels (rms_norm_ops.h). On the CPU: the
// refusals and the strict entry point's errors, which come before any device
// work. Its results against transformers' modules, on a GPU:
// tests/python/test_rms_norm_gpu.py (the reference is transformers' Python).

#include "graphed/check.h"
#include "graphed/rms_norm_ops.h"
#include "test_support.h"

#include <ATen/ATen.h>

namespace graphed {
namespace {

TEST(RmsNormOps, RefusesTensorsOffTheGpuBeforeTouchingADevice) {
  const at::Tensor hidden = at::zeros({2, 1, 8}), weight = at::ones({8});
  const auto why = rms_norm_refusal(hidden, {}, weight);
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("rms_norm's hidden states on a CUDA device, got Float [2, 1, 8] on cpu"),
            std::string::npos)
      << *why;
  EXPECT_THROW_WITH(rms_norm(hidden, {}, weight, 1e-6), Error,
                    "Expected rms_norm's hidden states on a CUDA device");
  EXPECT_THROW_WITH(rms_norm(hidden, at::zeros({2, 1, 8}), weight, 1e-6), Error,
                    "on a CUDA device");
}

TEST(RmsNormOps, RefusesDtypesItDoesNotReproduceBeforeTheDevice) {
  // float64 (and integers) keep transformers' forward; so do mixed dtypes,
  // which its products promote (a float32 weight under autocast's bfloat16).
  const auto doubles = rms_norm_refusal(at::zeros({2, 8}, at::kDouble), {}, at::ones({8}));
  ASSERT_TRUE(doubles.has_value());
  EXPECT_NE(doubles->find("hidden states in float32, bfloat16 or float16, got Double [2, 8]"),
            std::string::npos)
      << *doubles;
  const auto mixed = rms_norm_refusal(at::zeros({2, 8}, at::kBFloat16), {}, at::ones({8}));
  ASSERT_TRUE(mixed.has_value());
  EXPECT_NE(mixed->find("weight in the hidden states' dtype (BFloat16), got Float [8]"),
            std::string::npos)
      << *mixed;
  const auto gate = rms_norm_refusal(at::zeros({2, 8}, at::kHalf), at::zeros({2, 8}),
                                     at::ones({8}, at::kHalf));
  ASSERT_TRUE(gate.has_value());
  EXPECT_NE(gate->find("gate in the hidden states' dtype (Half)"), std::string::npos) << *gate;
  // Dtypes it takes get as far as the device check.
  const auto half = rms_norm_refusal(at::zeros({2, 8}, at::kHalf), {}, at::ones({8}, at::kHalf));
  ASSERT_TRUE(half.has_value());
  EXPECT_NE(half->find("on a CUDA device"), std::string::npos) << *half;
  EXPECT_THROW_WITH(rms_norm(at::zeros({2, 8}, at::kDouble), {}, at::ones({8}), 1e-6), Error,
                    "float32, bfloat16 or float16");
}

TEST(RmsNormOps, RefusesMissingAndEmptyArguments) {
  EXPECT_THROW_WITH(rms_norm(at::Tensor(), {}, at::ones({8}), 1e-6), Error,
                    "Expected rms_norm's hidden states and weight to be tensors, got none");
  EXPECT_THROW_WITH(rms_norm(at::zeros({0, 8}), {}, at::ones({8}), 1e-6), Error,
                    "with at least one dimension and one element, got Float [0, 8]");
}

}  // namespace
}  // namespace graphed
