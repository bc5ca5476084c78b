#include "graphed/optim.h"

#include "graphed/check.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <map>

namespace graphed {
namespace {

void check_params(const std::vector<at::Tensor>& params, const char* optimizer) {
  GRAPHED_CHECK(!params.empty(), optimizer, " expected at least one parameter, got none.");
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    GRAPHED_CHECK(p.defined() && p.is_cuda() && p.is_floating_point(), optimizer,
                  " expected CUDA floating-point parameters, but parameter ", i, " is ",
                  p.defined() ? p.toString() : std::string("undefined"),
                  ". Move the model to the GPU (.cuda()) before creating the optimizer.");
    GRAPHED_CHECK(p.device() == params[0].device(), optimizer,
                  " expected every parameter on one device, but parameter 0 is on ",
                  params[0].device().str(), " and parameter ", i, " on ", p.device().str(), ".");
  }
}

// The parameters that have gradients, with their per-parameter state at the
// same positions, grouped by dtype: the fused kernels take one dtype per call.
struct StepGroup {
  std::vector<at::Tensor> params, grads;
  std::vector<std::vector<at::Tensor>> state;  // state[k][i] belongs to params[i]
};

std::vector<StepGroup> step_groups(const std::vector<at::Tensor>& params,
                                   const std::vector<const std::vector<at::Tensor>*>& state) {
  std::map<c10::ScalarType, StepGroup> groups;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& grad = params[i].grad();
    if (!grad.defined()) {
      continue;
    }
    StepGroup& group = groups[params[i].scalar_type()];
    group.state.resize(state.size());
    group.params.push_back(params[i]);
    group.grads.push_back(grad);
    for (size_t k = 0; k < state.size(); ++k) {
      if (!state[k]->empty()) {
        group.state[k].push_back((*state[k])[i]);
      }
    }
  }
  std::vector<StepGroup> result;
  for (auto& [dtype, group] : groups) {
    result.push_back(std::move(group));
  }
  return result;
}

}  // namespace

CapturableOptimizer::CapturableOptimizer(std::vector<at::Tensor> params, double lr,
                                         const char* name)
    : params_(std::move(params)), lr_value_(lr) {
  check_params(params_, name);
  GRAPHED_CHECK(lr >= 0, name, " expected a learning rate >= 0, got ", lr, ".");
  c10::NoGradGuard no_grad;
  lr_ = at::full({}, lr, at::TensorOptions().device(params_[0].device()).dtype(at::kFloat));
}

void CapturableOptimizer::zero_grad(bool set_to_none) {
  for (at::Tensor p : params_) {
    at::Tensor& grad = p.mutable_grad();
    if (!grad.defined()) {
      continue;
    }
    if (set_to_none) {
      grad.reset();
    } else {
      grad.detach_();
      grad.zero_();
    }
  }
}

void CapturableOptimizer::set_lr(double lr) {
  GRAPHED_CHECK(lr >= 0, "Expected a learning rate >= 0, got ", lr, ".");
  lr_value_ = lr;
  c10::NoGradGuard no_grad;
  lr_.fill_(lr);
}

std::vector<at::Tensor> CapturableOptimizer::state() const {
  std::vector<at::Tensor> tensors = own_state();
  tensors.push_back(lr_);
  return tensors;
}

CapturableAdamW::CapturableAdamW(std::vector<at::Tensor> params, AdamWOptions options)
    : CapturableOptimizer(std::move(params), options.lr, "CapturableAdamW"), options_(options) {
  GRAPHED_CHECK(options_.eps >= 0 && options_.weight_decay >= 0 &&
                    options_.beta1 >= 0 && options_.beta1 < 1 && options_.beta2 >= 0 &&
                    options_.beta2 < 1,
                "CapturableAdamW expected eps >= 0, weight_decay >= 0 and betas in [0, 1), got "
                "eps=", options_.eps, ", weight_decay=",
                options_.weight_decay, ", betas=(", options_.beta1, ", ", options_.beta2, ").");
  c10::NoGradGuard no_grad;
  const auto floats = at::TensorOptions().device(params_[0].device()).dtype(at::kFloat);
  for (const at::Tensor& p : params_) {
    exp_avgs_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
    exp_avg_sqs_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (options_.amsgrad) {
      max_exp_avg_sqs_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
    }
    steps_.push_back(at::zeros({}, floats));
  }
}

