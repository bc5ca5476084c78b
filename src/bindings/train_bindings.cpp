// graphed._C: TrainStep, TrainingIteration, GradientGuard and the capturable optimizers.
// Conversion only.

#include "graphed/check.h"
#include "graphed/grad_guard.h"
#include "graphed/optim.h"
#include "graphed/train_step.h"
#include "graphed/training_iteration.h"
#include "python_values.h"
#include "registration.h"

#include <torch/csrc/Exceptions.h>

namespace graphed::python {
namespace {

std::shared_ptr<TrainStep> make_train_step(py::object step, const py::object& sample_batch,
                                           int warmup, const py::object& pool,
                                           const std::string& capture_error_mode,
                                           std::vector<at::Tensor> state, bool clone_loss,
                                           std::string description,
                                           std::optional<std::vector<at::Tensor>> collective_params,
                                           std::string collective_issuer,
                                           const py::object& tensor_dicts) {
  TrainStepOptions options;
  if (!tensor_dicts.is_none()) {
    options.read_parameters = read_tensors_of(tensor_dicts.cast<py::list>());
  }
  options.warmup_iters = warmup;
  options.pool = pool_from_python(pool);
  options.error_mode = parse_capture_error_mode(capture_error_mode);
  options.state = std::move(state);
  options.clone_loss = clone_loss;
  options.description = std::move(description);
  if (collective_params) {
    options.collectives = CollectiveCapture{std::move(collective_issuer),
                                            std::move(*collective_params)};
  }
  std::vector<c10::IValue> sample{to_ivalue(sample_batch)};
  TrainStepFunction call = wrap_single_argument_call(std::move(step));
  const WarningsToPython warnings;
  py::gil_scoped_release no_gil;
  return std::make_shared<TrainStep>(std::move(call), std::move(sample), std::move(options));
}

// Python's split(batch, microbatches) -> a list of microbatches, as the core's
// MicrobatchSplit: the batch is one value, and so is each microbatch.
MicrobatchSplit wrap_split(py::object split) {
  CapturableFunction call = wrap_call(std::move(split));
  return [call](const std::vector<c10::IValue>& batch, int microbatches) {
    const c10::IValue parts =
        call({c10::ivalue::Tuple::create({batch.at(0), c10::IValue(microbatches)}),
              c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get())});
    GRAPHED_CHECK(parts.isList() || parts.isTuple(), "Expected the split of a batch to return "
                  "a list of microbatches, got ", parts.tagKind(), ". Return one value per "
                  "microbatch, as graphed.train.split_batch does.");
    std::vector<std::vector<c10::IValue>> result;
    for (const c10::IValue& part : parts.isList() ? parts.toListRef()
                                                  : parts.toTupleRef().elements()) {
      result.push_back({part});
    }
    return result;
  };
}

// Python's step(found_inf) with found_inf a tensor or None.
std::function<void(const at::Tensor&)> wrap_step(py::object step) {
  CapturableFunction call = wrap_single_argument_call(std::move(step));
  return [call](const at::Tensor& found_inf) {
    (void)call({found_inf.defined() ? c10::IValue(found_inf) : c10::IValue()});
  };
}

std::shared_ptr<TrainingIteration> make_training_iteration(
    py::object loss, py::object split, py::object zero_grad, py::object step,
    std::vector<at::Tensor> params, std::vector<at::Tensor> buffers, int microbatches,
    bool skip_nonfinite, std::optional<double> clip_grad_norm,
    std::optional<LossScaling> loss_scaling, std::optional<at::ScalarType> autocast) {
  TrainingIterationParts parts;
  parts.loss = wrap_single_argument_call(std::move(loss));
  parts.split = wrap_split(std::move(split));
  parts.zero_grad = wrap_procedure(std::move(zero_grad));
  parts.step = wrap_step(std::move(step));
  parts.params = std::move(params);
  parts.buffers = std::move(buffers);
  parts.microbatches = microbatches;
  parts.guard = GradientGuardOptions{skip_nonfinite, clip_grad_norm, loss_scaling};
  parts.autocast = autocast;
  return std::make_shared<TrainingIteration>(std::move(parts));
}

}  // namespace

