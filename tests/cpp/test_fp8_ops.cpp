// The fused FP8 operations (fp8_ops.h). On the CPU: the ATen sequences (the
// reference) and the batched delayed-scaling update against one
// DelayedScaling per row, and the argument checks. On a GPU
// (Fp8KernelsOnGpu): graphed's kernels against those ATen sequences, to the
// bit: every bfloat16 value through both casts (rounding, subnormals,
// saturation, infinities), random tensors of every input dtype with odd and
// aligned shapes, unaligned views, transposes, amaxes (NaN included),
// current scaling, the batched update over many steps, and replays of a
// captured graph.

#include "graphed/check.h"
#include "graphed/fp8_ops.h"
#include "graphed/graph.h"
#include "test_support.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace graphed {
namespace {

const c10::Device kCpu(c10::kCPU);
const c10::Device kCuda(c10::DeviceType::CUDA, 0);

at::Tensor one(float value, c10::Device device = kCpu) {
  return at::full({1}, value, at::TensorOptions().dtype(at::kFloat).device(device));
}

// The bytes of an FP8 tensor, for exact comparisons (NaN == NaN).
at::Tensor bytes(const at::Tensor& t) {
  return t.view(at::kByte);
}

// Bitwise equality, where NaNs of either sign count as equal.
void expect_same_fp8(const at::Tensor& got, const at::Tensor& want, const std::string& where) {
  SCOPED_TRACE(where);
  ASSERT_EQ(got.scalar_type(), want.scalar_type());
  ASSERT_EQ(got.sizes(), want.sizes());
  const at::Tensor got_nan = got.to(at::kFloat).isnan();
  const at::Tensor want_nan = want.to(at::kFloat).isnan();
  EXPECT_TRUE(at::equal(got_nan, want_nan));
  const at::Tensor differ = bytes(got).ne(bytes(want)).logical_and_(got_nan.logical_not());
  const int64_t differing = differ.sum().item<int64_t>();
  if (differing > 0) {
    const at::Tensor first = differ.reshape({-1}).nonzero()[0][0];
    const int64_t i = first.item<int64_t>();
    ADD_FAILURE() << differing << " values differ; first at flat index " << i << ": got byte "
                  << bytes(got).reshape({-1})[i].item<int>() << ", want "
                  << bytes(want).reshape({-1})[i].item<int>();
  }
}

// --- the ATen sequences, on the CPU -------------------------------------------

TEST(Float8CastAten, WritesTheCastItsTransposeAndMergesTheAmax) {
  const at::Tensor x = at::tensor({1.0f, -600.0f, 2.5f, 0.25f, -3.0f, 7.0f}).reshape({2, 3});
  const at::Tensor amax = one(100.0f);
  Float8CastOutputs outputs;
  outputs.transposed = true;
  outputs.amax = amax;
  const Float8CastResult result = cast_to_float8_fused(x, one(2.0f), Float8Format::kE4M3, outputs);
  expect_same_fp8(result.data, cast_to_float8(x, one(2.0f), Float8Format::kE4M3), "data");
  expect_same_fp8(result.transposed, result.data.t().contiguous(), "transposed");
  EXPECT_FLOAT_EQ(result.data.to(at::kFloat)[0][1].item<float>(), -448.0f);  // saturated
  EXPECT_FLOAT_EQ(amax.item<float>(), 600.0f);
  amax.fill_(1000.0f);
  (void)cast_to_float8_fused(x, one(1.0f), Float8Format::kE5M2, outputs);
  EXPECT_FLOAT_EQ(amax.item<float>(), 1000.0f);  // a merge, not an overwrite
}

TEST(Float8CastAten, CurrentScalingOverwritesTheAmaxAndWritesBothScales) {
  const at::Tensor x = at::tensor({-8.0f, 2.0f, 0.5f, 1.0f}).reshape({2, 2});
  const at::Tensor amax = one(1000.0f);
  const at::Tensor scales = at::zeros({2});
  Float8CastOutputs outputs;
  outputs.amax = amax;
  const Float8CastResult result = cast_to_float8_current(
      x, Float8Format::kE4M3, /*margin=*/1, outputs, scales.narrow(0, 0, 1), scales.narrow(0, 1, 1));
  EXPECT_FLOAT_EQ(amax.item<float>(), 8.0f);
  EXPECT_FLOAT_EQ(scales[0].item<float>(), 448.0f / 8.0f / 2.0f);
  EXPECT_FLOAT_EQ(scales[1].item<float>(), 8.0f * 2.0f / 448.0f);
  expect_same_fp8(result.data, cast_to_float8(x, scales.narrow(0, 0, 1), Float8Format::kE4M3),
                  "data");
  // All zeros: scale 1.
  (void)cast_to_float8_current(at::zeros({4}), Float8Format::kE5M2, 0, outputs,
                               scales.narrow(0, 0, 1), scales.narrow(0, 1, 1));
  EXPECT_FLOAT_EQ(scales[0].item<float>(), 1.0f);
  EXPECT_FLOAT_EQ(scales[1].item<float>(), 1.0f);
}

TEST(Float8CastAten, RefusesWhatItCannotCast) {
  Float8CastOutputs outputs;
  EXPECT_THROW_WITH(cast_to_float8_fused(at::ones({4}, at::kInt), one(1.0f), Float8Format::kE4M3,
                                         outputs),
                    Error, "in float32, bfloat16 or float16 to cast to FP8, got Int");
  EXPECT_THROW_WITH(cast_to_float8_fused(at::ones({4}), at::ones({2}), Float8Format::kE4M3,
                                         outputs),
                    Error, "Expected the scale to be a float32 tensor with one element");
  outputs.transposed = true;
  EXPECT_THROW_WITH(cast_to_float8_fused(at::ones({2, 2, 2}), one(1.0f), Float8Format::kE4M3,
                                         outputs),
                    Error, "Expected a 2-D tensor for a transposed FP8 cast, got 3 dimensions");
  EXPECT_THROW_WITH(cast_to_float8_current(at::ones({4}), Float8Format::kE4M3, 0,
                                           Float8CastOutputs{}, one(1.0f), one(1.0f)),
                    Error, "Expected an amax tensor for current scaling");
}

TEST(RecordAmax, MergesTheLargestMagnitudeAndPropagatesNaN) {
  const at::Tensor amax = one(0.0f);
  record_amax(at::tensor({-3.0f, 2.0f}), amax);
  EXPECT_FLOAT_EQ(amax.item<float>(), 3.0f);
  record_amax(at::tensor({1.0f}), amax);
  EXPECT_FLOAT_EQ(amax.item<float>(), 3.0f);
  record_amax(at::tensor({std::numeric_limits<float>::quiet_NaN(), 1.0f}), amax);
  EXPECT_TRUE(std::isnan(amax.item<float>()));
}

// Steps of amaxes per row: ordinary values, a zero step and an overflowed one.
std::vector<std::vector<float>> amax_steps(int64_t rows, int64_t steps) {
  std::vector<std::vector<float>> all;
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<float> step;
    for (int64_t r = 0; r < rows; ++r) {
      float value = static_cast<float>((r * 7 + s * 13) % 23 + 1) * (r % 2 == 0 ? 0.01f : 3.0f);
      if (s == 3 && r % 3 == 0) {
        value = 0.0f;
      }
      if (s == 5 && r % 4 == 1) {
        value = std::numeric_limits<float>::infinity();
      }
      step.push_back(value);
    }
    all.push_back(step);
  }
  return all;
}

