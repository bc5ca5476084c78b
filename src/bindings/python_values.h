#pragma once

// Conversion between Python objects and the core's values: nested tuples,
// lists and dicts of tensors and constants become c10::IValue trees, Python
// callables become core functions, and Python stacks become SourceFrames.
// Conversion only: no decisions are made here.

#include "graphed/capture.h"
#include "graphed/source_location.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace graphed::python {

namespace py = pybind11;

// Note [Warnings of the core reach Python]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The core warns with TORCH_WARN (cleanup that failed after another failure,
// an operator the safety check could not inspect). c10 hands a warning to
// the calling thread's warning handler; torch's own bindings install
// torch::PyWarningHandler around each call, which turns the warnings into
// Python warnings when the call returns, but plain pybind11 functions get
// c10's default handler, which prints to stderr where Python's `warnings`
// filters (and pytest) never see it. So every binding that enters the core
// with the GIL released holds a WarningsToPython over the call: warnings are
// buffered while the core runs and issued as Python warnings (UserWarning)
// once the GIL is back. When the call fails, the warnings are issued and the
// exception goes on (torch's handler must then not raise itself).
class WarningsToPython {
 public:
  WarningsToPython() = default;
  WarningsToPython(const WarningsToPython&) = delete;
  WarningsToPython& operator=(const WarningsToPython&) = delete;
  // NOLINTNEXTLINE(bugprone-exception-escape): raises what a warnings filter raises
  ~WarningsToPython() noexcept(false) {
    if (std::uncaught_exceptions() > exceptions_) {
      handler_.set_in_exception();
    }
  }

 private:
  int exceptions_ = std::uncaught_exceptions();
  torch::PyWarningHandler handler_;
};

// A Python value as an IValue: tensors, None, bool, int, float, str and
// torch.device map to IValue kinds; exact tuples, lists and dicts become
// containers; any other object is held opaquely and compared by identity.
c10::IValue to_ivalue(py::handle object);

// The inverse of to_ivalue.
py::object to_python(const c10::IValue& value);

// A Python object owned from C++ code that may run without the GIL: released
// with the GIL taken, and leaked rather than released after the interpreter
// has finalized.
std::shared_ptr<py::object> share_object(py::object object);

// A core function that calls `function(*inputs[0], **inputs[1])` with the GIL
// held. When Python raises, it records the traceback's frames
// (note_exception_stack) and lets the Python exception propagate unchanged.
CapturableFunction wrap_call(py::object function);

// A core function that calls `function(inputs[0])` with the GIL held, for
// functions of one value (a training step of a batch); errors as wrap_call.
CapturableFunction wrap_single_argument_call(py::object function);
// A core procedure that calls `function()` with the GIL held. A Python
// exception propagates unchanged.
std::function<void()> wrap_procedure(py::object function);

// The tensors of a module as a list walked from its `_parameters` (and
// `_buffers`) dicts, given once, at graphing, for the check that they did not
// change (Note [Tensors a graph reads in place]). Walking the dicts from C++
// costs far less than module.parameters() per call.
std::function<std::vector<at::Tensor>()> read_tensors_of(const py::list& tensor_dicts);

// A core guard reading `read()` with the GIL held.
CaptureGuard wrap_guard(std::string name, py::object read);

// A pool handle as Python sees it, a (int, int) tuple; None means no pool.
py::tuple pool_to_python(const PoolId& pool);
std::optional<PoolId> pool_from_python(const py::object& pool);

// A memory budget as graphed.auto and graphed.Decoder take it: None, a
// number of bytes, or a size such as "2GiB" (parse_memory_size).
std::optional<int64_t> memory_budget_from_python(const py::object& budget);

// A graph's statistics as a dict.
py::dict graph_stats_to_python(const GraphStats& stats);

// Installs a SourceLocator that walks the Python stack; frames in files under
// any of `library_roots` count as library code, the rest as user code.
void install_python_locator(std::vector<std::string> library_roots);

}  // namespace graphed::python
