#include "graphed/advice.h"

#include "graphed/check.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

namespace graphed {

// Note [Predicting the graphed time]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A replayed graph runs the same kernels as the eager iteration, in the same
// order, but the host no longer issues them one by one: the GPU runs node
// after node, each start waiting only for the device-side dispatch of the
// next node. So a replay takes
//
//     sum of the kernels' own durations  +  nodes * per_node  +  launch
//
// where `per_node` is the device-side cost of moving from one node to the
// next and `launch` the fixed cost of one cudaGraphLaunch as seen by replays
// issued back to back (the GPU, not the host, is the bottleneck then). Both
// depend on the GPU, the driver and the CUDA version, not on the workload,
// so they are measured once per device at start-up (profile.h,
// measure_replay_cost): graphs of `small` and `large` tiny dependent kernels
// are replayed back to back and timed with CUDA events. Each node of those
// graphs costs its own duration plus per_node, so the slope of replay time
// over nodes is tiny_kernel + per_node, where tiny_kernel is the tiny
// kernel's duration as the profiler reports it; the intercept is `launch`.
// Subtracting the profiled duration keeps the model consistent with the
// workload's side, whose kernel durations come from the same profiler.
//
// The kernel durations are those of the eager trace. For a training step the
// trace must be of the iteration that will be captured (graphed.TrainStep
// drops gradients instead of zeroing them and steps a fused optimizer), not
// of the user's eager loop: Python's advise_training traces that iteration.
// The model ignores host work between graphs and host costs per replay: it
// holds when the graphed iteration is GPU-bound, which is what graphs are for;
// advise() notes when the host time per replay may not be small against it.

// Note [Choosing a strategy]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// The decision chart of the CUDA-graphs playbook, in order:
//  1. Blockers inside the modules (a `.item()` in a forward): no capture
//     strategy avoids them; fix them first (graphed.check names each).
//  2. Graphs would not pay off (GPU already busy >= 95% of the eager
//     iteration, or a predicted speedup below helps_above): stay eager.
//  3. Blockers between modules only (a loss logged with `.item()`, a
//     data-dependent branch in the training loop): capture each module on its
//     own and leave the glue eager.
//  4. Inputs of several shapes: one graph per shape bucket, inputs padded.
//  5. Otherwise the whole function or iteration as one graph: the fewest
//     launches and the only form that captures the optimizer step too.

namespace {

constexpr double kNsPerUs = 1e3;
constexpr double kNsPerMs = 1e6;
constexpr double kSmallKernelUs = 50.0;

// Linear interpolation between closest ranks of sorted `values` (numpy's default).
double percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) {
    return 0.0;
  }
  const double position = q * static_cast<double>(sorted.size() - 1);
  const auto below = static_cast<size_t>(std::floor(position));
  const size_t above = std::min(below + 1, sorted.size() - 1);
  const double fraction = position - static_cast<double>(below);
  return sorted[below] + (sorted[above] - sorted[below]) * fraction;
}

std::string fixed(double value, int digits) {
  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(digits);
  out << value;
  return out.str();
}

}  // namespace

std::string_view activity_kind_name(ActivityKind kind) {
  switch (kind) {
    case ActivityKind::kKernel:
      return "kernel";
    case ActivityKind::kMemcpy:
      return "memcpy";
    case ActivityKind::kMemset:
      return "memset";
  }
  return "kernel";
}

ActivityKind parse_activity_kind(std::string_view name) {
  for (ActivityKind kind : {ActivityKind::kKernel, ActivityKind::kMemcpy, ActivityKind::kMemset}) {
    if (activity_kind_name(kind) == name) {
      return kind;
    }
  }
  GRAPHED_THROW(Error, "Expected a GPU activity kind \"kernel\", \"memcpy\" or \"memset\", got \"",
                name, "\".");
}

std::string_view verdict_name(Verdict verdict) {
  switch (verdict) {
    case Verdict::kHelps:
      return "graphs help";
    case Verdict::kWontHelpMuch:
      return "won't help much";
    case Verdict::kAlreadyGpuBound:
      return "already GPU-bound";
  }
  return "graphs help";
}

std::string_view strategy_name(Strategy strategy) {
  switch (strategy) {
    case Strategy::kFullCapture:
      return "full_capture";
    case Strategy::kPerModule:
      return "per_module";
    case Strategy::kBucketed:
      return "bucketed";
    case Strategy::kFixBlockers:
      return "fix_blockers";
    case Strategy::kStayEager:
      return "stay_eager";
  }
  return "stay_eager";
}

