#pragma once

// The parts of graphed._C that live in their own binding files. module.cpp's
// PYBIND11_MODULE calls each once, after registering the error types.

#include <torch/csrc/utils/pybind.h>

namespace graphed::python {

// TrainStep, GradientGuard and clip_grad_norm.
void register_training(pybind11::module_& m);

// graphed.check: check_safety, the report types, and the entry points through
// which the Python adapter records host calls (check_bindings.cpp).
void register_safety_check(pybind11::module_& m);

// graphed.make_graphed_callables and GraphedCallable (graphed_callable_bindings.cpp).
void register_graphed_callables(pybind11::module_& m);
// graphed.advise: traces, the replay cost and the advice arithmetic
// (advice_bindings.cpp).
void register_advice(pybind11::module_& m);
// graphed.auto: GraphManager, module selection, memory sizes (auto_bindings.cpp).
void register_auto(pybind11::module_& m);
// graphed.generate and graphed.Decoder: the decode loop (decoder_bindings.cpp).
void register_decoder(pybind11::module_& m);
// graphed.generate_batch and Decoder.submit: continuous batching (serving_bindings.cpp).
void register_serving(pybind11::module_& m);
// graphed.fp8: the float8 recipe, linear function and scaling update (fp8_bindings.cpp).
void register_fp8(pybind11::module_& m);
// graphed.moe: the grouped matrix product of mixture-of-experts layers (moe_bindings.cpp).
void register_moe(pybind11::module_& m);
// The fused decode-step kernels of Mamba2-family layers (state_space_bindings.cpp).
void register_state_space(pybind11::module_& m);

}  // namespace graphed::python
