// graphed::capture from LibTorch: validation (no GPU needed), replay on current
// inputs, signature errors, guards, outputs, mutation, failure and state.

#include "graphed/capture.h"
#include "graphed/check.h"
#include "test_support.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>

namespace graphed {
namespace {

using c10::IValue;

at::TensorOptions cuda_floats() { return at::TensorOptions().device(at::kCUDA).dtype(at::kFloat); }

CapturableFunction affine(const at::Tensor& weight) {
  return [weight](const std::vector<IValue>& inputs) -> IValue {
    const at::Tensor& x = inputs[0].toTensor();
    const double scale = inputs[1].toDouble();
    return at::gelu(at::mm(x, weight)) * scale;
  };
}

TEST(CaptureValidation, RefusesCpuTensorsWithThePath) {
  EXPECT_THROW_WITH(capture(affine(at::eye(4)), {at::ones({4, 4}), IValue(1.0)}), Error,
                    "args[0] is (4, 4) float32 cpu");
}

TEST(CaptureValidation, RefusesZeroWarmup) {
  CaptureOptions options;
  options.warmup_iters = 0;
  EXPECT_THROW_WITH(capture(affine(at::eye(4)), {at::ones({4, 4}), IValue(1.0)}, options), Error,
                    "Expected warmup_iters >= 1, got 0");
}

TEST(CaptureValidation, RefusesAnEmptyFunction) {
  EXPECT_THROW_WITH(capture(CapturableFunction(), {}), Error, "Expected a function to capture");
}

TEST(CaptureValidation, NamesMustMatchInputs) {
  CaptureOptions options;
  options.input_names = {"x"};
  EXPECT_THROW_WITH(capture(affine(at::eye(4)), {at::ones({4, 4}), IValue(1.0)}, options), Error,
                    "one input name per sample input");
}

class CaptureOnGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    GRAPHED_REQUIRE_GPU();
    at::manual_seed(0);
    weight_ = at::randn({128, 128}, cuda_floats());
    x_ = at::randn({32, 128}, cuda_floats());
  }
  at::Tensor weight_;
  at::Tensor x_;
};

TEST_F(CaptureOnGpu, ReplaysOnNewInputValues) {
  CapturedFunction fn = capture(affine(weight_), {x_, IValue(2.0)});
  for (int step = 0; step < 3; ++step) {
    const at::Tensor x = at::randn({32, 128}, cuda_floats());
    const at::Tensor got = fn({x, IValue(2.0)}).toTensor();
    EXPECT_TRUE(at::allclose(got, at::gelu(at::mm(x, weight_)) * 2.0, 1e-5, 1e-5));
  }
  EXPECT_EQ(fn.stats().replays, 3);
  EXPECT_EQ(fn.stats().input_copies, 3);
  EXPECT_GT(fn.graph().stats().kernels, 0);
}

TEST_F(CaptureOnGpu, PassingTheStaticBufferSkipsTheCopy) {
  CapturedFunction fn = capture(affine(weight_), {x_, IValue(2.0)});
  const at::Tensor buffer = fn.static_inputs()[0];
  buffer.copy_(x_ * 3);
  const at::Tensor got = fn({buffer, IValue(2.0)}).toTensor();
  EXPECT_EQ(fn.stats().input_copies, 0);
  EXPECT_TRUE(at::allclose(got, at::gelu(at::mm(x_ * 3, weight_)) * 2.0, 1e-5, 1e-5));
}

TEST_F(CaptureOnGpu, MismatchedShapeIsSpelledOut) {
  CapturedFunction fn = capture(affine(weight_), {x_, IValue(2.0)});
  EXPECT_THROW_WITH(fn({at::randn({16, 128}, cuda_floats()), IValue(2.0)}), InputMismatchError,
                    "args[0]: expected (32, 128) float32 cuda:0, got (16, 128) float32 cuda:0");
  EXPECT_THROW_WITH(fn({x_, IValue(3.0)}), InputMismatchError, "args[1]: expected 2.0, got 3.0");
  EXPECT_EQ(fn.stats().replays, 0);
}

