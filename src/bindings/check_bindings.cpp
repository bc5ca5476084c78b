// graphed.check for Python: check_safety, its report, and the entry points the
// Python adapter records host calls through. Conversion only.

#include "graphed/safety_check.h"
#include "python_values.h"
#include "registration.h"

#include <exception>
#include <optional>

namespace graphed::python {
namespace {

py::object location_part(const SafetyFinding& finding, py::object (*part)(const SourceFrame&)) {
  return finding.location ? part(*finding.location) : py::none();
}

py::object frame_file(const SourceFrame& frame) { return py::str(frame.file); }
py::object frame_line(const SourceFrame& frame) { return py::int_(frame.line); }
py::object frame_function(const SourceFrame& frame) { return py::str(frame.function); }

py::dict finding_to_dict(const SafetyFinding& finding) {
  py::dict out;
  out["kind"] = std::string(blocker_kind_name(finding.kind));
  out["label"] = std::string(finding.info().label);
  out["op"] = finding.op;
  out["inside"] = finding.inside;
  out["inputs"] = finding.inputs;
  out["detail"] = finding.detail;
  out["why"] = std::string(finding.info().why);
  out["fix"] = std::string(finding.info().fix);
  out["file"] = location_part(finding, frame_file);
  out["line"] = location_part(finding, frame_line);
  out["function"] = location_part(finding, frame_function);
  out["count"] = finding.count;
  out["predicted"] = finding.predicted;
  out["severity"] = std::string(severity_name(finding.severity));
  out["in_installed_package"] = finding.in_installed_package();
  return out;
}

py::dict report_to_dict(const SafetyReport& report) {
  py::list findings;
  for (const SafetyFinding& finding : report.findings()) {
    findings.append(finding_to_dict(finding));
  }
  py::list harmless;
  for (const SafetyFinding& finding : report.harmless()) {
    harmless.append(finding_to_dict(finding));
  }
  py::dict out;
  out["description"] = report.description();
  out["ran_on_gpu"] = report.ran_on_gpu();
  out["operators_observed"] = report.operators_observed();
  out["findings"] = std::move(findings);
  out["harmless"] = std::move(harmless);
  out["verdict"] = std::string(capture_verdict_name(capture_verdict(report)));
  return out;
}

SafetyReport check_python(py::object run_once, std::vector<at::Tensor> state,
                          std::string description) {
  SafetyCheckOptions options;
  options.state = std::move(state);
  options.description = std::move(description);
  const std::function<void()> call = wrap_procedure(std::move(run_once));
  const WarningsToPython warnings;
  py::gil_scoped_release no_gil;
  return check_safety(call, options);
}

// `with _C.quiet_operators():` around a host call recorded already.
class QuietOperators {
 public:
  void enter() { guard_.emplace(); }
  void exit() { guard_.reset(); }

