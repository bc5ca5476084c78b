// graphed._C: Decoder (graphed.generate, graphed.Decoder). Conversion only.

#include "graphed/check.h"
#include "graphed/decoder.h"
#include "python_values.h"
#include "registration.h"

#include <torch/csrc/Device.h>

namespace graphed::python {
namespace {

// The Python step is called with one tuple (input_ids, position_ids,
// attention_mask) and returns the logits.
DecodeStep wrap_decode_step(py::object step) {
  CapturableFunction call = wrap_single_argument_call(std::move(step));
  return [call](const DecodeInputs& inputs) {
    const c10::IValue args = c10::ivalue::Tuple::create(
        {inputs.input_ids, inputs.position_ids, inputs.attention_mask});
    return call({args}).toTensor();
  };
}

// The Python prefill is called with one tuple (input_ids, attention_mask or
// None, position_ids) and returns the logits.
PrefillStep wrap_prefill(py::object prefill) {
  CapturableFunction call = wrap_single_argument_call(std::move(prefill));
  return [call](const at::Tensor& input_ids, const at::Tensor& attention_mask,
                const at::Tensor& position_ids) {
    // An undefined mask (no left padding) reaches Python as None.
    const c10::IValue mask = attention_mask.defined() ? c10::IValue(attention_mask) : c10::IValue();
    const c10::IValue args = c10::ivalue::Tuple::create({input_ids, mask, position_ids});
    return call({args}).toTensor();
  };
}

TokenCallback wrap_token_callback(const py::object& callback) {
  if (callback.is_none()) {
    return {};
  }
  CapturableFunction call = wrap_single_argument_call(callback);
  return [call](const at::Tensor& tokens) { (void)call({tokens}); };
}

std::unique_ptr<Decoder> make_decoder(py::object step, py::object prefill, py::object reset,
                                      int64_t max_batch, int64_t max_len,
                                      std::vector<int64_t> buckets, bool do_sample,
                                      double temperature, int64_t top_k, double top_p,
                                      int64_t min_tokens_to_keep,
                                      std::vector<int64_t> eos_token_ids,
                                      std::optional<int64_t> pad_token_id, int64_t check_every,
                                      const py::object& memory_budget, int warmup,
                                      bool use_graphs, const std::string& capture_error_mode,
                                      const py::object& device, int64_t prefill_graphs,
                                      std::optional<int64_t> vocab_size) {
  GRAPHED_CHECK(THPDevice_Check(device.ptr()), "Expected device to be a torch.device, got ",
                py::repr(device).cast<std::string>(), ".");
  DecoderOptions options;
  options.max_batch = max_batch;
  options.max_len = max_len;
  options.batch_buckets = std::move(buckets);
  options.sampling = SamplingOptions{do_sample, temperature, top_k, top_p, min_tokens_to_keep};
  options.eos_token_ids = std::move(eos_token_ids);
  options.pad_token_id = pad_token_id;
  options.vocab_size = vocab_size;
  options.check_every = check_every;
  options.memory_budget_bytes = memory_budget_from_python(memory_budget);
  options.warmup_iters = warmup;
  options.prefill_graphs = prefill_graphs;
  options.use_graphs = use_graphs;
  options.error_mode = parse_capture_error_mode(capture_error_mode);
  options.reset_cache = wrap_procedure(std::move(reset));
  const c10::Device where = reinterpret_cast<THPDevice*>(device.ptr())->device;
  const WarningsToPython warnings;  // an eos id outside the vocabulary warns
  return std::make_unique<Decoder>(wrap_decode_step(std::move(step)),
                                   wrap_prefill(std::move(prefill)), std::move(options), where);
}

py::dict report_to_python(const BucketReport& report) {
  py::dict out;
  out["kind"] = std::string(graph_kind_name(report.kind));
  out["batch"] = report.batch;
  if (report.kind == GraphKind::kPrefill) {
    out["prompt_len"] = report.prompt_len;
    out["padded"] = report.padded;
  }
  out["captured"] = report.captured;
  out["graph_bytes"] = report.graph_bytes;
  out["capture_ms"] = report.capture_ms;
  out["warmup_ms"] = report.warmup_ms;
  out["kernels"] = report.kernels;
  out["replays"] = report.replays;
  out["evictions"] = report.evictions;
  return out;
}

}  // namespace

void register_decoder(py::module_& m) {
  m.def("default_batch_buckets", &default_batch_buckets, py::arg("max_batch"));
  m.def("prompt_positions", &prompt_positions, py::arg("attention_mask"));
  py::class_<Decoder>(m, "Decoder",
                      "Autoregressive decoding on one captured graph per batch bucket.")
      .def(py::init(&make_decoder), py::arg("step"), py::arg("prefill"), py::arg("reset"),
           py::arg("max_batch"), py::arg("max_len"), py::arg("buckets"), py::arg("do_sample"),
           py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
           py::arg("min_tokens_to_keep"), py::arg("eos_token_ids"), py::arg("pad_token_id"),
           py::arg("check_every"), py::arg("memory_budget"), py::arg("warmup"),
           py::arg("use_graphs"), py::arg("capture_error_mode"), py::arg("device"),
           py::arg("prefill_graphs") = 16, py::arg("vocab_size") = py::none())
      .def(
          "capture_all",
          [](Decoder& self, const py::object& on_captured) {
            Decoder::BucketCaptured callback;
            if (!on_captured.is_none()) {
              std::shared_ptr<py::object> held = share_object(on_captured);
              callback = [held](int64_t batch, size_t done, size_t total) {
                py::gil_scoped_acquire gil;
                (*held)(batch, done, total);
              };
            }
            const WarningsToPython warnings;
            py::gil_scoped_release no_gil;
            self.capture_all(callback);
          },
          py::arg("on_captured") = py::none(),
          "Captures every bucket, largest first; calls on_captured(batch, done, total) after "
          "each.")
      .def("check_request", &Decoder::check_request, py::arg("batch"), py::arg("prompt_len"),
           py::arg("max_new_tokens"), py::arg("min_new_tokens"))
      .def(
          "generate",
          [](Decoder& self, const at::Tensor& input_ids, const std::optional<at::Tensor>& mask,
             int64_t max_new_tokens, int64_t min_new_tokens, const py::object& callback) {
            const TokenCallback on_token = wrap_token_callback(callback);
            DecodeResult result;
            {
              const WarningsToPython warnings;
              py::gil_scoped_release no_gil;
              result = self.generate(input_ids, mask.value_or(at::Tensor()), max_new_tokens,
                                     min_new_tokens, on_token);
            }
            return py::make_tuple(result.tokens, result.steps, result.bucket);
          },
          py::arg("input_ids"), py::arg("attention_mask"), py::arg("max_new_tokens"),
          py::arg("min_new_tokens"), py::arg("callback"))
      .def("bucket_for", &Decoder::bucket_for, py::arg("batch"))
      .def_property_readonly("buckets", &Decoder::buckets)
      .def_property_readonly("max_batch", [](const Decoder& self) { return self.options().max_batch; })
      .def_property_readonly("max_len", [](const Decoder& self) { return self.options().max_len; })
      .def("pool_bytes", &Decoder::pool_bytes)
      .def("memory_report", [](const Decoder& self) {
        py::list out;
        for (const BucketReport& report : self.memory_report()) {
          out.append(report_to_python(report));
        }
        return out;
      });
}

}  // namespace graphed::python
