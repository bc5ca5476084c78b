// graphed::TrainingIteration: the order of operations of Note [One training
// iteration], checked through pieces that record when they run.

#include "graphed/check.h"
#include "graphed/training_iteration.h"
#include "test_support.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <string>
#include <vector>

namespace graphed {
namespace {

using c10::IValue;

// Pieces that log their calls into `log`; the loss is (w * x).sum() for one
// trained parameter w, so that backward reaches it.
TrainingIterationParts logging_parts(std::vector<std::string>& log, const at::Tensor& w) {
  TrainingIterationParts parts;
  parts.loss = [&log, w](const std::vector<IValue>& values) -> IValue {
    const bool autocast = at::autocast::is_autocast_enabled(at::kCUDA);
    log.push_back(autocast ? "loss(autocast, cache " +
                                 std::string(at::autocast::is_autocast_cache_enabled() ? "on"
                                                                                      : "off") +
                                 ")"
                           : "loss");
    return (w * values.at(0).toTensor()).sum();
  };
  parts.split = [&log](const std::vector<IValue>& batch, int count) {
    log.push_back("split " + std::to_string(count));
    std::vector<std::vector<IValue>> result;
    for (const at::Tensor& chunk : batch.at(0).toTensor().chunk(count)) {
      result.push_back({chunk});
    }
    return result;
  };
  parts.zero_grad = [&log, w] {
    log.push_back("zero_grad");
    w.mutable_grad() = at::Tensor();
  };
  parts.step = [&log](const at::Tensor& found_inf) {
    log.push_back(found_inf.defined() ? "step(found_inf)" : "step()");
  };
  parts.params = {w};
  return parts;
}

at::Tensor cuda_ones(int64_t size) {
  return at::ones({size}, at::TensorOptions().device(at::kCUDA));
}

TEST(TrainingIterationValidation, EveryPieceIsRequired) {
  std::vector<std::string> log;
  const at::Tensor w = at::ones({3}).requires_grad_();
  for (const char* piece : {"loss", "split", "zero_grad", "step"}) {
    TrainingIterationParts parts = logging_parts(log, w);
    const std::string name = piece;
    if (name == "loss") {
      parts.loss = nullptr;
    } else if (name == "split") {
      parts.split = nullptr;
    } else if (name == "zero_grad") {
      parts.zero_grad = nullptr;
    } else {
      parts.step = nullptr;
    }
    EXPECT_THROW_WITH(TrainingIteration{std::move(parts)}, Error,
                      "(TrainingIterationParts::" + name + ")");
  }
}

TEST(TrainingIterationValidation, SettingsAndParametersAreChecked) {
  std::vector<std::string> log;
  const at::Tensor w = at::ones({3}).requires_grad_();
  TrainingIterationParts parts = logging_parts(log, w);
  parts.microbatches = 0;
  EXPECT_THROW_WITH(TrainingIteration{parts}, Error, "Expected microbatches >= 1, got 0");
  parts = logging_parts(log, w);
  parts.autocast = at::kFloat;
  EXPECT_THROW_WITH(TrainingIteration{parts}, Error, "Expected autocast to be bfloat16");
  parts = logging_parts(log, w);
  parts.params.clear();
  EXPECT_THROW_WITH(TrainingIteration{parts}, Error, "(TrainingIterationParts::params), got none");
  // The guard lives on the parameters' device, which must be a GPU.
  EXPECT_THROW_WITH(TrainingIteration{logging_parts(log, w)}, Error,
                    "Expected a CUDA device for the gradient guard");
  EXPECT_TRUE(log.empty()) << "no piece runs before the first call";
}

TEST(TrainingIterationOnGpu, RunsThePiecesInTheOrderOfTheNote) {
  GRAPHED_REQUIRE_GPU();
  std::vector<std::string> log;
  // Two microbatches of two values each, so w has two.
  const at::Tensor w = cuda_ones(2).requires_grad_();
  TrainingIterationParts parts = logging_parts(log, w);
  parts.microbatches = 2;
  parts.guard.skip_nonfinite = true;
  parts.autocast = at::kBFloat16;
  TrainingIteration iteration(std::move(parts));
  const at::Tensor x = at::arange(1, 5, at::TensorOptions().device(at::kCUDA).dtype(at::kFloat));
  const at::Tensor loss = iteration({x});
  EXPECT_EQ(log, (std::vector<std::string>{"zero_grad", "split 2", "loss(autocast, cache off)",
                                           "loss(autocast, cache off)", "step(found_inf)"}));
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCUDA)) << "autocast left on";
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  EXPECT_FALSE(loss.requires_grad());
  // Each microbatch's loss is divided by 2 and the two are summed; the
  // gradient accumulates (x[0:2] + x[2:4]) / 2 over both halves.
  EXPECT_NEAR(loss.item<double>(), (1 + 2 + 3 + 4) / 2.0, 1e-2);
  EXPECT_TRUE(at::allclose(w.grad(), (x.slice(0, 0, 2) + x.slice(0, 2, 4)) / 2));
  EXPECT_EQ(iteration.guard()->skipped_steps(), 0);
}

TEST(TrainingIterationOnGpu, OneMicrobatchIsNotSplitAndNothingToSkipPassesNoFlag) {
  GRAPHED_REQUIRE_GPU();
  std::vector<std::string> log;
  TrainingIteration iteration(logging_parts(log, cuda_ones(2).requires_grad_()));
  (void)iteration({cuda_ones(2)});
  EXPECT_EQ(log, (std::vector<std::string>{"zero_grad", "loss", "step()"}));
}

TEST(TrainingIterationOnGpu, ASplitMustGiveOneEntryPerMicrobatch) {
  GRAPHED_REQUIRE_GPU();
  std::vector<std::string> log;
  TrainingIterationParts parts = logging_parts(log, cuda_ones(2).requires_grad_());
  parts.microbatches = 3;
  parts.split = [](const std::vector<IValue>& batch, int) {
    return std::vector<std::vector<IValue>>{batch};
  };
  TrainingIteration iteration(std::move(parts));
  EXPECT_THROW_WITH(iteration({cuda_ones(2)}), Error,
                    "Expected the split of a batch to give 3 microbatches (microbatches=3), got 1");
}

}  // namespace
}  // namespace graphed
