// Traces through the Kineto profiler, CUDA-event timing and the replay-cost
// measurement. The host side runs without a GPU; suites named *OnGpu need one.

#include "graphed/check.h"
#include "graphed/graph.h"
#include "graphed/profile.h"
#include "test_support.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <cmath>

namespace graphed {
namespace {

TEST(RecordTrace, MarksEveryIterationOnTheHost) {
  const at::Tensor x = at::ones({64});
  int calls = 0;
  const Trace trace = record_trace(
      [&] {
        ++calls;
        (void)(x * 2 + 1);
      },
      3);
  EXPECT_EQ(calls, 3);
  ASSERT_EQ(trace.iterations.size(), 3U);
  for (size_t i = 0; i < trace.iterations.size(); ++i) {
    EXPECT_EQ(trace.iterations[i].name, kIterationMarker);
    EXPECT_GE(trace.iterations[i].duration_ns, 0);
    if (i > 0) {
      EXPECT_GE(trace.iterations[i].start_ns, trace.iterations[i - 1].start_ns);
    }
  }
  if (c10::cuda::device_count() == 0) {
    EXPECT_TRUE(trace.gpu.empty());
  }
}

TEST(RecordTrace, StopsTheProfilerWhenTheIterationThrows) {
  EXPECT_THROW(record_trace([] { throw std::runtime_error("boom"); }, 2), std::runtime_error);
  // A second trace works: the profiler was stopped.
  const Trace trace = record_trace([] {}, 1);
  EXPECT_EQ(trace.iterations.size(), 1U);
}

TEST(RecordTrace, RefusesToNestInAnotherProfiler) {
  namespace kineto_api = torch::autograd::profiler;
  namespace impl = torch::profiler::impl;
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO);
  const std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
  kineto_api::prepareProfiler(config, activities);
  kineto_api::enableProfiler(config, activities);
  EXPECT_THROW_WITH(record_trace([] {}, 1), Error, "no profiler to be running");
  kineto_api::disableProfiler();
}

TEST(RecordTrace, RejectsZeroIterations) {
  EXPECT_THROW_WITH(record_trace([] {}, 0), Error, "at least one iteration");
}

TEST(Profile, NeedsAGpu) {
  if (c10::cuda::device_count() > 0) {
    GTEST_SKIP() << "checks the message on machines without a GPU";
  }
  EXPECT_THROW_WITH(profile([] {}), Error, "needs a CUDA device");
  EXPECT_THROW_WITH(time_ms([] {}, 1, 1, 0), Error, "needs a CUDA device");
}

TEST(ProfileOnGpu, RecordsEachKernelOfEachIteration) {
  GRAPHED_REQUIRE_GPU();
  const at::Tensor x = at::zeros({1024}, at::TensorOptions().device(at::kCUDA));
  ProfileOptions options;
  options.profiled_iters = 4;
  const Profile result = profile(
      [&] {
        for (int i = 0; i < 10; ++i) {
          x.add_(1);
        }
      },
      options);
  EXPECT_GT(result.eager_ms, 0.0);
  EXPECT_EQ(result.trace.iterations.size(), 4U);
  EXPECT_EQ(result.trace.gpu.size(), 40U);
  EXPECT_GE(result.trace.launches.size(), 40U);
  const TraceSummary s = summarize(result.trace);
  EXPECT_DOUBLE_EQ(s.kernels_per_iter, 10.0);
  EXPECT_GT(s.gpu_busy_fraction, 0.0);
  EXPECT_LE(s.gpu_busy_fraction, 1.0);
}

TEST(ReplayCostOnGpu, IsMeasuredAndCached) {
  GRAPHED_REQUIRE_GPU();
  const ReplayCost cost = replay_cost(0);
  EXPECT_GT(cost.tiny_kernel_us, 0.0);
  EXPECT_GT(cost.large_replay_us, cost.small_replay_us);
  EXPECT_GE(cost.per_node_us, 0.0);
  EXPECT_LT(cost.per_node_us, 20.0) << "a node costing 20 us would make graphs pointless";
  EXPECT_DOUBLE_EQ(replay_cost(0).large_replay_us, cost.large_replay_us);
}

// The model of Note [Predicting the graphed time] on work other than its
// probe: kernels of several sizes, traced eagerly, then captured and replayed.
TEST(ReplayCostOnGpu, PredictsTheReplayOfOtherKernels) {
  GRAPHED_REQUIRE_GPU();
  const auto options = at::TensorOptions().device(at::kCUDA);
  const at::Tensor small = at::zeros({256}, options);
  const at::Tensor large = at::zeros({1 << 22}, options);
  const at::Tensor matrix = at::randn({512, 512}, options);
  at::Tensor product = at::empty({512, 512}, options);
  const std::function<void()> work = [&] {
    for (int i = 0; i < 40; ++i) {
      small.add_(1);
      large.mul_(1.0001);
      at::mm_out(product, matrix, matrix);
    }
  };
  const Profile eager = profile(work);
  {
    // cuBLAS sets up its workspace for a stream on first use: not during capture.
    const c10::cuda::CUDAStreamGuard guard(capture_stream(0));
    work();
  }
  Graph graph;
  graph.capture(work);
  const double replay_ms = time_ms([&] { graph.replay(); }, 20, 5, 3);
  const double predicted_ms = predict_graphed_ms(summarize(eager.trace), replay_cost(0));
  EXPECT_NEAR(predicted_ms, replay_ms, 0.2 * replay_ms)
      << "predicted " << predicted_ms << " ms, replay took " << replay_ms << " ms";
}

}  // namespace
}  // namespace graphed