TraceSummary summarize(const Trace& trace) {
  GRAPHED_CHECK(!trace.iterations.empty(),
                "Expected a trace of at least one iteration, got none. Record the iterations "
                "(profile.h does) or add one HostSpan per iteration to Trace::iterations.");
  TraceSummary s;
  s.iterations = static_cast<int64_t>(trace.iterations.size());
  const auto n = static_cast<double>(s.iterations);

  int64_t window_start = trace.iterations.front().start_ns;
  int64_t window_end = window_start;
  double host_ns = 0.0;
  for (const HostSpan& iteration : trace.iterations) {
    GRAPHED_CHECK(iteration.duration_ns >= 0, "Expected iteration spans of non-negative "
                  "duration, got ", iteration.duration_ns, " ns for \"", iteration.name, "\".");
    window_start = std::min(window_start, iteration.start_ns);
    window_end = std::max(window_end, iteration.start_ns + iteration.duration_ns);
    host_ns += static_cast<double>(iteration.duration_ns);
  }
  s.host_ms_per_iter = host_ns / n / kNsPerMs;

  std::vector<std::pair<int64_t, int64_t>> intervals;
  std::vector<double> durations_us;
  intervals.reserve(trace.gpu.size());
  durations_us.reserve(trace.gpu.size());
  double gpu_ns = 0.0;
  int64_t kernels = 0;
  int64_t small = 0;
  for (const GpuActivity& activity : trace.gpu) {
    GRAPHED_CHECK(activity.duration_ns >= 0, "Expected GPU activities of non-negative duration, "
                  "got ", activity.duration_ns, " ns for \"", activity.name, "\".");
    const int64_t end = activity.start_ns + activity.duration_ns;
    intervals.emplace_back(activity.start_ns, end);
    window_start = std::min(window_start, activity.start_ns);
    window_end = std::max(window_end, end);
    gpu_ns += static_cast<double>(activity.duration_ns);
    durations_us.push_back(static_cast<double>(activity.duration_ns) / kNsPerUs);
    kernels += activity.kind == ActivityKind::kKernel ? 1 : 0;
    small += durations_us.back() < kSmallKernelUs ? 1 : 0;
  }
  const auto activities = static_cast<double>(trace.gpu.size());
  s.activities_per_iter = activities / n;
  s.kernels_per_iter = static_cast<double>(kernels) / n;
  s.gpu_ms_per_iter = gpu_ns / n / kNsPerMs;
  if (!durations_us.empty()) {
    std::sort(durations_us.begin(), durations_us.end());
    s.duration_mean_us = gpu_ns / activities / kNsPerUs;
    s.duration_p50_us = percentile(durations_us, 0.5);
    s.duration_p90_us = percentile(durations_us, 0.9);
    s.duration_max_us = durations_us.back();
    s.small_fraction = static_cast<double>(small) / activities;
  }

  // Busy time is the union of the activities (streams may overlap); the gaps
  // are the idle stretches between consecutive pieces of that union.
  std::sort(intervals.begin(), intervals.end());
  double busy_ns = 0.0;
  std::vector<double> gaps_us;
  int64_t piece_start = 0;
  int64_t piece_end = 0;
  bool open = false;
  for (const auto& [start, end] : intervals) {
    if (open && start <= piece_end) {
      piece_end = std::max(piece_end, end);
      continue;
    }
    if (open) {
      busy_ns += static_cast<double>(piece_end - piece_start);
      gaps_us.push_back(static_cast<double>(start - piece_end) / kNsPerUs);
    }
    piece_start = start;
    piece_end = end;
    open = true;
  }
  if (open) {
    busy_ns += static_cast<double>(piece_end - piece_start);
  }
  const auto window_ns = static_cast<double>(window_end - window_start);
  s.gpu_busy_fraction = window_ns > 0.0 ? busy_ns / window_ns : 0.0;
  s.idle_ms_per_iter = (window_ns - busy_ns) / n / kNsPerMs;
  std::sort(gaps_us.begin(), gaps_us.end());
  s.gap_p50_us = percentile(gaps_us, 0.5);
  s.gap_p90_us = percentile(gaps_us, 0.9);

  double launch_ns = 0.0;
  for (const HostSpan& launch : trace.launches) {
    launch_ns += static_cast<double>(launch.duration_ns);
  }
  s.launches_per_iter = static_cast<double>(trace.launches.size()) / n;
  s.launch_call_us =
      trace.launches.empty() ? 0.0 : launch_ns / static_cast<double>(trace.launches.size()) / kNsPerUs;
  s.host_us_per_activity =
      s.activities_per_iter > 0.0 ? s.host_ms_per_iter * 1e3 / s.activities_per_iter : 0.0;

  // Note [Work in graphs and work launched eagerly]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // How much of an iteration's GPU work graphs hold, when graphs hold only
  // some of it (per-block graphs and the parts of blocks that cannot be
  // captured, with the rest eager): every launch call but a graph launch
  // enqueues one activity of its own (cudaLaunchKernel one kernel,
  // cudaMemcpyAsync one copy, cuLaunchKernel one Triton kernel), and a graph
  // launch enqueues all of its nodes at once. So the activities beyond the
  // eager launch calls are the ones graph replays ran. A call made inside
  // another's span (a driver call the runtime call made, where the profiler
  // lists both) is the same launch and counts once. Without launch calls in
  // the trace nothing can be told apart: 0.
  std::vector<const HostSpan*> launches;
  launches.reserve(trace.launches.size());
  for (const HostSpan& launch : trace.launches) {
    launches.push_back(&launch);
  }
  std::sort(launches.begin(), launches.end(),
            [](const HostSpan* a, const HostSpan* b) { return a->start_ns < b->start_ns; });
  int64_t graph_launches = 0;
  int64_t eager_launches = 0;
  int64_t enclosing_end = std::numeric_limits<int64_t>::min();
  for (const HostSpan* launch : launches) {
    const int64_t end = launch->start_ns + launch->duration_ns;
    if (launch->start_ns >= enclosing_end || end > enclosing_end) {
      enclosing_end = end;
      const bool graph = launch->name.find("GraphLaunch") != std::string::npos;
      graph_launches += graph ? 1 : 0;
      eager_launches += graph ? 0 : 1;
    }
  }
  s.graph_launches_per_iter = static_cast<double>(graph_launches) / n;
  if (!launches.empty()) {
    s.graphed_activities_per_iter =
        std::max(0.0, activities - static_cast<double>(eager_launches)) / n;
  }
  return s;
}

