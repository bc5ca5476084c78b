#pragma once

/// \file fp8_ops.h
/// The fused operations of FP8 training (issue 17): the scaled saturating
/// cast that also writes the transpose and records the amax, current
/// scaling's amax, and the delayed-scaling update of every tensor of a model
/// in one launch (Note [Fused FP8 casts] in src/device/fp8_kernels.cu). CUDA
/// tensors run graphed's kernels; CPU tensors, and every tensor with
/// Float8Kernels::kAten, run the ATen sequences the kernels replace
/// (fp8_scaling.h), which the GPU tests compare them with.

#include "graphed/fp8_scaling.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

namespace graphed {

/// Which implementation an FP8 operation runs.
enum class Float8Kernels {
  /// graphed's fused kernels for CUDA tensors, the ATen sequence for others.
  kAuto,
  /// The ATen sequence everywhere (the reference of the GPU tests).
  kAten,
};

/// What a fused cast writes; fields that were not asked for are undefined.
struct Float8CastResult {
  /// [rows, cols] (the input's shape), the input times the scale saturated
  /// to the format's range, in the format's dtype.
  at::Tensor data;
  /// [cols, rows], contiguous: the transpose of `data` (2-D inputs only).
  at::Tensor transposed;
};

/// Which outputs a cast writes, and where it records the input's amax.
struct Float8CastOutputs {
  /// Write the cast in the input's shape.
  bool data = true;
  /// Write the transposed cast ([cols, rows] contiguous; needs a 2-D input).
  bool transposed = false;
  /// A float32 one-element tensor on the input's device into which
  /// max(|input|) is merged (amax = max(amax, amax_of(input))); undefined:
  /// none is recorded.
  at::Tensor amax;
};

/// Casts `x` (float32, bfloat16 or float16) to `format` with `scale` (a
/// float32 one-element tensor on x's device), in one pass over x on CUDA:
/// cast_to_float8(x, scale, format), its transpose and its amax as asked
/// (Note [Fused FP8 casts]).
Float8CastResult cast_to_float8_fused(const at::Tensor& x, const at::Tensor& scale,
                                      Float8Format format, const Float8CastOutputs& outputs,
                                      Float8Kernels kernels = Float8Kernels::kAuto);

/// Current (dynamic) scaling: amax_of(x) into `outputs.amax` (required; it is
/// overwritten, not merged), then the cast with the scale of that amax
/// (current_scale's rule, with `margin`), whose value and inverse are written
/// into `scale_out` and `scale_inv_out` (float32 one-element tensors). Two
/// kernels on CUDA.
Float8CastResult cast_to_float8_current(const at::Tensor& x, Float8Format format, int64_t margin,
                                        const Float8CastOutputs& outputs,
                                        const at::Tensor& scale_out,
                                        const at::Tensor& scale_inv_out,
                                        Float8Kernels kernels = Float8Kernels::kAuto);

/// Merges max(|x|) into `amax` (a float32 one-element tensor on x's device).
void record_amax(const at::Tensor& x, const at::Tensor& amax,
                 Float8Kernels kernels = Float8Kernels::kAuto);

/// The delayed scaling of many tensors (every FP8 tensor of a model), one
/// row each, in flat device tensors so that one all_reduce and one kernel
/// serve them all. Row t follows the semantics of one DelayedScaling.
struct DelayedScalingTable {
  /// float32 [tensors, history_len]: each row's amaxes of the last steps.
  at::Tensor history;
  /// float32 [tensors]: this step's amax of each tensor so far (the casts
  /// merge into it; the update consumes it and sets it to zero).
  at::Tensor amax;
  /// float32 [tensors]: the scale each cast multiplies by.
  at::Tensor scale;
  /// float32 [tensors]: 1 / scale, what a scaled product multiplies by.
  at::Tensor scale_inv;
  /// float32 [tensors]: float8_max of each row's format.
  at::Tensor format_max;
  /// int64 [1]: the history column the next update writes (shared by all rows).
  at::Tensor slot;
};

/// A table for tensors of `formats` on `device`: empty history, amax 0,
/// scale 1. Validates `options`.
DelayedScalingTable make_delayed_scaling_table(const std::vector<Float8Format>& formats,
                                               const DelayedScalingOptions& options,
                                               c10::Device device);

/// Throws graphed::Error naming the field and the fix when the table's
/// tensors do not have the shapes, dtypes and device of one table with
/// `options.history_len` columns.
void validate_delayed_scaling_table(const DelayedScalingTable& table,
                                    const DelayedScalingOptions& options);

/// Once per step, after every cast of the step (and after the amaxes are
/// reduced across ranks): for every row, what DelayedScaling's
/// record_amax_value(amax[t]) then update_scale() do; then every amax is set
/// to zero for the next step. One kernel on CUDA.
void update_delayed_scaling(const DelayedScalingTable& table, const DelayedScalingOptions& options,
                            Float8Kernels kernels = Float8Kernels::kAuto);

}  // namespace graphed
