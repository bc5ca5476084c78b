// graphed._C: the Python face of libgraphed. Conversion only; every decision
// lives in the core.

#include "graphed/graphed.h"
#include "python_values.h"
#include "registration.h"

#include <c10/cuda/CUDAFunctions.h>

namespace py = pybind11;

namespace graphed::python {
namespace {

struct ErrorTypes {
  py::object base;
  py::object capture;
  py::object input_mismatch;
};

ErrorTypes& error_types() {
  static ErrorTypes types;
  return types;
}

void register_errors(py::module_& m) {
  ErrorTypes& types = error_types();
  types.base = py::reinterpret_steal<py::object>(
      PyErr_NewExceptionWithDoc("graphed.GraphedError",
                                "An error raised by graphed: the message says what was expected, "
                                "what was found and how to fix it.",
                                PyExc_RuntimeError, nullptr));
  types.capture = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "graphed.CaptureError",
      "Capturing a CUDA graph failed; the message names the operation that broke capture.",
      types.base.ptr(), nullptr));
  const py::tuple mismatch_bases = py::make_tuple(types.base, py::handle(PyExc_ValueError));
  types.input_mismatch = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "graphed.InputMismatchError",
      "A call's inputs differ from those the graph was captured with; the message lists each "
      "difference.",
      mismatch_bases.ptr(), nullptr));
  m.attr("GraphedError") = types.base;
  m.attr("CaptureError") = types.capture;
  m.attr("InputMismatchError") = types.input_mismatch;

  py::register_local_exception_translator([](std::exception_ptr pointer) {
    try {
      std::rethrow_exception(pointer);
    } catch (const InputMismatchError& error) {
      PyErr_SetString(error_types().input_mismatch.ptr(), error.what_without_backtrace());
    } catch (const CaptureError& error) {
      PyErr_SetString(error_types().capture.ptr(), error.what_without_backtrace());
    } catch (const Error& error) {
      PyErr_SetString(error_types().base.ptr(), error.what_without_backtrace());
    } catch (const c10::OutOfMemoryError& error) {
      PyErr_SetString(PyExc_MemoryError, error.what_without_backtrace());
    } catch (const c10::ValueError& error) {
      PyErr_SetString(PyExc_ValueError, error.what_without_backtrace());
    } catch (const c10::TypeError& error) {
      PyErr_SetString(PyExc_TypeError, error.what_without_backtrace());
    } catch (const c10::Error& error) {
      PyErr_SetString(PyExc_RuntimeError, error.what_without_backtrace());
    }
  });
}

std::shared_ptr<CapturedFunction> capture_python(
    py::object function, const py::tuple& args, const py::dict& kwargs, int warmup,
    const py::object& pool, const std::string& capture_error_mode, bool clone_outputs,
    std::vector<at::Tensor> state, const std::vector<std::pair<std::string, py::object>>& guards,
    std::string description, const std::string& input_update, const py::object& tensor_dicts) {
  CaptureOptions options;
  if (!tensor_dicts.is_none()) {
    options.read_parameters = read_tensors_of(tensor_dicts.cast<py::list>());
  }
  options.input_update = parse_input_update(input_update);
  options.warmup_iters = warmup;
  options.pool = pool_from_python(pool);
  options.error_mode = parse_capture_error_mode(capture_error_mode);
  options.clone_outputs = clone_outputs;
  options.input_names = {"args", "kwargs"};
  options.state = std::move(state);
  for (const auto& [name, read] : guards) {
    options.guards.push_back(wrap_guard(name, read));
  }
  options.description = std::move(description);
  std::vector<c10::IValue> sample{to_ivalue(args), to_ivalue(kwargs)};
  CapturableFunction call = wrap_call(std::move(function));
  const WarningsToPython warnings;
  py::gil_scoped_release no_gil;
  return std::make_shared<CapturedFunction>(
      capture(std::move(call), std::move(sample), std::move(options)));
}

py::object call_captured(CapturedFunction& self, const py::args& args, const py::kwargs& kwargs) {
  const std::vector<c10::IValue> inputs{to_ivalue(args), to_ivalue(kwargs)};
  c10::IValue outputs;
  {
    const WarningsToPython warnings;
    py::gil_scoped_release no_gil;
    outputs = self(inputs);
  }
  return to_python(outputs);
}

}  // namespace
}  // namespace graphed::python

