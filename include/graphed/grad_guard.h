#pragma once

/// \file grad_guard.h
/// What happens between backward and the optimizer step of a captured training
/// iteration, with no host synchronization: fp16 loss scaling and unscaling,
/// the non-finite check of the loss and the gradients, gradient clipping by the
/// global norm, and the count of skipped steps. Everything lives in device
/// tensors, so it records into a CUDA graph and replays every step.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <vector>

namespace graphed {

/// Dynamic loss scaling for fp16, as torch.amp.GradScaler does it.
struct LossScaling {
  /// The scale the first step multiplies the loss by.
  double init_scale = 65536.0;
  /// Factor the scale grows by after growth_interval finite steps in a row.
  double growth_factor = 2.0;
  /// Factor the scale shrinks by after a step with non-finite gradients.
  double backoff_factor = 0.5;
  /// Finite steps in a row before the scale grows.
  int64_t growth_interval = 2000;
};

/// Options of GradientGuard.
struct GradientGuardOptions {
  /// Skip the optimizer step when the loss or any gradient is not finite.
  bool skip_nonfinite = false;
  /// Clip gradients to this global 2-norm (torch.nn.utils.clip_grad_norm_).
  std::optional<double> clip_grad_norm;
  /// fp16 dynamic loss scaling; implies skipping non-finite steps.
  std::optional<LossScaling> loss_scaling;
};

/// The post-backward part of a training step, all on the device.
///
/// Note [Non-finite steps inside the graph]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// A NaN check usually reads a flag on the host (`loss.item()`), which a graph
/// cannot do; Megatron-LM turns its check off for full-iteration graphs. Here
/// the check produces `found_inf`, a zero-dimensional device tensor, and the
/// optimizer reads it on the device: the fused Adam, AdamW and SGD kernels
/// return early when it is non-zero, and their step counters are decremented
/// back, so a skipped step leaves weights and optimizer state bit-identical.
/// The count of skipped steps accumulates on the device and is read only when
/// asked for. With loss scaling the gradients are unscaled by the same kernel
/// that checks them (torch's _amp_foreach_non_finite_check_and_unscale_), and
/// the scale is updated afterwards by _amp_update_scale_, as GradScaler does.
class GradientGuard {
 public:
  /// Allocates the guard's device state on `device`.
  GradientGuard(c10::Device device, GradientGuardOptions options);

  /// The loss to call backward() on: multiplied by the loss scale with fp16
  /// scaling, else `loss` itself.
  at::Tensor scale_loss(const at::Tensor& loss) const;

  /// After backward: unscales `grads` (loss scaling), checks `loss` and
  /// `grads` for non-finite values (skip_nonfinite or loss scaling), and clips
  /// `grads` (clip_grad_norm). When the step is skipped, writes the protected
  /// buffers back to their values at begin_step() (Note [Buffers of a skipped
  /// step]). Returns the found_inf flag for the optimizer, or an undefined
  /// tensor when nothing can skip the step.
  at::Tensor process(const at::Tensor& loss, const std::vector<at::Tensor>& grads);

  /// Buffers the forward updates (BatchNorm's running statistics and
  /// num_batches_tracked) that a skipped step must leave exactly as they
  /// were; see Note [Buffers of a skipped step]. Allocates a shadow copy of
  /// each on the guard's device (call it before capture). Buffers on other
  /// devices are left out (a captured iteration cannot update them), as are
  /// repeats of one tensor. Replaces buffers protected before. Does nothing
  /// unless can_skip(): a step that cannot be skipped has nothing to undo.
  void protect_buffers(const std::vector<at::Tensor>& buffers);

  /// Call at the start of each iteration, before the forward: copies the
  /// protected buffers into their shadows (device to device, one kernel per
  /// dtype, no host sync). Does nothing without protected buffers.
  void begin_step();

  /// The buffers protect_buffers() kept.
  const std::vector<at::Tensor>& protected_buffers() const { return buffers_; }