ReplayCost ReplayCost::fit(int64_t small_nodes, double small_replay_us, int64_t large_nodes,
                           double large_replay_us, double tiny_kernel_us) {
  GRAPHED_CHECK(small_nodes > 0 && large_nodes > small_nodes,
                "Expected two graph sizes 0 < small < large to fit the replay cost, got small=",
                small_nodes, " and large=", large_nodes, ".");
  GRAPHED_CHECK(small_replay_us > 0.0 && large_replay_us > 0.0 && tiny_kernel_us >= 0.0,
                "Expected positive replay times and a non-negative kernel duration, got ",
                small_replay_us, " us, ", large_replay_us, " us and ", tiny_kernel_us, " us.");
  ReplayCost cost;
  cost.small_nodes = small_nodes;
  cost.large_nodes = large_nodes;
  cost.small_replay_us = small_replay_us;
  cost.large_replay_us = large_replay_us;
  cost.tiny_kernel_us = tiny_kernel_us;
  const double slope =
      (large_replay_us - small_replay_us) / static_cast<double>(large_nodes - small_nodes);
  // Timing noise can put the slope under the kernel's own duration; a node
  // never costs less than nothing.
  cost.per_node_us = std::max(0.0, slope - tiny_kernel_us);
  cost.launch_us = std::max(0.0, small_replay_us - slope * static_cast<double>(small_nodes));
  return cost;
}

double predict_graphed_ms(const TraceSummary& summary, const ReplayCost& cost, int64_t graphs) {
  return summary.gpu_ms_per_iter +
         (summary.activities_per_iter * cost.per_node_us +
          static_cast<double>(std::max<int64_t>(graphs, 1)) * cost.launch_us) /
             1e3;
}

