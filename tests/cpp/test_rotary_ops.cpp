// graphed's rotary embedding in one kernel (rotary_ops.h). On the CPU: the
// refusals and the strict entry point's errors, which come before any device
// work. Its results against transformers' apply_rotary_pos_emb, on a GPU:
// tests/python/test_rotary_gpu.py (the reference is transformers' Python).

#include "graphed/check.h"
#include "graphed/rotary_ops.h"
#include "test_support.h"

#include <ATen/ATen.h>

namespace graphed {
namespace {

TEST(RotaryOps, RefusesDtypesItDoesNotReproduceBeforeTheDevice) {
  const at::Tensor x = at::zeros({2, 4, 1, 8}, at::kDouble);
  const at::Tensor cos = at::ones({2, 1, 8}, at::kDouble), sin = at::zeros({2, 1, 8}, at::kDouble);
  const auto doubles = rotary_embedding_refusal(x, cos, sin);
  ASSERT_TRUE(doubles.has_value());
  EXPECT_NE(doubles->find("states in float32, bfloat16 or float16, got Double [2, 4, 1, 8]"),
            std::string::npos)
      << *doubles;
  // Cosines in float32 with bfloat16 states: transformers' products promote.
  const auto mixed = rotary_embedding_refusal(x.to(at::kBFloat16), cos.to(at::kFloat),
                                              sin.to(at::kBFloat16));
  ASSERT_TRUE(mixed.has_value());
  EXPECT_NE(mixed->find("cosines in the states' dtype (BFloat16), got Float [2, 1, 8]"),
            std::string::npos)
      << *mixed;
  EXPECT_THROW_WITH(rotary_embedding(x, cos, sin), Error, "float32, bfloat16 or float16");
}

TEST(RotaryOps, RefusesShapesAndTheCpuWithTheReason) {
  const at::Tensor cos = at::ones({2, 1, 8}), sin = at::zeros({2, 1, 8});
  const auto three_d = rotary_embedding_refusal(at::zeros({2, 1, 8}), cos, sin);
  ASSERT_TRUE(three_d.has_value());
  EXPECT_NE(three_d->find("states of [batch, heads, seq, dim]"), std::string::npos) << *three_d;
  const auto cpu = rotary_embedding_refusal(at::zeros({2, 4, 1, 8}), cos, sin);
  ASSERT_TRUE(cpu.has_value());
  EXPECT_NE(cpu->find("states on the states' CUDA device, got Float [2, 4, 1, 8] on cpu"),
            std::string::npos)
      << *cpu;
  EXPECT_THROW_WITH(rotary_embedding(at::Tensor(), cos, sin), Error,
                    "Expected rotary_embedding's states, cosines and sines to be tensors, got "
                    "none");
}

}  // namespace
}  // namespace graphed