  /// After the optimizer step: updates the loss scale (loss scaling only).
  void after_step();

  /// True when process() produces a found_inf flag.
  bool can_skip() const { return options_.skip_nonfinite || options_.loss_scaling.has_value(); }
  /// Steps skipped so far. Reads a device counter (synchronizes).
  int64_t skipped_steps() const;
  /// The current loss scale, or nullopt without loss scaling (synchronizes).
  std::optional<double> loss_scale() const;
  /// The global gradient norm of the last step, when it was computed.
  const at::Tensor& grad_norm() const { return grad_norm_; }
  /// The device tensors a step changes (scale, growth tracker, skip counter):
  /// include them in a capture's state so that warm-up does not change them.
  std::vector<at::Tensor> state() const;
  /// The options.
  const GradientGuardOptions& options() const { return options_; }

 private:
  GradientGuardOptions options_;
  at::Tensor found_inf_;
  at::Tensor skipped_;
  at::Tensor scale_;
  at::Tensor growth_tracker_;
  at::Tensor grad_norm_;
  std::vector<at::Tensor> buffers_;
  std::vector<at::Tensor> shadows_;
};

/// Note [Buffers of a skipped step]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// A skipped step leaves weights and optimizer state alone because the
/// optimizer reads found_inf (Note [Non-finite steps inside the graph]). But
/// the forward has already run by then, and it updates module buffers: one
/// NaN pixel in a batch makes BatchNorm's running_mean and running_var NaN
/// for good, and num_batches_tracked counts a batch that was never trained
/// on. Whether the step is bad is only known after backward, on the device,
/// so the buffers cannot be left alone; they are put back instead:
///
/// 1. begin_step(), before the forward, copies each protected buffer into a
///    shadow tensor the guard owns (_foreach_copy_, one kernel per dtype).
/// 2. process(), once found_inf is final, writes
///    `where(found_inf > 0, shadow, buffer)` into each buffer
///    (where_out with the buffer as both the output and the "else" input).
///
/// Both are device work with no host read, so they record into the captured
/// iteration and replay every step. `where` selects elements, it does not
/// blend them: the result is bit-identical to the snapshot for every dtype,
/// including int64 counters and buffers the bad step filled with NaN, where
/// arithmetic blending (`b + f * (s - b)`, lerp) would keep the NaN. A good
/// step costs one elementwise kernel per buffer and one copy kernel per
/// dtype; the shadows cost as much memory as the buffers. Only guards that
/// can skip (skip_nonfinite or loss scaling) protect buffers.

/// Copies each of `tensors` into the shadow at the same index (same sizes and
/// device), with one _foreach_copy_ per dtype; enqueued on the current stream.
void snapshot_tensors(const std::vector<at::Tensor>& tensors,
                      const std::vector<at::Tensor>& shadows);

/// Where `flag` (a zero-dimensional tensor on the tensors' device; non-zero
/// means the step was skipped) is set, writes each shadow back into the
/// tensor at the same index, bit for bit; otherwise leaves the tensors as
/// they are. Decided on the device: no host sync. See Note [Buffers of a
/// skipped step].
void restore_tensors_if(const at::Tensor& flag, const std::vector<at::Tensor>& tensors,
                        const std::vector<at::Tensor>& shadows);

/// Scales `grads` in place so that their global 2-norm is at most `max_norm`,
/// as torch.nn.utils.clip_grad_norm_ does, without reading the norm on the
/// host. Returns the norm before clipping (a float32 device scalar).
at::Tensor clip_grad_norm(const std::vector<at::Tensor>& grads, double max_norm);

/// The global 2-norm of `grads` as a float32 device scalar (no host sync).
at::Tensor global_grad_norm(const std::vector<at::Tensor>& grads);

/// Groups tensors by dtype, keeping their order within each group: the fused
/// and foreach kernels take one dtype per list.
std::vector<std::vector<at::Tensor>> group_by_dtype(const std::vector<at::Tensor>& tensors);

}  // namespace graphed
