#include "graphed/graphed_callable.h"

#include "graphed/check.h"
#include "test_support.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <vector>

namespace {

using graphed::GraphableCallable;
using graphed::GraphedCallablesOptions;

GraphableCallable identity_callable() {
  GraphableCallable callable;
  callable.function = [](const std::vector<c10::IValue>& inputs) { return inputs.at(0); };
  callable.description = "function `identity`";
  return callable;
}

TEST(GraphedCallables, RejectsCpuSamplesWithTheFix) {
  std::vector<std::vector<c10::IValue>> samples{{torch::ones({4})}};
  EXPECT_THROW_WITH(graphed::make_graphed_callables({identity_callable()}, samples),
                    graphed::Error, "on a CUDA device");
}

TEST(GraphedCallables, RejectsZeroWarmup) {
  GraphedCallablesOptions options;
  options.warmup_iters = 0;
  std::vector<std::vector<c10::IValue>> samples{{torch::ones({4})}};
  EXPECT_THROW_WITH(graphed::make_graphed_callables({identity_callable()}, samples, options),
                    graphed::Error, "num_warmup_iters >= 1");
}

TEST(GraphedCallables, RejectsAutocastWithItsWeightCache) {
  at::autocast::set_autocast_enabled(at::kCPU, true);
  at::autocast::set_autocast_cache_enabled(true);
  std::vector<std::vector<c10::IValue>> samples{{torch::ones({4})}};
  EXPECT_THROW_WITH(graphed::make_graphed_callables({identity_callable()}, samples),
                    graphed::Error, "cache_enabled=False");
  at::autocast::set_autocast_enabled(at::kCPU, false);
}

TEST(GraphedCallables, RejectsSampleCountsThatDoNotFitTheOrder) {
  GraphedCallablesOptions options;
  options.order = {1, 2, -2, -1};
  std::vector<std::vector<c10::IValue>> samples{{torch::ones({4})}, {torch::ones({4})}};
  EXPECT_THROW_WITH(graphed::make_graphed_callables({identity_callable()}, samples, options),
                    graphed::Error, "split evenly");
}

// An MLP block of LibTorch modules, graphed and compared with eager.
struct Block : torch::nn::Module {
  Block() {
    first = register_module("first", torch::nn::Linear(64, 128));
    second = register_module("second", torch::nn::Linear(128, 64));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({64})));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x + second(torch::gelu(first(norm(x))));
  }
  torch::nn::Linear first{nullptr};
  torch::nn::Linear second{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};

std::vector<std::shared_ptr<Block>> make_blocks(int count) {
  torch::manual_seed(0);
  std::vector<std::shared_ptr<Block>> blocks;
  for (int i = 0; i < count; ++i) {
    blocks.push_back(std::make_shared<Block>());
    blocks.back()->to(torch::kCUDA);
  }
  return blocks;
}

std::vector<GraphableCallable> graphable(const std::vector<std::shared_ptr<Block>>& blocks) {
  std::vector<GraphableCallable> callables;
  for (const auto& block : blocks) {
    callables.push_back(graphed::graphable_module(
        block, [block](const std::vector<c10::IValue>& inputs) -> c10::IValue {
          return block->forward(inputs.at(0).toTensor());
        }));
  }
  return callables;
}

TEST(GraphedCallablesOnGpu, PerBlockGraphsMatchEagerOverAccumulatedSteps) {
  GRAPHED_REQUIRE_GPU();
  const auto eager = make_blocks(3);
  const auto graphed_blocks = make_blocks(3);
  const auto input_options = torch::TensorOptions().device(torch::kCUDA);
  std::vector<std::vector<c10::IValue>> samples;
  for (int i = 0; i < 3; ++i) {
    samples.push_back({torch::randn({16, 64}, input_options).requires_grad_(true)});
  }
  auto calls = graphed::make_graphed_callables(graphable(graphed_blocks), samples);
  ASSERT_EQ(calls.size(), 3u);
  // Two accumulated microbatches, then a comparison of every gradient.
  for (int step = 0; step < 2; ++step) {
    const auto x = torch::randn({16, 64}, input_options);
    auto eager_x = x.clone().requires_grad_(true);
    auto graphed_x = x.clone().requires_grad_(true);
    torch::Tensor eager_out = eager_x;
    torch::Tensor graphed_out = graphed_x;
    for (int i = 0; i < 3; ++i) {
      eager_out = eager[i]->forward(eager_out);
      graphed_out = (*calls[i])({graphed_out}).toTensor();
    }
    EXPECT_TRUE(torch::allclose(graphed_out, eager_out, 1e-5, 1e-6));
    eager_out.square().sum().backward();
    graphed_out.square().sum().backward();
    EXPECT_TRUE(torch::allclose(graphed_x.grad(), eager_x.grad(), 1e-5, 1e-6));
  }
  for (int i = 0; i < 3; ++i) {
    const auto eager_parameters = eager[i]->parameters();
    const auto graphed_parameters = graphed_blocks[i]->parameters();
    for (size_t p = 0; p < eager_parameters.size(); ++p) {
      EXPECT_TRUE(torch::allclose(graphed_parameters[p].grad(), eager_parameters[p].grad(), 1e-5,
                                  1e-5))
          << "block " << i << " parameter " << p;
    }
  }
  const auto stats = calls[1]->stats();
  EXPECT_EQ(stats.forward_replays, 2);
  EXPECT_EQ(stats.backward_replays, 2);
  EXPECT_TRUE(stats.eager_calls.empty());
}

TEST(GraphedCallablesOnGpu, EvalModeRunsEagerlyAndIsCounted) {
  GRAPHED_REQUIRE_GPU();
  const auto blocks = make_blocks(1);
  std::vector<std::vector<c10::IValue>> samples{
      {torch::randn({8, 64}, torch::TensorOptions().device(torch::kCUDA))}};
  auto calls = graphed::make_graphed_callables(graphable(blocks), samples);
  blocks[0]->eval();
  const auto x = torch::randn({8, 64}, torch::TensorOptions().device(torch::kCUDA));
  const auto out = (*calls[0])({x}).toTensor();
  EXPECT_TRUE(torch::allclose(out, blocks[0]->forward(x)));
  const auto stats = calls[0]->stats();
  EXPECT_EQ(stats.forward_replays, 0);
  ASSERT_EQ(stats.eager_calls.size(), 1u);
  EXPECT_NE(stats.eager_calls.begin()->first.find("training is False"), std::string::npos);
}

TEST(GraphedCallablesOnGpu, ReplacedParametersAreRefused) {
  GRAPHED_REQUIRE_GPU();
  const auto blocks = make_blocks(1);
  std::vector<std::vector<c10::IValue>> samples{
      {torch::randn({8, 64}, torch::TensorOptions().device(torch::kCUDA))}};
  auto calls = graphed::make_graphed_callables(graphable(blocks), samples);
  blocks[0]->register_parameter("extra", torch::zeros({1}, torch::kCUDA));
  EXPECT_THROW_WITH((*calls[0])({samples[0][0]}), graphed::Error, "changed to");
}

}  // namespace
