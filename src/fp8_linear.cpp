// The float8 linear layer (fp8_linear.h): an autograd function whose three
// products run in FP8 through at::_scaled_mm, its casts fused (fp8_ops.h),
// and the weight's cast kept between microbatches.

#include "graphed/fp8_linear.h"

#include "graphed/check.h"
#include "graphed/fp8_ops.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace graphed {

// Note [The weight is cast once per step]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With gradient accumulation every microbatch's forward would cast the same
// weight again: the weight only changes at the optimizer step. Transformer
// Engine asks the caller to say which microbatch is the first
// (is_first_microbatch); graphed finds out itself. The optimizer updates the
// weight in place, which bumps its version counter (weight._version), and it
// does so while a step is being captured too, at capture time. So a forward
// may reuse the cast an earlier forward kept when the weight is the same
// tensor at the same version, and:
//   - the same capture made it (the CUDA capture id of the stream), or both
//     run eagerly, or both were captured inside one Float8CastScope (Note
//     [Weight casts shared by the graphs of a scope]): the cache key,
//     Float8CastKey. A cast kept in one graph lives in that graph's pool and
//     is rewritten by its replays; a graph that read an eager cast would read
//     it forever, after the optimizer changed the weight. So a captured
//     TrainStep with microbatches=N casts the weight in the first
//     microbatch's forward only, and every replay does the same;
//     make_graphed_callables (with order= or not) casts it in the first
//     forward graph that uses it and its later forward graphs read that
//     cast; other separately captured graphs (auto, graphed.capture,
//     torch.cuda.graph) each cast;
//   - no step boundary passed in between (the epoch): replays of a captured
//     training step change the weight without any host-side version bump,
//     and update_scales ends a step; both advance the epoch, so an eager
//     forward after them casts again;
//   - the forward trains (grad mode on, something requires grad). An
//     evaluation forward always casts and keeps nothing: an evaluation graph
//     must not bake in a training cast.
// Under delayed scaling the weight's scale only changes in update_scales, at
// the step boundary, so the kept cast was made with the scale the step uses;
// under current scaling the cast keeps its own inverse scale. The weight's
// amax (its row of state.amax) is recorded by the forward that casts only; a
// forward that reuses a cast records nothing for the weight, which changes
// nothing: the amax of the same weight is the same number, and delayed
// scaling merges amaxes with max until update_scales.
// Recipe.cache_weights=False turns this off, to measure what it saves.

// Note [Weight casts shared by the graphs of a scope]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Extends Note [The weight is cast once per step] to graphs captured one
// after another, which Transformer Engine's fp8_weight_caching does with
// is_first_microbatch. make_graphed_callables(..., order=...) captures a
// forward graph per callable and microbatch into one pool, and its contract
// is that they replay every step in capture order. So the first microbatch's
// forward graph can cast the weight and the later microbatches' forward
// graphs (and every backward graph, which reads the transposed cast saved by
// its forward) can read that cast.
//
// Keying. While a Float8CastScope is active on the thread, a cast made while
// capturing is kept under the scope (Float8CastKey::kScope, the scope's id)
// instead of the capture id, so a later capture inside the same scope finds
// it; the other conditions are unchanged (same weight tensor, version and
// epoch, a training forward). An eager forward keeps the key kEager inside a
// scope too: a graph never reads an eager cast (it would read it forever),
// and an eager forward never reads a graph's cast (its memory is only
// rewritten when the graph replays). Outside a scope nothing changes.
//
// Lifetime. The graph that casts writes the cast into memory of the pool at
// every replay; the graphs that read it hold its address. That memory must
// stay allocated as long as any of them can replay: were it freed, the
// caching allocator would hand it to the next capture into that pool (a later
// capture of the same make_graphed_callables, whose temporaries would then
// overwrite the cast between the caster's and a reader's replay, or a later
// capture that shares the pool). The cache alone cannot promise that: it
// keeps one entry per layer and drops it at the next store (an eager forward,
// the next capture elsewhere), and an autograd graph keeps only the
// transposed cast, and only until its backward is captured. So the scope
// records every cast captured inside it, holding the tensors of the kept
// ones (Float8ScopeCasts), from the store on: no later capture of the scope
// can reuse that memory. make_graphed_callables keeps the record with its
// graphs (GraphedCallablesShared), so the casts are freed with the last of
// those graphs, never before. That costs no memory the pool had not already
// given them.
//
// Stale casts. The price of the contract is that a reader graph replayed
// without the caster after the weights changed reads last step's cast (TE's
// is_first_microbatch=False does that silently). make_graphed_callables
// refuses such a replay instead (graphed_callable.cpp,
// see Note [Readers of a shared cast replay after its caster]). The amax is
// recorded by the caster only, as in Note [The weight is cast once per step];
// update_scales must run after the last microbatch (as it must anyway), or
// the readers would pair the old cast with the new inverse scale.

