// The fused decode-step kernels of Mamba2-family layers (state_space_ops.h).
// On the CPU: the refusals and the strict entry points' errors, which come
// before any device work. Their results against transformers' functions, on
// a GPU: tests/python/test_state_space_kernels_gpu.py (the reference is
// transformers' Python).

#include "graphed/check.h"
#include "graphed/state_space_ops.h"
#include "test_support.h"

#include <ATen/ATen.h>

namespace graphed {
namespace {

struct StepArguments {
  at::Tensor state = at::zeros({1, 4, 2, 3});
  at::Tensor x = at::zeros({1, 4, 2});
  at::Tensor dt = at::zeros({1, 4, 2});
  at::Tensor a = at::zeros({4, 2, 3});
  at::Tensor b = at::zeros({1, 2, 3});
  at::Tensor c = at::zeros({1, 2, 3});
  at::Tensor d = at::zeros({4, 2});
};

TEST(StateSpaceOps, TheStateUpdateRefusesWhatItCannotTakeBeforeTouchingADevice) {
  StepArguments s;
  const auto why = selective_state_update_refusal(s.state, s.x, s.dt, s.a, s.b, s.c, s.d, {});
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("selective_state_update's state on a CUDA device"), std::string::npos)
      << *why;
  EXPECT_THROW_WITH(selective_state_update(s.state, s.x, s.dt, s.a, s.b, s.c, s.d, {}, true),
                    Error, "on a CUDA device, got Float [1, 4, 2, 3] on cpu");
  EXPECT_THROW_WITH(selective_state_update(s.state, at::Tensor(), s.dt, s.a, s.b, s.c, s.d, {},
                                           true),
                    Error, "Expected selective_state_update's state, x, dt, A, B and C to be "
                           "tensors, got Float [1, 4, 2, 3] on cpu, none");
}

TEST(StateSpaceOps, TheConvolutionUpdateRefusesWhatItCannotTakeBeforeTouchingADevice) {
  const at::Tensor x = at::zeros({2, 5, 1}), state = at::zeros({2, 5, 4}),
                   weight = at::zeros({5, 4});
  EXPECT_THROW_WITH(causal_conv1d_update(x, state, weight, {}, true), Error,
                    "Expected causal_conv1d_update's x on a CUDA device");
  EXPECT_THROW_WITH(causal_conv1d_update(x, state, at::Tensor(), {}, true), Error,
                    "Expected causal_conv1d_update's x, conv_state and weight to be tensors");
  EXPECT_THROW_WITH(causal_conv1d_update(x.to(at::kDouble), state, weight, {}, true), Error,
                    "on a CUDA device");
}

}  // namespace
}  // namespace graphed
