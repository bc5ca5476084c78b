#pragma once

/// \file optim.h
/// Optimizers for LibTorch programs that can be captured in a CUDA graph.
///
/// Note [Capturable optimizers]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// torch::optim keeps step counters and the learning rate on the host, so a
/// captured step would replay the bias correction and the learning rate of
/// the step it was captured at. These optimizers keep all of it on the device
/// (step counters, the learning rate as a one-element tensor that set_lr()
/// fills) and run torch's fused kernels (_fused_adamw_, _fused_sgd_): one
/// multi-tensor launch per dtype instead of one per parameter and operation.
/// Their state exists from construction with the values a first step expects
/// (zero moments, step 0), so a graph captured after warm-up and a restore of
/// that state replays exactly the first step eager execution would take. A
/// `found_inf` flag (see GradientGuard) skips a step on the device.

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace graphed {

/// The part every capturable optimizer shares: parameters, the learning rate
/// as a device tensor, gradient clearing and the state list for snapshots;
/// see Note [Capturable optimizers].
class CapturableOptimizer {
 public:
  virtual ~CapturableOptimizer() = default;
  CapturableOptimizer(const CapturableOptimizer&) = delete;
  CapturableOptimizer& operator=(const CapturableOptimizer&) = delete;

  /// One step over every parameter that has a gradient; skipped on the device
  /// when `found_inf` is defined and non-zero, leaving everything as it was.
  virtual void step(const at::Tensor& found_inf = at::Tensor()) = 0;
  /// Clears the gradients: drops them (set_to_none) or zeroes them in place.
  void zero_grad(bool set_to_none = true);
  /// Sets the learning rate in place on the device (graphs read the new value).
  void set_lr(double lr);
  /// The learning rate last set.
  double lr() const { return lr_value_; }
  /// The parameters.
  const std::vector<at::Tensor>& params() const { return params_; }
  /// Every state tensor (the optimizer's own and the learning rate), for snapshots.
  std::vector<at::Tensor> state() const;

 protected:
  /// Checks `params` (CUDA floating-point tensors on one device; `name`
  /// appears in messages) and creates the learning-rate tensor.
  CapturableOptimizer(std::vector<at::Tensor> params, double lr, const char* name);
  /// The subclass's state tensors (moments, counters, buffers).
  virtual std::vector<at::Tensor> own_state() const = 0;

  std::vector<at::Tensor> params_;
  at::Tensor lr_;

 private:
  double lr_value_;
};

/// Hyperparameters of CapturableAdamW (torch.optim.AdamW's defaults).
struct AdamWOptions {
  /// Learning rate.
  double lr = 1e-3;
  /// Coefficient of the running average of the gradient.
  double beta1 = 0.9;
  /// Coefficient of the running average of the squared gradient.
  double beta2 = 0.999;
  /// Added to the denominator for numerical stability.
  double eps = 1e-8;
  /// Decoupled weight decay.
  double weight_decay = 1e-2;
  /// Use the AMSGrad variant.
  bool amsgrad = false;
  /// Maximize the objective instead of minimizing it.
  bool maximize = false;
};

/// AdamW whose step can be captured in a CUDA graph.
class CapturableAdamW final : public CapturableOptimizer {
 public:
  /// Creates the optimizer and its state for `params` (CUDA floating-point
  /// tensors that require grad, on one device).
  CapturableAdamW(std::vector<at::Tensor> params, AdamWOptions options = {});

  /// One AdamW step over every parameter that has a gradient. When
  /// `found_inf` is non-zero on the device, the step leaves everything as it was.
  void step(const at::Tensor& found_inf = at::Tensor()) override;
  /// The hyperparameters it was created with.
  const AdamWOptions& options() const { return options_; }

 private:
  std::vector<at::Tensor> own_state() const override;

  AdamWOptions options_;
  std::vector<at::Tensor> exp_avgs_;
  std::vector<at::Tensor> exp_avg_sqs_;
  std::vector<at::Tensor> max_exp_avg_sqs_;
  std::vector<at::Tensor> steps_;
};

/// Hyperparameters of CapturableSGD (torch.optim.SGD's defaults).
struct SGDOptions {
  /// Learning rate.
  double lr = 1e-3;
  /// Momentum factor.
  double momentum = 0.0;
  /// Dampening for momentum; must be 0 when momentum is used (see step()).
  double dampening = 0.0;
  /// L2 penalty.
  double weight_decay = 0.0;
  /// Nesterov momentum.
  bool nesterov = false;
  /// Maximize the objective instead of minimizing it.
  bool maximize = false;
};

/// SGD whose step can be captured in a CUDA graph.
class CapturableSGD final : public CapturableOptimizer {
 public:
  /// Creates the optimizer and its momentum buffers for `params`. Momentum
  /// with dampening is refused: eager SGD's first step copies the gradient
  /// into the buffer instead of damping it, a branch a graph cannot replay.
  CapturableSGD(std::vector<at::Tensor> params, SGDOptions options = {});

  /// One SGD step over every parameter that has a gradient; skipped on the
  /// device when `found_inf` is non-zero.
  void step(const at::Tensor& found_inf = at::Tensor()) override;
  /// The hyperparameters it was created with.
  const SGDOptions& options() const { return options_; }

 private:
  std::vector<at::Tensor> own_state() const override;

  SGDOptions options_;
  std::vector<at::Tensor> momentum_buffers_;
};

}  // namespace graphed
