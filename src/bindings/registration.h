#pragma once

// Registration functions of graphed._C's parts, called from module.cpp.

#include <torch/csrc/utils/pybind.h>

namespace graphed::python {

// TrainStep, GradientGuard and clip_grad_norm.
void register_training(pybind11::module_& m);

}  // namespace graphed::python
