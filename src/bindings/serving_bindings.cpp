// graphed._C: RequestScheduler (graphed.generate_batch, graphed.Decoder.submit
// and run). Conversion only.

#include "graphed/check.h"
#include "graphed/decoder.h"
#include "graphed/request_scheduler.h"
#include "python_values.h"
#include "registration.h"

namespace graphed::python {
namespace {

// The Python slot prefill is called with one tuple (input_ids, slot) and
// returns the logits.
SlotPrefill wrap_slot_prefill(py::object prefill) {
  CapturableFunction call = wrap_single_argument_call(std::move(prefill));
  return [call](const at::Tensor& input_ids, int64_t slot) {
    const c10::IValue args = c10::ivalue::Tuple::create({input_ids, c10::IValue(slot)});
    return call({args}).toTensor();
  };
}

RequestTokensCallback wrap_request_callback(const py::object& callback) {
  if (callback.is_none()) {
    return {};
  }
  std::shared_ptr<py::object> held = share_object(callback);
  return [held](int64_t id, const std::vector<int64_t>& tokens, bool finished) {
    py::gil_scoped_acquire gil;
    (*held)(id, py::cast(tokens), finished);
  };
}

py::list finished_to_python(const std::vector<FinishedRequest>& finished) {
  py::list out;
  for (const FinishedRequest& request : finished) {
    out.append(py::make_tuple(request.id, py::cast(request.tokens), request.hit_eos));
  }
  return out;
}

py::dict stats_to_python(const SchedulerStats& stats) {
  py::dict out;
  out["submitted"] = stats.submitted;
  out["finished"] = stats.finished;
  out["prefills"] = stats.prefills;
  out["prefill_ms"] = stats.prefill_ms;
  out["decode_steps"] = stats.decode_steps;
  out["chunks"] = stats.chunks;
  out["live_row_steps"] = stats.live_row_steps;
  out["row_steps"] = stats.row_steps;
  out["host_waits"] = stats.host_waits;
  return out;
}

}  // namespace

void register_serving(py::module_& m) {
  py::class_<RequestScheduler>(m, "RequestScheduler",
                               "Continuous batching on a Decoder's decode graphs.")
      .def(py::init([](Decoder& decoder, py::object prefill, int64_t chunk_steps,
                       std::vector<int64_t> eos_token_ids, int64_t copies_in_flight,
                       int64_t prefills_per_round) {
             SchedulerOptions options;
             options.prefills_per_round = prefills_per_round;
             options.chunk_steps = chunk_steps;
             options.eos_token_ids = std::move(eos_token_ids);
             options.copies_in_flight = copies_in_flight;
             const WarningsToPython warnings;
             py::gil_scoped_release no_gil;
             return std::make_unique<RequestScheduler>(
                 decoder, wrap_slot_prefill(std::move(prefill)), std::move(options));
           }),
           py::arg("decoder"), py::arg("prefill"), py::arg("chunk_steps") = 8,
           py::arg("eos_token_ids") = std::vector<int64_t>{}, py::arg("copies_in_flight") = 3,
           py::arg("prefills_per_round") = 0,
           py::keep_alive<1, 2>())
      .def("submit", &RequestScheduler::submit, py::arg("prompt"), py::arg("max_new_tokens"))
      .def(
          "step",
          [](RequestScheduler& self, const py::object& callback) {
            const RequestTokensCallback on_tokens = wrap_request_callback(callback);
            std::vector<FinishedRequest> finished;
            {
              const WarningsToPython warnings;
              py::gil_scoped_release no_gil;
              finished = self.step(on_tokens);
            }
            return finished_to_python(finished);
          },
          py::arg("callback") = py::none())
      .def(
          "run",
          [](RequestScheduler& self, const py::object& callback) {
            const RequestTokensCallback on_tokens = wrap_request_callback(callback);
            std::vector<FinishedRequest> finished;
            {
              const WarningsToPython warnings;
              py::gil_scoped_release no_gil;
              finished = self.run(on_tokens);
            }
            return finished_to_python(finished);
          },
          py::arg("callback") = py::none())
      .def_property_readonly("idle", &RequestScheduler::idle)
      .def_property_readonly("waiting", &RequestScheduler::waiting)
      .def_property_readonly("slots", &RequestScheduler::slots)
      .def("stats", [](const RequestScheduler& self) { return stats_to_python(self.stats()); });
}

}  // namespace graphed::python
