// The grouped matrix product of mixture-of-experts layers (grouped_mm.h). On
// the CPU: the argument checks and their messages, which come before any
// device work. On a GPU (GroupedMmOnGpu): the output and both gradients of
// graphed's kernels and of the automatic choice (torch's bfloat16 kernel on
// sm90/sm100) against a float64 loop of per-group products, for float32,
// float16 and bfloat16, with uneven, empty and single groups, rows past the
// last offset (zeros), sizes that are not multiples of the 64x64 tile,
// transposed and strided operands, more groups than a warp scans at once; a
// captured graph replayed with other offsets written into the same tensor;
// and offsets out of range and out of order, which must neither fault nor
// write outside the output.

#include "graphed/check.h"
#include "graphed/graph.h"
#include "graphed/grouped_mm.h"
#include "test_support.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

namespace graphed {
namespace {

const c10::Device kCuda(c10::DeviceType::CUDA, 0);

at::Tensor offsets_tensor(const std::vector<int32_t>& ends, c10::Device device) {
  return at::tensor(std::vector<int32_t>(ends), at::TensorOptions().dtype(at::kInt)).to(device);
}

// --- the argument checks, on the CPU --------------------------------------------

TEST(GroupedMm, RefusesWhatItCannotMultiplyBeforeTouchingADevice) {
  const at::Tensor a = at::randn({6, 4});
  const at::Tensor b = at::randn({2, 4, 3});
  const at::Tensor offs = at::tensor(std::vector<int32_t>{2, 6}, at::kInt);
  EXPECT_THROW_WITH(grouped_mm(at::Tensor(), b, offs), Error,
                    "Expected three tensors for grouped_mm");
  EXPECT_THROW_WITH(grouped_mm(at::randn({6}), b, offs), Error,
                    "Expected the input of grouped_mm to be 2-D");
  EXPECT_THROW_WITH(grouped_mm(a, at::randn({4, 3}), offs), Error,
                    "Expected the weights of grouped_mm to be 3-D");
  EXPECT_THROW_WITH(grouped_mm(a.to(at::kDouble), b.to(at::kDouble), offs), Error,
                    "in float32, bfloat16 or float16, got Double");
  EXPECT_THROW_WITH(grouped_mm(a, b.to(at::kBFloat16), offs), Error,
                    "Expected the input and the weights of grouped_mm in one dtype");
  EXPECT_THROW_WITH(grouped_mm(a, b, offs.to(at::kLong)), Error,
                    "Expected the offsets of grouped_mm to be a 1-D int32 tensor");
  EXPECT_THROW_WITH(grouped_mm(a, b, offs.reshape({1, 2})), Error, "1-D int32 tensor");
  EXPECT_THROW_WITH(grouped_mm(a, b, offs.narrow(0, 0, 1)), Error,
                    "Expected one offset per group of grouped_mm: the weights have 2 groups, got 1");
  EXPECT_THROW_WITH(grouped_mm(a, at::randn({2, 5, 3}), offs), Error,
                    "Expected the input's in_features to match the weights' of grouped_mm");
  // Everything fits but the device.
  EXPECT_THROW_WITH(grouped_mm(a, b, offs), Error, "Expected CUDA tensors for grouped_mm");
}

TEST(GroupedMm, WeightGradientChecksItsArgumentsToo) {
  const at::Tensor a = at::randn({6, 4});
  const at::Tensor offs = at::tensor(std::vector<int32_t>{2, 6}, at::kInt);
  EXPECT_THROW_WITH(grouped_mm_weight_grad(a, at::randn({5, 3}), offs), Error,
                    "with one row count");
  EXPECT_THROW_WITH(grouped_mm_weight_grad(a, at::randn({6, 3}, at::kHalf), offs), Error,
                    "of grouped_mm's weight gradient in one dtype");
  EXPECT_THROW_WITH(grouped_mm_weight_grad(a, at::randn({6, 3}), at::zeros({}, at::kInt)), Error,
                    "1-D int32 tensor");
  EXPECT_THROW_WITH(grouped_mm_weight_grad(a, at::randn({6, 3}), offs), Error,
                    "Expected CUDA tensors for grouped_mm");
}

TEST(GroupedMm, TorchsKernelIsNeverChosenForCpuOrFloat32Operands) {
  EXPECT_FALSE(grouped_mm_uses_torch(at::randn({8, 8}).to(at::kBFloat16),
                                     at::randn({2, 8, 8}).to(at::kBFloat16)));
  EXPECT_FALSE(grouped_mm_uses_torch(at::randn({8, 8}), at::randn({2, 8, 8})));
  EXPECT_FALSE(grouped_mm_uses_torch(at::Tensor(), at::Tensor()));
}

// --- on a GPU ---------------------------------------------------------------------

class GroupedMmOnGpu : public ::testing::Test {
 protected:
  void SetUp() override { GRAPHED_REQUIRE_GPU(); }
};

// Offsets as the kernels read them: clamped into [0, rows], running maximum.
std::vector<int64_t> effective_ends(const std::vector<int32_t>& ends, int64_t rows) {
  std::vector<int64_t> out;
  int64_t running = 0;
  for (int32_t end : ends) {
    running = std::max<int64_t>(running, std::min<int64_t>(std::max<int64_t>(end, 0), rows));
    out.push_back(running);
  }
  return out;
}

// The float64 references: loops of per-group products on the CPU.
at::Tensor reference_output(const at::Tensor& a, const at::Tensor& b,
                            const std::vector<int64_t>& ends) {
  const at::Tensor a64 = a.to(at::kCPU, at::kDouble);
  const at::Tensor b64 = b.to(at::kCPU, at::kDouble);
  at::Tensor out = at::zeros({a.size(0), b.size(2)}, a64.options());
  int64_t start = 0;
  for (size_t g = 0; g < ends.size(); ++g) {
    if (ends[g] > start) {
      out.narrow(0, start, ends[g] - start).copy_(a64.narrow(0, start, ends[g] - start).mm(b64[g]));
    }
    start = ends[g];
  }
  return out;
}

at::Tensor reference_weight_grad(const at::Tensor& a, const at::Tensor& grad,
                                 const std::vector<int64_t>& ends) {
  const at::Tensor a64 = a.to(at::kCPU, at::kDouble);
  const at::Tensor g64 = grad.to(at::kCPU, at::kDouble);
  at::Tensor out = at::zeros({static_cast<int64_t>(ends.size()), a.size(1), grad.size(1)},
                             a64.options());
  int64_t start = 0;
  for (size_t g = 0; g < ends.size(); ++g) {
    if (ends[g] > start) {
      out[g].copy_(a64.narrow(0, start, ends[g] - start).t().mm(g64.narrow(0, start, ends[g] - start)));
    }
    start = ends[g];
  }
  return out;
}

double tolerance(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16:
      return 1e-2;  // the output's rounding: 2^-8 relative
    case at::kHalf:
      return 2e-3;  // 2^-11 relative
    default:
      return 2e-5;  // float32 accumulation over a few hundred terms
  }
}

// max |got - want| relative to max |want| (or 1 where want is all zeros).
void expect_close(const at::Tensor& got, const at::Tensor& want, at::ScalarType dtype,
                  const std::string& where) {
  SCOPED_TRACE(where);
  ASSERT_EQ(got.sizes(), want.sizes());
  const at::Tensor got64 = got.to(at::kCPU, at::kDouble);
  ASSERT_TRUE(got64.isfinite().all().item<bool>()) << "non-finite values";
  const double scale = std::max(want.abs().max().item<double>(), 1.0);
  const double error = (got64 - want).abs().max().item<double>() / scale;
  EXPECT_LE(error, tolerance(dtype)) << "relative error " << error;
}

void expect_zero_rows(const at::Tensor& t, int64_t from, const std::string& where) {
  if (from < t.size(0)) {
    EXPECT_EQ(t.narrow(0, from, t.size(0) - from).abs().max().item<double>(), 0.0)
        << where << ": rows from " << from << " must be exactly zero";
  }
}

struct Case {
  std::string name;
  int64_t rows;
  int64_t k;
  int64_t n;
  std::vector<int32_t> counts;  // rows per group; the rest are rows past the last offset
  bool transposed_weights;
};

std::vector<int32_t> cumulative(const std::vector<int32_t>& counts) {
  std::vector<int32_t> ends(counts.size());
  std::partial_sum(counts.begin(), counts.end(), ends.begin());
  return ends;
}

std::vector<Case> cases() {
  std::vector<int32_t> many(70, 0);  // more groups than one warp scans at once
  for (size_t g = 0; g < many.size(); g += 3) {
    many[g] = static_cast<int32_t>(g % 11 + 1);
  }
  many[69] = 65;
  return {
      {"uneven groups and rows past the last offset", 150, 40, 70, {17, 0, 64, 1, 30}, false},
      {"uneven groups, transposed weights", 150, 40, 70, {17, 0, 64, 1, 30}, true},
      {"every row in one group", 200, 96, 130, {0, 200, 0}, false},
      {"70 groups, most of them empty", 400, 24, 33, many, true},
      {"tiny", 5, 3, 1, {2, 3}, false},
      {"no rows in any group", 20, 8, 8, {0, 0, 0}, false},
      {"aligned (torch's kernel for bfloat16 on sm90)", 256, 128, 256, {64, 0, 100, 80}, false},
      {"aligned, transposed weights", 256, 128, 256, {64, 0, 100, 80}, true},
      // At most 32 rows: the few-rows kernel (Note [A decode step's few rows]).
      {"a decode step of one token, top-2", 2, 512, 1024, {0, 1, 0, 0, 1, 0, 0, 0}, false},
      {"a decode step of 8 tokens, transposed weights", 16, 96, 130, {3, 0, 5, 0, 1, 2, 0, 3},
       true},
      {"32 rows in one group", 32, 40, 70, {0, 32}, false},
  };
}

void run_case(const Case& c, at::ScalarType dtype, GroupedMmKernels kernels) {
  const std::string where = c10::str(c.name, ", ", dtype,
                                     kernels == GroupedMmKernels::kAuto ? ", auto" : ", graphed");
  at::manual_seed(static_cast<uint64_t>(c.rows * 31 + c.k));
  const auto options = at::TensorOptions().dtype(dtype).device(kCuda);
  const int64_t groups = static_cast<int64_t>(c.counts.size());
  const at::Tensor a = at::randn({c.rows, c.k}, options).requires_grad_();
  const at::Tensor weights = c.transposed_weights ? at::randn({groups, c.n, c.k}, options)
                                                  : at::randn({groups, c.k, c.n}, options);
  weights.requires_grad_();
  const at::Tensor b = c.transposed_weights ? weights.transpose(-2, -1) : weights;
  const std::vector<int32_t> ends = cumulative(c.counts);
  const at::Tensor offs = offsets_tensor(ends, kCuda);
  const std::vector<int64_t> effective = effective_ends(ends, c.rows);

  const at::Tensor out = grouped_mm(a, b, offs, kernels);
  ASSERT_EQ(out.scalar_type(), dtype);
  expect_close(out, reference_output(a, b, effective), dtype, where + ": output");
  expect_zero_rows(out, effective.back(), where + ": output");

  const at::Tensor grad = at::randn({c.rows, c.n}, options);
  const auto grads = torch::autograd::grad({out}, {a, weights}, {grad});
  const at::Tensor grad_b = c.transposed_weights ? grads[1].transpose(-2, -1) : grads[1];
  expect_close(grads[0], reference_output(grad, b.transpose(-2, -1), effective), dtype,
               where + ": input gradient");
  expect_zero_rows(grads[0], effective.back(), where + ": input gradient");
  expect_close(grad_b, reference_weight_grad(a, grad, effective), dtype,
               where + ": weight gradient");
  int64_t start = 0;
  for (int64_t g = 0; g < groups; ++g) {
    if (effective[g] == start) {
      EXPECT_EQ(grad_b[g].abs().max().item<double>(), 0.0)
          << where << ": the weight gradient of empty group " << g << " must be exactly zero";
    }
    start = effective[g];
  }
}

TEST_F(GroupedMmOnGpu, OutputAndGradientsMatchAFloat64LoopOfProducts) {
  for (at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (GroupedMmKernels kernels : {GroupedMmKernels::kGraphed, GroupedMmKernels::kAuto}) {
      for (const Case& c : cases()) {
        run_case(c, dtype, kernels);
      }
    }
  }
}

TEST_F(GroupedMmOnGpu, TorchsKernelTakesAlignedBFloat16OnHopperAndBlackwellOnly) {
  const int major = at::cuda::getDeviceProperties(0)->major;
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(kCuda);
  const at::Tensor a = at::randn({64, 128}, bf16);
  EXPECT_EQ(grouped_mm_uses_torch(a, at::randn({4, 128, 64}, bf16)), major == 9 || major == 10);
  EXPECT_EQ(grouped_mm_uses_torch(a, at::randn({4, 64, 128}, bf16).transpose(-2, -1)),
            major == 9 || major == 10);
  EXPECT_FALSE(grouped_mm_uses_torch(a.to(at::kFloat), at::randn({4, 128, 64}, kCuda)));
  EXPECT_FALSE(grouped_mm_uses_torch(a.to(at::kHalf), at::randn({4, 128, 64}, bf16).to(at::kHalf)));
  // Leading strides that are not multiples of 16 bytes, an unaligned start.
  EXPECT_FALSE(grouped_mm_uses_torch(at::randn({64, 12}, bf16), at::randn({4, 12, 64}, bf16)));
  EXPECT_FALSE(grouped_mm_uses_torch(at::randn({1, 64 * 128 + 1}, bf16).narrow(1, 1, 64 * 128)
                                         .view({64, 128}),
                                     at::randn({4, 128, 64}, bf16)));
}

TEST_F(GroupedMmOnGpu, StridedAndExpandedOperandsNeedNoCopy) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const auto options = at::TensorOptions().dtype(dtype).device(kCuda);
    const at::Tensor wide = at::randn({90, 50}, options);
    const at::Tensor a = wide.narrow(1, 3, 40);  // rows 50 elements apart
    const at::Tensor b = at::randn({3, 70, 40}, options).permute({0, 2, 1});
    const std::vector<int32_t> ends{30, 30, 77};
    const at::Tensor offs = offsets_tensor(ends, kCuda);
    const std::vector<int64_t> effective = effective_ends(ends, 90);
    expect_close(grouped_mm(a, b, offs), reference_output(a, b, effective), dtype,
                 c10::str("strided operands, ", dtype));
    // The gradient of a sum is an expanded (stride 0) tensor.
    const at::Tensor grad = at::ones({1, 1}, options).expand({90, 70});
    expect_close(grouped_mm_weight_grad(a, grad, offs),
                 reference_weight_grad(a, grad, effective), dtype,
                 c10::str("expanded gradient, ", dtype));
  }
}

