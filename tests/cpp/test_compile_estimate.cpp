// The compiled-step prediction on hand-built traces: kernel classes from
// real profiler names and the arithmetic of Note [Predicting a compiled
// step]. No GPU needed.

#include "graphed/compile_estimate.h"

#include "graphed/advice.h"
#include "graphed/check.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

namespace graphed {
namespace {

constexpr int64_t kUs = 1000;  // nanoseconds

TEST(ClassifyKernel, TellsApartWhatFusionKeepsFromWhatItMerges) {
  const std::vector<std::pair<std::string, KernelClass>> names = {
      {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", KernelClass::kMatmul},
      {"nvjet_hsh_64x8_64x16_2x1_v_bz_TNT", KernelClass::kMatmul},
      {"void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4>",
       KernelClass::kMatmul},
      {"void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4>",
       KernelClass::kMatmul},
      {"void cublasLt::splitKreduce_kernel<32, 16, int, float>", KernelClass::kMatmul},
      {"void graphed::(anonymous namespace)::grouped_mm_kernel(GroupedMm)",
       KernelClass::kMatmul},
      {"void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>",
       KernelClass::kAttention},
      {"fmha_cutlassB_bf16_aligned_64x64_k64_sm80", KernelClass::kAttention},
      {"cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64",
       KernelClass::kAttention},
      {"sm90_xmma_fprop_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nchw", KernelClass::kConvolution},
      {"void cudnn::engines_precompiled::nchwToNhwcKernel<float>", KernelClass::kConvolution},
      {"void at::native::conv_depthwise2d_forward_kernel<3, float, int>",
       KernelClass::kConvolution},
      {"void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdam>",
       KernelClass::kOptimizer},
      {"void at::native::lpnorm_cleanup<float, 2, float, float>", KernelClass::kOptimizer},
      {"triton_poi_fused_add_mul_0", KernelClass::kGenerated},
      {"triton_red_fused_native_layer_norm_1", KernelClass::kGenerated},
      {"ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
       KernelClass::kCollective},
      {"void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>",
       KernelClass::kFusible},
      {"void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>",
       KernelClass::kFusible},
      {"void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>",
       KernelClass::kFusible},
      {"void (anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>",
       KernelClass::kFusible},
      {"void at::native::index_elementwise_kernel<128, 4>", KernelClass::kFusible},
      {"void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1>",
       KernelClass::kFusible},
      {"void cudnn::bn_bw_1C11_kernel_new<float, float, float2, 512, true, 1>",
       KernelClass::kFusible},
      {"void cudnn::pooling_fw_4d_kernel<float, float, cudnn::maxpooling_func<float>>",
       KernelClass::kFusible},
  };
  for (const auto& [name, expected] : names) {
    EXPECT_EQ(classify_kernel(name), expected)
        << name << ": " << kernel_class_name(classify_kernel(name)) << " instead of "
        << kernel_class_name(expected);
  }
}

TEST(EstimateCompiled, ShrinksTheFusibleKernelsAndKeepsTheRest) {
  Trace trace;
  // Two iterations, each: a 100 us GEMM, four 10 us elementwise kernels, one
  // 20 us optimizer kernel and a 1 us memset (fixed, though a memset's name
  // would classify as fusible).
  for (int i = 0; i < 2; ++i) {
    const int64_t t = i * 1000 * kUs;
    trace.iterations.push_back(HostSpan{"it", t, 500 * kUs});
    trace.gpu.push_back(GpuActivity{"ampere_sgemm_128x64_nn", ActivityKind::kKernel, t,
                                    100 * kUs});
    for (int k = 0; k < 4; ++k) {
      trace.gpu.push_back(GpuActivity{"vectorized_elementwise_kernel", ActivityKind::kKernel,
                                      t + (200 + 20 * k) * kUs, 10 * kUs});
    }
    trace.gpu.push_back(GpuActivity{"multi_tensor_apply_kernel", ActivityKind::kKernel,
                                    t + 300 * kUs, 20 * kUs});
    trace.gpu.push_back(GpuActivity{"elementwise", ActivityKind::kMemset, t + 330 * kUs,
                                    1 * kUs});
  }
  ReplayCost cost;
  cost.per_node_us = 1.0;
  cost.launch_us = 10.0;
  const CompiledEstimate e = estimate_compiled(trace, cost);
  EXPECT_DOUBLE_EQ(e.fixed_ms, 0.121);
  EXPECT_DOUBLE_EQ(e.fusible_ms, 0.040);
  EXPECT_DOUBLE_EQ(e.fixed_activities, 3.0);
  EXPECT_DOUBLE_EQ(e.fusible_kernels, 4.0);
  const double nodes = 3.0 + kFusedKernelShare * 4.0;
  EXPECT_DOUBLE_EQ(e.predicted_ms, 0.121 + kFusedTimeShare * 0.040 + (nodes * 1.0 + 10.0) / 1e3);
  // Two graphs pay two launches.
  EXPECT_DOUBLE_EQ(estimate_compiled(trace, cost, 2).predicted_ms, e.predicted_ms + 0.010);
}

TEST(EstimateCompiled, NeedsAnIteration) {
  try {
    estimate_compiled(Trace{}, ReplayCost{});
    FAIL() << "expected graphed::Error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("Expected a trace of at least one iteration to "
                                             "predict a compiled step"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace graphed
