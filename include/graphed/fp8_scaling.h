#pragma once

/// \file fp8_scaling.h
/// The arithmetic of FP8 training's per-tensor scales (issue 17): the two FP8
/// formats, the scale that maps an amax onto a format's range, the saturating
/// cast, and DelayedScaling, one tensor's amax history and scale. Every update
/// is a device tensor operation, so a captured graph replays it each step
/// (Note [FP8 scales live on the device]).

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace graphed {

/// Note [FP8 scales live on the device]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// An FP8 tensor holds x * scale cast to 8 bits; the scale keeps the largest
/// magnitude (amax) near the format's largest finite value, so that small
/// values keep their precision and none overflows. Delayed scaling, Transformer
/// Engine's recipe, casts step k with the scale computed from the amaxes of
/// the steps before it: each cast records its tensor's amax into a history,
/// and after the step the scale becomes float8_max / max(history) / 2^margin.
/// Computed on the host, that is a read per tensor per step, which a graph
/// cannot replay: a captured step would cast with the scale of the step it was
/// captured at, forever. So the history, the slot it writes next, the scale
/// and its inverse are device tensors, and recording and updating are tensor
/// operations (index_copy_ at a device index, a max, a where); a replay
/// advances them like an eager step does. An amax of zero (a tensor of zeros)
/// or one that is not finite (an overflowed step, which the gradient guard
/// skips) leaves the scale as it was, as Transformer Engine does.
/// The amax is recorded per call, and reduced across ranks (once per step,
/// after every backward graph) by whoever owns the step, through
/// record_amax_value.

/// The two FP8 formats of Hopper tensor cores: E4M3 (more precision; forward
/// activations and weights) and E5M2 (more range; gradients).
enum class Float8Format { kE4M3, kE5M2 };

/// The largest finite value of `format`: 448 (E4M3), 57344 (E5M2).
double float8_max(Float8Format format);

/// The ATen dtype of `format`: float8_e4m3fn or float8_e5m2.
c10::ScalarType float8_dtype(Float8Format format);

/// Which amax of the history the next scale follows.
enum class AmaxReduction {
  /// The largest of the last history_len steps (Transformer Engine's default).
  kMax,
  /// The last step's.
  kMostRecent,
};

/// Options of DelayedScaling (the fields of Transformer Engine's DelayedScaling).
struct DelayedScalingOptions {
  /// How many steps' amaxes are remembered (>= 1).
  int64_t history_len = 16;
  /// How the history becomes the amax the scale follows.
  AmaxReduction reduction = AmaxReduction::kMax;
  /// Headroom in powers of two (>= 0): the scale is divided by 2^margin.
  int64_t margin = 0;
};

/// Throws graphed::Error naming the field and the fix when `options` are out
/// of range.
void validate_delayed_scaling_options(const DelayedScalingOptions& options);

/// float8_max(format) / amax / 2^margin where that is finite and amax is
/// positive and finite; `previous` elsewhere. `amax` and `previous` are float32
/// tensors of one shape on one device; no host read (Note [FP8 scales live on
/// the device]).
at::Tensor scale_from_amax(const at::Tensor& amax, const at::Tensor& previous,
                           Float8Format format, int64_t margin);

/// The amax of `x` as a float32 scalar tensor on its device: max(|x|).
at::Tensor amax_of(const at::Tensor& x);

/// `x` * `scale`, saturated to +-float8_max(format), in `format`'s dtype. The
/// product is formed in float32 whatever x's dtype.
at::Tensor cast_to_float8(const at::Tensor& x, const at::Tensor& scale, Float8Format format);

/// Dynamic (current) scaling: the scale from `x`'s own amax, with 1 where x
/// is all zeros or not finite.
at::Tensor current_scale(const at::Tensor& x, Float8Format format, int64_t margin = 0);

/// One tensor's delayed scaling: its amax history, the slot the next amax
/// goes to, its scale (1 at first) and inverse scale, all on one device.
/// Record each step's amax (record_amax on the tensor, or record_amax_value
/// with an amax already reduced across ranks), then call update_scale() once
/// per step; cast() uses the current scale. Movable, not copyable.
class DelayedScaling {
 public:
  /// State for `format` on `device`; validates `options`.
  DelayedScaling(Float8Format format, DelayedScalingOptions options, c10::Device device);

  /// Writes amax(|x|) into the history's next slot.
  void record_amax(const at::Tensor& x);
  /// Writes `amax` (a scalar or one-element tensor on this state's device).
  void record_amax_value(const at::Tensor& amax);
  /// The scale from the history (Note [FP8 scales live on the device]); then
  /// the next record goes to the following slot, the oldest one.
  void update_scale();

  /// `x` cast with the current scale (cast_to_float8).
  at::Tensor cast(const at::Tensor& x) const;

  /// The current scale, float32 [1].
  const at::Tensor& scale() const { return scale_; }
  /// 1 / scale(), float32 [1]: what a scaled matmul multiplies its result by.
  const at::Tensor& scale_inv() const { return scale_inv_; }
  /// The amaxes of the last history_len steps, float32 [history_len], in slot order.
  const at::Tensor& amax_history() const { return history_; }
  /// The tensors of this state (history, next slot, scale, inverse scale), for
  /// snapshots around warm-up and capture and for state_dict.
  std::vector<at::Tensor> state() const;

  /// The format it casts to.
  Float8Format format() const { return format_; }
  /// The options it was built with.
  const DelayedScalingOptions& options() const { return options_; }

 private:
  Float8Format format_;
  DelayedScalingOptions options_;
  at::Tensor history_;    // float32 [history_len]
  at::Tensor next_slot_;  // int64 [1]
  at::Tensor scale_;      // float32 [1]
  at::Tensor scale_inv_;  // float32 [1]
};

}  // namespace graphed