TEST_F(GroupedMmOnGpu, ReplaysFollowTheOffsetsTheTensorHoldsThen) {
  for (at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    const auto options = at::TensorOptions().dtype(dtype).device(kCuda);
    at::manual_seed(5);
    const int64_t rows = 192;
    const at::Tensor a = at::randn({rows, 64}, options).requires_grad_();
    const at::Tensor w = at::randn({4, 128, 64}, options).requires_grad_();
    const at::Tensor grad = at::randn({rows, 128}, options);
    const at::Tensor offs = offsets_tensor({50, 50, 120, 150}, kCuda);
    const auto step = [&] {
      const at::Tensor out = grouped_mm(a, w.transpose(-2, -1), offs);
      const auto grads = torch::autograd::grad({out}, {a, w}, {grad});
      return std::vector<at::Tensor>{out, grads[0], grads[1]};
    };
    (void)step();  // warm-up, eagerly
    std::vector<at::Tensor> outputs;
    graphed::Graph graph;
    graph.capture([&] { outputs = step(); });
    const std::vector<std::vector<int32_t>> replays = {
        {0, 192, 192, 192}, {10, 20, 30, 40}, {64, 64, 64, 180}, {50, 50, 120, 150}};
    for (const std::vector<int32_t>& ends : replays) {
      offs.copy_(offsets_tensor(ends, kCuda));
      graph.replay();
      const std::vector<int64_t> effective = effective_ends(ends, rows);
      std::string where = c10::str(dtype, ", replay with offsets");
      for (int32_t end : ends) {
        where += c10::str(" ", end);
      }
      const at::Tensor b = w.transpose(-2, -1);
      expect_close(outputs[0], reference_output(a, b, effective), dtype, where + ": output");
      expect_zero_rows(outputs[0], effective.back(), where + ": output");
      expect_close(outputs[1], reference_output(grad, w, effective), dtype,
                   where + ": input gradient");
      expect_close(outputs[2].transpose(-2, -1), reference_weight_grad(a, grad, effective), dtype,
                   where + ": weight gradient");
    }
  }
}

