// graphed.advise for Python: traces, the replay cost and the advice
// arithmetic. Conversion only: traces cross as dicts of lists of tuples, the
// advice as a dict; every decision lives in advice.cpp and profile.cpp.

#include "graphed/advice.h"
#include "graphed/profile.h"
#include "python_values.h"
#include "registration.h"

namespace graphed::python {
namespace {

using GpuRecord = std::tuple<std::string, std::string, int64_t, int64_t>;
using HostRecord = std::tuple<std::string, int64_t, int64_t>;

py::dict trace_to_python(const Trace& trace) {
  py::list gpu;
  for (const GpuActivity& a : trace.gpu) {
    gpu.append(py::make_tuple(a.name, std::string(activity_kind_name(a.kind)), a.start_ns,
                              a.duration_ns));
  }
  const auto spans = [](const std::vector<HostSpan>& from) {
    py::list out;
    for (const HostSpan& s : from) {
      out.append(py::make_tuple(s.name, s.start_ns, s.duration_ns));
    }
    return out;
  };
  py::dict out;
  out["gpu"] = std::move(gpu);
  out["launches"] = spans(trace.launches);
  out["iterations"] = spans(trace.iterations);
  return out;
}

Trace trace_from_python(const py::dict& object) {
  Trace trace;
  const auto list = [&](const char* key) {
    return object.contains(key) ? py::list(object[key]) : py::list();
  };
  for (const py::handle item : list("gpu")) {
    const auto [name, kind, start, duration] = item.cast<GpuRecord>();
    trace.gpu.push_back(GpuActivity{name, parse_activity_kind(kind), start, duration});
  }
  for (const py::handle item : list("launches")) {
    const auto [name, start, duration] = item.cast<HostRecord>();
    trace.launches.push_back(HostSpan{name, start, duration});
  }
  for (const py::handle item : list("iterations")) {
    const auto [name, start, duration] = item.cast<HostRecord>();
    trace.iterations.push_back(HostSpan{name, start, duration});
  }
  return trace;
}

py::dict cost_to_python(const ReplayCost& cost) {
  py::dict out;
  out["per_node_us"] = cost.per_node_us;
  out["launch_us"] = cost.launch_us;
  out["small_nodes"] = cost.small_nodes;
  out["large_nodes"] = cost.large_nodes;
  out["small_replay_us"] = cost.small_replay_us;
  out["large_replay_us"] = cost.large_replay_us;
  out["tiny_kernel_us"] = cost.tiny_kernel_us;
  return out;
}

ReplayCost cost_from_python(const py::dict& object) {
  ReplayCost cost;
  cost.per_node_us = object["per_node_us"].cast<double>();
  cost.launch_us = object["launch_us"].cast<double>();
  const auto optional = [&](const char* key, auto fallback) {
    return object.contains(key) ? object[key].cast<decltype(fallback)>() : fallback;
  };
  cost.small_nodes = optional("small_nodes", int64_t{0});
  cost.large_nodes = optional("large_nodes", int64_t{0});
  cost.small_replay_us = optional("small_replay_us", 0.0);
  cost.large_replay_us = optional("large_replay_us", 0.0);
  cost.tiny_kernel_us = optional("tiny_kernel_us", 0.0);
  return cost;
}

py::dict summary_to_python(const TraceSummary& s) {
  py::dict out;
  out["iterations"] = s.iterations;
  out["activities_per_iter"] = s.activities_per_iter;
  out["kernels_per_iter"] = s.kernels_per_iter;
  out["gpu_ms_per_iter"] = s.gpu_ms_per_iter;
  out["duration_mean_us"] = s.duration_mean_us;
  out["duration_p50_us"] = s.duration_p50_us;
  out["duration_p90_us"] = s.duration_p90_us;
  out["duration_max_us"] = s.duration_max_us;
  out["small_fraction"] = s.small_fraction;
  out["gpu_busy_fraction"] = s.gpu_busy_fraction;
  out["idle_ms_per_iter"] = s.idle_ms_per_iter;
  out["gap_p50_us"] = s.gap_p50_us;
  out["gap_p90_us"] = s.gap_p90_us;
  out["host_ms_per_iter"] = s.host_ms_per_iter;
  out["launches_per_iter"] = s.launches_per_iter;
  out["launch_call_us"] = s.launch_call_us;
  out["host_us_per_activity"] = s.host_us_per_activity;
  out["graph_launches_per_iter"] = s.graph_launches_per_iter;
  out["graphed_activities_per_iter"] = s.graphed_activities_per_iter;
  return out;
}

py::dict advice_to_python(const Advice& advice) {
  py::dict out;
  out["summary"] = summary_to_python(advice.summary);
  out["replay_cost"] = cost_to_python(advice.cost);
  out["eager_ms"] = advice.eager_ms;
  out["eager_gpu_busy"] = advice.eager_gpu_busy;
  out["graphs"] = advice.graphs;
  out["predicted_ms"] = advice.predicted_ms;
  out["predicted_speedup"] = advice.predicted_speedup;
  out["verdict"] = std::string(verdict_name(advice.verdict));
  out["strategy"] = std::string(strategy_name(advice.strategy));
  out["reason"] = advice.reason;
  out["notes"] = advice.notes;
  py::dict compiled;
  compiled["fixed_ms"] = advice.compiled.fixed_ms;
  compiled["fusible_ms"] = advice.compiled.fusible_ms;
  compiled["fixed_activities"] = advice.compiled.fixed_activities;
  compiled["fusible_kernels"] = advice.compiled.fusible_kernels;
  compiled["predicted_ms"] = advice.compiled.predicted_ms;
  out["compiled"] = compiled;
  return out;
}

py::dict advise_python(const py::dict& trace, const py::dict& cost, double eager_ms,
                       int64_t blockers, bool blockers_between_modules, int64_t module_graphs,
                       bool shapes_vary, bool training, double helps_above,
                       double gpu_bound_at) {
  AdviceInputs inputs;
  inputs.eager_ms = eager_ms;
  inputs.blockers = blockers;
  inputs.blockers_between_modules = blockers_between_modules;
  inputs.module_graphs = module_graphs;
  inputs.shapes_vary = shapes_vary;
  inputs.training = training;
  inputs.helps_above = helps_above;
  inputs.gpu_bound_at = gpu_bound_at;
  py::dict out = advice_to_python(advise(trace_from_python(trace), cost_from_python(cost), inputs));
  out["helps_above"] = helps_above;  // the verdict's bar, which optimize applies to compile too
  return out;
}

py::tuple profile_python(py::object iteration, int warmup, int timed_iters, int timed_repeats,
                         int profiled_iters) {
  ProfileOptions options;
  options.warmup = warmup;
  options.timed_iters = timed_iters;
  options.timed_repeats = timed_repeats;
  options.profiled_iters = profiled_iters;
  const std::function<void()> call = wrap_procedure(std::move(iteration));
  Profile result;
  {
    const WarningsToPython warnings;
    py::gil_scoped_release no_gil;
    result = profile(call, options);
  }
  return py::make_tuple(trace_to_python(result.trace), result.eager_ms);
}

py::dict record_trace_python(py::object iteration, int iterations) {
  const std::function<void()> call = wrap_procedure(std::move(iteration));
  Trace trace;
  {
    const WarningsToPython warnings;
    py::gil_scoped_release no_gil;
    trace = record_trace(call, iterations);
  }
  return trace_to_python(trace);
}

double time_ms_python(py::object fn, int iters, int repeats, int warmup) {
  const std::function<void()> call = wrap_procedure(std::move(fn));
  const WarningsToPython warnings;
  py::gil_scoped_release no_gil;
  return time_ms(call, iters, repeats, warmup);
}

}  // namespace

void register_advice(py::module_& m) {
  m.def("summarize_trace",
        [](const py::dict& trace) { return summary_to_python(summarize(trace_from_python(trace))); },
        py::arg("trace"),
        "Per-iteration figures of a trace {'gpu': [(name, kind, start_ns, duration_ns)], "
        "'launches': [(name, start_ns, duration_ns)], 'iterations': [...]}.");
  m.def("fit_replay_cost",
        [](int64_t small_nodes, double small_replay_us, int64_t large_nodes,
           double large_replay_us, double tiny_kernel_us) {
          return cost_to_python(ReplayCost::fit(small_nodes, small_replay_us, large_nodes,
                                                large_replay_us, tiny_kernel_us));
        },
        py::arg("small_nodes"), py::arg("small_replay_us"), py::arg("large_nodes"),
        py::arg("large_replay_us"), py::arg("tiny_kernel_us"),
        "The replay cost fitted to two replay timings and the tiny kernel's duration.");
  m.def("predict_graphed_ms",
        [](const py::dict& trace, const py::dict& cost, int64_t graphs) {
          return predict_graphed_ms(summarize(trace_from_python(trace)), cost_from_python(cost),
                                    graphs);
        },
        py::arg("trace"), py::arg("cost"), py::arg("graphs") = 1,
        "Predicted time of one graphed iteration of the traced work, in milliseconds.");
  m.def("advise_trace", &advise_python, py::arg("trace"), py::arg("cost"), py::arg("eager_ms"),
        py::arg("blockers") = 0, py::arg("blockers_between_modules") = false,
        py::arg("module_graphs") = 1, py::arg("shapes_vary") = false, py::arg("training") = false,
        py::arg("helps_above") = 1.2, py::arg("gpu_bound_at") = 0.95,
        "The advice for a trace: summary, prediction, verdict, strategy, reason and notes.");
  m.def("profile", &profile_python, py::arg("iteration"), py::arg("warmup"),
        py::arg("timed_iters"), py::arg("timed_repeats"), py::arg("profiled_iters"),
        "Warm up, time with CUDA events and trace `iteration()`; returns (trace, eager_ms).");
  m.def("record_trace", &record_trace_python, py::arg("iteration"), py::arg("iterations"),
        "Trace `iterations` back-to-back calls of `iteration()` with the Kineto profiler.");
  m.def("time_ms", &time_ms_python, py::arg("fn"), py::arg("iters"), py::arg("repeats"),
        py::arg("warmup"), "Milliseconds per call of `fn()`, timed with CUDA events.");
  m.def(
      "replay_cost",
      [](int device) {
        ReplayCost cost;
        {
          const WarningsToPython warnings;
          py::gil_scoped_release no_gil;
          cost = replay_cost(static_cast<c10::DeviceIndex>(device));
        }
        return cost_to_python(cost);
      },
      py::arg("device"), "The replay cost of `device`, measured on first use per process.");
  m.def(
      "measure_replay_cost",
      [](int device, int64_t small_nodes, int64_t large_nodes) {
        ReplayCost cost;
        {
          const WarningsToPython warnings;
          py::gil_scoped_release no_gil;
          cost = measure_replay_cost(static_cast<c10::DeviceIndex>(device), small_nodes,
                                     large_nodes);
        }
        return cost_to_python(cost);
      },
      py::arg("device"), py::arg("small_nodes") = 32, py::arg("large_nodes") = 512,
      "Measure the replay cost of `device` now.");
}

}  // namespace graphed::python