Advice advise(const Trace& trace, const ReplayCost& cost, const AdviceInputs& inputs) {
  Advice advice;
  advice.summary = summarize(trace);
  advice.cost = cost;
  const TraceSummary& s = advice.summary;
  GRAPHED_CHECK(s.activities_per_iter > 0.0,
                "Expected GPU work in the traced iterations, found none: the function ran no "
                "kernels on the GPU (are its tensors on the CPU?), so there is nothing to "
                "capture or predict.");
  advice.eager_ms = inputs.eager_ms > 0.0 ? inputs.eager_ms : s.host_ms_per_iter;
  if (inputs.eager_ms <= 0.0) {
    advice.notes.emplace_back(
        "no eager time measured without the profiler: the profiled host time is used, which "
        "the profiler inflates");
  }
  advice.eager_gpu_busy = std::min(1.0, s.gpu_ms_per_iter / advice.eager_ms);

  const bool blocked_inside = inputs.blockers > 0 && !inputs.blockers_between_modules;
  const bool per_module = inputs.blockers > 0 && inputs.blockers_between_modules;
  advice.graphs = per_module ? std::max<int64_t>(inputs.module_graphs, 1) : 1;
  advice.predicted_ms = predict_graphed_ms(s, cost, advice.graphs);
  advice.predicted_speedup = advice.eager_ms / advice.predicted_ms;
  advice.compiled = estimate_compiled(trace, cost, advice.graphs);

  std::string verdict_reason;
  if (advice.eager_gpu_busy >= inputs.gpu_bound_at) {
    advice.verdict = Verdict::kAlreadyGpuBound;
    verdict_reason = "the GPU is busy " + fixed(100.0 * advice.eager_gpu_busy, 0) +
                     "% of the eager iteration, so there is little launch overhead to remove";
  } else if (advice.predicted_speedup < inputs.helps_above) {
    advice.verdict = Verdict::kWontHelpMuch;
    verdict_reason = "the GPU idles " + fixed(100.0 * (1.0 - advice.eager_gpu_busy), 0) +
                     "% of the eager iteration, but replaying is predicted to gain only " +
                     fixed(advice.predicted_speedup, 2) + "x";
  } else {
    advice.verdict = Verdict::kHelps;
    verdict_reason = "the GPU idles " + fixed(100.0 * (1.0 - advice.eager_gpu_busy), 0) +
                     "% of the eager iteration between " + fixed(s.activities_per_iter, 0) +
                     " activities of " + fixed(s.duration_p50_us, 1) +
                     " us (median); one replay is predicted to take " +
                     fixed(advice.predicted_ms, 3) + " ms against " + fixed(advice.eager_ms, 3) +
                     " ms eager (" + fixed(advice.predicted_speedup, 2) + "x)";
  }

  std::string strategy_reason;
  const std::string whole = inputs.training ? "the whole training iteration (graphed.TrainStep)"
                                            : "the whole function (graphed.capture)";
  if (blocked_inside) {
    advice.strategy = Strategy::kFixBlockers;
    strategy_reason = std::to_string(inputs.blockers) +
                      " capture blocker(s) sit inside the modules; no capture strategy avoids "
                      "them: fix what graphed.check lists first";
  } else if (advice.verdict != Verdict::kHelps) {
    advice.strategy = Strategy::kStayEager;
    strategy_reason = "stay eager";
  } else if (per_module) {
    advice.strategy = Strategy::kPerModule;
    strategy_reason = std::to_string(inputs.blockers) +
                      " capture blocker(s) sit between modules: capture each module (" +
                      std::to_string(advice.graphs) + " graphs) and leave the code between "
                      "them eager";
    advice.notes.emplace_back(
        "the prediction counts the modules' kernels and one launch per graph; the eager code "
        "between modules adds its own time");
  } else if (inputs.shapes_vary) {
    advice.strategy = Strategy::kBucketed;
    strategy_reason = "inputs come in several shapes: capture one graph per shape bucket and pad "
                      "inputs up to it";
    advice.notes.emplace_back(
        "the prediction is for the traced shape; padded calls run the bucket's larger kernels");
  } else {
    advice.strategy = Strategy::kFullCapture;
    strategy_reason = "nothing blocks capture and shapes are fixed: capture " + whole;
  }
  advice.reason = std::string(verdict_name(advice.verdict)) + ": " + verdict_reason +
                  ". Strategy: " + strategy_reason + ".";
  // Replays issued back to back keep the GPU fed only while the host needs
  // less time per replay than the GPU; a tiny graph may not.
  const double host_launch_ms = 2.0 * s.launch_call_us / 1e3 * static_cast<double>(advice.graphs);
  if (host_launch_ms > 0.5 * advice.predicted_ms) {
    advice.notes.emplace_back(
        "the graphed iteration is short against the host's cost of a launch: the host may "
        "become the bottleneck and the prediction optimistic");
  }
  return advice;
}

}  // namespace graphed
