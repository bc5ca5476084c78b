// graphed._C: mixture-of-experts layers (graphed.moe): the grouped matrix
// product that CUDA graphs capture in every dtype. Conversion only.

#include "graphed/check.h"
#include "graphed/grouped_mm.h"
#include "registration.h"

#include <string>

namespace py = pybind11;

namespace graphed::python {
namespace {

GroupedMmKernels parse_grouped_mm_kernels(const std::string& kernels) {
  GRAPHED_CHECK(kernels == "auto" || kernels == "graphed", "Expected kernels \"auto\" (torch's ",
                "bfloat16 kernel where it is capturable, graphed's elsewhere) or \"graphed\" ",
                "(graphed's kernels always) for grouped_mm, got \"", kernels, "\".");
  return kernels == "auto" ? GroupedMmKernels::kAuto : GroupedMmKernels::kGraphed;
}

}  // namespace

void register_moe(py::module_& m) {
  m.def(
      "grouped_mm",
      [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
         const std::string& kernels) {
        return grouped_mm(a, b, offs, parse_grouped_mm_kernels(kernels));
      },
      py::arg("a"), py::arg("b"), py::arg("offs"), py::arg("kernels") = "auto",
      "out[S, N] = a[rows of g] @ b[g] for the groups of rows that the int32 offsets end, "
      "zeros past the last offset; autograd-aware and capturable in every dtype "
      "(graphed.moe.grouped_mm documents it).");
  m.def(
      "grouped_mm_weight_grad",
      [](const at::Tensor& a, const at::Tensor& grad, const at::Tensor& offs,
         const std::string& kernels) {
        return grouped_mm_weight_grad(a, grad, offs, parse_grouped_mm_kernels(kernels));
      },
      py::arg("a"), py::arg("grad"), py::arg("offs"), py::arg("kernels") = "auto",
      "[E, K, N] with [g] = a[rows of g]^T @ grad[rows of g]: the weight gradient of grouped_mm, "
      "zeros for groups without rows (no autograd).");
  m.def("grouped_mm_uses_torch", &grouped_mm_uses_torch, py::arg("a"), py::arg("b"),
        "True when grouped_mm(a, b, offs) runs torch's own capturable bfloat16 kernel "
        "(torch._grouped_mm), False when it runs graphed's kernels.");
}

}  // namespace graphed::python
