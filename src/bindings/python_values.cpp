#include "python_values.h"

#include "graphed/check.h"
#include "graphed/memory_budget.h"

#include <torch/csrc/Device.h>
#include <torch/csrc/autograd/python_variable.h>

#include <frameobject.h>

#include <memory>
#include <optional>

namespace graphed::python {
namespace {

py::object structure_function(const char* name) {
  // Leaked on purpose: released at exit after the interpreter, it would crash.
  static auto* module = new py::object(py::module_::import("graphed._structure"));
  return module->attr(name);
}

// Holds a Python object inside an IValue. Takes the GIL to release it,
// since IValues are destroyed wherever their last owner is.
class HeldPythonObject final : public c10::ivalue::PyObjectHolder {
 public:
  explicit HeldPythonObject(py::handle object) : object_(object.ptr()) { Py_INCREF(object_); }
  ~HeldPythonObject() override {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      Py_DECREF(object_);
    }
  }
  PyObject* getPyObject() override { return object_; }
  c10::InferredType tryToInferType() override {
    return c10::InferredType(std::string("an opaque Python object"));
  }
  c10::IValue toIValue(const c10::TypePtr& /*type*/, std::optional<int32_t> /*n*/) override {
    TORCH_CHECK(false, "graphed cannot convert an opaque Python object to a typed value.");
  }
  std::string toStr() override {
    py::gil_scoped_acquire gil;
    return py::repr(object_).cast<std::string>();
  }
  // See Note [Host objects holding tensors] in src/signature.cpp: the
  // tensors the object holds, or one undefined tensor for a cache that holds
  // none yet (it will, once a layer appends to it).
  std::vector<at::Tensor> extractTensors() override {
    py::gil_scoped_acquire gil;
    const auto found =
        structure_function("stateful_tensors")(py::handle(object_)).cast<py::tuple>();
    std::vector<at::Tensor> tensors;
    for (py::handle tensor : found[0].cast<py::list>()) {
      tensors.push_back(THPVariable_Unpack(tensor.ptr()));
    }
    if (tensors.empty() && found[1].cast<bool>()) {
      tensors.emplace_back();
    }
    return tensors;
  }

 private:
  PyObject* object_;
};

}  // namespace

std::shared_ptr<py::object> share_object(py::object object) {
  return std::shared_ptr<py::object>(new py::object(std::move(object)), [](py::object* held) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete held;
    } else {
      (void)held->release();  // The interpreter is gone; leak rather than crash.
      delete held;
    }
  });
}

namespace {

c10::TypePtr dict_key_type(const py::dict& dict) {
  for (const auto& item : dict) {
    if (!PyUnicode_Check(item.first.ptr())) {
      return c10::AnyType::get();
    }
  }
  return c10::StringType::get();
}

std::vector<SourceFrame> frames_from_traceback(py::handle traceback,
                                               const std::vector<std::string>& roots);

std::vector<std::string>& library_roots() {
  static std::vector<std::string> roots;
  return roots;
}

bool is_library_file(const std::string& file, const std::vector<std::string>& roots) {
  if (file.empty() || file.front() == '<') {
    return true;  // <frozen ...>, <string>: not a place a user can edit.
  }
  for (const std::string& root : roots) {
    if (file.compare(0, root.size(), root) == 0) {
      return true;
    }
  }
  return false;
}

SourceFrame frame_of(PyFrameObject* frame, const std::vector<std::string>& roots) {
  SourceFrame result;
  PyCodeObject* code = PyFrame_GetCode(frame);
  result.file = py::str(code->co_filename).cast<std::string>();
  result.function = py::str(code->co_name).cast<std::string>();
  Py_DECREF(code);
  result.line = PyFrame_GetLineNumber(frame);
  result.is_user_code = !is_library_file(result.file, roots);
  result.is_installed_package = is_installed_package_file(result.file);
  return result;
}

std::vector<SourceFrame> frames_from_traceback(py::handle traceback,
                                               const std::vector<std::string>& roots) {
  std::vector<SourceFrame> frames;
  for (py::handle tb = traceback; tb && !tb.is_none(); tb = tb.attr("tb_next")) {
    auto* frame = reinterpret_cast<PyFrameObject*>(tb.attr("tb_frame").ptr());
    SourceFrame source = frame_of(frame, roots);
    source.line = tb.attr("tb_lineno").cast<int>();
    frames.push_back(std::move(source));
  }
  std::reverse(frames.begin(), frames.end());  // innermost first
  return frames;
}

class PythonLocator final : public SourceLocator {
 public:
  explicit PythonLocator(std::vector<std::string> roots) : roots_(std::move(roots)) {}