// Note [Token counts that are not multiples of 16]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The weight gradient is grad_output^T x input: an FP8 product whose inner
// dimension is the token count, and FP8 tensor cores (torch._scaled_mm) need
// every dimension a multiple of 16. Models nobody here wrote rarely oblige: a
// ViT on 32x32 images with 8x8 patches has 17 tokens per image (16 patches
// and the class token). Rather than refuse them, a training forward pads the
// tokens with zero rows up to the next multiple of 16 and drops the extra
// output rows (ATen's pad and narrow, outside the autograd function, so
// their own backward zero-pads the output gradient). Zero rows change
// nothing that is kept: they add nothing to the weight and bias gradients,
// and an amax of zeros is 0, which max-merging ignores. They cost a copy of
// the input and of the output gradient, of the layer's size. Without a
// weight gradient nothing runs over the tokens and no padding is needed.

namespace {

constexpr int64_t kTokenMultiple = 16;

std::atomic<uint64_t> weight_epoch{0};
std::atomic<uint64_t> next_scope_id{1};
thread_local Float8CastScope* active_scope = nullptr;

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

unsigned long long capture_id_of(const at::Tensor& weight) {
  if (!weight.is_cuda()) {
    return 0;
  }
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  GRAPHED_CHECK_CUDA(cudaStreamGetCaptureInfo(
      c10::cuda::getCurrentCUDAStream(weight.device().index()).stream(), &status, &id));
  return status == cudaStreamCaptureStatusActive ? id : 0;
}

// A cast operand and the inverse scale its product multiplies by.
struct Operand {
  at::Tensor data;
  at::Tensor transposed;
  at::Tensor scale_inv;  // float32, 0-dim
};

Operand cast_operand(const at::Tensor& x, Float8Operand row, Float8Format format,
                     const Float8LinearState& state, const Float8Recipe& recipe, bool data,
                     bool transposed) {
  Float8CastOutputs outputs;
  outputs.data = data;
  outputs.transposed = transposed;
  outputs.amax = state.amax.narrow(0, row, 1);
  Operand operand;
  Float8CastResult result;
  if (recipe.scaling == Float8Scaling::kDelayed) {
    result = cast_to_float8_fused(x, state.scale.narrow(0, row, 1), format, outputs);
    operand.scale_inv = state.scale_inv.select(0, row);
  } else {
    // Fresh scales per cast: a pipelined schedule may run the next
    // microbatch's forward before this one's backward reads them.
    // The inverse scale 16 bytes in, so that _scaled_mm can read it in place
    // (Note [Scales aligned to 16 bytes]).
    const at::Tensor scales = at::empty({8}, state.amax.options());
    result = cast_to_float8_current(x, format, recipe.delayed.margin, outputs,
                                    scales.narrow(0, 0, 1), scales.narrow(0, 4, 1));
    operand.scale_inv = scales.select(0, 4);
  }
  operand.data = result.data;
  operand.transposed = result.transposed;
  return operand;
}

// at::_scaled_mm(a, b) * scale_a * scale_b (+ bias) in `out_dtype`; `a`
// row-major, `b` column-major. Emulated: the same in float32 matrix products.
at::Tensor scaled_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                         const at::Tensor& scale_b, const std::optional<at::Tensor>& bias,
                         at::ScalarType out_dtype, bool fast_accum, bool emulate) {
  if (emulate) {
    at::Tensor out = at::matmul(a.to(at::kFloat) * scale_a, b.to(at::kFloat) * scale_b);
    if (bias) {
      out.add_(bias->to(at::kFloat));
    }
    return out.to(out_dtype);
  }
  // Note [Scales aligned to 16 bytes]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // cuBLASLt finds no FP8 algorithm (CUBLAS_STATUS_NOT_SUPPORTED) when a scale's address is not 16-byte
  // aligned, and the per-operand scales are elements of [3]-tensors (4-byte
  // steps). Seen on the H200 with torch 2.11; PyTorch's async-TP hit the same
  // (pytorch/pytorch#159957). A misaligned scale is copied to a fresh (256-byte
  // aligned) scalar: one tiny copy kernel, captured like the rest.
  const auto aligned = [](const at::Tensor& scale) {
    return reinterpret_cast<uintptr_t>(scale.data_ptr()) % 16 == 0 ? scale : scale.clone();
  };
  // _scaled_mm adds a bias in its epilogue for bfloat16 and float16 outputs
  // (a bias of the output's dtype); a float32 output gets it added after.
  const bool bias_in_product = bias && (out_dtype == at::kBFloat16 || out_dtype == at::kHalf);
  at::Tensor out = at::_scaled_mm(
      a, b, aligned(scale_a), aligned(scale_b),
      bias_in_product ? std::optional<at::Tensor>(bias->to(out_dtype)) : std::nullopt,
      std::nullopt, out_dtype, fast_accum);
  if (bias && !bias_in_product) {
    out.add_(*bias);
  }
  return out;
}