void expect_table_follows_delayed_scaling(c10::Device device, Float8Kernels kernels,
                                          AmaxReduction reduction, int64_t margin) {
  const std::vector<Float8Format> formats = {Float8Format::kE4M3, Float8Format::kE4M3,
                                             Float8Format::kE5M2, Float8Format::kE4M3,
                                             Float8Format::kE4M3, Float8Format::kE5M2,
                                             Float8Format::kE4M3};
  const DelayedScalingOptions options{/*history_len=*/4, reduction, margin};
  DelayedScalingTable table = make_delayed_scaling_table(formats, options, device);
  std::vector<DelayedScaling> rows;
  for (Float8Format format : formats) {
    rows.emplace_back(format, options, kCpu);
  }
  const auto steps = amax_steps(static_cast<int64_t>(formats.size()), 9);
  for (size_t s = 0; s < steps.size(); ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    table.amax.copy_(at::tensor(steps[s]));
    update_delayed_scaling(table, options, kernels);
    for (size_t r = 0; r < rows.size(); ++r) {
      rows[r].record_amax_value(at::tensor(steps[s][r]));
      rows[r].update_scale();
      SCOPED_TRACE("row " + std::to_string(r));
      EXPECT_TRUE(at::equal(table.scale.cpu()[static_cast<int64_t>(r)].reshape({1}), rows[r].scale()));
      EXPECT_TRUE(at::equal(table.scale_inv.cpu()[static_cast<int64_t>(r)].reshape({1}), rows[r].scale_inv()));
      EXPECT_TRUE(at::equal(table.history.cpu()[static_cast<int64_t>(r)], rows[r].amax_history()));
    }
    EXPECT_EQ(table.amax.cpu().count_nonzero().item<int64_t>(), 0);
    EXPECT_EQ(table.slot.cpu().item<int64_t>(), static_cast<int64_t>((s + 1) % 4));
  }
}

