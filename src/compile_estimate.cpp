// What torch.compile's fusion would leave of a traced step (compile_estimate.h).

#include "graphed/compile_estimate.h"

#include "graphed/advice.h"

#include "graphed/check.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <string>

namespace graphed {

// Note [Predicting a compiled step]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch.compile(model) in Inductor's default mode changes a step's kernels in
// one way that matters here: the memory-bound kernels between the matrix
// products (elementwise ops, casts, normalizations, softmax, reductions,
// indexing, the loss) are fused into fewer generated kernels that read and
// write each tensor once, in the forward and in the backward alike. It keeps
// what it does not generate: matrix products and convolutions go to cuBLAS
// and cuDNN as before, fused attention stays the same kernel, and the
// optimizer step and gradient clipping (outside the compiled model) run their
// own kernels. So graphed predicts the compiled step, captured whole, as
//
//     fixed kernels' time  +  kFusedTimeShare * fusible kernels' time
//     + (fixed activities + kFusedKernelShare * fusible kernels) * per_node
//     + graphs * launch
//
// with per_node and launch those of Note [Predicting the graphed time]. The
// two shares are averages over the models of the zoo (bench/zoo.py, the H200):
// a fused kernel does the work of about three eager ones in a little under
// half their time, as it moves the tensors once instead of once per op. The
// kernels are told apart by the names the profiler reports (classify_kernel);
// a name that matches nothing counts as fusible, the common case. The
// prediction decides whether optimize(compile="auto") builds the compiled
// candidate at all; the candidate is then verified and timed like any other,
// so a wrong prediction costs a compile, never a slower step.

namespace {

std::string lower(std::string_view name) {
  std::string out(name);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

template <size_t N>
bool has_any(const std::string& name, const std::array<std::string_view, N>& parts) {
  return std::any_of(parts.begin(), parts.end(), [&](std::string_view part) {
    return name.find(part) != std::string::npos;
  });
}

constexpr std::array<std::string_view, 2> kGenerated = {"triton_", "triton__"};
constexpr std::array<std::string_view, 2> kCollective = {"nccl", "all_reduce"};
constexpr std::array<std::string_view, 7> kAttention = {
    "flash_fwd", "flash_bwd", "fmha", "sdpa", "attention", "flash_attn", "mha_"};
// cuDNN's batch norms and poolings say "cudnn" but are memory-bound ops that
// Inductor decomposes and fuses into its own kernels, as it does the native ones.
constexpr std::array<std::string_view, 6> kCudnnFusible = {
    "bn_fw", "bn_bw", "batchnorm", "batch_norm", "pooling_fw", "pooling_bw"};
constexpr std::array<std::string_view, 11> kConvolution = {
    "conv1d", "conv2d", "conv3d", "convolve", "depthwise", "fprop", "dgrad", "wgrad",
    "implicit_gemm", "winograd", "cudnn"};
constexpr std::array<std::string_view, 9> kMatmul = {
    "gemm", "gemv", "cutlass", "cublas", "nvjet", "matmul", "splitkreduce", "dot_kernel",
    "grouped_mm"};
constexpr std::array<std::string_view, 5> kOptimizer = {
    "multi_tensor_apply", "fused_adam", "fusedadam", "lpnorm", "_foreach"};

}  // namespace

std::string_view kernel_class_name(KernelClass kind) {
  switch (kind) {
    case KernelClass::kMatmul:
      return "matmul";
    case KernelClass::kConvolution:
      return "convolution";
    case KernelClass::kAttention:
      return "attention";
    case KernelClass::kOptimizer:
      return "optimizer";
    case KernelClass::kGenerated:
      return "generated";
    case KernelClass::kCollective:
      return "collective";
    case KernelClass::kFusible:
      return "fusible";
  }
  return "fusible";
}

KernelClass classify_kernel(std::string_view name) {
  const std::string n = lower(name);
  // Order matters: cuDNN's attention kernels say "cudnn" and "sdpa", its batch
  // norms "cudnn" and "bn_fw", its convolutions "gemm" ("implicit_gemm").
  if (has_any(n, kGenerated)) {
    return KernelClass::kGenerated;
  }
  if (has_any(n, kCollective)) {
    return KernelClass::kCollective;
  }
  if (has_any(n, kAttention)) {
    return KernelClass::kAttention;
  }
  if (has_any(n, kCudnnFusible)) {
    return KernelClass::kFusible;
  }
  if (has_any(n, kConvolution)) {
    return KernelClass::kConvolution;
  }
  if (has_any(n, kMatmul)) {
    return KernelClass::kMatmul;
  }
  if (has_any(n, kOptimizer)) {
    return KernelClass::kOptimizer;
  }
  return KernelClass::kFusible;
}

CompiledEstimate estimate_compiled(const Trace& trace, const ReplayCost& cost, int64_t graphs) {
  GRAPHED_CHECK(!trace.iterations.empty(),
                "Expected a trace of at least one iteration to predict a compiled step, got "
                "none. Record the iterations (profile.h does) or add one HostSpan per iteration "
                "to Trace::iterations.");
  const auto n = static_cast<double>(trace.iterations.size());
  double fixed_ns = 0.0;
  double fusible_ns = 0.0;
  double fixed = 0.0;
  double fusible = 0.0;
  for (const GpuActivity& activity : trace.gpu) {
    const bool fuses = activity.kind == ActivityKind::kKernel &&
                       classify_kernel(activity.name) == KernelClass::kFusible;
    (fuses ? fusible_ns : fixed_ns) += static_cast<double>(activity.duration_ns);
    (fuses ? fusible : fixed) += 1.0;
  }
  CompiledEstimate estimate;
  estimate.fixed_ms = fixed_ns / n / 1e6;
  estimate.fusible_ms = fusible_ns / n / 1e6;
  estimate.fixed_activities = fixed / n;
  estimate.fusible_kernels = fusible / n;
  const double nodes = estimate.fixed_activities + kFusedKernelShare * estimate.fusible_kernels;
  estimate.predicted_ms =
      estimate.fixed_ms + kFusedTimeShare * estimate.fusible_ms +
      (nodes * cost.per_node_us + static_cast<double>(std::max<int64_t>(graphs, 1)) *
                                      cost.launch_us) / 1e3;
  return estimate;
}

}  // namespace graphed