struct Float8LinearFunction : public torch::autograd::Function<Float8LinearFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               const Float8LinearState& state, const Float8Recipe& recipe,
                               Float8WeightCache* cache, bool input_grad, bool weight_grad,
                               bool bias_grad) {
    const int64_t in_features = weight.size(1);
    const int64_t out_features = weight.size(0);
    const at::Tensor x = input.reshape({-1, in_features});
    const bool trains = input_grad || weight_grad || bias_grad;
    const c10::DeviceType device_type = input.device().type();
    const at::ScalarType out_dtype = at::autocast::is_autocast_enabled(device_type)
                                         ? at::autocast::get_autocast_dtype(device_type)
                                         : input.scalar_type();

    const Operand x8 = cast_operand(x, kFloat8Input, Float8Format::kE4M3, state, recipe,
                                    /*data=*/true, /*transposed=*/weight_grad);
    Operand w8;
    const bool use_cache = cache != nullptr && recipe.cache_weights && trains;
    // An uncached cast outside a scope needs no key (it is not kept).
    const Float8CastKey key = use_cache || Float8CastScope::active() != nullptr
                                  ? current_float8_cast_key(weight)
                                  : Float8CastKey{};
    if (!use_cache ||
        !cache->lookup(weight, key, input_grad, w8.data, w8.transposed, w8.scale_inv)) {
      w8 = cast_operand(weight, kFloat8Weight, Float8Format::kE4M3, state, recipe,
                        /*data=*/true, /*transposed=*/input_grad);
      if (cache != nullptr) {
        cache->store(weight, key, w8.data, w8.transposed, w8.scale_inv, use_cache);
      }
    }
    const at::Tensor y = scaled_matmul(x8.data, w8.data.t(), x8.scale_inv, w8.scale_inv, bias,
                                       out_dtype, recipe.fast_accum_forward, recipe.emulate);

    if (trains) {
      auto& saved = ctx->saved_data;
      saved["x8t"] = x8.transposed;
      saved["x_scale_inv"] = x8.scale_inv;
      saved["w8t"] = w8.transposed;
      saved["w_scale_inv"] = w8.scale_inv;
      saved["amax"] = state.amax;
      saved["scale"] = state.scale;
      saved["scale_inv"] = state.scale_inv;
      saved["input_sizes"] = input.sizes().vec();
      saved["input_dtype"] = input.scalar_type();
      saved["weight_dtype"] = weight.scalar_type();
      saved["bias_dtype"] = bias ? bias->scalar_type() : at::kFloat;
      saved["input_grad"] = input_grad;
      saved["weight_grad"] = weight_grad;
      saved["bias_grad"] = bias_grad;
      saved["delayed"] = recipe.scaling == Float8Scaling::kDelayed;
      saved["grad_e4m3"] = recipe.grad_format == Float8Format::kE4M3;
      saved["margin"] = recipe.delayed.margin;
      saved["fast_accum"] = recipe.fast_accum_backward;
      saved["emulate"] = recipe.emulate;
    }
    std::vector<int64_t> out_sizes = input.sizes().vec();
    out_sizes.back() = out_features;
    return {y.view(out_sizes)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto& saved = ctx->saved_data;
    const bool input_grad = saved["input_grad"].toBool();
    const bool weight_grad = saved["weight_grad"].toBool();
    const bool bias_grad = saved["bias_grad"].toBool();
    Float8LinearState state;
    state.amax = saved["amax"].toTensor();
    state.scale = saved["scale"].toTensor();
    state.scale_inv = saved["scale_inv"].toTensor();
    Float8Recipe recipe;
    recipe.scaling = saved["delayed"].toBool() ? Float8Scaling::kDelayed : Float8Scaling::kCurrent;
    recipe.delayed.margin = saved["margin"].toInt();
    const Float8Format grad_format =
        saved["grad_e4m3"].toBool() ? Float8Format::kE4M3 : Float8Format::kE5M2;
    const bool fast_accum = saved["fast_accum"].toBool();
    const bool emulate = saved["emulate"].toBool();
    const std::vector<int64_t> input_sizes = saved["input_sizes"].toIntVector();

    const at::Tensor& grad_output = grad_outputs[0];
    const at::Tensor g = grad_output.reshape({-1, grad_output.size(-1)});
    const Operand g8 = cast_operand(g, kFloat8GradOutput, grad_format, state, recipe,
                                    /*data=*/input_grad, /*transposed=*/weight_grad);
    at::Tensor grad_input;
    at::Tensor grad_weight;
    at::Tensor grad_bias;
    if (input_grad) {
      const at::Tensor w8t = saved["w8t"].toTensor();
      grad_input = scaled_matmul(g8.data, w8t.t(), g8.scale_inv, saved["w_scale_inv"].toTensor(),
                                 std::nullopt, saved["input_dtype"].toScalarType(), fast_accum,
                                 emulate)
                       .view(input_sizes);
    }
    if (weight_grad) {
      const at::Tensor x8t = saved["x8t"].toTensor();
      grad_weight = scaled_matmul(g8.transposed, x8t.t(), g8.scale_inv,
                                  saved["x_scale_inv"].toTensor(), std::nullopt,
                                  saved["weight_dtype"].toScalarType(), fast_accum, emulate);
    }
    if (bias_grad) {
      grad_bias = g.sum({0}, /*keepdim=*/false, at::kFloat).to(saved["bias_dtype"].toScalarType());
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void check_supported(const at::Tensor& input, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, const Float8Recipe& recipe) {
  GRAPHED_CHECK(weight.dim() == 2, "Expected a 2-D weight [out_features, in_features], got ",
                weight.dim(), " dimensions ", weight.sizes(), ".");
  const int64_t out_features = weight.size(0);
  const int64_t in_features = weight.size(1);
  GRAPHED_CHECK(in_features % 16 == 0 && out_features % 16 == 0,
                "Expected in_features and out_features to be multiples of 16 (FP8 matrix products ",
                "need it), got ", in_features, " and ", out_features,
                ". Keep this layer in high precision (graphed.fp8.convert skips it); see ",
                "docs/troubleshooting.md#fp8-dims-not-multiple-of-16.");
  GRAPHED_CHECK(input.dim() >= 1 && input.size(-1) == in_features, "Expected an input [..., ",
                in_features, "] (in_features of the weight), got ", input.sizes(), ".");
  for (const at::Tensor* t : {&input, &weight}) {
    const auto type = t->scalar_type();
    GRAPHED_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf,
                  "Expected the ", t == &input ? "input" : "weight",
                  " of a float8 linear layer in float32, bfloat16 or float16, got ", type,
                  ". Cast it (model.float()); see docs/troubleshooting.md#fp8-unsupported-dtype.");
  }
  GRAPHED_CHECK(input.device() == weight.device(), "Expected the input on the weight's device ",
                weight.device(), ", got ", input.device(), ". Move the input to the model's device.");
  if (bias) {
    GRAPHED_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->device() ==
                      weight.device(),
                  "Expected a bias [", out_features, "] on ", weight.device(), ", got ",
                  bias->sizes(), " on ", bias->device(), ".");
  }
  if (!recipe.emulate) {
    GRAPHED_CHECK(input.is_cuda(), "Expected CUDA tensors for a float8 linear layer (its ",
                  "products run on FP8 tensor cores), got the input on ", input.device(),
                  ". Move the model to the GPU, or use Recipe(emulate=True) to emulate FP8 in ",
                  "float32 (for tests); see docs/troubleshooting.md#fp8-needs-cuda.");
    const cudaDeviceProp* properties = at::cuda::getDeviceProperties(input.device().index());
    const int capability = properties->major * 10 + properties->minor;
    GRAPHED_CHECK(capability >= 89, "Expected a GPU with FP8 tensor cores (compute capability ",
                  "8.9 or newer: Ada, Hopper, Blackwell), got ", properties->name,
                  " (compute capability ", properties->major, ".", properties->minor,
                  "). Train in bf16 on this GPU, or use Recipe(emulate=True); see ",
                  "docs/troubleshooting.md#fp8-needs-cuda.");
  }
}

}  // namespace

