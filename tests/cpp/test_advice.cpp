// The advice arithmetic on hand-built traces: summaries, the replay-cost
// fit, the prediction, verdicts and strategies. No GPU needed.

#include "graphed/advice.h"
#include "graphed/check.h"
#include "test_support.h"

#include <gtest/gtest.h>

namespace graphed {
namespace {

constexpr int64_t kUs = 1000;  // nanoseconds

// `iterations` iterations of `kernels` kernels of `duration_us` each, `gap_us`
// apart on the GPU; each iteration's host span covers its kernels, and one
// launch call of `launch_us` precedes each kernel.
Trace evenly_spaced(int iterations, int kernels, int64_t duration_us, int64_t gap_us,
                    int64_t launch_us = 5) {
  Trace trace;
  int64_t t = 0;
  for (int i = 0; i < iterations; ++i) {
    const int64_t begin = t;
    for (int k = 0; k < kernels; ++k) {
      trace.launches.push_back(HostSpan{"cudaLaunchKernel", t, launch_us * kUs});
      trace.gpu.push_back(GpuActivity{"k", ActivityKind::kKernel, t + gap_us * kUs,
                                      duration_us * kUs});
      t += (gap_us + duration_us) * kUs;
    }
    trace.iterations.push_back(HostSpan{"graphed::iteration", begin, t - begin});
  }
  return trace;
}

ReplayCost cost(double per_node_us, double launch_us) {
  ReplayCost c;
  c.per_node_us = per_node_us;
  c.launch_us = launch_us;
  return c;
}

TEST(Summarize, CountsDurationsGapsAndHostTime) {
  Trace trace;
  // One iteration of 100 us host time; kernels of 10, 20 and 70 us, a memset
  // of 1 us; idle 5 us before the first and between the others.
  trace.iterations.push_back(HostSpan{"it", 0, 100 * kUs});
  trace.gpu.push_back(GpuActivity{"a", ActivityKind::kKernel, 5 * kUs, 10 * kUs});
  trace.gpu.push_back(GpuActivity{"m", ActivityKind::kMemset, 20 * kUs, 1 * kUs});
  trace.gpu.push_back(GpuActivity{"b", ActivityKind::kKernel, 30 * kUs, 20 * kUs});
  trace.gpu.push_back(GpuActivity{"c", ActivityKind::kKernel, 55 * kUs, 70 * kUs});
  trace.launches.push_back(HostSpan{"cudaLaunchKernel", 1 * kUs, 4 * kUs});
  trace.launches.push_back(HostSpan{"cudaLaunchKernel", 10 * kUs, 6 * kUs});

  const TraceSummary s = summarize(trace);
  EXPECT_EQ(s.iterations, 1);
  EXPECT_DOUBLE_EQ(s.activities_per_iter, 4.0);
  EXPECT_DOUBLE_EQ(s.kernels_per_iter, 3.0);
  EXPECT_DOUBLE_EQ(s.gpu_ms_per_iter, 0.101);
  EXPECT_DOUBLE_EQ(s.duration_mean_us, 101.0 / 4);
  EXPECT_DOUBLE_EQ(s.duration_p50_us, 15.0);        // between 10 and 20
  EXPECT_NEAR(s.duration_p90_us, 20.0 + 0.7 * 50.0, 1e-9);
  EXPECT_DOUBLE_EQ(s.duration_max_us, 70.0);
  EXPECT_DOUBLE_EQ(s.small_fraction, 0.75);
  // The window runs from the host's start (0) to the last kernel's end (125 us).
  EXPECT_NEAR(s.gpu_busy_fraction, 101.0 / 125.0, 1e-12);
  EXPECT_NEAR(s.idle_ms_per_iter, 0.024, 1e-12);
  // Gaps between pieces of GPU work: 5, 9 and 5 us.
  EXPECT_DOUBLE_EQ(s.gap_p50_us, 5.0);
  EXPECT_NEAR(s.gap_p90_us, 5.0 + 0.8 * 4.0, 1e-9);
  EXPECT_DOUBLE_EQ(s.host_ms_per_iter, 0.1);
  EXPECT_DOUBLE_EQ(s.launches_per_iter, 2.0);
  EXPECT_DOUBLE_EQ(s.launch_call_us, 5.0);
  EXPECT_DOUBLE_EQ(s.host_us_per_activity, 25.0);
}

TEST(Summarize, OverlappingStreamsCountOnceAsBusy) {
  Trace trace;
  trace.iterations.push_back(HostSpan{"it", 0, 10 * kUs});
  trace.gpu.push_back(GpuActivity{"a", ActivityKind::kKernel, 0, 60 * kUs});
  trace.gpu.push_back(GpuActivity{"b", ActivityKind::kMemcpy, 20 * kUs, 60 * kUs});
  trace.gpu.push_back(GpuActivity{"c", ActivityKind::kKernel, 90 * kUs, 10 * kUs});
  const TraceSummary s = summarize(trace);
  EXPECT_DOUBLE_EQ(s.gpu_ms_per_iter, 0.13);  // durations add up, overlap or not
  EXPECT_DOUBLE_EQ(s.gpu_busy_fraction, 0.9);  // but busy time is their union
  EXPECT_DOUBLE_EQ(s.gap_p50_us, 10.0);
}

TEST(Summarize, AveragesOverIterations) {
  const TraceSummary s = summarize(evenly_spaced(4, 10, 3, 7));
  EXPECT_EQ(s.iterations, 4);
  EXPECT_DOUBLE_EQ(s.activities_per_iter, 10.0);
  EXPECT_DOUBLE_EQ(s.gpu_ms_per_iter, 0.03);
  EXPECT_DOUBLE_EQ(s.host_ms_per_iter, 0.1);
  EXPECT_DOUBLE_EQ(s.gpu_busy_fraction, 0.3);
  EXPECT_DOUBLE_EQ(s.idle_ms_per_iter, 0.07);
  EXPECT_DOUBLE_EQ(s.gap_p50_us, 7.0);
}

TEST(Summarize, TellsWorkInGraphsFromWorkLaunchedEagerly) {
  // Two iterations, each: one graph replay of 6 kernels, then 3 kernels
  // launched eagerly, one of them a runtime call whose driver call the
  // profiler lists inside it.
  Trace trace;
  for (int i = 0; i < 2; ++i) {
    const int64_t t = i * 1000 * kUs;
    trace.iterations.push_back(HostSpan{"it", t, 500 * kUs});
    trace.launches.push_back(HostSpan{"cudaGraphLaunch", t + 1 * kUs, 5 * kUs});
    for (int k = 0; k < 6; ++k) {
      trace.gpu.push_back(GpuActivity{"g", ActivityKind::kKernel, t + (10 + 10 * k) * kUs, kUs});
    }
    for (int k = 0; k < 3; ++k) {
      const int64_t at = t + (100 + 20 * k) * kUs;
      trace.launches.push_back(HostSpan{"cudaLaunchKernel", at, 8 * kUs});
      trace.gpu.push_back(GpuActivity{"e", ActivityKind::kKernel, at + 10 * kUs, kUs});
    }
    trace.launches.push_back(HostSpan{"cuLaunchKernel", t + 102 * kUs, 4 * kUs});
  }
  const TraceSummary s = summarize(trace);
  EXPECT_DOUBLE_EQ(s.activities_per_iter, 9.0);
  EXPECT_DOUBLE_EQ(s.graph_launches_per_iter, 1.0);
  EXPECT_DOUBLE_EQ(s.graphed_activities_per_iter, 6.0);
}

TEST(Summarize, WithoutLaunchCallsNoWorkCountsAsGraphed) {
  Trace trace = evenly_spaced(2, 5, 3, 2);
  EXPECT_DOUBLE_EQ(summarize(trace).graphed_activities_per_iter, 0.0);  // all eager
  trace.launches.clear();
  EXPECT_DOUBLE_EQ(summarize(trace).graphed_activities_per_iter, 0.0);  // unknown
  EXPECT_DOUBLE_EQ(summarize(trace).graph_launches_per_iter, 0.0);
}

TEST(Summarize, RejectsTracesWithoutIterations) {
  EXPECT_THROW_WITH(summarize(Trace{}), Error, "at least one iteration");
}

TEST(ActivityKinds, RoundTripAndRejectUnknownNames) {
  for (ActivityKind kind : {ActivityKind::kKernel, ActivityKind::kMemcpy, ActivityKind::kMemset}) {
    EXPECT_EQ(parse_activity_kind(activity_kind_name(kind)), kind);
  }
  EXPECT_THROW_WITH(parse_activity_kind("sync"), Error, "\"sync\"");
}

TEST(ReplayCostFit, SlopeLessKernelIsPerNodeInterceptIsLaunch) {
  // 32 nodes in 80 us, 512 in 1040 us: 2 us per node of which the kernel
  // itself takes 1.5 us; 80 - 32 * 2 = 16 us of launch.
  const ReplayCost c = ReplayCost::fit(32, 80.0, 512, 1040.0, 1.5);
  EXPECT_DOUBLE_EQ(c.per_node_us, 0.5);
  EXPECT_DOUBLE_EQ(c.launch_us, 16.0);
  EXPECT_EQ(c.small_nodes, 32);
  EXPECT_EQ(c.large_nodes, 512);
  EXPECT_DOUBLE_EQ(c.tiny_kernel_us, 1.5);
}

TEST(ReplayCostFit, NeverNegative) {
  const ReplayCost c = ReplayCost::fit(32, 80.0, 512, 1040.0, 2.5);
  EXPECT_DOUBLE_EQ(c.per_node_us, 0.0);
  const ReplayCost d = ReplayCost::fit(10, 10.0, 20, 40.0, 1.0);
  EXPECT_DOUBLE_EQ(d.launch_us, 0.0);
}

TEST(ReplayCostFit, RejectsBadMeasurements) {
  EXPECT_THROW_WITH(ReplayCost::fit(512, 1.0, 32, 2.0, 1.0), Error, "0 < small < large");
  EXPECT_THROW_WITH(ReplayCost::fit(32, 0.0, 512, 2.0, 1.0), Error, "positive replay times");
}

TEST(Predict, KernelTimePlusNodesPlusLaunches) {
  const TraceSummary s = summarize(evenly_spaced(2, 80, 2, 10));
  // 80 kernels of 2 us = 0.16 ms; 80 * 0.25 us + 10 us launch = 0.03 ms.
  EXPECT_NEAR(predict_graphed_ms(s, cost(0.25, 10.0)), 0.19, 1e-12);
  EXPECT_NEAR(predict_graphed_ms(s, cost(0.25, 10.0), 4), 0.22, 1e-12);
}

TEST(Advise, LaunchBoundWorkHelpsWithFullCapture) {
  const Advice a = advise(evenly_spaced(3, 80, 2, 10), cost(0.25, 10.0), {1.0});
  EXPECT_EQ(a.verdict, Verdict::kHelps);
  EXPECT_EQ(a.strategy, Strategy::kFullCapture);
  EXPECT_DOUBLE_EQ(a.eager_ms, 1.0);
  EXPECT_NEAR(a.eager_gpu_busy, 0.16, 1e-12);
  EXPECT_NEAR(a.predicted_ms, 0.19, 1e-12);
  EXPECT_NEAR(a.predicted_speedup, 1.0 / 0.19, 1e-9);
  EXPECT_EQ(a.graphs, 1);
  EXPECT_NE(a.reason.find("graphed.capture"), std::string::npos) << a.reason;
  EXPECT_TRUE(a.notes.empty());
}

TEST(Advise, TrainingNamesTrainStep) {
  AdviceInputs inputs;
  inputs.eager_ms = 1.0;
  inputs.training = true;
  const Advice a = advise(evenly_spaced(1, 80, 2, 10), cost(0.25, 10.0), inputs);
  EXPECT_NE(a.reason.find("graphed.TrainStep"), std::string::npos) << a.reason;
}

TEST(Advise, BusyGpuIsAlreadyGpuBound) {
  // 10 kernels of 100 us with 1 us gaps: 99% busy.
  const Advice a = advise(evenly_spaced(2, 10, 100, 1), cost(0.25, 10.0), {1.01});
  EXPECT_EQ(a.verdict, Verdict::kAlreadyGpuBound);
  EXPECT_EQ(a.strategy, Strategy::kStayEager);
  EXPECT_NE(a.reason.find("already GPU-bound"), std::string::npos) << a.reason;
}

TEST(Advise, SmallGainWontHelpMuch) {
  // 85% busy: replaying removes at most the 15% idle, less the replay cost.
  const Advice a = advise(evenly_spaced(2, 10, 85, 15), cost(1.0, 10.0), {1.0});
  EXPECT_EQ(a.verdict, Verdict::kWontHelpMuch);
  EXPECT_EQ(a.strategy, Strategy::kStayEager);
  EXPECT_LT(a.predicted_speedup, 1.2);
}

TEST(Advise, BlockersInsideModulesMustBeFixedFirst) {
  AdviceInputs inputs;
  inputs.eager_ms = 1.0;
  inputs.blockers = 2;
  const Advice a = advise(evenly_spaced(1, 80, 2, 10), cost(0.25, 10.0), inputs);
  EXPECT_EQ(a.strategy, Strategy::kFixBlockers);
  EXPECT_NE(a.reason.find("2 capture blocker(s) sit inside"), std::string::npos) << a.reason;
}

TEST(Advise, BlockersBetweenModulesGetPerModuleGraphs) {
  AdviceInputs inputs;
  inputs.eager_ms = 1.0;
  inputs.blockers = 1;
  inputs.blockers_between_modules = true;
  inputs.module_graphs = 4;
  const Advice a = advise(evenly_spaced(1, 80, 2, 10), cost(0.25, 10.0), inputs);
  EXPECT_EQ(a.strategy, Strategy::kPerModule);
  EXPECT_EQ(a.graphs, 4);
  EXPECT_NEAR(a.predicted_ms, 0.16 + (80 * 0.25 + 4 * 10.0) / 1e3, 1e-12);
  EXPECT_EQ(a.notes.size(), 1U);
}

TEST(Advise, VaryingShapesGetBuckets) {
  AdviceInputs inputs;
  inputs.eager_ms = 1.0;
  inputs.shapes_vary = true;
  const Advice a = advise(evenly_spaced(1, 80, 2, 10), cost(0.25, 10.0), inputs);
  EXPECT_EQ(a.strategy, Strategy::kBucketed);
}

TEST(Advise, WithoutEagerTimeUsesHostTimeAndSaysSo) {
  const Advice a = advise(evenly_spaced(2, 80, 2, 10), cost(0.25, 10.0), {});
  EXPECT_DOUBLE_EQ(a.eager_ms, 0.96);
  ASSERT_EQ(a.notes.size(), 1U);
  EXPECT_NE(a.notes[0].find("profiler inflates"), std::string::npos);
}

TEST(Advise, NoGpuWorkIsAnError) {
  Trace trace;
  trace.iterations.push_back(HostSpan{"it", 0, 10 * kUs});
  EXPECT_THROW_WITH(advise(trace, cost(0.25, 10.0), {1.0}), Error, "no kernels on the GPU");
}

TEST(Advise, TinyGraphsWarnThatTheHostMayBound) {
  // Two kernels of 1 us: the replay is shorter than two launch calls.
  const Advice a =
      advise(evenly_spaced(1, 2, 1, 50, /*launch_us=*/20), cost(0.25, 2.0), {0.2});
  ASSERT_FALSE(a.notes.empty());
  EXPECT_NE(a.notes.back().find("host may become the bottleneck"), std::string::npos);
}

}  // namespace
}  // namespace graphed