void register_training(py::module_& m) {
  py::class_<TrainStep, std::shared_ptr<TrainStep>>(
      m, "TrainStep", "A whole training iteration captured as one CUDA graph.")
      .def(py::init(&make_train_step), py::arg("step"), py::arg("sample_batch"),
           py::arg("warmup"), py::arg("pool"), py::arg("capture_error_mode"), py::arg("state"),
           py::arg("clone_loss"), py::arg("description"), py::arg("collective_params") = py::none(),
           py::arg("collective_issuer") = "DistributedDataParallel",
           py::arg("tensor_dicts") = py::none())
      .def(
          "step",
          [](TrainStep& self, const py::object& batch) {
            const std::vector<c10::IValue> inputs{to_ivalue(batch)};
            at::Tensor loss;
            {
              const WarningsToPython warnings;
              py::gil_scoped_release no_gil;
              loss = self.step(inputs);
            }
            return loss;
          },
          py::arg("batch"))
      .def(
          "capture_eval",
          [](TrainStep& self, py::object fn, const py::tuple& args, const py::dict& kwargs,
             int warmup) {
            std::vector<c10::IValue> sample{to_ivalue(args), to_ivalue(kwargs)};
            CapturableFunction call = wrap_call(std::move(fn));
            const WarningsToPython warnings;
            py::gil_scoped_release no_gil;
            self.capture_eval(std::move(call), std::move(sample), warmup);
          },
          py::arg("fn"), py::arg("args"), py::arg("kwargs"), py::arg("warmup"))
      .def("evaluate",
           [](TrainStep& self, const py::args& args, const py::kwargs& kwargs) {
             const std::vector<c10::IValue> inputs{to_ivalue(args), to_ivalue(kwargs)};
             c10::IValue outputs;
             {
               const WarningsToPython warnings;
               py::gil_scoped_release no_gil;
               outputs = self.evaluate(inputs);
             }
             return to_python(outputs);
           })
      .def("release",
           [](TrainStep& self) {
             const WarningsToPython warnings;
             py::gil_scoped_release no_gil;
             self.release();
           })
      .def_property_readonly("released", &TrainStep::released)
      .def_property_readonly("has_eval", &TrainStep::has_eval)
      .def_property_readonly("steps", &TrainStep::steps)
      .def_property_readonly(
          "static_batch",
          [](const TrainStep& self) { return self.train_graph().static_inputs(); },
          "The static batch buffers; a batch made of them is not copied.")
      .def("graph_stats", [](const TrainStep& self) {
        py::dict out = graph_stats_to_python(self.train_graph().graph().stats());
        out["warmup_ms"] = self.train_graph().stats().warmup_ms;
        out["pool"] = pool_to_python(self.train_graph().graph().pool());
        return out;
      });

  py::class_<LossScaling>(m, "LossScaling",
                          "Dynamic fp16 loss scaling as torch.amp.GradScaler does it, on the "
                          "device: pass to TrainStep.from_parts(loss_scaling=...).")
      .def(py::init([](double init_scale, double growth_factor, double backoff_factor,
                       int64_t growth_interval) {
             return LossScaling{init_scale, growth_factor, backoff_factor, growth_interval};
           }),
           py::arg("init_scale") = 65536.0, py::arg("growth_factor") = 2.0,
           py::arg("backoff_factor") = 0.5, py::arg("growth_interval") = 2000);

  py::class_<GradientGuard, std::shared_ptr<GradientGuard>>(
      m, "GradientGuard",
      "Loss scaling, non-finite check, clipping and skip counting on the device.")
      .def(py::init([](const c10::Device& device, bool skip_nonfinite,
                       std::optional<double> clip_grad_norm,
                       std::optional<LossScaling> loss_scaling) {
             return std::make_shared<GradientGuard>(
                 device, GradientGuardOptions{skip_nonfinite, clip_grad_norm, loss_scaling});
           }),
           py::arg("device"), py::arg("skip_nonfinite"), py::arg("clip_grad_norm"),
           py::arg("loss_scaling"))
      .def("scale_loss", &GradientGuard::scale_loss)
      .def("process", &GradientGuard::process, py::arg("loss"), py::arg("grads"))
      .def("after_step", &GradientGuard::after_step)
      .def("protect_buffers", &GradientGuard::protect_buffers, py::arg("buffers"),
           "Buffers a skipped step must leave as they were (BatchNorm statistics).")
      .def("begin_step", &GradientGuard::begin_step,
           "Snapshots the protected buffers; call before the forward of each iteration.")
      .def_property_readonly("protected_buffers", &GradientGuard::protected_buffers)
      .def_property_readonly("can_skip", &GradientGuard::can_skip)
      .def_property_readonly("skipped_steps", &GradientGuard::skipped_steps)
      .def_property_readonly("loss_scale", &GradientGuard::loss_scale)
      .def_property_readonly("grad_norm", &GradientGuard::grad_norm)
      .def("state", &GradientGuard::state);

  py::class_<TrainingIteration, std::shared_ptr<TrainingIteration>>(
      m, "TrainingIteration",
      "The usual training iteration, whose order of operations lives in the C++ core (Note [One "
      "training iteration] in include/graphed/training_iteration.h), built from Python pieces: "
      "loss(microbatch) (forward and loss), split(batch, microbatches), zero_grad(), "
      "step(found_inf) (found_inf a device flag or None), the parameters and the buffers a "
      "skipped step puts back. Calling it runs one iteration on a batch and returns the summed "
      "microbatch losses.")
      .def(py::init(&make_training_iteration), py::kw_only(), py::arg("loss"), py::arg("split"),
           py::arg("zero_grad"), py::arg("step"), py::arg("params"), py::arg("buffers"),
           py::arg("microbatches"), py::arg("skip_nonfinite"), py::arg("clip_grad_norm"),
           py::arg("loss_scaling"), py::arg("autocast"))
      .def(
          "__call__",
          [](TrainingIteration& self, const py::object& batch) {
            const std::vector<c10::IValue> values{to_ivalue(batch)};
            at::Tensor loss;
            try {
              // Backward runs in here: Note [One training iteration] says why
              // the GIL must be released.
              const WarningsToPython warnings;
              py::gil_scoped_release no_gil;
              loss = self(values);
            } catch (python_error& error) {
              // Raised in a Python autograd node during backward: give Python
              // its exception back, as Tensor.backward() would.
              error.restore();
              throw py::error_already_set();
            }
            return loss;
          },
          py::arg("batch"), "Runs one iteration on `batch` and returns the loss.")
      .def_property_readonly("guard", &TrainingIteration::guard,
                             "The iteration's GradientGuard.")
      .def_property_readonly("microbatches", &TrainingIteration::microbatches,
                             "Microbatches per iteration.");

  m.def("clip_grad_norm", &clip_grad_norm, py::arg("grads"), py::arg("max_norm"));
  m.attr("COLLECTIVE_WARMUP_ITERS") = kCollectiveWarmupIters;
}

}  // namespace graphed::python