void validate_float8_recipe(const Float8Recipe& recipe) {
  validate_delayed_scaling_options(recipe.delayed);
}

Float8Scaling parse_float8_scaling(const std::string& name) {
  if (name == "delayed") {
    return Float8Scaling::kDelayed;
  }
  GRAPHED_CHECK(name == "current", "Expected scaling \"delayed\" (scales from the amax history ",
                "of earlier steps) or \"current\" (from each tensor's own amax), got \"", name,
                "\".");
  return Float8Scaling::kCurrent;
}

AmaxReduction parse_amax_reduction(const std::string& name) {
  if (name == "max") {
    return AmaxReduction::kMax;
  }
  GRAPHED_CHECK(name == "most_recent", "Expected amax_compute \"max\" (the largest amax of the ",
                "history) or \"most_recent\" (the last step's), got \"", name, "\".");
  return AmaxReduction::kMostRecent;
}

Float8Format parse_float8_format(const std::string& name) {
  if (name == "e4m3") {
    return Float8Format::kE4M3;
  }
  GRAPHED_CHECK(name == "e5m2", "Expected an FP8 format \"e5m2\" (range, the usual one for ",
                "gradients) or \"e4m3\" (precision), got \"", name, "\".");
  return Float8Format::kE5M2;
}

void validate_float8_linear_state(const Float8LinearState& state, c10::Device device) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"amax", &state.amax},
                                {"scale", &state.scale},
                                {"scale_inv", &state.scale_inv}}) {
    GRAPHED_CHECK(t->defined() && t->dim() == 1 && t->size(0) == 3 &&
                      t->scalar_type() == at::kFloat && t->device() == device,
                  "Expected the layer's ", name, " to be a float32 [3] tensor on ", device,
                  " (one row per FP8 tensor: input, weight, output gradient), got ",
                  t->defined() ? c10::str(t->scalar_type(), " ", t->sizes(), " on ", t->device())
                               : "none",
                  ". Move the model with .to(device) after graphed.fp8.convert, which moves the ",
                  "scaling state with it.");
  }
}