TEST(DelayedScalingTable, UpdatesEveryRowAsOneDelayedScalingWould) {
  expect_table_follows_delayed_scaling(kCpu, Float8Kernels::kAuto, AmaxReduction::kMax, 0);
  expect_table_follows_delayed_scaling(kCpu, Float8Kernels::kAuto, AmaxReduction::kMostRecent, 2);
}

TEST(DelayedScalingTable, RefusesTablesOfTheWrongShape) {
  const DelayedScalingOptions options{4, AmaxReduction::kMax, 0};
  DelayedScalingTable table = make_delayed_scaling_table(
      {Float8Format::kE4M3, Float8Format::kE5M2}, options, kCpu);
  EXPECT_THROW_WITH(update_delayed_scaling(table, {8, AmaxReduction::kMax, 0}), Error,
                    "Expected the table's history to be a contiguous Float tensor of shape [2, 8]");
  table.scale = at::ones({3});
  EXPECT_THROW_WITH(update_delayed_scaling(table, options), Error,
                    "Expected the table's scale to be a contiguous Float tensor of shape [2]");
}

// --- graphed's kernels against the ATen sequences, on a GPU ---------------------

class Fp8KernelsOnGpu : public ::testing::Test {
 protected:
  void SetUp() override { GRAPHED_REQUIRE_GPU(); }
};

struct CastCase {
  int64_t rows;
  int64_t cols;
  at::ScalarType dtype;
  Float8Format format;
};

std::string describe(const CastCase& c) {
  return c10::str(c.rows, "x", c.cols, " ", c.dtype, " -> ",
                  c.format == Float8Format::kE4M3 ? "e4m3" : "e5m2");
}

// A random tensor with magnitudes across the format's range and beyond (some
// values saturate) and a few zeros and negative zeros.
at::Tensor spread_values(int64_t rows, int64_t cols, at::ScalarType dtype, int64_t seed) {
  at::manual_seed(seed);
  const auto floats = at::TensorOptions().dtype(at::kFloat).device(kCuda);
  at::Tensor x = at::randn({rows, cols}, floats) * at::exp2(at::randint(-20, 12, {rows, cols},
                                                                        floats));
  x.reshape({-1}).narrow(0, 0, std::min<int64_t>(3, x.numel())).zero_();
  if (x.numel() > 4) {
    x.reshape({-1})[3] = -0.0f;
  }
  return x.to(dtype);
}