TEST_F(CaptureOnGpu, OutputsAreStaticUnlessCloned) {
  CapturedFunction shared = capture(affine(weight_), {x_, IValue(1.0)});
  const at::Tensor first = shared({x_, IValue(1.0)}).toTensor();
  const at::Tensor second = shared({x_ * 2, IValue(1.0)}).toTensor();
  EXPECT_TRUE(first.is_same(second)) << "static outputs are the same tensor every call";

  CaptureOptions options;
  options.clone_outputs = true;
  CapturedFunction cloned = capture(affine(weight_), {x_, IValue(1.0)}, options);
  const at::Tensor kept = cloned({x_, IValue(1.0)}).toTensor();
  const at::Tensor expected = kept.clone();
  (void)cloned({x_ * 2, IValue(1.0)});
  EXPECT_TRUE(at::equal(kept, expected)) << "a cloned output survives the next call";
}

TEST_F(CaptureOnGpu, GuardsCatchHostStateChanges) {
  bool training = false;
  CaptureOptions options;
  options.guards.push_back({"module.training", [&] { return IValue(training); }});
  CapturedFunction fn = capture(affine(weight_), {x_, IValue(1.0)}, options);
  EXPECT_NO_THROW(fn({x_, IValue(1.0)}));
  training = true;
  EXPECT_THROW_WITH(fn({x_, IValue(1.0)}), InputMismatchError,
                    "module.training: expected False, got True");
}

TEST_F(CaptureOnGpu, InPlaceWritesToInputsReachTheCaller) {
  CapturedFunction fn = capture(
      [](const std::vector<IValue>& inputs) -> IValue {
        at::Tensor counter = inputs[0].toTensor();
        counter.add_(1);
        return counter * 2;
      },
      {at::zeros({4}, cuda_floats())});
  ASSERT_EQ(fn.mutated_inputs(), std::vector<size_t>{0});
  const at::Tensor mine = at::zeros({4}, cuda_floats());
  (void)fn({mine});
  (void)fn({mine});
  EXPECT_TRUE(at::equal(mine, at::full({4}, 2.0, cuda_floats())));
}

TEST_F(CaptureOnGpu, FailedCaptureRestoresStateAndNamesTheOperator) {
  at::Tensor state = at::zeros({4}, cuda_floats());
  CaptureOptions options;
  options.state = {state};
  options.description = "function `bad`";
  auto gen = at::cuda::detail::getDefaultCUDAGenerator();
  const at::Tensor expected_random = [&] {
    const at::Tensor rng_state = gen.get_state();
    const at::Tensor sample = at::randn({8}, cuda_floats());
    gen.set_state(rng_state);
    return sample;
  }();
  try {
    (void)capture(
        [&](const std::vector<IValue>& inputs) -> IValue {
          state.add_(1);                                        // mutates state in warm-up
          at::Tensor noise = at::randn({8}, cuda_floats());     // advances the generator
          if (inputs[0].toTensor().sum().item<float>() > 0) {  // breaks capture
            return noise;
          }
          return noise * 2;
        },
        {x_}, options);
    ADD_FAILURE() << "expected CaptureError";
  } catch (const CaptureError& error) {
    const std::string message = error.what_without_backtrace();
    EXPECT_NE(message.find("function `bad`"), std::string::npos) << message;
    EXPECT_NE(message.find("aten::_local_scalar_dense"), std::string::npos) << message;
    EXPECT_NE(message.find("Capture changed nothing"), std::string::npos) << message;
  }
  EXPECT_TRUE(at::equal(state, at::zeros({4}, cuda_floats()))) << "state was not restored";
  EXPECT_TRUE(at::equal(at::randn({8}, cuda_floats()), expected_random))
      << "the CUDA generator was not restored";
}