 private:
  std::optional<QuietOperatorsGuard> guard_;
};

}  // namespace

void register_safety_check(py::module_& m) {
  py::class_<SafetyFinding>(m, "SafetyFinding",
                            "One operation that would break or spoil CUDA graph capture, at one "
                            "place in the user's code.")
      .def_property_readonly(
          "kind", [](const SafetyFinding& self) { return std::string(blocker_kind_name(self.kind)); },
          "What breaks capture: 'host_read', 'data_dependent_shape', 'explicit_sync', "
          "'host_device_copy', 'cpu_tensor', 'unregistered_generator', 'autocast_cache' or "
          "'other'.")
      .def_property_readonly(
          "label", [](const SafetyFinding& self) { return std::string(self.info().label); },
          "The kind for people, e.g. 'host read'.")
      .def_readonly("op", &SafetyFinding::op, "The operation, e.g. 'aten::item'.")
      .def_readonly("inside", &SafetyFinding::inside,
                    "The operator or autograd node it ran inside, or ''.")
      .def_readonly("inputs", &SafetyFinding::inputs, "Its tensor inputs.")
      .def_readonly("detail", &SafetyFinding::detail, "What exactly was seen, or ''.")
      .def_property_readonly(
          "why", [](const SafetyFinding& self) { return std::string(self.info().why); },
          "Why it breaks capture.")
      .def_property_readonly(
          "fix", [](const SafetyFinding& self) { return std::string(self.info().fix); },
          "What to change.")
      .def_property_readonly(
          "file", [](const SafetyFinding& self) { return location_part(self, frame_file); },
          "The user's source file, or None.")
      .def_property_readonly(
          "line", [](const SafetyFinding& self) { return location_part(self, frame_line); },
          "The line in `file`, or None.")
      .def_property_readonly(
          "function",
          [](const SafetyFinding& self) { return location_part(self, frame_function); },
          "The user's function, or None.")
      .def_property_readonly("where", &SafetyFinding::where, "'file:line in function', or ''.")
      .def_readonly("count", &SafetyFinding::count, "How many times it happened there.")
      .def_readonly("predicted", &SafetyFinding::predicted,
                    "True when seen on CPU tensors: it breaks capture once they live on the GPU.")
      .def_property_readonly(
          "severity",
          [](const SafetyFinding& self) { return std::string(severity_name(self.severity)); },
          "What it does to a capture: 'breaks_capture' (CUDA refuses it), 'spoils_replay' (a "
          "value is frozen into the graph) or 'harmless' (e.g. a copy of zero bytes).")
      .def_property_readonly("in_installed_package", &SafetyFinding::in_installed_package,
                             "True when it happened inside an installed package (transformers, "
                             "timm...) rather than your own code.")
      .def("to_dict", &finding_to_dict, "The finding as a JSON-ready dict.")
      .def("__repr__", [](const SafetyFinding& self) {
        return c10::str("<SafetyFinding ", blocker_kind_name(self.kind), " ", self.op,
                        self.location ? " at " + self.where() : "", " x", self.count, ">");
      });

  py::class_<SafetyReport>(m, "SafetyReport",
                           "What graphed.check found; true when anything would break capture. "
                           "str() gives the report for people, to_dict() the JSON form.")
      .def_property_readonly("description", &SafetyReport::description, "What was checked.")
      .def_property_readonly("findings", &SafetyReport::findings,
                             "The findings, in the order they first happened.")
      .def_property_readonly("harmless", &SafetyReport::harmless,
                             "Operations that look like blockers but affect no capture (copies "
                             "of zero bytes); not among findings.")
      .def_property_readonly(
          "verdict",
          [](const SafetyReport& self) {
            return std::string(capture_verdict_name(capture_verdict(self)));
          },
          "'clean', 'try_capture' (every finding inside installed packages such as transformers, "
          "which a capture may never meet; a trial capture decides) or 'blocked'.")
      .def_property_readonly("ran_on_gpu", &SafetyReport::ran_on_gpu,
                             "False for a pass on CPU tensors only, whose findings are "
                             "predictions.")
      .def_property_readonly("operators_observed", &SafetyReport::operators_observed,
                             "Operators the pass observed.")
      .def("to_dict", &report_to_dict, "The report as a JSON-ready dict.")
      .def("__str__", &SafetyReport::to_string)
      .def("__bool__", [](const SafetyReport& self) { return !self.empty(); })
      .def("__len__", [](const SafetyReport& self) { return self.findings().size(); })
      .def("__repr__", [](const SafetyReport& self) {
        return c10::str("<SafetyReport of ", self.description(), ": ", self.findings().size(),
                        " findings>");
      });

  m.def("check_safety", &check_python, py::arg("run_once"), py::arg("state"),
        py::arg("description"),
        "Run `run_once()` once under the safety check; `state` tensors and the default "
        "generators are restored afterwards.");
  m.def(
      "record_host_blocker",
      [](const std::string& kind, const std::string& call, const std::vector<at::Tensor>& tensors) {
        return record_host_blocker(blocker_kind_from_name(kind), call, tensors);
      },
      py::arg("kind"), py::arg("call"), py::arg("tensors"),
      "Record a host call that blocks capture into the running check; False when none runs.");
  m.def(
      "record_tensor_from_host_data",
      [](const std::string& call, const c10::Device& target, int64_t elements) {
        return record_tensor_from_host_data(call, target, elements);
      },
      py::arg("call"), py::arg("target"), py::arg("elements") = -1,
      "Record a tensor of `elements` elements (-1: unknown) built from host data for `target`; "
      "True when it recorded a finding.");
  m.def(
      "set_check_pass_wrapper",
      [](py::object wrapper) {
        if (wrapper.is_none()) {
          set_check_pass_wrapper({});
          return;
        }
        std::shared_ptr<py::object> held = share_object(std::move(wrapper));
        set_check_pass_wrapper([held](const std::function<void()>& pass) {
          // The pass's own exception (the user's, or graphed's) travels
          // around the Python wrapper untranslated.
          std::exception_ptr failure;
          {
            py::gil_scoped_acquire gil;
            (*held)(py::cpp_function([&pass, &failure] {
              const WarningsToPython warnings;
              py::gil_scoped_release no_gil;
              try {
                pass();
              } catch (...) {
                failure = std::current_exception();
              }
            }));
          }
          if (failure) {
            std::rethrow_exception(failure);
          }
        });
      },
      py::arg("wrapper"),
      "Install `wrapper(run)`, called around every check pass (it must call run() once); None "
      "removes it.");
  py::class_<QuietOperators>(m, "quiet_operators",
                             "Context manager: the running check ignores this thread's "
                             "operators (they belong to a host call recorded already).")
      .def(py::init<>())
      .def("__enter__", [](QuietOperators& self) { self.enter(); })
      .def("__exit__", [](QuietOperators& self, const py::args& /*exception*/) { self.exit(); });
}

}  // namespace graphed::python