void expect_fused_cast_matches_aten(const at::Tensor& x, const at::Tensor& scale,
                                    Float8Format format, const std::string& where) {
  Float8CastOutputs fused_outputs;
  fused_outputs.transposed = x.dim() == 2;
  fused_outputs.amax = at::zeros({1}, scale.options());
  Float8CastOutputs aten_outputs = fused_outputs;
  aten_outputs.amax = at::zeros({1}, scale.options());
  const Float8CastResult fused =
      cast_to_float8_fused(x, scale, format, fused_outputs, Float8Kernels::kAuto);
  const Float8CastResult aten =
      cast_to_float8_fused(x, scale, format, aten_outputs, Float8Kernels::kAten);
  expect_same_fp8(fused.data, aten.data, where + " data");
  if (fused_outputs.transposed) {
    expect_same_fp8(fused.transposed, aten.transposed, where + " transposed");
  }
  const float fused_amax = fused_outputs.amax.item<float>();
  const float aten_amax = aten_outputs.amax.item<float>();
  if (std::isnan(aten_amax)) {
    EXPECT_TRUE(std::isnan(fused_amax)) << where;
  } else {
    EXPECT_EQ(fused_amax, aten_amax) << where;
  }
}

TEST_F(Fp8KernelsOnGpu, EveryBFloat16ValueCastsAsAtenCastsIt) {
  // All 65536 bfloat16 bit patterns (NaNs, infinities, subnormals, and every
  // rounding case of both formats), at three scales.
  const at::Tensor bits = at::arange(0, 65536, at::TensorOptions().dtype(at::kInt).device(kCuda))
                              .to(at::kShort);
  const at::Tensor all = bits.view(at::kBFloat16).reshape({256, 256});
  for (Float8Format format : {Float8Format::kE4M3, Float8Format::kE5M2}) {
    for (float scale : {1.0f, 0.0078125f, 3.0f}) {
      expect_fused_cast_matches_aten(all, one(scale, kCuda), format,
                                     c10::str("all bf16, scale ", scale));
      expect_fused_cast_matches_aten(all.to(at::kFloat), one(scale, kCuda), format,
                                     c10::str("all bf16 as float32, scale ", scale));
    }
  }
}

TEST_F(Fp8KernelsOnGpu, RandomTensorsOfEveryDtypeAndShape) {
  const std::vector<CastCase> cases = {
      {64, 64, at::kBFloat16, Float8Format::kE4M3},    {4096, 2048, at::kBFloat16, Float8Format::kE4M3},
      {2048, 4096, at::kFloat, Float8Format::kE4M3},   {512, 768, at::kHalf, Float8Format::kE5M2},
      {1024, 6144, at::kBFloat16, Float8Format::kE5M2}, {37, 53, at::kBFloat16, Float8Format::kE4M3},
      {130, 70, at::kFloat, Float8Format::kE5M2},      {1, 8, at::kHalf, Float8Format::kE4M3},
      {67, 1, at::kBFloat16, Float8Format::kE4M3},     {16, 4100, at::kFloat, Float8Format::kE4M3},
  };
  int64_t seed = 0;
  for (const CastCase& c : cases) {
    const at::Tensor x = spread_values(c.rows, c.cols, c.dtype, ++seed);
    for (float scale : {1.0f, 448.0f / 6.0f}) {
      expect_fused_cast_matches_aten(x, one(scale, kCuda), c.format,
                                     c10::str(describe(c), " scale ", scale));
    }
    // The flat kernel (no transpose), also on a 1-D view.
    expect_fused_cast_matches_aten(x.reshape({-1}), one(2.0f, kCuda), c.format,
                                   describe(c) + " flat");
  }
}

TEST_F(Fp8KernelsOnGpu, UnalignedViewsTakeTheElementwisePath) {
  const at::Tensor base = spread_values(1, 64 * 48 + 1, at::kBFloat16, 7);
  const at::Tensor x = base.reshape({-1}).narrow(0, 1, 64 * 48);  // 2-byte offset
  expect_fused_cast_matches_aten(x.reshape({64, 48}), one(1.0f, kCuda), Float8Format::kE4M3,
                                 "offset view");
  expect_fused_cast_matches_aten(x, one(1.0f, kCuda), Float8Format::kE5M2, "offset view, flat");
  // A non-contiguous input is made contiguous first.
  const at::Tensor wide = spread_values(96, 64, at::kFloat, 8);
  expect_fused_cast_matches_aten(wide.t(), one(1.0f, kCuda), Float8Format::kE4M3, "transposed view");
}

