// graphed._C: GraphManager (graphed.auto), module selection and memory sizes.
// Conversion only.

#include "graphed/check.h"
#include "graphed/graph_manager.h"
#include "graphed/memory_budget.h"
#include "graphed/module_selection.h"
#include "python_values.h"
#include "registration.h"

namespace graphed::python {
namespace {

std::unique_ptr<GraphManager> make_manager(int warmup, const py::object& buckets,
                                           const py::object& memory_budget,
                                           const std::string& fallback, bool check_blockers,
                                           int capture_warmup, int max_capture_ahead,
                                           const std::string& capture_error_mode,
                                           const std::string& input_update,
                                           const py::object& on_capture_ahead,
                                           bool pick_buckets) {
  GraphManagerOptions options;
  options.warmup = warmup;
  if (!buckets.is_none()) {
    options.buckets =
        BucketPolicy(buckets.cast<std::map<int64_t, std::vector<int64_t>>>());
  }
  options.pick_buckets = pick_buckets;
  options.memory_budget_bytes = memory_budget_from_python(memory_budget);
  options.fallback = parse_fallback_policy(fallback);
  options.check_blockers = check_blockers;
  options.capture_warmup_iters = capture_warmup;
  options.max_capture_ahead = max_capture_ahead;
  options.error_mode = parse_capture_error_mode(capture_error_mode);
  options.input_update = parse_input_update(input_update);
  if (!on_capture_ahead.is_none()) {
    std::shared_ptr<py::object> held = share_object(on_capture_ahead);
    options.on_capture_ahead = [held](const std::string& module, size_t done, size_t total) {
      py::gil_scoped_acquire gil;
      (*held)(module, done, total);
    };
  }
  GraphEntryFactories factories;
  factories.training = make_training_entry;
  factories.training_group = make_training_group;
  return std::make_unique<GraphManager>(std::move(options), std::move(factories));
}

// (name, class name, parameters, is_container, base class names): see
// graphed.auto._module_infos.
using ModuleTuple = std::tuple<std::string, std::string, int64_t, bool, std::vector<std::string>>;

std::vector<ModuleInfo> infos_from_python(const std::vector<ModuleTuple>& modules) {
  std::vector<ModuleInfo> infos;
  infos.reserve(modules.size());
  for (const auto& [name, type, parameters, is_container, bases] : modules) {
    infos.push_back(ModuleInfo{name, type, parameters, is_container, bases});
  }
  return infos;
}

py::dict stats_to_python(const GraphManagerStats& stats) {
  py::dict out;
  out["calls"] = stats.calls;
  out["replays"] = stats.replays;
  out["warmup_calls"] = stats.warmup_calls;
  out["captures"] = stats.captures;
  out["evictions"] = stats.evictions;
  out["tensor_changes"] = stats.tensor_changes;
  out["fallback_calls"] = stats.fallback_calls;
  out["capture_ms"] = stats.capture_ms;
  out["graphs"] = stats.graphs;
  out["graph_memory_bytes"] = stats.graph_memory_bytes;
  out["pool_reserved_bytes"] = stats.pool_reserved_bytes;
  out["memory_budget_bytes"] =
      stats.memory_budget_bytes < 0 ? py::object(py::none()) : py::int_(stats.memory_budget_bytes);
  out["order"] = stats.order;
  py::dict modules;
  for (const ModuleStats& module : stats.modules) {
    py::dict entry;
    entry["state"] = module.state;
    entry["calls"] = module.calls;
    entry["replays"] = module.replays;
    entry["graphs"] = module.graphs;
    if (!module.part_of.empty()) entry["part_of"] = module.part_of;
    modules[py::str(module.name)] = entry;
  }
  out["modules"] = modules;
  py::list fallbacks;
  for (const FallbackStats& fallback : stats.fallbacks) {
    py::dict entry;
    entry["module"] = fallback.module;
    entry["reason"] = fallback.reason;
    entry["count"] = fallback.count;
    fallbacks.append(entry);
  }
  out["fallbacks"] = fallbacks;
  py::list groups;
  for (const TrainingGroupStats& group : stats.training_groups) {
    py::dict entry;
    entry["modules"] = group.modules;
    entry["order"] = group.order;
    entry["left_out"] = group.left_out;
    entry["failure"] = group.failure.empty() ? py::object(py::none()) : py::str(group.failure);
    entry["capture_ms"] = group.capture_ms;
    entry["pool_reserved_bytes"] = group.pool_reserved_bytes;
    groups.append(entry);
  }
  out["training_groups"] = groups;
  py::list false_findings;
  for (const FallbackStats& finding : stats.check_false_findings) {
    py::dict entry;
    entry["module"] = finding.module;
    entry["finding"] = finding.reason;
    false_findings.append(entry);
  }
  out["check_false_findings"] = false_findings;
  out["manager_notes"] = stats.notes;
  return out;
}

}  // namespace

void register_auto(py::module_& m) {
  m.def("parse_memory_size", &parse_memory_size, py::arg("text"),
        "Bytes in a size such as \"512MB\" or \"2GiB\".");
  m.def(
      "select_repeated_blocks",
      [](const std::vector<ModuleTuple>& modules) {
        return select_repeated_blocks(infos_from_python(modules));
      },
      py::arg("modules"),
      "Names of the largest repeated blocks among (name, type, parameters, is_container, bases).");
  m.def(
      "parts_to_graph",
      [](const std::string& blocked, const std::vector<ModuleTuple>& modules) {
        return parts_to_graph(blocked, infos_from_python(modules));
      },
      py::arg("blocked"), py::arg("modules"),
      "The parts of a module that cannot be captured which graphed.auto graphs in its place "
      "(Note [Graphing the parts of a block]).");
  m.def(
      "validate_module_selection",
      [](const std::vector<std::string>& chosen,
         const std::vector<ModuleTuple>& modules) {
        validate_module_selection(chosen, infos_from_python(modules));
      },
      py::arg("chosen"), py::arg("modules"),
      "Raise when a chosen name is unknown, repeated, or contains another chosen module.");

  // What GraphManager.call returns for a call the caller must run itself.
  auto run_eager = share_object(py::module_::import("builtins").attr("object")());
  auto run_own_forward = share_object(py::module_::import("builtins").attr("object")());
  m.attr("RUN_EAGER") = *run_eager;
  m.attr("RUN_OWN_FORWARD") = *run_own_forward;
  py::class_<GraphManager>(m, "GraphManager",
                           "Automatic per-module capture (graphed.auto's core).")
      .def(py::init(&make_manager), py::arg("warmup"), py::arg("buckets"),
           py::arg("memory_budget"), py::arg("fallback"), py::arg("check_blockers"),
           py::arg("capture_warmup"), py::arg("max_capture_ahead"),
           py::arg("capture_error_mode"), py::arg("input_update"),
           py::arg("on_capture_ahead") = py::none(), py::arg("pick_buckets") = false)
      .def(
          "add_module",
          [](GraphManager& self, std::string name, std::string type, py::object forward,
             std::vector<at::Tensor> state, std::vector<at::Tensor> parameters,
             const py::object& parameter_dicts, const py::object& buffer_dicts,
             std::string part_of) {
            ModuleSpec spec;
            spec.steady_shapes = !part_of.empty();
            spec.part_of = std::move(part_of);
            spec.name = std::move(name);
            spec.type = std::move(type);
            spec.forward = wrap_call(std::move(forward));
            spec.state = std::move(state);
            spec.parameters = std::move(parameters);
            if (!parameter_dicts.is_none() && !buffer_dicts.is_none()) {
              spec.read_parameters = read_tensors_of(parameter_dicts.cast<py::list>());
              spec.read_buffers = read_tensors_of(buffer_dicts.cast<py::list>());
            }
            return self.add_module(std::move(spec));
          },
          py::arg("name"), py::arg("type"), py::arg("forward"), py::arg("state"),
          py::arg("parameters"), py::arg("parameter_dicts") = py::none(),
          py::arg("buffer_dicts") = py::none(), py::arg("part_of") = "")
      .def(
          "call",
          [run_eager, run_own_forward](GraphManager& self, size_t index, const py::tuple& args,
                      const py::dict& kwargs, bool training) -> py::object {
            const std::vector<c10::IValue> inputs{to_ivalue(args), to_ivalue(kwargs),
                                                  c10::IValue(training)};
            std::optional<c10::IValue> outputs;
            {
              const WarningsToPython warnings;
              py::gil_scoped_release no_gil;
              outputs = self.try_call(index, inputs);
            }
            // Note [A fallback costs nothing]: the caller runs the forward
            // (and, once the module is blocked, puts it back in place).
            if (outputs) return to_python(*outputs);
            return self.blocked(index) ? *run_own_forward : *run_eager;
          },
          py::arg("index"), py::arg("args"), py::arg("kwargs"), py::arg("training"),
          "Runs module `index`; returns graphed._C.RUN_EAGER when the call falls back "
          "(counted): the caller then runs the module's own forward; RUN_OWN_FORWARD when "
          "the module can never use a graph: the caller also puts its own forward back.")
      .def("blocked", &GraphManager::blocked, py::arg("index"),
           "True once the module falls back for good: its calls can go straight to its own "
           "forward.")
      .def("stats", [](const GraphManager& self) { return stats_to_python(self.stats()); })
      .def("clear", &GraphManager::clear, py::call_guard<py::gil_scoped_release>());
}

}  // namespace graphed::python
