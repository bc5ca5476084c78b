// The float8 linear layer (fp8_linear.h). On the CPU, with emulated FP8
// products: the recipe's parsing and checks, the forward and both gradients
// against the products written out by hand from the casts, amax recording,
// token counts padded to multiples of 16, current scaling, the weight cache
// (Note [The weight is cast once per step]), the keys and records of
// Float8CastScope (Note [Weight casts shared by the graphs of a scope]) and
// the argument errors. On a GPU (Fp8LinearOnGpu): torch's _scaled_mm path
// against the emulated one, the weight cache inside a captured graph and
// across the graphs of a scope.

#include "graphed/check.h"
#include "graphed/fp8_linear.h"
#include "graphed/fp8_ops.h"
#include "graphed/graph.h"
#include "test_support.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <vector>

namespace graphed {
namespace {

const c10::Device kCpu(c10::kCPU);
const c10::Device kCuda(c10::DeviceType::CUDA, 0);

Float8LinearState fresh_state(c10::Device device) {
  const auto floats = at::TensorOptions().dtype(at::kFloat).device(device);
  return {at::zeros({3}, floats), at::ones({3}, floats), at::ones({3}, floats)};
}

Float8Recipe emulated(Float8Scaling scaling = Float8Scaling::kDelayed) {
  Float8Recipe recipe;
  recipe.scaling = scaling;
  recipe.emulate = true;
  return recipe;
}

// The three products of a float8 linear layer written out from the casts.
struct Reference {
  at::Tensor y, grad_input, grad_weight, grad_bias;
};

Reference reference(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                    const at::Tensor& g, const at::Tensor& scales, Float8Format grad_format) {
  const auto dequantized = [](const at::Tensor& t, const at::Tensor& scale, Float8Format format) {
    return cast_to_float8(t, scale, format).to(at::kFloat) / scale;
  };
  const at::Tensor x8 = dequantized(x, scales.narrow(0, 0, 1), Float8Format::kE4M3);
  const at::Tensor w8 = dequantized(w, scales.narrow(0, 1, 1), Float8Format::kE4M3);
  const at::Tensor g8 = dequantized(g, scales.narrow(0, 2, 1), grad_format);
  return {x8.matmul(w8.t()) + b, g8.matmul(w8), g8.t().matmul(x8), g.sum(0)};
}

TEST(Float8Recipe, ParsesItsNamesAndRefusesOthers) {
  EXPECT_EQ(parse_float8_scaling("delayed"), Float8Scaling::kDelayed);
  EXPECT_EQ(parse_float8_scaling("current"), Float8Scaling::kCurrent);
  EXPECT_EQ(parse_amax_reduction("most_recent"), AmaxReduction::kMostRecent);
  EXPECT_EQ(parse_float8_format("e4m3"), Float8Format::kE4M3);
  EXPECT_THROW_WITH(parse_float8_scaling("dynamic"), Error,
                    "Expected scaling \"delayed\" (scales from the amax history");
  EXPECT_THROW_WITH(parse_amax_reduction("mean"), Error, "Expected amax_compute \"max\"");
  EXPECT_THROW_WITH(parse_float8_format("e3m4"), Error, "Expected an FP8 format \"e5m2\"");
  Float8Recipe recipe;
  recipe.delayed.history_len = 0;
  EXPECT_THROW_WITH(validate_float8_recipe(recipe), Error, "Expected history_len >= 1");
}

TEST(Float8LinearEmulated, ProductsAndGradientsFollowTheCastsAndRecordAmaxes) {
  at::manual_seed(0);
  const at::Tensor x = at::randn({2, 16, 32}).requires_grad_();
  const at::Tensor w = (at::randn({48, 32}) * 0.1).requires_grad_();
  const at::Tensor b = at::randn({48}).requires_grad_();
  const at::Tensor g = at::randn({2, 16, 48}) * 1e-2;
  Float8LinearState state = fresh_state(kCpu);
  // Scales other than 1, as after a few steps of delayed scaling.
  state.scale.copy_(at::tensor({100.0f, 2000.0f, 8000.0f}));
  state.scale_inv.copy_(at::reciprocal(state.scale));
  const at::Tensor y = float8_linear(x, w, b, state, emulated());
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 16, 48}));
  torch::autograd::backward({y}, {g});
  const Reference want = reference(x.detach().reshape({-1, 32}), w.detach(), b.detach(),
                                   g.reshape({-1, 48}), state.scale, Float8Format::kE5M2);
  EXPECT_TRUE(at::allclose(y.detach().reshape({-1, 48}), want.y, 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(x.grad().reshape({-1, 32}), want.grad_input, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(w.grad(), want.grad_weight, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(b.grad(), want.grad_bias, 1e-5, 1e-6));
  // Each cast merged its tensor's amax.
  EXPECT_FLOAT_EQ(state.amax[0].item<float>(), x.detach().abs().max().item<float>());
  EXPECT_FLOAT_EQ(state.amax[1].item<float>(), w.detach().abs().max().item<float>());
  EXPECT_FLOAT_EQ(state.amax[2].item<float>(), g.abs().max().item<float>());
  // The scales themselves only change in update_delayed_scaling.
  EXPECT_TRUE(at::equal(state.scale, at::tensor({100.0f, 2000.0f, 8000.0f})));
}

// Note [Token counts that are not multiples of 16]: 3 x 17 tokens train
// exactly as the products written out over the 51 tokens themselves.
TEST(Float8LinearEmulated, TokenCountsThatAreNotMultiplesOf16AreZeroPadded) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({3, 17, 32}).requires_grad_();
  const at::Tensor w = (at::randn({48, 32}) * 0.1).requires_grad_();
  const at::Tensor b = at::randn({48}).requires_grad_();
  const at::Tensor g = at::randn({3, 17, 48}) * 1e-2;
  Float8LinearState state = fresh_state(kCpu);
  state.scale.copy_(at::tensor({100.0f, 2000.0f, 8000.0f}));
  state.scale_inv.copy_(at::reciprocal(state.scale));
  const at::Tensor y = float8_linear(x, w, b, state, emulated());
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{3, 17, 48}));
  torch::autograd::backward({y}, {g});
  const Reference want = reference(x.detach().reshape({-1, 32}), w.detach(), b.detach(),
                                   g.reshape({-1, 48}), state.scale, Float8Format::kE5M2);
  EXPECT_TRUE(at::allclose(y.detach().reshape({-1, 48}), want.y, 1e-5, 1e-5));
  ASSERT_EQ(x.grad().sizes(), x.sizes());
  EXPECT_TRUE(at::allclose(x.grad().reshape({-1, 32}), want.grad_input, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(w.grad(), want.grad_weight, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(b.grad(), want.grad_bias, 1e-5, 1e-6));
  // The zero rows left every amax as the real tokens set it.
  EXPECT_FLOAT_EQ(state.amax[0].item<float>(), x.detach().abs().max().item<float>());
  EXPECT_FLOAT_EQ(state.amax[2].item<float>(), g.abs().max().item<float>());
  // Current scaling: the amax of a padded tensor is the real tokens' amax, so
  // the scales, and the products, are those of the unpadded tensors.
  const at::Tensor x_current = (x.detach() * 5).requires_grad_();
  Float8LinearState current = fresh_state(kCpu);
  const at::Tensor y_current =
      float8_linear(x_current, w, std::nullopt, current, emulated(Float8Scaling::kCurrent));
  ASSERT_EQ(y_current.sizes(), (std::vector<int64_t>{3, 17, 48}));
  y_current.sum().backward();
  EXPECT_FLOAT_EQ(current.amax[0].item<float>(), x_current.detach().abs().max().item<float>());
  EXPECT_FLOAT_EQ(current.amax[2].item<float>(), 1.0f);
}

TEST(Float8LinearEmulated, CurrentScalingUsesEachTensorsOwnAmax) {
  at::manual_seed(1);
  const at::Tensor x = (at::randn({32, 16}) * 5).requires_grad_();
  const at::Tensor w = at::randn({16, 16}).requires_grad_();
  const at::Tensor g = at::randn({32, 16}) * 1e-3;
  Float8LinearState state = fresh_state(kCpu);
  Float8Recipe recipe = emulated(Float8Scaling::kCurrent);
  recipe.grad_format = Float8Format::kE4M3;
  const at::Tensor y = float8_linear(x, w, std::nullopt, state, recipe);
  torch::autograd::backward({y}, {g});
  const at::Tensor scales = at::stack({current_scale(x.detach(), Float8Format::kE4M3),
                                       current_scale(w.detach(), Float8Format::kE4M3),
                                       current_scale(g, Float8Format::kE4M3)})
                                .reshape({3});
  const Reference want = reference(x.detach(), w.detach(), at::zeros({16}), g, scales,
                                   Float8Format::kE4M3);
  EXPECT_TRUE(at::allclose(y.detach(), want.y, 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(x.grad(), want.grad_input, 1e-5, 1e-7));
  EXPECT_TRUE(at::allclose(w.grad(), want.grad_weight, 1e-5, 1e-7));
  // The layer's delayed-scaling scales are not touched.
  EXPECT_TRUE(at::equal(state.scale, at::ones({3})));
}

TEST(Float8WeightCacheEmulated, CastsTheWeightOncePerVersionAndEpoch) {
  const at::Tensor x = at::randn({16, 32}).requires_grad_();
  const at::Tensor w = at::randn({16, 32}).requires_grad_();
  Float8LinearState state = fresh_state(kCpu);
  Float8WeightCache cache;
  const Float8Recipe recipe = emulated();
  const auto train_forward = [&] {
    float8_linear(x, w, std::nullopt, state, recipe, &cache).sum().backward();
  };
  train_forward();
  train_forward();
  train_forward();
  EXPECT_EQ(cache.casts(), 1);  // three microbatches, one cast
  EXPECT_TRUE(cache.holds_cast());
  {
    at::NoGradGuard no_grad;
    w.add_(1.0);  // the optimizer step bumps the version
  }
  train_forward();
  EXPECT_EQ(cache.casts(), 2);
  advance_float8_weight_epoch();  // a replayed step or update_scales
  train_forward();
  EXPECT_EQ(cache.casts(), 3);
  {
    // Evaluation casts every time and keeps nothing.
    at::NoGradGuard no_grad;
    (void)float8_linear(x, w, std::nullopt, state, recipe, &cache);
    EXPECT_EQ(cache.casts(), 4);
    EXPECT_FALSE(cache.holds_cast());
  }
  // The weight's gradient after a cached forward equals the uncached one.
  w.mutable_grad() = at::Tensor();
  train_forward();
  train_forward();
  EXPECT_EQ(cache.casts(), 5);
  const at::Tensor cached_grad = w.grad().clone();
  w.mutable_grad() = at::Tensor();
  Float8Recipe uncached = recipe;
  uncached.cache_weights = false;
  float8_linear(x, w, std::nullopt, state, uncached, &cache).sum().backward();
  float8_linear(x, w, std::nullopt, state, uncached, &cache).sum().backward();
  EXPECT_EQ(cache.casts(), 7);
  EXPECT_TRUE(at::allclose(w.grad(), cached_grad));
}

// Note [Weight casts shared by the graphs of a scope]: the keys, on any device.
TEST(Float8CastKey, EagerForwardsCapturesAndScopesAreKeptApart) {
  using Kind = Float8CastKey::Kind;
  EXPECT_EQ(float8_cast_key(0, 0), (Float8CastKey{Kind::kEager, 0}));
  // An eager forward inside a scope is still eager: it never meets a graph's cast.
  EXPECT_EQ(float8_cast_key(0, 5), float8_cast_key(0, 0));
  // Outside a scope, each capture keeps its own casts.
  EXPECT_EQ(float8_cast_key(7, 0), (Float8CastKey{Kind::kCapture, 7}));
  EXPECT_NE(float8_cast_key(7, 0), float8_cast_key(8, 0));
  EXPECT_NE(float8_cast_key(7, 0), float8_cast_key(0, 0));
  // Inside a scope, every capture shares the scope's casts, and no other scope's.
  EXPECT_EQ(float8_cast_key(7, 5), (Float8CastKey{Kind::kScope, 5}));
  EXPECT_EQ(float8_cast_key(7, 5), float8_cast_key(8, 5));
  EXPECT_NE(float8_cast_key(7, 5), float8_cast_key(7, 6));
  // A scope's key never equals a capture's with the same number.
  EXPECT_NE(float8_cast_key(5, 0), float8_cast_key(9, 5));
}

TEST(Float8CastScope, NestsOnItsThreadWithUniqueIds) {
  EXPECT_EQ(Float8CastScope::active(), nullptr);
  const at::Tensor w = at::randn({16, 16});
  {
    const Float8CastScope outer;
    EXPECT_EQ(Float8CastScope::active(), &outer);
    EXPECT_NE(outer.id(), 0u);
    {
      const Float8CastScope inner;
      EXPECT_EQ(Float8CastScope::active(), &inner);
      EXPECT_NE(inner.id(), outer.id());
    }
    EXPECT_EQ(Float8CastScope::active(), &outer);
    // A CPU tensor is never being captured: its casts stay eager in a scope.
    EXPECT_EQ(current_float8_cast_key(w), float8_cast_key(0, 0));
    EXPECT_EQ(outer.casts(), nullptr);  // nothing recorded, nothing allocated
    EXPECT_EQ(outer.num_casts(), 0u);
    EXPECT_EQ(outer.num_reads(), 0u);
  }
  EXPECT_EQ(Float8CastScope::active(), nullptr);
}

// The cache driven with the keys that captures 11 and 12 would have.
TEST(Float8CastScope, CapturesOfOneScopeShareACastThatTheScopeKeepsAlive) {
  const at::Tensor w = at::randn({16, 32}).requires_grad_();
  const int64_t version = w._version();
  const at::Tensor data = at::randn({16, 32});
  const at::Tensor transposed = at::randn({32, 16});
  const at::Tensor scale_inv = at::ones({});
  Float8WeightCache cache;
  at::Tensor d;
  at::Tensor t;
  at::Tensor s;
  std::shared_ptr<Float8ScopeCasts> record;
  {
    const Float8CastScope scope;
    const Float8CastKey first = float8_cast_key(11, scope.id());
    const Float8CastKey second = float8_cast_key(12, scope.id());
    EXPECT_FALSE(cache.lookup(w, first, /*need_transposed=*/true, d, t, s));
    cache.store(w, first, data, transposed, scale_inv, /*keep=*/true);
    ASSERT_EQ(scope.num_casts(), 1u);
    EXPECT_EQ(scope.num_reads(), 0u);
    // The second capture of the scope reads the first one's cast.
    ASSERT_TRUE(cache.lookup(w, second, /*need_transposed=*/true, d, t, s));
    EXPECT_TRUE(d.is_same(data));
    EXPECT_TRUE(t.is_same(transposed));
    EXPECT_TRUE(s.is_same(scale_inv));
    ASSERT_EQ(scope.num_reads(), 1u);
    EXPECT_EQ(scope.casts()->reads[0], 0u);
    // Eager forwards inside the scope do not, nor captures outside it or in
    // another scope; none of those misses is recorded.
    EXPECT_FALSE(cache.lookup(w, float8_cast_key(0, scope.id()), false, d, t, s));
    EXPECT_FALSE(cache.lookup(w, float8_cast_key(12, 0), false, d, t, s));
    {
      const Float8CastScope other;
      EXPECT_FALSE(cache.lookup(w, float8_cast_key(12, other.id()), false, d, t, s));
      EXPECT_EQ(other.num_reads(), 0u);
    }
    EXPECT_EQ(scope.num_reads(), 1u);
    // The other conditions hold as before: a new version or a new step casts again.
    {
      at::NoGradGuard no_grad;
      w.mul_(1.0);
    }
    EXPECT_FALSE(cache.lookup(w, second, false, d, t, s));
    cache.store(w, second, data.clone(), transposed.clone(), scale_inv.clone(), true);
    advance_float8_weight_epoch();
    EXPECT_FALSE(cache.lookup(w, second, false, d, t, s));
    // An eager cast inside the scope is not the scope's.
    cache.store(w, float8_cast_key(0, scope.id()), data, transposed, scale_inv, true);
    // A cast that is not kept (evaluation, cache_weights=false) is counted
    // without holding its tensors.
    cache.store(w, second, data.clone(), at::Tensor(), scale_inv, /*keep=*/false);
    EXPECT_FALSE(cache.holds_cast());
    EXPECT_EQ(scope.num_casts(), 3u);
    record = scope.casts();
  }
  EXPECT_EQ(cache.casts(), 4);
  // The record outlives the scope and the cache's entry: it holds what the
  // graphs captured in the scope read.
  cache.clear();
  ASSERT_EQ(record->casts.size(), 3u);
  EXPECT_TRUE(record->casts[0].kept);
  EXPECT_TRUE(record->casts[0].data.is_same(data));
  EXPECT_TRUE(record->casts[0].transposed.is_same(transposed));
  EXPECT_TRUE(record->casts[0].weight.is_same(w));
  EXPECT_EQ(record->casts[0].weight_version, version);
  EXPECT_EQ(record->casts[1].weight_version, version + 1);
  EXPECT_FALSE(record->casts[2].kept);
  EXPECT_FALSE(record->casts[2].data.defined());
  EXPECT_EQ(record->reads, (std::vector<size_t>{0}));
}

TEST(Float8CastScope, EagerForwardsInsideAScopeBehaveAsOutside) {
  const at::Tensor x = at::randn({16, 32}).requires_grad_();
  const at::Tensor w = at::randn({16, 32}).requires_grad_();
  Float8LinearState state = fresh_state(kCpu);
  Float8WeightCache cache;
  const Float8CastScope scope;
  for (int m = 0; m < 3; ++m) {
    float8_linear(x, w, std::nullopt, state, emulated(), &cache).sum().backward();
  }
  EXPECT_EQ(cache.casts(), 1);  // eager microbatches still share a cast
  EXPECT_EQ(scope.casts(), nullptr);  // and the scope records nothing of them
}

TEST(Float8WeightCacheEmulated, OnlyTheForwardThatCastsRecordsTheWeightsAmax) {
  const at::Tensor x = at::randn({16, 32}).requires_grad_();
  const at::Tensor w = at::randn({16, 32}).requires_grad_();
  Float8LinearState state = fresh_state(kCpu);
  Float8WeightCache cache;
  float8_linear(x, w, std::nullopt, state, emulated(), &cache).sum().backward();
  EXPECT_FLOAT_EQ(state.amax[1].item<float>(), w.detach().abs().max().item<float>());
  state.amax.zero_();
  // The next microbatch reads the kept cast: it records its input's and its
  // gradient's amaxes, not the weight's (the same number, already recorded).
  float8_linear(x, w, std::nullopt, state, emulated(), &cache).sum().backward();
  EXPECT_EQ(cache.casts(), 1);
  EXPECT_GT(state.amax[0].item<float>(), 0.0f);
  EXPECT_EQ(state.amax[1].item<float>(), 0.0f);
  EXPECT_GT(state.amax[2].item<float>(), 0.0f);
}

TEST(Float8LinearErrors, SayWhatToChange) {
  Float8LinearState state = fresh_state(kCpu);
  EXPECT_THROW_WITH(float8_linear(at::randn({16, 24}), at::randn({16, 24}), std::nullopt, state,
                                  emulated()),
                    Error, "Expected in_features and out_features to be multiples of 16");
  EXPECT_THROW_WITH(float8_linear(at::randn({16, 32}), at::randn({16, 32}), std::nullopt, state,
                                  Float8Recipe{}),
                    Error, "Expected CUDA tensors for a float8 linear layer");
  EXPECT_THROW_WITH(float8_linear(at::randn({16, 32}, at::kDouble), at::randn({16, 32}),
                                  std::nullopt, state, emulated()),
                    Error, "Expected the input of a float8 linear layer in float32, bfloat16 or "
                           "float16, got Double");
  state.scale = at::ones({2});
  EXPECT_THROW_WITH(float8_linear(at::randn({16, 32}), at::randn({16, 32}), std::nullopt, state,
                                  emulated()),
                    Error, "Expected the layer's scale to be a float32 [3] tensor");
  // Without training nothing is padded (Note [Token counts that are not
  // multiples of 16]).
  at::NoGradGuard no_grad;
  EXPECT_EQ(float8_linear(at::randn({10, 32}), at::randn({16, 32}), std::nullopt,
                          fresh_state(kCpu), emulated())
                .sizes(),
            (std::vector<int64_t>{10, 16}));
}

// --- torch's FP8 products, on a GPU -----------------------------------------------

class Fp8LinearOnGpu : public ::testing::Test {
 protected:
  void SetUp() override { GRAPHED_REQUIRE_GPU(); }
};

// Relative error of `got` against `want` in the Frobenius norm.
double relative_error(const at::Tensor& got, const at::Tensor& want) {
  return (got.to(at::kFloat) - want.to(at::kFloat)).norm().item<double>() /
         want.to(at::kFloat).norm().item<double>();
}

TEST_F(Fp8LinearOnGpu, ScaledMmMatchesTheEmulatedProducts) {
  at::manual_seed(2);
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(kCuda);
  const auto floats = at::TensorOptions().dtype(at::kFloat).device(kCuda);
  for (Float8Scaling scaling : {Float8Scaling::kDelayed, Float8Scaling::kCurrent}) {
    const at::Tensor x_data = at::randn({4, 64, 256}, bf16);
    const at::Tensor w_data = at::randn({512, 256}, floats) * 0.05;
    const at::Tensor b_data = at::randn({512}, floats);
    const at::Tensor g = at::randn({4, 64, 512}, bf16) * 1e-3;
    std::vector<at::Tensor> outputs;
    std::vector<at::Tensor> grads;
    for (bool emulate : {false, true}) {
      const at::Tensor x = x_data.clone().requires_grad_();
      const at::Tensor w = w_data.clone().requires_grad_();
      const at::Tensor b = b_data.clone().requires_grad_();
      Float8LinearState state = fresh_state(kCuda);
      state.scale.copy_(at::tensor({50.0f, 4000.0f, 20000.0f}));
      state.scale_inv.copy_(at::reciprocal(state.scale));
      Float8Recipe recipe;
      recipe.scaling = scaling;
      recipe.emulate = emulate;
      const at::Tensor y = float8_linear(x, w, b, state, recipe);
      EXPECT_EQ(y.scalar_type(), at::kBFloat16);
      torch::autograd::backward({y}, {g});
      EXPECT_EQ(x.grad().scalar_type(), at::kBFloat16);
      EXPECT_EQ(w.grad().scalar_type(), at::kFloat);
      outputs.push_back(y.detach());
      grads.insert(grads.end(), {x.grad(), w.grad(), b.grad()});
    }
    // The same FP8 operands; only the accumulation (fast accumulation in the
    // forward) and the bf16 rounding of the outputs differ.
    EXPECT_LT(relative_error(outputs[0], outputs[1]), 1e-2);
    for (int i = 0; i < 3; ++i) {
      EXPECT_LT(relative_error(grads[i], grads[3 + i]), 1e-2) << "gradient " << i;
    }
  }
}

TEST_F(Fp8LinearOnGpu, CapturedMicrobatchesCastTheWeightOnce) {
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(kCuda);
  const at::Tensor x = at::randn({64, 128}, bf16).requires_grad_();
  const at::Tensor w = at::randn({256, 128}, at::TensorOptions().device(kCuda)).requires_grad_();
  Float8LinearState state = fresh_state(kCuda);
  Float8WeightCache cache;
  Float8Recipe recipe;
  // Eager: three microbatches, one cast.
  for (int m = 0; m < 3; ++m) {
    float8_linear(x, w, std::nullopt, state, recipe, &cache).sum().backward();
  }
  EXPECT_EQ(cache.casts(), 1);
  // Captured: the eager cast is not used inside the graph; the graph's own
  // first microbatch casts and the others reuse it.
  at::Tensor out;
  graphed::Graph graph;
  graph.capture([&] {
    for (int m = 0; m < 3; ++m) {
      out = float8_linear(x.detach(), w, std::nullopt, state, recipe, &cache);
    }
  });
  EXPECT_EQ(cache.casts(), 2);
  // After the capture an eager forward casts again (the graph's cast lives in its pool).
  float8_linear(x, w, std::nullopt, state, recipe, &cache).sum().backward();
  EXPECT_EQ(cache.casts(), 3);
}

// Note [Weight casts shared by the graphs of a scope]: two graphs captured in
// one scope into one pool, replayed in order, the second reading the first's
// cast; outside a scope each graph casts.
TEST_F(Fp8LinearOnGpu, GraphsCapturedInOneScopeShareTheWeightCast) {
  at::manual_seed(3);
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(kCuda);
  const at::Tensor x = at::randn({64, 128}, bf16);
  const at::Tensor w = at::randn({256, 128}, at::TensorOptions().device(kCuda)).requires_grad_();
  Float8LinearState state = fresh_state(kCuda);
  Float8WeightCache cache;
  const Float8Recipe recipe{};
  const auto uncached = [&] {
    at::NoGradGuard no_grad;  // an evaluation forward casts and keeps nothing
    return float8_linear(x, w, std::nullopt, state, recipe);
  };
  (void)float8_linear(x, w, std::nullopt, state, recipe, &cache);  // eager: warms up, keeps a cast
  ASSERT_EQ(cache.casts(), 1);
  GraphCaptureOptions options;
  options.pool = new_pool();
  at::Tensor out0;
  at::Tensor out1;
  Graph caster;
  Graph reader;
  std::shared_ptr<Float8ScopeCasts> record;
  {
    const Float8CastScope scope;
    caster.capture([&] { out0 = float8_linear(x, w, std::nullopt, state, recipe, &cache); },
                   options);
    reader.capture([&] { out1 = float8_linear(x, w, std::nullopt, state, recipe, &cache); },
                   options);
    EXPECT_EQ(cache.casts(), 2);  // the eager cast was not read; the second graph cast nothing
    EXPECT_EQ(scope.num_casts(), 1u);
    EXPECT_EQ(scope.num_reads(), 1u);
    record = scope.casts();
  }
  // One fused cast kernel fewer (delayed scaling: one kernel per cast).
  EXPECT_EQ(caster.stats().kernels, reader.stats().kernels + 1);
  // An eager forward now casts again and drops the cache's entry; the record
  // still holds the graphs' cast.
  float8_linear(x, w, std::nullopt, state, recipe, &cache).sum().backward();
  EXPECT_EQ(cache.casts(), 3);
  ASSERT_NE(record, nullptr);
  EXPECT_TRUE(record->casts.at(0).data.defined());
  for (int step = 0; step < 2; ++step) {
    caster.replay();
    reader.replay();
    const at::Tensor want = uncached();
    EXPECT_TRUE(at::equal(out0, out1)) << "step " << step;
    EXPECT_LT(relative_error(out1, want), 1e-3) << "step " << step;
    {
      at::NoGradGuard no_grad;
      w.mul_(2.0);  // the next step's weights: the caster's replay casts them
    }
  }
  // Outside a scope, separately captured graphs each cast.
  Graph first;
  Graph second;
  first.capture([&] { out0 = float8_linear(x, w, std::nullopt, state, recipe, &cache); }, options);
  second.capture([&] { out1 = float8_linear(x, w, std::nullopt, state, recipe, &cache); },
                 options);
  EXPECT_EQ(cache.casts(), 5);
  EXPECT_EQ(first.stats().kernels, second.stats().kernels);
}

}  // namespace
}  // namespace graphed