  std::vector<SourceFrame> current_stack() const override {
    std::vector<SourceFrame> frames;
    if (!Py_IsInitialized()) {
      return frames;
    }
    py::gil_scoped_acquire gil;
    PyFrameObject* frame = PyEval_GetFrame();  // borrowed
    Py_XINCREF(frame);
    for (int depth = 0; frame != nullptr && depth < kMaxDepth; ++depth) {
      frames.push_back(frame_of(frame, roots_));
      PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
      Py_DECREF(frame);
      frame = back;
    }
    Py_XDECREF(frame);
    return frames;
  }

 private:
  static constexpr int kMaxDepth = 64;
  std::vector<std::string> roots_;
};

// Note [Structured Python containers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// IValues know tuples, lists and dicts, not their Python subclasses: a named
// tuple, an OrderedDict, transformers' ModelOutput (which models return, and
// whose tensors a graph must own like any output). Such a value is converted
// to the pair (structure, children): the structure is an interned host
// object (graphed._structure.Structure: the type and context that
// torch.utils._pytree records), the children a tuple converted as usual, so
// that the core sees every tensor inside. Converting back rebuilds the
// original type around the new children. Types pytree does not know stay
// opaque objects, compared by identity.

bool is_structure(py::handle object) {
  static auto* type = new py::object(structure_function("Structure"));
  return py::isinstance(object, *type);
}

std::optional<c10::IValue> structured_to_ivalue(py::handle object) {
  const py::object flattened = structure_function("flatten")(object);
  if (flattened.is_none()) {
    return std::nullopt;
  }
  const auto pair = flattened.cast<py::tuple>();
  std::vector<c10::IValue> children;
  for (py::handle child : pair[1].cast<py::list>()) {
    children.push_back(to_ivalue(child));
  }
  c10::intrusive_ptr<c10::ivalue::PyObjectHolder> structure =
      c10::make_intrusive<HeldPythonObject>(pair[0]);
  return c10::ivalue::Tuple::create(
      {c10::IValue(std::move(structure)), c10::ivalue::Tuple::create(std::move(children))});
}

}  // namespace

