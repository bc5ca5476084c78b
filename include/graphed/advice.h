#pragma once

/// \file advice.h
/// graphed::advise: the arithmetic that turns a profiler trace of a few eager
/// iterations into advice. Pure arithmetic on plain records, with no CUDA and
/// no profiler, so that it is tested on stored traces without a GPU: kernels
/// per iteration, their duration distribution, GPU busy fraction and idle
/// gaps, host time per launch; the predicted time of the same work replayed
/// as a CUDA graph (Note [Predicting the graphed time]), the speedup, a
/// verdict and the capture strategy to use (Note [Choosing a strategy]).
/// profile.h records the traces and measures the replay cost.

#include "graphed/compile_estimate.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace graphed {

/// What a GPU activity is.
enum class ActivityKind {
  /// A kernel.
  kKernel,
  /// A memory copy (host-device or device-device).
  kMemcpy,
  /// A memory set.
  kMemset,
};

/// "kernel", "memcpy" or "memset".
std::string_view activity_kind_name(ActivityKind kind);
/// Parses activity_kind_name's names; throws graphed::Error listing them otherwise.
ActivityKind parse_activity_kind(std::string_view name);

/// One activity that ran on the GPU. Times share one clock with HostSpan.
struct GpuActivity {
  /// The kernel's name, or the copy's kind, as the profiler reports it.
  std::string name;
  /// What it is.
  ActivityKind kind = ActivityKind::kKernel;
  /// When it started, in nanoseconds on the trace's clock.
  int64_t start_ns = 0;
  /// How long it ran on the GPU, in nanoseconds.
  int64_t duration_ns = 0;
};

/// A stretch of host time: a runtime call that enqueued GPU work
/// (cudaLaunchKernel, cudaMemcpyAsync...) or one profiled iteration.
struct HostSpan {
  /// The runtime call, or the iteration marker.
  std::string name;
  /// When it started, in nanoseconds on the trace's clock.
  int64_t start_ns = 0;
  /// How long the host spent in it, in nanoseconds.
  int64_t duration_ns = 0;
};

/// A trace of one or more back-to-back iterations of the same work.
struct Trace {
  /// Every GPU activity of the iterations, in any order.
  std::vector<GpuActivity> gpu;
  /// The runtime calls that enqueued them (empty when not recorded).
  std::vector<HostSpan> launches;
  /// One span per iteration, from the host's start of it to its end.
  std::vector<HostSpan> iterations;
};

/// What a trace says, per iteration.
struct TraceSummary {
  /// Iterations in the trace.
  int64_t iterations = 0;
  /// GPU activities (kernels, copies, sets) per iteration: the nodes a graph
  /// of one iteration holds.
  double activities_per_iter = 0.0;
  /// Kernels per iteration.
  double kernels_per_iter = 0.0;
  /// Summed GPU duration of one iteration's activities, in milliseconds: the
  /// kernel-time floor.
  double gpu_ms_per_iter = 0.0;
  /// Activity durations over the trace, in microseconds.
  double duration_mean_us = 0.0;
  /// Median activity duration, in microseconds.
  double duration_p50_us = 0.0;
  /// 90th percentile of the activity durations, in microseconds.
  double duration_p90_us = 0.0;
  /// Longest activity, in microseconds.
  double duration_max_us = 0.0;
  /// Share of activities shorter than 50 us (launch overhead dominates them).
  double small_fraction = 0.0;
  /// Share of the traced window in which some activity ran on the GPU.
  double gpu_busy_fraction = 0.0;
  /// GPU idle time per iteration within the traced window, in milliseconds.
  double idle_ms_per_iter = 0.0;
  /// Idle gaps between consecutive stretches of GPU work, in microseconds.
  double gap_p50_us = 0.0;
  /// 90th percentile of those idle gaps, in microseconds.
  double gap_p90_us = 0.0;
  /// Host time of one iteration (under the profiler), in milliseconds.
  double host_ms_per_iter = 0.0;
  /// Runtime launch calls per iteration, and the mean host time of one.
  double launches_per_iter = 0.0;
  /// Mean host time of one runtime launch call, in microseconds.
  double launch_call_us = 0.0;
  /// Host time per GPU activity: host_ms_per_iter spread over the activities.
  double host_us_per_activity = 0.0;
  /// Launch calls per iteration that replay a graph (cudaGraphLaunch).
  double graph_launches_per_iter = 0.0;
  /// GPU activities per iteration that graph replays ran rather than launch
  /// calls of their own; 0 when the trace holds no launch calls (Note [Work
  /// in graphs and work launched eagerly] in src/advice.cpp).
  double graphed_activities_per_iter = 0.0;
};

/// Summarizes `trace`. Throws graphed::Error when it holds no iteration.
TraceSummary summarize(const Trace& trace);

