#include "graphed/grad_guard.h"

#include "graphed/check.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <map>
#include <unordered_set>

namespace graphed {

std::vector<std::vector<at::Tensor>> group_by_dtype(const std::vector<at::Tensor>& tensors) {
  std::map<c10::ScalarType, std::vector<at::Tensor>> groups;
  for (const at::Tensor& tensor : tensors) {
    groups[tensor.scalar_type()].push_back(tensor);
  }
  std::vector<std::vector<at::Tensor>> result;
  for (auto& [dtype, group] : groups) {
    result.push_back(std::move(group));
  }
  return result;
}

namespace {

void check_shadows(const std::vector<at::Tensor>& tensors, const std::vector<at::Tensor>& shadows) {
  GRAPHED_CHECK(tensors.size() == shadows.size(), "Expected one shadow per tensor, got ",
                shadows.size(), " shadows for ", tensors.size(), " tensors.");
  for (size_t i = 0; i < tensors.size(); ++i) {
    GRAPHED_CHECK(tensors[i].sizes().equals(shadows[i].sizes()) &&
                      tensors[i].scalar_type() == shadows[i].scalar_type() &&
                      tensors[i].device() == shadows[i].device(),
                  "Expected shadow ", i, " to have the sizes, dtype and device of its tensor (",
                  tensors[i].sizes(), " ", tensors[i].scalar_type(), " ",
                  tensors[i].device().str(), "), got ", shadows[i].sizes(), " ",
                  shadows[i].scalar_type(), " ", shadows[i].device().str(),
                  ". Allocate the shadows with empty_like(tensor).");
  }
}

}  // namespace

void snapshot_tensors(const std::vector<at::Tensor>& tensors,
                      const std::vector<at::Tensor>& shadows) {
  check_shadows(tensors, shadows);
  c10::NoGradGuard no_grad;
  // _foreach_copy_ takes one dtype per list (its fast path; the kernel
  // falls back to one copy per tensor otherwise).
  std::map<c10::ScalarType, std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>> groups;
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto& group = groups[tensors[i].scalar_type()];
    group.first.push_back(shadows[i]);
    group.second.push_back(tensors[i]);
  }
  for (auto& [dtype, group] : groups) {
    at::_foreach_copy_(group.first, group.second);
  }
}

void restore_tensors_if(const at::Tensor& flag, const std::vector<at::Tensor>& tensors,
                        const std::vector<at::Tensor>& shadows) {
  check_shadows(tensors, shadows);
  if (tensors.empty()) {
    return;
  }
  GRAPHED_CHECK(flag.defined() && flag.numel() == 1, "Expected the skip flag to be a tensor with "
                "one element (found_inf), got ", flag.defined() ? c10::str(flag.sizes())
                                                                : std::string("an undefined tensor"),
                ".");
  c10::NoGradGuard no_grad;
  // See Note [Buffers of a skipped step]: select, never blend.
  const at::Tensor skip = flag.reshape({}).ne(0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor target = tensors[i];
    at::where_out(target, skip, shadows[i], tensors[i]);
  }
}

at::Tensor global_grad_norm(const std::vector<at::Tensor>& grads) {
  GRAPHED_CHECK(!grads.empty(), "Expected at least one gradient to take the norm of, got none: "
                "did backward() reach the parameters?");
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> norms;
  for (const std::vector<at::Tensor>& group : group_by_dtype(grads)) {
    for (const at::Tensor& norm : at::_foreach_norm(group, 2)) {
      norms.push_back(norm.to(at::kFloat));
    }
  }
  return at::linalg_vector_norm(at::stack(norms), 2);
}

at::Tensor clip_grad_norm(const std::vector<at::Tensor>& grads, double max_norm) {
  GRAPHED_CHECK(max_norm > 0, "Expected a positive max_norm for gradient clipping, got ",
                max_norm, ".");
  c10::NoGradGuard no_grad;
  at::Tensor norm = global_grad_norm(grads);
  // Same arithmetic as torch.nn.utils.clip_grad_norm_, so results match eager.
  const at::Tensor coefficient = at::clamp(max_norm / (norm + 1e-6), std::nullopt, 1.0);
  for (const std::vector<at::Tensor>& group : group_by_dtype(grads)) {
    at::_foreach_mul_(group, coefficient);
  }
  return norm;
}