c10::IValue to_ivalue(py::handle object) {
  PyObject* raw = object.ptr();
  if (THPVariable_Check(raw)) {
    return THPVariable_Unpack(raw);
  }
  if (raw == Py_None) {
    return c10::IValue();
  }
  if (PyBool_Check(raw)) {
    return raw == Py_True;
  }
  if (PyLong_CheckExact(raw)) {
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(raw, &overflow);
    if (overflow == 0) {
      return static_cast<int64_t>(value);
    }
  } else if (PyFloat_CheckExact(raw)) {
    return PyFloat_AS_DOUBLE(raw);
  } else if (PyUnicode_CheckExact(raw)) {
    return object.cast<std::string>();
  } else if (THPDevice_Check(raw)) {
    return reinterpret_cast<THPDevice*>(raw)->device;
  } else if (PyTuple_CheckExact(raw)) {
    std::vector<c10::IValue> elements;
    elements.reserve(PyTuple_GET_SIZE(raw));
    for (py::handle element : py::reinterpret_borrow<py::tuple>(object)) {
      elements.push_back(to_ivalue(element));
    }
    return c10::ivalue::Tuple::create(std::move(elements));
  } else if (PyList_CheckExact(raw)) {
    c10::impl::GenericList list(c10::AnyType::get());
    list.reserve(PyList_GET_SIZE(raw));
    for (py::handle element : py::reinterpret_borrow<py::list>(object)) {
      list.push_back(to_ivalue(element));
    }
    return list;
  } else if (PyDict_CheckExact(raw)) {
    const auto dict = py::reinterpret_borrow<py::dict>(object);
    c10::impl::GenericDict result(dict_key_type(dict), c10::AnyType::get());
    for (const auto& item : dict) {
      result.insert(to_ivalue(item.first), to_ivalue(item.second));
    }
    return result;
  }
  if (PyTuple_Check(raw) || PyList_Check(raw) || PyDict_Check(raw)) {
    if (std::optional<c10::IValue> structured = structured_to_ivalue(object)) {
      return std::move(*structured);
    }
  }
  c10::intrusive_ptr<c10::ivalue::PyObjectHolder> held =
      c10::make_intrusive<HeldPythonObject>(object);
  return c10::IValue(std::move(held));
}

py::object to_python(const c10::IValue& value) {
  if (value.isTensor()) {
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(value.toTensor()));
  }
  if (value.isNone()) {
    return py::none();
  }
  if (value.isBool()) {
    return py::bool_(value.toBool());
  }
  if (value.isInt()) {
    return py::int_(value.toInt());
  }
  if (value.isDouble()) {
    return py::float_(value.toDouble());
  }
  if (value.isString()) {
    return py::str(value.toStringRef());
  }
  if (value.isDevice()) {
    return py::reinterpret_steal<py::object>(THPDevice_New(value.toDevice()));
  }
  if (value.isTuple()) {
    const auto& elements = value.toTupleRef().elements();
    if (elements.size() == 2 && elements[0].isPyObject() && elements[1].isTuple()) {
      py::handle first = elements[0].toPyObjectHolder()->getPyObject();
      if (is_structure(first)) {  // See Note [Structured Python containers].
        return structure_function("unflatten")(first, to_python(elements[1]));
      }
    }
    py::tuple tuple(elements.size());
    for (size_t i = 0; i < elements.size(); ++i) {
      tuple[i] = to_python(elements[i]);
    }
    return std::move(tuple);
  }
  if (value.isList()) {
    py::list list;
    for (const c10::IValue& element : value.toListRef()) {
      list.append(to_python(element));
    }
    return std::move(list);
  }
  if (value.isGenericDict()) {
    py::dict dict;
    for (const auto& entry : value.toGenericDict()) {
      dict[to_python(entry.key())] = to_python(entry.value());
    }
    return std::move(dict);
  }
  if (value.isPyObject()) {
    return py::reinterpret_borrow<py::object>(value.toPyObjectHolder()->getPyObject());
  }
  TORCH_CHECK(false, "graphed cannot give Python a value of kind ", value.tagKind());
}

// Calls `call()` with the GIL held and converts its result; a Python error
// leaves its traceback's frames for the core's message and propagates as is.
template <typename Call>
c10::IValue call_python(Call&& call) {
  py::gil_scoped_acquire gil;
  try {
    return to_ivalue(call());
  } catch (py::error_already_set& error) {
    note_exception_stack(frames_from_traceback(error.trace(), library_roots()));
    throw;
  }
}

CapturableFunction wrap_call(py::object function) {
  std::shared_ptr<py::object> held = share_object(std::move(function));
  return [held](const std::vector<c10::IValue>& inputs) -> c10::IValue {
    return call_python([&] {
      const py::object args = to_python(inputs.at(0));
      const py::object kwargs = to_python(inputs.at(1));
      return (*held)(*args, **kwargs);
    });
  };
}

