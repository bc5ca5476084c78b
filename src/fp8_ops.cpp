// The fused FP8 operations (fp8_ops.h): argument checks, the kernels of
// src/device/fp8_kernels.cu for CUDA tensors, and the ATen sequences they
// replace for CPU tensors and as the GPU tests' reference.

#include "graphed/fp8_ops.h"

#include "graphed/check.h"

#include "device/fp8_kernels.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>

namespace graphed {
namespace {

device::HighPrecisionType high_precision_type(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kBFloat16:
      return device::HighPrecisionType::kBFloat16;
    case at::kHalf:
      return device::HighPrecisionType::kFloat16;
    default:
      return device::HighPrecisionType::kFloat32;
  }
}

device::Fp8Type fp8_type(Float8Format format) {
  return format == Float8Format::kE4M3 ? device::Fp8Type::kE4M3 : device::Fp8Type::kE5M2;
}

void check_castable(const at::Tensor& x, const char* what) {
  GRAPHED_CHECK(x.defined(), "Expected a tensor to cast to FP8 (", what, "), got an undefined one.");
  const auto type = x.scalar_type();
  GRAPHED_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf,
                "Expected ", what, " in float32, bfloat16 or float16 to cast to FP8, got ", type,
                ". Cast it first (x.float()); see docs/troubleshooting.md#fp8-unsupported-dtype.");
}

void check_scalar_float(const at::Tensor& t, const at::Tensor& x, const char* what) {
  GRAPHED_CHECK(t.defined() && t.numel() == 1 && t.scalar_type() == at::kFloat,
                "Expected ", what, " to be a float32 tensor with one element, got ",
                t.defined() ? c10::str(t.scalar_type(), " of shape ", t.sizes()) : "none",
                ". Pass a row of the scaling state (e.g. scale[0:1]).");
  GRAPHED_CHECK(t.device() == x.device(), "Expected ", what, " on ", x.device(),
                " (the device of the tensor being cast), got ", t.device(),
                ". Keep the scaling state on the model's device.");
}

void check_outputs(const at::Tensor& x, const Float8CastOutputs& outputs) {
  GRAPHED_CHECK(!outputs.transposed || x.dim() == 2, "Expected a 2-D tensor for a transposed ",
                "FP8 cast, got ", x.dim(), " dimensions ", x.sizes(),
                ". Flatten it first (x.reshape(-1, x.size(-1))).");
  if (outputs.amax.defined()) {
    check_scalar_float(outputs.amax, x, "the amax");
  }
}

bool use_kernels(const at::Tensor& x, Float8Kernels kernels) {
  return kernels == Float8Kernels::kAuto && x.is_cuda();
}

cudaStream_t stream_of(const at::Tensor& x) {
  return c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
}

float* float_pointer(const at::Tensor& t) {
  return t.defined() ? static_cast<float*>(t.data_ptr()) : nullptr;
}

// The outputs of a cast in the kernel's layout, and the kernel's arguments.
Float8CastResult allocate_cast(const at::Tensor& x, Float8Format format,
                               const Float8CastOutputs& outputs, device::Fp8Cast& cast) {
  Float8CastResult result;
  const auto options = x.options().dtype(float8_dtype(format));
  cast.input = x.data_ptr();
  cast.input_type = high_precision_type(x);
  cast.output_type = fp8_type(format);
  cast.format_max = static_cast<float>(float8_max(format));
  if (outputs.transposed) {
    cast.rows = x.size(0);
    cast.cols = x.size(1);
    result.transposed = at::empty({cast.cols, cast.rows}, options);
    cast.output_transposed = static_cast<uint8_t*>(result.transposed.data_ptr());
  } else {
    cast.rows = 1;
    cast.cols = x.numel();
  }
  if (outputs.data) {
    result.data = at::empty(x.sizes(), options);
    cast.output = static_cast<uint8_t*>(result.data.data_ptr());
  }
  cast.amax = float_pointer(outputs.amax);
  return result;
}

Float8CastResult aten_cast(const at::Tensor& x, const at::Tensor& scale, Float8Format format,
                           const Float8CastOutputs& outputs) {
  Float8CastResult result;
  const at::Tensor data = cast_to_float8(x, scale.reshape({1}), format);
  if (outputs.data) {
    result.data = data;
  }
  if (outputs.transposed) {
    result.transposed = data.t().contiguous();
  }
  if (outputs.amax.defined()) {
    record_amax(x, outputs.amax, Float8Kernels::kAten);
  }
  return result;
}

}  // namespace