Float8CastKey float8_cast_key(unsigned long long capture_id, uint64_t scope_id) {
  if (capture_id == 0) {
    return {Float8CastKey::Kind::kEager, 0};
  }
  if (scope_id != 0) {
    return {Float8CastKey::Kind::kScope, scope_id};
  }
  return {Float8CastKey::Kind::kCapture, capture_id};
}

Float8CastKey current_float8_cast_key(const at::Tensor& weight) {
  return float8_cast_key(capture_id_of(weight), active_scope != nullptr ? active_scope->id() : 0);
}

Float8CastScope::Float8CastScope() : id_(next_scope_id.fetch_add(1)), enclosing_(active_scope) {
  active_scope = this;
}

Float8CastScope::~Float8CastScope() {
  // Scopes are RAII objects of one thread, so the innermost one ends first.
  active_scope = enclosing_;
}

Float8CastScope* Float8CastScope::active() { return active_scope; }

Float8ScopeCasts& Float8CastScope::record() {
  if (!casts_) {
    casts_ = std::make_shared<Float8ScopeCasts>();
  }
  return *casts_;
}

namespace {

// The active scope when `key` names it: a cast or read to record there.
Float8CastScope* scope_of(const Float8CastKey& key) {
  Float8CastScope* scope = Float8CastScope::active();
  return key.kind == Float8CastKey::Kind::kScope && scope != nullptr && scope->id() == key.id
             ? scope
             : nullptr;
}

}  // namespace