TEST_F(Fp8KernelsOnGpu, AmaxMergesWithAtomicMaxAndNaNWins) {
  const at::Tensor x = spread_values(300, 200, at::kBFloat16, 9);
  const at::Tensor amax = one(0.0f, kCuda);
  record_amax(x, amax);
  EXPECT_EQ(amax.item<float>(), amax_of(x).item<float>());
  const float larger = amax.item<float>() * 2;
  amax.fill_(larger);
  record_amax(x, amax);
  EXPECT_EQ(amax.item<float>(), larger);
  at::Tensor with_nan = x.clone();
  with_nan[17][3] = -std::numeric_limits<float>::quiet_NaN();
  record_amax(with_nan, amax);
  EXPECT_TRUE(std::isnan(amax.item<float>()));
  // Infinity beats every finite value.
  with_nan[17][3] = -std::numeric_limits<float>::infinity();
  amax.zero_();
  record_amax(with_nan, amax);
  EXPECT_TRUE(std::isinf(amax.item<float>()));
}

TEST_F(Fp8KernelsOnGpu, CurrentScalingMatchesAten) {
  int64_t seed = 20;
  for (const auto& [rows, cols, dtype] :
       std::vector<std::tuple<int64_t, int64_t, at::ScalarType>>{
           {4096, 2048, at::kBFloat16}, {33, 47, at::kFloat}, {128, 256, at::kHalf}}) {
    for (int64_t margin : {0, 3}) {
      const at::Tensor x = spread_values(rows, cols, dtype, ++seed) * 1e-3;
      const auto floats = at::TensorOptions().dtype(at::kFloat).device(kCuda);
      Float8CastOutputs fused_outputs;
      fused_outputs.transposed = true;
      fused_outputs.amax = at::full({1}, 123.0f, floats);
      Float8CastOutputs aten_outputs = fused_outputs;
      aten_outputs.amax = at::full({1}, 123.0f, floats);
      const at::Tensor fused_scales = at::zeros({2}, floats);
      const at::Tensor aten_scales = at::zeros({2}, floats);
      const Float8CastResult fused = cast_to_float8_current(
          x, Float8Format::kE4M3, margin, fused_outputs, fused_scales.narrow(0, 0, 1),
          fused_scales.narrow(0, 1, 1), Float8Kernels::kAuto);
      const Float8CastResult aten = cast_to_float8_current(
          x, Float8Format::kE4M3, margin, aten_outputs, aten_scales.narrow(0, 0, 1),
          aten_scales.narrow(0, 1, 1), Float8Kernels::kAten);
      const std::string where = c10::str(rows, "x", cols, " ", dtype, " margin ", margin);
      EXPECT_TRUE(at::equal(fused_outputs.amax, aten_outputs.amax)) << where;
      EXPECT_TRUE(at::equal(fused_scales, aten_scales)) << where;
      expect_same_fp8(fused.data, aten.data, where + " data");
      expect_same_fp8(fused.transposed, aten.transposed, where + " transposed");
    }
  }
  // All zeros: scale 1, as current_scale says.
  const auto floats = at::TensorOptions().dtype(at::kFloat).device(kCuda);
  Float8CastOutputs outputs;
  outputs.amax = at::zeros({1}, floats);
  const at::Tensor scales = at::zeros({2}, floats);
  (void)cast_to_float8_current(at::zeros({64, 64}, floats), Float8Format::kE5M2, 0, outputs,
                               scales.narrow(0, 0, 1), scales.narrow(0, 1, 1));
  EXPECT_TRUE(at::equal(scales, at::ones({2}, floats)));
}

