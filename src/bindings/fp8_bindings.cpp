// graphed._C: float8 training (graphed.fp8): the recipe, the weight cache,
// the float8 linear function and the delayed-scaling update. Conversion only.

#include "graphed/check.h"
#include "graphed/fp8_linear.h"
#include "graphed/fp8_ops.h"
#include "registration.h"

#include <pybind11/stl.h>

namespace py = pybind11;

namespace graphed::python {
namespace {

Float8Kernels parse_kernels(const std::string& kernels) {
  GRAPHED_CHECK(kernels == "auto" || kernels == "aten", "Expected kernels \"auto\" (graphed's ",
                "fused kernels on CUDA tensors) or \"aten\" (the ATen reference), got \"",
                kernels, "\".");
  return kernels == "auto" ? Float8Kernels::kAuto : Float8Kernels::kAten;
}

Float8Recipe make_recipe(const std::string& scaling, int64_t history_len, int64_t margin,
                         const std::string& amax_compute, const std::string& grad_format,
                         bool cache_weights, bool fast_accum_forward, bool fast_accum_backward,
                         bool emulate) {
  Float8Recipe recipe;
  recipe.scaling = parse_float8_scaling(scaling);
  recipe.delayed.history_len = history_len;
  recipe.delayed.margin = margin;
  recipe.delayed.reduction = parse_amax_reduction(amax_compute);
  recipe.grad_format = parse_float8_format(grad_format);
  recipe.cache_weights = cache_weights;
  recipe.fast_accum_forward = fast_accum_forward;
  recipe.fast_accum_backward = fast_accum_backward;
  recipe.emulate = emulate;
  validate_float8_recipe(recipe);
  return recipe;
}

}  // namespace

void register_fp8(py::module_& m) {
  py::class_<Float8Recipe>(m, "Float8Recipe",
                           "A validated float8 recipe (graphed.fp8.Recipe builds it).")
      .def(py::init(&make_recipe), py::arg("scaling"), py::arg("history_len"),
           py::arg("margin"), py::arg("amax_compute"), py::arg("grad_format"),
           py::arg("cache_weights"), py::arg("fast_accum_forward"),
           py::arg("fast_accum_backward"), py::arg("emulate"))
      .def_property_readonly("history_len",
                             [](const Float8Recipe& r) { return r.delayed.history_len; })
      .def_property_readonly("delayed", [](const Float8Recipe& r) {
        return r.scaling == Float8Scaling::kDelayed;
      });

  py::class_<Float8WeightCache, std::shared_ptr<Float8WeightCache>>(
      m, "Float8WeightCache", "A layer's FP8 weight cast, kept between microbatches.")
      .def(py::init<>())
      .def("clear", &Float8WeightCache::clear)
      .def_property_readonly("casts", &Float8WeightCache::casts)
      .def_property_readonly("holds_cast", &Float8WeightCache::holds_cast)
      // A copied or unpickled layer starts without a kept cast.
      .def("__deepcopy__", [](const Float8WeightCache&, const py::dict&) {
        return std::make_shared<Float8WeightCache>();
      })
      .def(py::pickle([](const Float8WeightCache&) { return py::tuple(); },
                      [](const py::tuple&) { return std::make_shared<Float8WeightCache>(); }));

  m.def(
      "float8_linear",
      [](const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
         const at::Tensor& amax, const at::Tensor& scale, const at::Tensor& scale_inv,
         const Float8Recipe& recipe, const std::shared_ptr<Float8WeightCache>& cache) {
        Float8LinearState state{amax, scale, scale_inv};
        return float8_linear(input, weight, bias, state, recipe, cache.get());
      },
      py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("amax"), py::arg("scale"),
      py::arg("scale_inv"), py::arg("recipe"), py::arg("cache") = nullptr);

  m.def(
      "fp8_update_delayed_scaling",
      [](const at::Tensor& history, const at::Tensor& amax, const at::Tensor& scale,
         const at::Tensor& scale_inv, const at::Tensor& format_max, const at::Tensor& slot,
         const Float8Recipe& recipe, const std::string& kernels) {
        DelayedScalingTable table{history, amax, scale, scale_inv, format_max, slot};
        py::gil_scoped_release release;
        update_delayed_scaling(table, recipe.delayed, parse_kernels(kernels));
      },
      py::arg("history"), py::arg("amax"), py::arg("scale"), py::arg("scale_inv"),
      py::arg("format_max"), py::arg("slot"), py::arg("recipe"), py::arg("kernels") = "auto");

  m.def(
      "fp8_cast",
      [](const at::Tensor& x, const at::Tensor& scale, const std::string& format, bool data,
         bool transposed, const std::optional<at::Tensor>& amax, const std::string& kernels) {
        Float8CastOutputs outputs;
        outputs.data = data;
        outputs.transposed = transposed;
        if (amax) {
          outputs.amax = *amax;
        }
        const Float8CastResult result =
            cast_to_float8_fused(x, scale, parse_float8_format(format), outputs,
                                 parse_kernels(kernels));
        return py::make_tuple(result.data, result.transposed);
      },
      py::arg("x"), py::arg("scale"), py::arg("format"), py::arg("data") = true,
      py::arg("transposed") = false, py::arg("amax") = py::none(), py::arg("kernels") = "auto");

  m.def("fp8_format_max",
        [](const std::string& format) { return float8_max(parse_float8_format(format)); },
        py::arg("format"));
  m.def("advance_float8_weight_epoch", &advance_float8_weight_epoch);
}

}  // namespace graphed::python