PYBIND11_MODULE(_C, m) {
  using namespace graphed;
  using namespace graphed::python;
  m.doc() = "graphed's C++ core (libgraphed) for Python: conversion only.";
  register_errors(m);
  register_training(m);
  register_safety_check(m);
  register_graphed_callables(m);
  register_advice(m);
  register_auto(m);
  register_decoder(m);
  register_serving(m);
  register_fp8(m);
  register_moe(m);
  register_state_space(m);

  m.def("install_source_locator", &install_python_locator, py::arg("library_roots"),
        "Point capture-failure messages at user code: frames under these roots are library code.");
  m.def("cuda_device_count", [] { return static_cast<int>(c10::cuda::device_count()); });
  m.def(
      "build_info",
      [] {
        py::dict info;
        info["version"] = GRAPHED_VERSION_STRING;
        info["torch"] = GRAPHED_BUILT_WITH_TORCH;
        info["cuda"] = GRAPHED_BUILT_WITH_CUDA;
        info["nvtx"] = nvtx_available();
        return info;
      },
      "What this build of graphed is: its version, the torch and CUDA toolkit versions it was "
      "built with, and whether it emits NVTX ranges.");
  m.def("set_nvtx", &set_nvtx_enabled, py::arg("enabled"),
        "Switches graphed's NVTX ranges on or off for the process; returns the previous "
        "setting.");
  m.def("nvtx_enabled", &nvtx_enabled,
        "True when graphed emits NVTX ranges (built with NVTX and switched on).");
  m.def(
      "_convert", [](py::handle value) { return to_python(to_ivalue(value)); }, py::arg("value"),
      "`value` converted to the core's form and back, as every call's inputs and outputs are "
      "(for tests).");
  m.def(
      "stateful_host_object",
      [](py::handle args, py::handle kwargs) -> py::object {
        const std::optional<std::string> found =
            find_stateful_host_object({to_ivalue(args), to_ivalue(kwargs)}, {"args", "kwargs"});
        return found ? py::object(py::str(*found)) : py::object(py::none());
      },
      py::arg("args"), py::arg("kwargs"),
      "Where (args, kwargs) hold a host object with tensors or a key/value cache, or None.");
  m.def(
      "capture_stream_handle",
      [](int device) {
        return reinterpret_cast<intptr_t>(
            capture_stream(static_cast<c10::DeviceIndex>(device)).stream());
      },
      py::arg("device"),
      "The cudaStream_t (as an int) graphed warms up and captures on for `device`.");
  m.def("graph_pool_handle", [] { return pool_to_python(new_pool()); },
        "A pool handle that several captures can share (replay them in capture order).");
  m.def("capture", &capture_python, py::arg("function"), py::arg("args"), py::arg("kwargs"),
        py::arg("warmup"), py::arg("pool"), py::arg("capture_error_mode"),
        py::arg("clone_outputs"), py::arg("state"), py::arg("guards"), py::arg("description"),
        py::arg("input_update") = "copy", py::arg("tensor_dicts") = py::none());

  py::class_<CapturedFunction, std::shared_ptr<CapturedFunction>>(
      m, "CapturedFunction",
      "A function captured as a CUDA graph; calling it replays the graph on the current stream. "
      "Outputs are overwritten by the next call unless captured with clone_outputs=True.")
      .def("__call__", &call_captured)
      .def_property_readonly(
          "static_inputs", [](const CapturedFunction& self) { return self.static_inputs(); },
          "The static input buffers; pass them back (after writing into them) to skip copies.")
      .def_property_readonly(
          "static_outputs",
          [](const CapturedFunction& self) { return to_python(self.static_outputs()); },
          "The outputs as the last replay left them.")
      .def_property_readonly(
          "pool", [](const CapturedFunction& self) { return pool_to_python(self.graph().pool()); },
          "The memory pool handle; pass it as pool= to share memory with a later capture.")
      .def_property_readonly(
          "signature", [](const CapturedFunction& self) { return self.signature().describe(); },
          "What each input must look like.")
      .def_property_readonly(
          "mutated_inputs",
          [](const CapturedFunction& self) {
            std::vector<std::string> paths;
            for (size_t index : self.mutated_inputs()) {
              paths.push_back(self.signature().tensor_path(index));
            }
            return paths;
          },
          "Inputs the function writes in place; they are copied back after each call.")
      .def(
          "stats",
          [](const CapturedFunction& self) {
            py::dict out = graph_stats_to_python(self.graph().stats());
            out["replays"] = self.stats().replays;
            out["input_copies"] = self.stats().input_copies;
            out["input_repoints"] = self.stats().input_repoints;
            out["repointable_inputs"] = self.stats().repointable_inputs;
            out["warmup_ms"] = self.stats().warmup_ms;
            return out;
          },
          "Node and kernel counts, pool memory, capture and warm-up time, call counters.")
      .def(
          "dot",
          [](const CapturedFunction& self, const std::optional<std::string>& path) -> py::object {
            if (path) {
              self.graph().write_dot(*path);
              return py::none();
            }
            return py::str(self.graph().dot());
          },
          py::arg("path") = py::none(),
          "The graph in Graphviz DOT form; written to `path` when given, else returned.");
}
