#include "graphed/fp8_scaling.h"

#include "graphed/check.h"

#include <ATen/ATen.h>

#include <cmath>

namespace graphed {

double float8_max(Float8Format format) {
  return format == Float8Format::kE4M3 ? 448.0 : 57344.0;
}

c10::ScalarType float8_dtype(Float8Format format) {
  return format == Float8Format::kE4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
}

void validate_delayed_scaling_options(const DelayedScalingOptions& options) {
  GRAPHED_CHECK(options.history_len >= 1, "Expected history_len >= 1 (the steps whose amaxes ",
                "the scale follows), got ", options.history_len,
                ". Use 1 to follow the last step only, or Transformer Engine's 16.");
  GRAPHED_CHECK(options.margin >= 0 && options.margin <= 64, "Expected margin in 0..64 (powers ",
                "of two of headroom below the format's largest value), got ", options.margin,
                ". Use 0 unless values overflow between steps.");
}

at::Tensor scale_from_amax(const at::Tensor& amax, const at::Tensor& previous,
                           Float8Format format, int64_t margin) {
  const at::Tensor wanted = at::reciprocal(amax).mul_(float8_max(format) / std::ldexp(1.0, margin));
  const at::Tensor usable = amax.gt(0).logical_and_(amax.isfinite()).logical_and_(wanted.isfinite());
  return at::where(usable, wanted, previous);
}

at::Tensor amax_of(const at::Tensor& x) {
  if (x.numel() == 0) {
    // Nothing read: an amax of 0, as the fused kernels leave it.
    return at::zeros({}, x.options().dtype(at::kFloat));
  }
  return x.abs().amax().to(at::kFloat);
}

at::Tensor cast_to_float8(const at::Tensor& x, const at::Tensor& scale, Float8Format format) {
  const double limit = float8_max(format);
  return x.to(at::kFloat).mul(scale).clamp_(-limit, limit).to(float8_dtype(format));
}

at::Tensor current_scale(const at::Tensor& x, Float8Format format, int64_t margin) {
  const at::Tensor amax = amax_of(x);
  return scale_from_amax(amax, at::ones_like(amax), format, margin);
}

DelayedScaling::DelayedScaling(Float8Format format, DelayedScalingOptions options,
                               c10::Device device)
    : format_(format), options_(options) {
  validate_delayed_scaling_options(options_);
  const auto floats = at::TensorOptions().dtype(at::kFloat).device(device);
  history_ = at::zeros({options_.history_len}, floats);
  next_slot_ = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(device));
  scale_ = at::ones({1}, floats);
  scale_inv_ = at::ones({1}, floats);
}

void DelayedScaling::record_amax(const at::Tensor& x) {
  record_amax_value(amax_of(x));
}

void DelayedScaling::record_amax_value(const at::Tensor& amax) {
  GRAPHED_CHECK(amax.numel() == 1, "Expected one amax (a scalar or one-element tensor), got a ",
                "tensor of shape ", amax.sizes(), ". Reduce it first (amax_of).");
  GRAPHED_CHECK(amax.device() == history_.device(), "Expected the amax on ", history_.device(),
                " (this scaling state's device), got ", amax.device(), ". Record amaxes of ",
                "tensors on the state's device.");
  // Wrapped: state() hands the slot out, and a restored one may be anything.
  history_.index_copy_(0, at::remainder(next_slot_, options_.history_len),
                       amax.reshape({1}).to(at::kFloat));
}

void DelayedScaling::update_scale() {
  const at::Tensor amax = options_.reduction == AmaxReduction::kMax
                              ? history_.amax().reshape({1})
                              : history_.index_select(
                                    0, at::remainder(next_slot_, options_.history_len));
  scale_.copy_(scale_from_amax(amax, scale_, format_, options_.margin));
  at::reciprocal_out(scale_inv_, scale_);
  next_slot_.remainder_(options_.history_len).add_(1).remainder_(options_.history_len);
}

at::Tensor DelayedScaling::cast(const at::Tensor& x) const {
  return cast_to_float8(x, scale_, format_);
}

std::vector<at::Tensor> DelayedScaling::state() const {
  return {history_, next_slot_, scale_, scale_inv_};
}

}  // namespace graphed
