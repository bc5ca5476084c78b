#pragma once

/// \file fp8_linear.h
/// graphed's float8 linear layer for training (issue 17): y = x W^T + b with
/// both products of the backward in FP8 too, through torch's scaled matrix
/// product (at::_scaled_mm), the casts fused (fp8_ops.h), per-tensor scales
/// that are device tensors (delayed or current scaling), and the weight cast
/// once per optimizer step however many microbatches run (Note [The weight is
/// cast once per step]).

#include "graphed/fp8_scaling.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

namespace graphed {

/// How a float8 linear layer chooses its scales.
enum class Float8Scaling {
  /// From the amax history of earlier steps (Transformer Engine's recipe):
  /// the casts record amaxes, update_delayed_scaling (once per step) turns
  /// them into the next step's scales.
  kDelayed,
  /// From each tensor's own amax, computed right before its cast (an extra
  /// reduction kernel per cast; no state between steps).
  kCurrent,
};

/// A float8 training recipe (graphed.fp8.Recipe in Python).
struct Float8Recipe {
  /// Delayed or current scaling.
  Float8Scaling scaling = Float8Scaling::kDelayed;
  /// History length, amax reduction and margin. The margin applies to both
  /// scalings; the history to delayed scaling only.
  DelayedScalingOptions delayed;
  /// The format of the output gradients (E5M2: range; E4M3: precision).
  Float8Format grad_format = Float8Format::kE5M2;
  /// Cast the weight once per optimizer step, not once per microbatch.
  bool cache_weights = true;
  /// _scaled_mm's use_fast_accum for the forward product.
  bool fast_accum_forward = true;
  /// _scaled_mm's use_fast_accum for the two products of the backward.
  bool fast_accum_backward = false;
  /// Emulate the FP8 products with float32 matrix products on any device
  /// (casts and scales as on the GPU), for tests without a Hopper GPU.
  bool emulate = false;
};

/// Throws graphed::Error naming the field and the fix when `recipe` is out of range.
void validate_float8_recipe(const Float8Recipe& recipe);

/// "delayed" or "current"; throws graphed::Error naming the choices otherwise.
Float8Scaling parse_float8_scaling(const std::string& name);
/// "max" or "most_recent" (Transformer Engine's amax_compute_algo).
AmaxReduction parse_amax_reduction(const std::string& name);
/// "e4m3" or "e5m2".
Float8Format parse_float8_format(const std::string& name);

/// The rows of a layer's scaling state: one per FP8 tensor of the layer.
enum Float8Operand : int64_t {
  /// The input x (E4M3).
  kFloat8Input = 0,
  /// The weight W (E4M3).
  kFloat8Weight = 1,
  /// The gradient of the output (the recipe's grad_format).
  kFloat8GradOutput = 2,
};

/// One layer's scaling state: float32 [3] tensors indexed by Float8Operand,
/// usually views of a model's DelayedScalingTable, on the layer's device.
struct Float8LinearState {
  /// This step's amax of each tensor (merged by the casts).
  at::Tensor amax;
  /// The scale each cast multiplies by (delayed scaling).
  at::Tensor scale;
  /// 1 / scale.
  at::Tensor scale_inv;
};

/// Throws graphed::Error when `state`'s tensors are not float32 [3] on `device`.
void validate_float8_linear_state(const Float8LinearState& state, c10::Device device);

/// The weight's FP8 cast kept between the microbatches of one optimizer step
/// (Note [The weight is cast once per step]). One per layer; not thread-safe.
class Float8WeightCache {
 public:
  /// An empty cache.
  Float8WeightCache() = default;

  /// Forgets the cast; the next training forward casts again.
  void clear();
  /// How many times a forward cast the weight through this cache (eagerly
  /// or while capturing; replays of a graph are not counted).
  int64_t casts() const { return casts_; }
  /// Whether a cast is kept.
  bool holds_cast() const { return data_.defined(); }

  /// The cast of `weight` kept by an earlier forward of this step, or an
  /// empty result when there is none that this call may use. Used by
  /// float8_linear.
  bool lookup(const at::Tensor& weight, bool need_transposed, at::Tensor& data,
              at::Tensor& transposed, at::Tensor& scale_inv) const;
  /// Keeps the cast of `weight`; float8_linear calls it after each cast.
  void store(const at::Tensor& weight, at::Tensor data, at::Tensor transposed,
             at::Tensor scale_inv, bool keep);

 private:
  at::Tensor data_;
  at::Tensor transposed_;
  at::Tensor scale_inv_;
  const void* weight_impl_ = nullptr;
  const void* weight_data_ = nullptr;
  int64_t weight_version_ = 0;
  uint64_t epoch_ = 0;
  unsigned long long capture_id_ = 0;
  int64_t casts_ = 0;
};

/// Starts a new step for every Float8WeightCache: casts kept so far are not
/// used again. Called by update_scales (once per step) and by replays of a
/// captured training step, which change the weights without a version bump.
void advance_float8_weight_epoch();

/// y = input W^T + bias with FP8 products (an autograd function: backward
/// computes the input, weight and bias gradients, the products in FP8).
/// `input` is [..., in_features] in float32, bfloat16 or float16; `weight`
/// [out_features, in_features] (float32 master weights are fine); both
/// feature counts multiples of 16, and the token count (input.numel() /
/// in_features) too when the weight is trained. The output has the input's
/// dtype, or autocast's. Delayed scaling reads `state.scale` and merges the
/// amaxes into `state.amax`; current scaling writes `state.amax`. `cache`
/// (optional) keeps the weight's cast between microbatches.
at::Tensor float8_linear(const at::Tensor& input, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, const Float8LinearState& state,
                         const Float8Recipe& recipe, Float8WeightCache* cache = nullptr);

}  // namespace graphed
