#pragma once

/// \file fp8_linear.h
/// graphed's float8 linear layer for training (issue 17): y = x W^T + b with
/// both products of the backward in FP8 too, through torch's scaled matrix
/// product (at::_scaled_mm), the casts fused (fp8_ops.h), per-tensor scales
/// that are device tensors (delayed or current scaling), and the weight cast
/// once per optimizer step however many microbatches run (Note [The weight is
/// cast once per step]), also across the graphs of one Float8CastScope
/// (make_graphed_callables with order=).

#include "graphed/fp8_scaling.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

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

/// Which forwards may share a kept weight cast: eager forwards share with
/// eager ones, a capture with the same capture, and inside a Float8CastScope
/// every capture of the scope with the others (Note [The weight is cast once
/// per step], Note [Weight casts shared by the graphs of a scope]).
struct Float8CastKey {
  /// Where a cast was made.
  enum class Kind : uint8_t {
    /// Eagerly (no capture on the weight's current stream), scope or not.
    kEager,
    /// While capturing, outside any Float8CastScope: keyed by the capture.
    kCapture,
    /// While capturing inside a Float8CastScope: keyed by the scope.
    kScope,
  };
  /// Where the cast was made.
  Kind kind = Kind::kEager;
  /// The CUDA capture id (kCapture) or the scope's id (kScope); 0 for kEager.
  uint64_t id = 0;

  /// Same kind and id.
  bool operator==(const Float8CastKey& other) const {
    return kind == other.kind && id == other.id;
  }
  /// Not operator==.
  bool operator!=(const Float8CastKey& other) const { return !(*this == other); }
};

/// The key of a cast made with `capture_id` (the CUDA capture id of the
/// weight's current stream, 0 when it is not capturing) while the scope
/// `scope_id` is active (0: none). Eager casts are kEager whatever the scope.
Float8CastKey float8_cast_key(unsigned long long capture_id, uint64_t scope_id);

/// The key of a cast of `weight` made now on this thread: the capture of the
/// current stream of its device and the active Float8CastScope.
Float8CastKey current_float8_cast_key(const at::Tensor& weight);

/// What the graphs captured inside one Float8CastScope cast and read: the
/// record that keeps the casts' memory alive for as long as those graphs can
/// replay (Note [Weight casts shared by the graphs of a scope]). Filled by
/// Float8WeightCache while the scope is active; read-only afterwards.
struct Float8ScopeCasts {
  /// One weight cast captured inside the scope.
  struct Cast {
    /// The weight that was cast.
    at::Tensor weight;
    /// Its version (weight._version()) when it was cast.
    int64_t weight_version = 0;
    /// Whether a cache kept it for later captures (a training forward with
    /// Recipe.cache_weights); only kept casts hold their tensors.
    bool kept = false;
    /// The FP8 weight (undefined when not kept).
    at::Tensor data;
    /// Its transpose, for the input gradient (undefined when not made or not kept).
    at::Tensor transposed;
    /// The inverse scale the products multiply by (undefined when not kept).
    at::Tensor scale_inv;
  };
  /// Every cast captured inside the scope, in capture order.
  std::vector<Cast> casts;
  /// One entry per captured forward that read a kept cast of an earlier
  /// capture instead of casting: the index of that cast in `casts`.
  std::vector<size_t> reads;
};

/// While alive, weight casts captured on this thread are kept under this
/// scope instead of under their capture, so graphs captured inside it one
/// after another share one cast per weight and step: the first capture that
/// casts a weight keeps the cast, and later captures (same weight tensor,
/// same version, same epoch, training forwards) read it and cast nothing.
/// Eager forwards inside the scope neither read nor leave casts for captures.
///
/// The contract of the graphs captured inside (make_graphed_callables opens
/// one around its captures, whose graphs share one pool and replay every
/// step in capture order): each step, the graph that casts replays before
/// the graphs that read its cast; a reader replayed without it after the
/// weights changed reads last step's cast. Keep casts() as long as any of the
/// graphs can replay: it holds the memory they read. Scopes nest (the
/// innermost is active) and must be destroyed on the thread that made them.
/// See Note [Weight casts shared by the graphs of a scope].
class Float8CastScope {
 public:
  /// Activates a new scope on this thread.
  Float8CastScope();
  /// Deactivates it (the enclosing scope, if any, is active again); the
  /// record in casts() lives on while someone holds it.
  ~Float8CastScope();
  Float8CastScope(const Float8CastScope&) = delete;
  Float8CastScope& operator=(const Float8CastScope&) = delete;

  /// This scope's id: unique in the process, never 0.
  uint64_t id() const { return id_; }
  /// What was cast and read inside the scope; null until a capture inside
  /// cast a weight through a Float8WeightCache.
  const std::shared_ptr<Float8ScopeCasts>& casts() const { return casts_; }
  /// Casts recorded so far (casts()->casts.size(), 0 without a record).
  size_t num_casts() const { return casts_ ? casts_->casts.size() : 0; }
  /// Reads recorded so far (casts()->reads.size(), 0 without a record).
  size_t num_reads() const { return casts_ ? casts_->reads.size() : 0; }

  /// The innermost scope active on this thread, or nullptr.
  static Float8CastScope* active();

 private:
  friend class Float8WeightCache;
  Float8ScopeCasts& record();

  uint64_t id_;
  Float8CastScope* enclosing_;
  std::shared_ptr<Float8ScopeCasts> casts_;
};

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

  /// The cast of `weight` kept by an earlier forward of this step under
  /// `key` (current_float8_cast_key(weight) for a forward running now), or
  /// false when there is none that this call may use. A read of a cast kept
  /// under the active Float8CastScope is recorded in the scope. Used by
  /// float8_linear.
  bool lookup(const at::Tensor& weight, const Float8CastKey& key, bool need_transposed,
              at::Tensor& data, at::Tensor& transposed, at::Tensor& scale_inv) const;
  /// Counts a cast of `weight` made under `key` and, when `keep`, keeps it
  /// for later forwards (else forgets the kept one). A cast made under the
  /// active Float8CastScope is recorded in the scope, which holds its
  /// tensors when kept. float8_linear calls it after each cast.
  void store(const at::Tensor& weight, const Float8CastKey& key, at::Tensor data,
             at::Tensor transposed, at::Tensor scale_inv, bool keep);

 private:
  at::Tensor data_;
  at::Tensor transposed_;
  at::Tensor scale_inv_;
  const void* weight_impl_ = nullptr;
  const void* weight_data_ = nullptr;
  int64_t weight_version_ = 0;
  uint64_t epoch_ = 0;
  Float8CastKey key_;
  // Index of the kept cast in its scope's record (key_.kind == kScope).
  size_t scope_cast_ = 0;
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
/// feature counts multiples of 16; a token count (input.numel() / in_features)
/// that is not is padded with zero rows when the weight is trained (Note
/// [Token counts that are not multiples of 16]). The output has the input's
/// dtype, or autocast's. Delayed scaling reads `state.scale` and merges the
/// amaxes into `state.amax`; current scaling writes `state.amax`. `cache`
/// (optional) keeps the weight's cast between microbatches.
at::Tensor float8_linear(const at::Tensor& input, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, const Float8LinearState& state,
                         const Float8Recipe& recipe, Float8WeightCache* cache = nullptr);

}  // namespace graphed