void CapturableAdamW::step(const at::Tensor& found_inf) {
  c10::NoGradGuard no_grad;
  const std::optional<at::Tensor> skip =
      found_inf.defined() ? std::optional<at::Tensor>(found_inf) : std::nullopt;
  for (StepGroup& group :
       step_groups(params_, {&exp_avgs_, &exp_avg_sqs_, &max_exp_avg_sqs_, &steps_})) {
    std::vector<at::Tensor>& steps = group.state[3];
    // As torch.optim's fused AdamW: count the step, run the kernel (which
    // returns early on found_inf), then take the count back if it skipped.
    at::_foreach_add_(steps, 1);
    at::_fused_adamw_(group.params, group.grads, group.state[0], group.state[1], group.state[2],
                      steps, lr_, options_.beta1, options_.beta2, options_.weight_decay,
                      options_.eps, options_.amsgrad, options_.maximize, std::nullopt, skip);
    if (skip) {
      at::_foreach_sub_(steps, std::vector<at::Tensor>(steps.size(), found_inf.reshape({})));
    }
  }
}

std::vector<at::Tensor> CapturableAdamW::own_state() const {
  std::vector<at::Tensor> tensors;
  for (const auto* list : {&exp_avgs_, &exp_avg_sqs_, &max_exp_avg_sqs_, &steps_}) {
    tensors.insert(tensors.end(), list->begin(), list->end());
  }
  return tensors;
}

CapturableSGD::CapturableSGD(std::vector<at::Tensor> params, SGDOptions options)
    : CapturableOptimizer(std::move(params), options.lr, "CapturableSGD"), options_(options) {
  GRAPHED_CHECK(options_.momentum >= 0 && options_.weight_decay >= 0,
                "CapturableSGD expected momentum and weight_decay >= 0, got momentum=",
                options_.momentum, ", weight_decay=",
                options_.weight_decay, ".");
  GRAPHED_CHECK(options_.momentum == 0 || options_.dampening == 0,
                "CapturableSGD cannot capture momentum with dampening (got dampening=",
                options_.dampening, "): eager SGD's first step copies the gradient into the "
                "momentum buffer undamped, a branch a replayed graph cannot take. Use "
                "dampening=0.");
  GRAPHED_CHECK(!options_.nesterov || options_.momentum > 0,
                "CapturableSGD: Nesterov momentum needs momentum > 0, got momentum=",
                options_.momentum, ".");
  c10::NoGradGuard no_grad;
  if (options_.momentum != 0) {
    for (const at::Tensor& p : params_) {
      momentum_buffers_.push_back(at::zeros_like(p, at::MemoryFormat::Preserve));
    }
  }
}

void CapturableSGD::step(const at::Tensor& found_inf) {
  c10::NoGradGuard no_grad;
  const std::optional<at::Tensor> skip =
      found_inf.defined() ? std::optional<at::Tensor>(found_inf) : std::nullopt;
  for (StepGroup& group : step_groups(params_, {&momentum_buffers_})) {
    // A zero buffer updated as momentum * 0 + grad equals eager's first-step
    // copy of the gradient, so is_first_step stays false (see constructor).
    at::_fused_sgd_(group.params, group.grads, group.state[0], options_.weight_decay,
                    options_.momentum, lr_, options_.dampening, options_.nesterov,
                    options_.maximize, /*is_first_step=*/false, std::nullopt, skip);
  }
}

std::vector<at::Tensor> CapturableSGD::own_state() const { return momentum_buffers_; }

}  // namespace graphed
