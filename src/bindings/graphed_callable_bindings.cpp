// graphed.make_graphed_callables for Python: conversion only.

#include "graphed/graphed_callable.h"
#include "python_values.h"
#include "registration.h"

#include <torch/csrc/autograd/python_variable.h>

namespace py = pybind11;

namespace graphed::python {
namespace {

std::vector<std::shared_ptr<GraphedCallable>> make_graphed_callables_python(
    const py::list& callables, const py::list& samples, int warmup, bool allow_unused_input,
    const py::object& pool, std::vector<int64_t> order, const std::string& capture_error_mode) {
  std::vector<GraphableCallable> graphables;
  for (const py::handle entry : callables) {
    const py::dict spec = py::reinterpret_borrow<py::dict>(entry);
    GraphableCallable callable;
    callable.function = wrap_call(spec["function"]);
    callable.parameters = spec["parameters"].cast<std::vector<at::Tensor>>();
    callable.state = spec["state"].cast<std::vector<at::Tensor>>();
    if (!spec["training"].is_none()) {
      callable.training = spec["training"].cast<bool>();
    }
    if (!spec["parameter_dicts"].is_none()) {
      callable.read_parameters = read_tensors_of(spec["parameter_dicts"]);
    }
    callable.description = spec["description"].cast<std::string>();
    graphables.push_back(std::move(callable));
  }
  std::vector<std::vector<c10::IValue>> sample_values;
  for (const py::handle sample : samples) {
    const py::tuple args_and_kwargs = py::reinterpret_borrow<py::tuple>(sample);
    sample_values.push_back({to_ivalue(args_and_kwargs[0]), to_ivalue(args_and_kwargs[1])});
  }
  GraphedCallablesOptions options;
  options.warmup_iters = warmup;
  options.allow_unused_input = allow_unused_input;
  options.pool = pool_from_python(pool);
  options.order = std::move(order);
  options.error_mode = parse_capture_error_mode(capture_error_mode);
  options.input_names = {"args", "kwargs"};
  const WarningsToPython warnings;
  py::gil_scoped_release no_gil;
  return make_graphed_callables(std::move(graphables), std::move(sample_values),
                                std::move(options));
}

py::object call_graphed(GraphedCallable& self, const py::object& training, const py::tuple& args,
                        const py::dict& kwargs) {
  const std::vector<c10::IValue> inputs{to_ivalue(args), to_ivalue(kwargs)};
  std::optional<bool> flag;
  if (!training.is_none()) {
    flag = training.cast<bool>();
  }
  return to_python(self.call(inputs, flag));
}

}  // namespace

void register_graphed_callables(py::module_& m) {
  m.def("make_graphed_callables", &make_graphed_callables_python, py::arg("callables"),
        py::arg("samples"), py::arg("warmup"), py::arg("allow_unused_input"), py::arg("pool"),
        py::arg("order"), py::arg("capture_error_mode"));

  py::class_<GraphedCallable, std::shared_ptr<GraphedCallable>>(
      m, "GraphedCallable",
      "A callable replaced by forward and backward CUDA graphs (see "
      "graphed.make_graphed_callables).")
      .def("call", &call_graphed, py::arg("training"), py::arg("args"), py::arg("kwargs"),
           "Replays the graphs (or runs eagerly when `training` differs from capture).")
      .def_property_readonly("description", &GraphedCallable::description,
                             "What was captured, as messages name it.")
      .def_property_readonly("num_microbatches", &GraphedCallable::num_microbatches,
                             "Forward/backward graph pairs: one per microbatch of `order`.")
      .def_property_readonly(
          "pool", [](const GraphedCallable& self) { return pool_to_python(self.pool()); },
          "The memory pool the graphs share (pass it as `pool=` to share it further).")
      .def_property_readonly(
          "signature", [](const GraphedCallable& self) { return self.signature().describe(); },
          "The inputs the graphs were captured for (shapes, dtypes, devices, constants).")
      .def(
          "stats",
          [](const GraphedCallable& self) {
            const GraphedCallableStats stats = self.stats();
            py::dict out;
            out["forward_replays"] = stats.forward_replays;
            out["backward_replays"] = stats.backward_replays;
            out["input_copies"] = stats.input_copies;
            out["grad_copies"] = stats.grad_copies;
            py::dict eager;
            int64_t eager_total = 0;
            for (const auto& [reason, count] : stats.eager_calls) {
              eager[py::str(reason)] = count;
              eager_total += count;
            }
            out["eager_calls"] = eager_total;
            out["eager_reasons"] = eager;
            py::list graphs;
            for (const GraphedPassInfo& info : self.graphs()) {
              py::dict graph = graph_stats_to_python(info.graph);
              graph["microbatch"] = info.microbatch;
              graph["pass"] = info.forward ? "forward" : "backward";
              if (info.forward) {
                graph["fp8_weight_casts"] = info.float8_weight_casts;
                graph["fp8_weight_cast_reads"] = info.float8_weight_cast_reads;
              }
              graphs.append(graph);
            }
            out["graphs"] = graphs;
            return out;
          },
          "Replay and copy counters, eager calls by reason, and each graph's nodes and pool "
          "(forward graphs also: FP8 weight casts made and shared casts read).");
}

}  // namespace graphed::python