CapturableFunction wrap_single_argument_call(py::object function) {
  std::shared_ptr<py::object> held = share_object(std::move(function));
  return [held](const std::vector<c10::IValue>& inputs) -> c10::IValue {
    return call_python([&] { return (*held)(to_python(inputs.at(0))); });
  };
}

std::function<void()> wrap_procedure(py::object function) {
  std::shared_ptr<py::object> held = share_object(std::move(function));
  return [held]() {
    py::gil_scoped_acquire gil;
    (*held)();
  };
}

std::function<std::vector<at::Tensor>()> read_tensors_of(const py::list& tensor_dicts) {
  for (const py::handle dict : tensor_dicts) {
    GRAPHED_CHECK(PyDict_Check(dict.ptr()), "Expected a list of dicts of tensors (modules' "
                  "_parameters and _buffers), got an element of type ",
                  Py_TYPE(dict.ptr())->tp_name, ". Pass [m._parameters for m in "
                  "module.modules()].");
  }
  // A copy of the list (of the dicts themselves), released with the GIL.
  std::shared_ptr<py::object> held = share_object(py::list(tensor_dicts));
  return [held]() {
    py::gil_scoped_acquire gil;
    std::vector<at::Tensor> tensors;
    for (const py::handle dict : py::reinterpret_borrow<py::list>(*held)) {
      PyObject* key = nullptr;
      PyObject* value = nullptr;
      Py_ssize_t position = 0;
      while (PyDict_Next(dict.ptr(), &position, &key, &value)) {
        if (THPVariable_Check(value)) {
          tensors.push_back(THPVariable_Unpack(value));
        }
      }
    }
    return tensors;
  };
}

CaptureGuard wrap_guard(std::string name, py::object read) {
  std::shared_ptr<py::object> held = share_object(std::move(read));
  return CaptureGuard{std::move(name), [held]() -> c10::IValue {
                        py::gil_scoped_acquire gil;
                        return to_ivalue((*held)());
                      }};
}

py::tuple pool_to_python(const PoolId& pool) { return py::make_tuple(pool.first, pool.second); }

std::optional<PoolId> pool_from_python(const py::object& pool) {
  if (pool.is_none()) {
    return std::nullopt;
  }
  const auto pair = pool.cast<std::pair<c10::CaptureId_t, c10::CaptureId_t>>();
  return PoolId{pair.first, pair.second};
}

py::dict graph_stats_to_python(const GraphStats& stats) {
  py::dict out;
  out["nodes"] = stats.nodes;
  out["kernels"] = stats.kernels;
  out["memcpys"] = stats.memcpys;
  out["memsets"] = stats.memsets;
  out["other_nodes"] = stats.other_nodes;
  out["pool_reserved_bytes"] = stats.pool_reserved_bytes;
  out["pool_allocated_bytes"] = stats.pool_allocated_bytes;
  out["capture_ms"] = stats.capture_ms;
  return out;
}

void install_python_locator(std::vector<std::string> roots) {
  library_roots() = roots;
  set_source_locator(std::make_shared<PythonLocator>(std::move(roots)));
}

std::optional<int64_t> memory_budget_from_python(const py::object& budget) {
  if (budget.is_none()) {
    return std::nullopt;
  }
  if (py::isinstance<py::str>(budget)) {
    return parse_memory_size(budget.cast<std::string>());
  }
  GRAPHED_CHECK(py::isinstance<py::int_>(budget) && !py::isinstance<py::bool_>(budget),
                "Expected memory_budget to be None, a number of bytes or a size such as "
                "\"2GiB\", got ", py::repr(budget).cast<std::string>(), ".");
  const int64_t bytes = budget.cast<int64_t>();
  GRAPHED_CHECK(bytes >= 1, "Expected a memory budget of at least one byte, got ", bytes,
                ". Pass a positive size such as \"2GiB\", or None for no budget.");
  return bytes;
}

}  // namespace graphed::python