Float8CastResult cast_to_float8_fused(const at::Tensor& x_in, const at::Tensor& scale,
                                      Float8Format format, const Float8CastOutputs& outputs,
                                      Float8Kernels kernels) {
  check_castable(x_in, "the input");
  check_scalar_float(scale, x_in, "the scale");
  check_outputs(x_in, outputs);
  const at::Tensor x = x_in.contiguous();
  if (!use_kernels(x, kernels)) {
    return aten_cast(x, scale, format, outputs);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  device::Fp8Cast cast;
  Float8CastResult result = allocate_cast(x, format, outputs, cast);
  cast.scale = static_cast<const float*>(scale.data_ptr());
  GRAPHED_CHECK_CUDA(device::launch_fp8_cast(cast, stream_of(x)));
  return result;
}

Float8CastResult cast_to_float8_current(const at::Tensor& x_in, Float8Format format,
                                        int64_t margin, const Float8CastOutputs& outputs,
                                        const at::Tensor& scale_out,
                                        const at::Tensor& scale_inv_out, Float8Kernels kernels) {
  check_castable(x_in, "the input");
  check_outputs(x_in, outputs);
  GRAPHED_CHECK(outputs.amax.defined(), "Expected an amax tensor for current scaling (the ",
                "input's amax is reduced into it before the cast), got none. Pass ",
                "Float8CastOutputs{.amax = ...}.");
  check_scalar_float(scale_out, x_in, "the scale output");
  check_scalar_float(scale_inv_out, x_in, "the inverse scale output");
  GRAPHED_CHECK(margin >= 0 && margin <= 64, "Expected margin in 0..64, got ", margin, ".");
  const at::Tensor x = x_in.contiguous();
  if (!use_kernels(x, kernels)) {
    outputs.amax.copy_(amax_of(x).reshape(outputs.amax.sizes()));
    scale_out.copy_(scale_from_amax(outputs.amax, at::ones_like(outputs.amax), format, margin)
                        .reshape(scale_out.sizes()));
    scale_inv_out.copy_(at::reciprocal(scale_out).reshape(scale_inv_out.sizes()));
    Float8CastOutputs without_amax = outputs;
    without_amax.amax = at::Tensor();
    return aten_cast(x, scale_out, format, without_amax);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = stream_of(x);
  float* amax = float_pointer(outputs.amax);
  GRAPHED_CHECK_CUDA(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  device::AmaxReduction reduction;
  reduction.input = x.data_ptr();
  reduction.input_type = high_precision_type(x);
  reduction.count = x.numel();
  reduction.amax = amax;
  GRAPHED_CHECK_CUDA(device::launch_amax_reduction(reduction, stream));
  device::Fp8Cast cast;
  Float8CastOutputs without_amax = outputs;
  without_amax.amax = at::Tensor();
  Float8CastResult result = allocate_cast(x, format, without_amax, cast);
  cast.scale_amax = amax;
  cast.margin = static_cast<int>(margin);
  cast.scale_out = float_pointer(scale_out);
  cast.scale_inv_out = float_pointer(scale_inv_out);
  GRAPHED_CHECK_CUDA(device::launch_fp8_cast(cast, stream));
  return result;
}

void record_amax(const at::Tensor& x_in, const at::Tensor& amax, Float8Kernels kernels) {
  check_castable(x_in, "the input");
  check_scalar_float(amax, x_in, "the amax");
  const at::Tensor x = x_in.contiguous();
  if (!use_kernels(x, kernels)) {
    amax.copy_(at::maximum(amax, amax_of(x).reshape(amax.sizes())));
    return;
  }
  const c10::cuda::CUDAGuard guard(x.device());
  device::AmaxReduction reduction;
  reduction.input = x.data_ptr();
  reduction.input_type = high_precision_type(x);
  reduction.count = x.numel();
  reduction.amax = float_pointer(amax);
  GRAPHED_CHECK_CUDA(device::launch_amax_reduction(reduction, stream_of(x)));
}

DelayedScalingTable make_delayed_scaling_table(const std::vector<Float8Format>& formats,
                                               const DelayedScalingOptions& options,
                                               c10::Device device) {
  validate_delayed_scaling_options(options);
  const auto floats = at::TensorOptions().dtype(at::kFloat).device(device);
  const auto rows = static_cast<int64_t>(formats.size());
  std::vector<float> maxima;
  maxima.reserve(formats.size());
  for (Float8Format format : formats) {
    maxima.push_back(static_cast<float>(float8_max(format)));
  }
  DelayedScalingTable table;
  table.history = at::zeros({rows, options.history_len}, floats);
  table.amax = at::zeros({rows}, floats);
  table.scale = at::ones({rows}, floats);
  table.scale_inv = at::ones({rows}, floats);
  table.format_max = at::tensor(maxima, at::TensorOptions().dtype(at::kFloat)).to(device);
  table.slot = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(device));
  return table;
}

void validate_delayed_scaling_table(const DelayedScalingTable& table,
                                    const DelayedScalingOptions& options) {
  validate_delayed_scaling_options(options);
  GRAPHED_CHECK(table.amax.defined() && table.amax.dim() == 1,
                "Expected the table's amax to be a 1-D tensor [tensors], got ",
                table.amax.defined() ? c10::str(table.amax.sizes()) : "none",
                ". Build tables with make_delayed_scaling_table.");
  const int64_t rows = table.amax.size(0);
  const c10::Device device = table.amax.device();
  const auto check_field = [&](const at::Tensor& t, const char* name, at::ScalarType dtype,
                               std::vector<int64_t> shape) {
    GRAPHED_CHECK(t.defined() && t.sizes() == c10::IntArrayRef(shape) &&
                      t.scalar_type() == dtype && t.device() == device && t.is_contiguous(),
                  "Expected the table's ", name, " to be a contiguous ", dtype, " tensor of shape ",
                  c10::IntArrayRef(shape), " on ", device, ", got ",
                  t.defined() ? c10::str(t.scalar_type(), " ", t.sizes(), " on ", t.device(),
                                         t.is_contiguous() ? "" : " (not contiguous)")
                              : "none",
                  ". Every row needs one amax, scale, inverse scale, format maximum and history ",
                  "row of history_len=", options.history_len,
                  " columns; build tables with make_delayed_scaling_table.");
  };
  check_field(table.history, "history", at::kFloat, {rows, options.history_len});
  check_field(table.amax, "amax", at::kFloat, {rows});
  check_field(table.scale, "scale", at::kFloat, {rows});
  check_field(table.scale_inv, "scale_inv", at::kFloat, {rows});
  check_field(table.format_max, "format_max", at::kFloat, {rows});
  check_field(table.slot, "slot", at::kLong, {1});
}

void update_delayed_scaling(const DelayedScalingTable& table, const DelayedScalingOptions& options,
                            Float8Kernels kernels) {
  validate_delayed_scaling_table(table, options);
  if (!use_kernels(table.amax, kernels)) {
    // DelayedScaling's record_amax_value and update_scale, for every row.
    // The slot wrapped into the history, as the kernel does: a slot loaded
    // from a checkpoint may be anything, and no index may reach an assert.
    table.history.index_copy_(1, at::remainder(table.slot, options.history_len),
                              table.amax.unsqueeze(1));
    const at::Tensor reduced = options.reduction == AmaxReduction::kMax
                                   ? table.history.amax(1)
                                   : table.amax.clone();
    const at::Tensor wanted =
        at::reciprocal(reduced).mul_(table.format_max.div(std::ldexp(1.0, options.margin)));
    const at::Tensor usable =
        reduced.gt(0).logical_and_(reduced.isfinite()).logical_and_(wanted.isfinite());
    table.scale.copy_(at::where(usable, wanted, table.scale));
    table.scale_inv.copy_(at::reciprocal(table.scale));
    table.amax.zero_();
    table.slot.add_(1).remainder_(options.history_len);
    return;
  }
  const c10::cuda::CUDAGuard guard(table.amax.device());
  device::DelayedScalingUpdate update;
  update.history = float_pointer(table.history);
  update.amax = float_pointer(table.amax);
  update.scale = float_pointer(table.scale);
  update.scale_inv = float_pointer(table.scale_inv);
  update.format_max = float_pointer(table.format_max);
  update.slot = table.slot.data_ptr<int64_t>();
  update.tensors = table.amax.size(0);
  update.history_len = options.history_len;
  update.margin = static_cast<int>(options.margin);
  update.most_recent = options.reduction == AmaxReduction::kMostRecent;
  GRAPHED_CHECK_CUDA(device::launch_delayed_scaling_update(update, stream_of(table.amax)));
}

}  // namespace graphed
