// graphed._C: the fused decode-step kernels of Mamba2-family layers, of
// RMSNorms (python/graphed/_state_space_kernels.py, _decode_norms.py) and of
// the rotary embedding (_decode_rotary.py). Conversion only.

#include "graphed/rms_norm_ops.h"
#include "graphed/rotary_ops.h"
#include "graphed/state_space_ops.h"
#include "registration.h"

#include <optional>

namespace py = pybind11;

namespace graphed::python {
namespace {

at::Tensor or_undefined(const std::optional<at::Tensor>& t) {
  return t ? *t : at::Tensor();
}

}  // namespace

void register_state_space(py::module_& m) {
  m.def(
      "try_selective_state_update",
      [](const at::Tensor& state, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
         const at::Tensor& B, const at::Tensor& C, const std::optional<at::Tensor>& D,
         const std::optional<at::Tensor>& dt_bias, bool dt_softplus) -> py::object {
        const at::Tensor d = or_undefined(D), bias = or_undefined(dt_bias);
        if (selective_state_update_refusal(state, x, dt, A, B, C, d, bias)) {
          return py::none();
        }
        return py::cast(selective_state_update(state, x, dt, A, B, C, d, bias, dt_softplus));
      },
      py::arg("state"), py::arg("x"), py::arg("dt"), py::arg("A"), py::arg("B"), py::arg("C"),
      py::arg("D") = py::none(), py::arg("dt_bias") = py::none(),
      py::arg("dt_softplus") = false,
      "transformers' mamba2_selective_state_update (z None) in three kernels, bitwise its "
      "result; None (nothing run) for arguments the fused kernels do not take.");
  m.def(
      "selective_state_update_refusal",
      [](const at::Tensor& state, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
         const at::Tensor& B, const at::Tensor& C, const std::optional<at::Tensor>& D,
         const std::optional<at::Tensor>& dt_bias) {
        return selective_state_update_refusal(state, x, dt, A, B, C, or_undefined(D),
                                              or_undefined(dt_bias));
      },
      py::arg("state"), py::arg("x"), py::arg("dt"), py::arg("A"), py::arg("B"), py::arg("C"),
      py::arg("D") = py::none(), py::arg("dt_bias") = py::none(),
      "Why try_selective_state_update would return None for these arguments, or None.");
  m.def(
      "try_causal_conv1d_update",
      [](const at::Tensor& x, const at::Tensor& conv_state, const at::Tensor& weight,
         const std::optional<at::Tensor>& bias, bool silu) -> py::object {
        const at::Tensor b = or_undefined(bias);
        if (causal_conv1d_update_refusal(x, conv_state, weight, b)) {
          return py::none();
        }
        return py::cast(causal_conv1d_update(x, conv_state, weight, b, silu));
      },
      py::arg("x"), py::arg("conv_state"), py::arg("weight"), py::arg("bias") = py::none(),
      py::arg("silu") = false,
      "transformers' causal_conv1d_update in one kernel, bitwise its result; None (nothing "
      "run) for arguments the fused kernel does not take.");
  m.def(
      "causal_conv1d_update_refusal",
      [](const at::Tensor& x, const at::Tensor& conv_state, const at::Tensor& weight,
         const std::optional<at::Tensor>& bias) {
        return causal_conv1d_update_refusal(x, conv_state, weight, or_undefined(bias));
      },
      py::arg("x"), py::arg("conv_state"), py::arg("weight"), py::arg("bias") = py::none(),
      "Why try_causal_conv1d_update would return None for these arguments, or None.");
  m.def(
      "try_rms_norm",
      [](const at::Tensor& hidden, const std::optional<at::Tensor>& gate,
         const at::Tensor& weight, double eps, bool weight_plus_one,
         bool round_before_weight) -> py::object {
        const at::Tensor g = or_undefined(gate);
        if (rms_norm_refusal(hidden, g, weight)) {
          return py::none();
        }
        return py::cast(rms_norm(hidden, g, weight, eps, weight_plus_one, round_before_weight));
      },
      py::arg("hidden"), py::arg("gate"), py::arg("weight"), py::arg("eps"),
      py::arg("weight_plus_one") = false, py::arg("round_before_weight") = true,
      "transformers' RMSNorm forward in float32, bfloat16 or float16 (gated when gate is given; "
      "scaled by 1 + weight, as Gemma's, with weight_plus_one; Llama's weight * "
      "h.to(input_dtype) with round_before_weight, else the product in float32, then the cast) "
      "in three kernels, bitwise its result; None (nothing run) for arguments the fused "
      "kernels do not take.");
  m.def(
      "rms_norm_refusal",
      [](const at::Tensor& hidden, const std::optional<at::Tensor>& gate,
         const at::Tensor& weight) { return rms_norm_refusal(hidden, or_undefined(gate), weight); },
      py::arg("hidden"), py::arg("gate"), py::arg("weight"),
      "Why try_rms_norm would return None for these arguments, or None.");
  m.def(
      "try_rotary_embedding",
      [](const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) -> py::object {
        if (rotary_embedding_refusal(x, cos, sin)) {
          return py::none();
        }
        return py::cast(rotary_embedding(x, cos, sin));
      },
      py::arg("x"), py::arg("cos"), py::arg("sin"),
      "transformers' apply_rotary_pos_emb for one tensor, (x * cos.unsqueeze(1)) + "
      "(rotate_half(x) * sin.unsqueeze(1)), in one kernel, bitwise its result; None (nothing "
      "run) for arguments the kernel does not take.");
  m.def("rotary_embedding_refusal", &rotary_embedding_refusal, py::arg("x"), py::arg("cos"),
        py::arg("sin"), "Why try_rotary_embedding would return None for these arguments, or None.");
}

}  // namespace graphed::python