TEST_F(CaptureOnGpu, RequiresGradInputsAreRefusedUnderGradMode) {
  CapturedFunction fn = capture(affine(weight_), {x_, IValue(1.0)});
  const at::Tensor tracked = x_.clone().requires_grad_();
  EXPECT_THROW_WITH(fn({tracked, IValue(1.0)}), Error, "captured for inference");
  c10::NoGradGuard no_grad;
  EXPECT_NO_THROW(fn({tracked, IValue(1.0)}));
}

TEST_F(CaptureOnGpu, CpuOutputsAreRefused) {
  EXPECT_THROW_WITH(capture([](const std::vector<IValue>&) -> IValue { return at::ones({2}); },
                            {x_}),
                    CaptureError, "returned a tensor on cpu");
}

TEST_F(CaptureOnGpu, DropoutDiffersBetweenReplaysWithTheRightKeepRate) {
  CapturedFunction fn = capture(
      [](const std::vector<IValue>& inputs) -> IValue {
        return at::dropout(inputs[0].toTensor(), 0.25, /*train=*/true);
      },
      {at::ones({1 << 20}, cuda_floats())});
  const at::Tensor ones = at::ones({1 << 20}, cuda_floats());
  const at::Tensor first = fn({ones}).toTensor().clone();
  const at::Tensor second = fn({ones}).toTensor();
  EXPECT_FALSE(at::equal(first, second));
  const double kept = (second != 0).to(at::kDouble).mean().item<double>();
  EXPECT_NEAR(kept, 0.75, 0.005);
}

// Note [Tensors a graph reads in place]: the weight the graph reads, given
// other storage or replaced after capture, makes calls raise; values changed
// in place are followed.
TEST_F(CaptureOnGpu, ParametersMovedOrReplacedAfterCaptureRaise) {
  at::Tensor weight = at::randn({4, 4}, cuda_floats());
  auto current = std::make_shared<at::Tensor>(weight);
  CaptureOptions options;
  options.read_parameters = [current] { return std::vector<at::Tensor>{*current}; };
  const at::Tensor x = at::randn({4, 4}, cuda_floats());
  CapturedFunction fast = capture(
      [current](const std::vector<IValue>& inputs) -> IValue {
        return at::mm(inputs[0].toTensor(), *current);
      },
      {x}, options);
  weight.mul_(2);
  EXPECT_TRUE(at::allclose(fast({x}).toTensor(), at::mm(x, weight)));

  *current = at::randn({4, 4}, cuda_floats());  // replaced
  EXPECT_THROW_WITH(fast({x}), Error, "parameter or buffer 0 ((4, 4) float32 cuda:0 at capture) "
                                      "was replaced by another tensor");
  *current = weight;
  weight.set_data(at::randn({4, 4}, cuda_floats()));  // moved: the old memory is freed
  EXPECT_THROW_WITH(fast({x}), Error, "at another address");
}

TEST_F(CaptureOnGpu, AnOutputThatIsAnInputIsCopiedNotRepointed) {
  CaptureOptions options;
  options.input_update = InputUpdate::kRepoint;
  const at::Tensor x = at::randn({1024}, cuda_floats());
  CapturedFunction fast = capture(
      [](const std::vector<IValue>& inputs) -> IValue {
        const at::Tensor& t = inputs[0].toTensor();
        return c10::ivalue::Tuple::create({t * 2, t});
      },
      {x}, options);
  EXPECT_EQ(fast.stats().repointable_inputs, 0);
  const at::Tensor y = at::randn({1024}, cuda_floats());
  const auto outputs = fast({y}).toTupleRef().elements();
  EXPECT_TRUE(at::equal(outputs[1].toTensor(), y));
  EXPECT_TRUE(at::allclose(outputs[0].toTensor(), y * 2));
}

}  // namespace
}  // namespace graphed