TEST_F(GroupedMmOnGpu, OffsetsOutOfRangeOrOrderNeitherFaultNorWriteOutside) {
  const int32_t huge = std::numeric_limits<int32_t>::max();
  const std::vector<std::vector<int32_t>> bad = {
      {-5, 1000000, 3, huge}, {huge, huge, huge}, {-1, -1, -1}, {40, 10, 70, 5}};
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (GroupedMmKernels kernels : {GroupedMmKernels::kGraphed, GroupedMmKernels::kAuto}) {
      // 100 rows take the tiled kernel, 12 the few-rows one.
      for (const int64_t rows : {int64_t{100}, int64_t{12}}) {
        for (const std::vector<int32_t>& ends : bad) {
          const auto options = at::TensorOptions().dtype(dtype).device(kCuda);
          const int64_t groups = static_cast<int64_t>(ends.size());
          const at::Tensor a = at::randn({rows, 64}, options);
          const at::Tensor b = at::randn({groups, 64, 128}, options);
          const at::Tensor offs = offsets_tensor(ends, kCuda);
          const at::Tensor out = grouped_mm(a, b, offs, kernels);
          const at::Tensor grad_b =
              grouped_mm_weight_grad(a, at::randn({rows, 128}, options), offs, kernels);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          // What the kernels promise: the clamped running maximum of the offsets.
          const std::vector<int64_t> effective = effective_ends(ends, rows);
          const std::string where = c10::str("bad offsets, ", dtype, ", ", rows, " rows");
          expect_close(out, reference_output(a, b, effective), dtype, where);
          expect_zero_rows(out, effective.back(), where);
          EXPECT_TRUE(grad_b.isfinite().all().item<bool>());
        }
      }
    }
  }
  // The context still works.
  const at::Tensor x = at::ones({1024}, kCuda);
  EXPECT_EQ(x.sum().item<float>(), 1024.0f);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace graphed