/// The cost of replaying a graph on this GPU beyond its kernels' own time,
/// measured at start-up by profile.h's measure_replay_cost.
struct ReplayCost {
  /// Time each node adds to a replay besides its own duration, in microseconds.
  double per_node_us = 0.0;
  /// Fixed time per replay (graph launch), in microseconds.
  double launch_us = 0.0;
  /// The measurement behind it: replay times of graphs of `small_nodes` and
  /// `large_nodes` tiny kernels, and the profiled duration of one such kernel.
  int64_t small_nodes = 0;
  /// Nodes of the larger probe graph.
  int64_t large_nodes = 0;
  /// Replay time of the small probe graph, in microseconds.
  double small_replay_us = 0.0;
  /// Replay time of the large probe graph, in microseconds.
  double large_replay_us = 0.0;
  /// Profiled duration of one tiny probe kernel, in microseconds.
  double tiny_kernel_us = 0.0;

  /// Fits the replay cost to two measurements; see Note [Predicting the
  /// graphed time]. Throws graphed::Error unless 0 < small < large and the
  /// times are positive.
  static ReplayCost fit(int64_t small_nodes, double small_replay_us, int64_t large_nodes,
                        double large_replay_us, double tiny_kernel_us);
};

/// Will graphs pay off?
enum class Verdict {
  /// The predicted speedup clears AdviceInputs::helps_above.
  kHelps,
  /// The GPU idles, but replaying would not gain enough.
  kWontHelpMuch,
  /// The GPU is busy nearly all the time already.
  kAlreadyGpuBound,
};

/// How to capture; see Note [Choosing a strategy].
enum class Strategy {
  /// Capture the whole function or training iteration as one graph.
  kFullCapture,
  /// One graph per module (forward and backward); the code between modules
  /// that breaks capture stays eager.
  kPerModule,
  /// One graph per input shape bucket, inputs padded up to the bucket.
  kBucketed,
  /// Capture blockers sit inside the modules: fix them first.
  kFixBlockers,
  /// Graphs would not pay off: stay eager.
  kStayEager,
};

/// "graphs help", "won't help much" or "already GPU-bound".
std::string_view verdict_name(Verdict verdict);
/// "full_capture", "per_module", "bucketed", "fix_blockers" or "stay_eager".
std::string_view strategy_name(Strategy strategy);

/// What advise() needs besides the trace.
struct AdviceInputs {
  /// Time of one eager iteration measured without the profiler (CUDA
  /// events, back to back), in milliseconds. Not positive: the trace's host
  /// time is used, which the profiler inflates.
  double eager_ms = 0.0;
  /// Capture blockers graphed.check found in the whole function.
  int64_t blockers = 0;
  /// True when every module checked on its own is free of blockers, so the
  /// blockers sit in the code between modules.
  bool blockers_between_modules = false;
  /// Graphs a per-module capture would replay per iteration.
  int64_t module_graphs = 1;
  /// True when the function is called with inputs of several shapes.
  bool shapes_vary = false;
  /// True for a training iteration (forward, backward, optimizer step).
  bool training = false;
  /// The predicted speedup above which graphs are worth it.
  double helps_above = 1.2;
  /// The eager GPU busy share at or above which the GPU is the bottleneck.
  double gpu_bound_at = 0.95;
};

/// The advice for one workload.
struct Advice {
  /// The trace, summarized.
  TraceSummary summary;
  /// The replay cost the prediction used.
  ReplayCost cost;
  /// One eager iteration, in milliseconds.
  double eager_ms = 0.0;
  /// Share of the eager iteration the GPU is busy: gpu_ms_per_iter / eager_ms.
  double eager_gpu_busy = 0.0;
  /// Graphs replayed per iteration by the predicted strategy.
  int64_t graphs = 1;
  /// Predicted time of one graphed iteration, in milliseconds.
  double predicted_ms = 0.0;
  /// eager_ms / predicted_ms.
  double predicted_speedup = 0.0;
  /// Will graphs pay off?
  Verdict verdict = Verdict::kHelps;
  /// What to do.
  Strategy strategy = Strategy::kFullCapture;
  /// Why: the verdict and the strategy in a sentence or two each.
  std::string reason;
  /// Caveats of the prediction for this workload.
  std::vector<std::string> notes;
  /// The same step compiled by torch.compile (Inductor, default mode) and
  /// replayed as `graphs` graphs: Note [Predicting a compiled step].
  CompiledEstimate compiled;
};

/// Predicted time of replaying `graphs` graphs that hold the work of one
/// iteration of `summary`, in milliseconds; see Note [Predicting the graphed
/// time].
double predict_graphed_ms(const TraceSummary& summary, const ReplayCost& cost, int64_t graphs = 1);

/// The advice for the work `trace` recorded.
Advice advise(const Trace& trace, const ReplayCost& cost, const AdviceInputs& inputs);

}  // namespace graphed