TEST_F(Fp8KernelsOnGpu, BatchedUpdateMatchesDelayedScalingAndTheAtenTable) {
  expect_table_follows_delayed_scaling(kCuda, Float8Kernels::kAuto, AmaxReduction::kMax, 0);
  expect_table_follows_delayed_scaling(kCuda, Float8Kernels::kAuto, AmaxReduction::kMostRecent, 1);
  expect_table_follows_delayed_scaling(kCuda, Float8Kernels::kAten, AmaxReduction::kMax, 2);
  // More rows than the block has threads.
  const DelayedScalingOptions options{16, AmaxReduction::kMax, 0};
  std::vector<Float8Format> formats(1000, Float8Format::kE4M3);
  formats[999] = Float8Format::kE5M2;
  DelayedScalingTable fused = make_delayed_scaling_table(formats, options, kCuda);
  DelayedScalingTable aten = make_delayed_scaling_table(formats, options, kCuda);
  for (int step = 0; step < 20; ++step) {
    at::manual_seed(step);
    const at::Tensor amax = at::rand({1000}, fused.amax.options()) * (step % 7 == 0 ? 0 : 100);
    fused.amax.copy_(amax);
    aten.amax.copy_(amax);
    update_delayed_scaling(fused, options, Float8Kernels::kAuto);
    update_delayed_scaling(aten, options, Float8Kernels::kAten);
    SCOPED_TRACE("step " + std::to_string(step));
    EXPECT_TRUE(at::equal(fused.history, aten.history));
    EXPECT_TRUE(at::equal(fused.scale, aten.scale));
    EXPECT_TRUE(at::equal(fused.scale_inv, aten.scale_inv));
    EXPECT_TRUE(at::equal(fused.slot, aten.slot));
    EXPECT_TRUE(at::equal(fused.amax, aten.amax));
  }
}

TEST_F(Fp8KernelsOnGpu, ReplayedGraphRecordsCastsAndUpdatesLikeEagerSteps) {
  const DelayedScalingOptions options{3, AmaxReduction::kMax, 0};
  const std::vector<Float8Format> formats = {Float8Format::kE4M3, Float8Format::kE5M2};
  DelayedScalingTable captured = make_delayed_scaling_table(formats, options, kCuda);
  DelayedScalingTable eager = make_delayed_scaling_table(formats, options, kCuda);
  const at::Tensor x = at::zeros({256, 128}, at::TensorOptions().dtype(at::kBFloat16).device(kCuda));
  const at::Tensor g = at::zeros({256, 64}, at::TensorOptions().dtype(at::kBFloat16).device(kCuda));
  Float8CastResult x8;
  Float8CastResult g8;
  const auto one_step = [&](const DelayedScalingTable& table, Float8CastResult& x_out,
                            Float8CastResult& g_out) {
    Float8CastOutputs x_outputs;
    x_outputs.transposed = true;
    x_outputs.amax = table.amax.narrow(0, 0, 1);
    x_out = cast_to_float8_fused(x, table.scale.narrow(0, 0, 1), Float8Format::kE4M3, x_outputs);
    Float8CastOutputs g_outputs;
    g_outputs.transposed = true;
    g_outputs.amax = table.amax.narrow(0, 1, 1);
    g_out = cast_to_float8_fused(g, table.scale.narrow(0, 1, 1), Float8Format::kE5M2, g_outputs);
    update_delayed_scaling(table, options);
  };
  graphed::Graph graph;
  graph.capture([&] { one_step(captured, x8, g8); });
  for (int step = 0; step < 7; ++step) {
    x.copy_(spread_values(256, 128, at::kBFloat16, 100 + step) * 1e-2);
    g.copy_(spread_values(256, 64, at::kBFloat16, 200 + step) * 1e-4);
    graph.replay();
    Float8CastResult x_eager;
    Float8CastResult g_eager;
    one_step(eager, x_eager, g_eager);
    SCOPED_TRACE("replay " + std::to_string(step));
    expect_same_fp8(x8.data, x_eager.data, "x");
    expect_same_fp8(x8.transposed, x_eager.transposed, "x transposed");
    expect_same_fp8(g8.transposed, g_eager.transposed, "g transposed");
    EXPECT_TRUE(at::equal(captured.history, eager.history));
    EXPECT_TRUE(at::equal(captured.scale, eager.scale));
    EXPECT_TRUE(at::equal(captured.slot, eager.slot));
  }
}

}  // namespace
}  // namespace graphed