GradientGuard::GradientGuard(c10::Device device, GradientGuardOptions options)
    : options_(options) {
  GRAPHED_CHECK(device.is_cuda(), "Expected a CUDA device for the gradient guard, got ",
                device.str(), ".");
  const auto floats = at::TensorOptions().device(device).dtype(at::kFloat);
  // Zero-dimensional, as torch.amp.GradScaler keeps them: the fused optimizers
  // subtract found_inf from their zero-dimensional step counters.
  found_inf_ = at::zeros({}, floats);
  skipped_ = at::zeros({}, floats);
  if (options_.loss_scaling) {
    const LossScaling& scaling = *options_.loss_scaling;
    GRAPHED_CHECK(scaling.init_scale > 0 && scaling.growth_factor > 1 &&
                      scaling.backoff_factor > 0 && scaling.backoff_factor < 1 &&
                      scaling.growth_interval > 0,
                  "Expected init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                  "growth_interval > 0 for loss scaling, got ", scaling.init_scale, ", ",
                  scaling.growth_factor, ", ", scaling.backoff_factor, ", ",
                  scaling.growth_interval, ".");
    scale_ = at::full({}, scaling.init_scale, floats);
    growth_tracker_ = at::zeros({}, at::TensorOptions().device(device).dtype(at::kInt));
  }
}

at::Tensor GradientGuard::scale_loss(const at::Tensor& loss) const {
  if (!options_.loss_scaling) {
    return loss;
  }
  return loss * scale_.to(loss.scalar_type());
}

at::Tensor GradientGuard::process(const at::Tensor& loss, const std::vector<at::Tensor>& grads) {
  c10::NoGradGuard no_grad;
  if (can_skip()) {
    found_inf_.zero_();
  }
  if (options_.loss_scaling) {
    const at::Tensor inv_scale = scale_.reciprocal();
    for (std::vector<at::Tensor>& group : group_by_dtype(grads)) {
      at::_amp_foreach_non_finite_check_and_unscale_(group, found_inf_, inv_scale);
    }
  }
  if (options_.clip_grad_norm) {
    grad_norm_ = clip_grad_norm(grads, *options_.clip_grad_norm);
  } else if (options_.skip_nonfinite && !options_.loss_scaling) {
    grad_norm_ = global_grad_norm(grads);
  }
  if (!can_skip()) {
    return at::Tensor();
  }
  // Any NaN or inf in a gradient makes the global norm non-finite; so does a
  // non-finite loss (which backward may not propagate, e.g. inf * 0).
  at::Tensor bad = at::logical_not(at::isfinite(loss.detach().to(at::kFloat))).reshape({});
  if (grad_norm_.defined() && !options_.loss_scaling) {
    bad = at::logical_or(bad, at::logical_not(at::isfinite(grad_norm_)).reshape({}));
  }
  at::maximum_out(found_inf_, found_inf_, bad.to(at::kFloat));
  skipped_.add_(found_inf_);
  restore_tensors_if(found_inf_, buffers_, shadows_);
  return found_inf_;
}

void GradientGuard::protect_buffers(const std::vector<at::Tensor>& buffers) {
  buffers_.clear();
  shadows_.clear();
  if (!can_skip()) {
    return;
  }
  c10::NoGradGuard no_grad;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const at::Tensor& buffer : buffers) {
    if (!buffer.defined() || buffer.device() != found_inf_.device() ||
        !seen.insert(buffer.unsafeGetTensorImpl()).second) {
      continue;
    }
    buffers_.push_back(buffer);
    shadows_.push_back(at::empty_like(buffer, at::MemoryFormat::Preserve));
  }
}

void GradientGuard::begin_step() {
  if (!buffers_.empty()) {
    snapshot_tensors(buffers_, shadows_);
  }
}

void GradientGuard::after_step() {
  if (!options_.loss_scaling) {
    return;
  }
  c10::NoGradGuard no_grad;
  const LossScaling& scaling = *options_.loss_scaling;
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, scaling.growth_factor,
                         scaling.backoff_factor, scaling.growth_interval);
}

int64_t GradientGuard::skipped_steps() const {
  return static_cast<int64_t>(skipped_.item<float>());
}

std::optional<double> GradientGuard::loss_scale() const {
  if (!options_.loss_scaling) {
    return std::nullopt;
  }
  return scale_.item<double>();
}

std::vector<at::Tensor> GradientGuard::state() const {
  std::vector<at::Tensor> tensors{found_inf_, skipped_};
  if (options_.loss_scaling) {
    tensors.push_back(scale_);
    tensors.push_back(growth_tracker_);
  }
  return tensors;
}

}  // namespace graphed