void Float8WeightCache::clear() {
  data_ = at::Tensor();
  transposed_ = at::Tensor();
  scale_inv_ = at::Tensor();
  weight_impl_ = nullptr;
  weight_data_ = nullptr;
}

bool Float8WeightCache::lookup(const at::Tensor& weight, const Float8CastKey& key,
                               bool need_transposed, at::Tensor& data, at::Tensor& transposed,
                               at::Tensor& scale_inv) const {
  if (!data_.defined() || weight.unsafeGetTensorImpl() != weight_impl_ ||
      weight.data_ptr() != weight_data_ || weight._version() != weight_version_ ||
      epoch_ != weight_epoch.load() || key_ != key ||
      (need_transposed && !transposed_.defined())) {
    return false;
  }
  data = data_;
  transposed = transposed_;
  scale_inv = scale_inv_;
  // Note [Weight casts shared by the graphs of a scope]: the scope learns
  // which capture reads which cast.
  if (Float8CastScope* scope = scope_of(key)) {
    scope->record().reads.push_back(scope_cast_);
  }
  return true;
}

void Float8WeightCache::store(const at::Tensor& weight, const Float8CastKey& key,
                              at::Tensor data, at::Tensor transposed, at::Tensor scale_inv,
                              bool keep) {
  ++casts_;
  if (Float8CastScope* scope = scope_of(key)) {
    // The scope holds kept casts for as long as its graphs may read them
    // (Note [Weight casts shared by the graphs of a scope]).
    Float8ScopeCasts& record = scope->record();
    Float8ScopeCasts::Cast cast;
    cast.weight = weight;
    cast.weight_version = weight._version();
    cast.kept = keep;
    if (keep) {
      cast.data = data;
      cast.transposed = transposed;
      cast.scale_inv = scale_inv;
    }
    scope_cast_ = record.casts.size();
    record.casts.push_back(std::move(cast));
  }
  if (!keep) {
    clear();
    return;
  }
  data_ = std::move(data);
  transposed_ = std::move(transposed);
  scale_inv_ = std::move(scale_inv);
  weight_impl_ = weight.unsafeGetTensorImpl();
  weight_data_ = weight.data_ptr();
  weight_version_ = weight._version();
  epoch_ = weight_epoch.load();
  key_ = key;
}

void advance_float8_weight_epoch() {
  weight_epoch.fetch_add(1);
}

at::Tensor float8_linear(const at::Tensor& input, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, const Float8LinearState& state,
                         const Float8Recipe& recipe, Float8WeightCache* cache) {
  validate_float8_recipe(recipe);
  const bool grad_mode = at::GradMode::is_enabled();
  const bool input_grad = grad_mode && input.requires_grad();
  const bool weight_grad = grad_mode && weight.requires_grad();
  const bool bias_grad = grad_mode && bias && bias->requires_grad();
  check_supported(input, weight, bias, recipe);
  validate_float8_linear_state(state, weight.device());
  const int64_t in_features = weight.size(1);
  const int64_t tokens = input.numel() / std::max<int64_t>(in_features, 1);
  if (!weight_grad || tokens % kTokenMultiple == 0) {
    return Float8LinearFunction::apply(input, weight, bias, state, recipe, cache, input_grad,
                                       weight_grad, bias_grad)[0];
  }
  // See Note [Token counts that are not multiples of 16].
  const int64_t padded_tokens = (tokens / kTokenMultiple + 1) * kTokenMultiple;
  const at::Tensor padded = at::constant_pad_nd(input.reshape({tokens, in_features}),
                                                {0, 0, 0, padded_tokens - tokens});
  std::vector<int64_t> output_sizes(input.sizes().begin(), input.sizes().end());
  output_sizes.back() = weight.size(0);
  return Float8LinearFunction::apply(padded, weight, bias, state, recipe, cache, input_grad,
                                     weight_grad, bias_grad)[0]
      .narrow(0, 0, tokens)
      .view(output_sizes);
}

}  // namespace graphed
