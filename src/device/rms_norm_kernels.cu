// graphed's RMSNorm kernels (rms_norm_kernels.h). Each expression is one
// ATen kernel of transformers' RMSNorm, rounded as that kernel rounds it
// (Note [The reference's roundings] in state_space_kernels.cu): products
// with __fmul_rn, the sum with eps with __fadd_rn, SiLU as ATen writes it
// (x / (1 + exp(-x)), expf and an IEEE division), the square as ATen's pow
// with exponent 2 (x * x) and the root as ATen's rsqrt (rsqrtf). No
// fast-math in either build.

#include "rms_norm_kernels.h"

#include "elementwise_grid.h"

namespace graphed::device {
namespace {

constexpr int kThreads = kElementwiseThreads;

__global__ void rms_norm_gate_kernel(RmsNormGate g) {
  const int64_t total = g.rows * g.cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / g.cols;
    const int64_t c = i - r * g.cols;
    const float z = g.gate[r * g.gate_row_stride + c];
    const float silu = z / (1.0f + expf(-z));
    const float h = __fmul_rn(g.hidden[r * g.hidden_row_stride + c], silu);
    g.gated[i] = h;
    g.squares[i] = __fmul_rn(h, h);
  }
}

__global__ void rms_norm_scale_kernel(RmsNormScale s) {
  const int64_t total = s.rows * s.cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / s.cols;
    const int64_t c = i - r * s.cols;
    const float root = rsqrtf(__fadd_rn(s.variance[r], s.eps));
    const float weight = s.weight[c * s.weight_stride];
    // Gemma's (1.0 + weight) is its own ATen kernel (weight + 1.0), then a
    // product; a product of two floats rounds the same in either order.
    const float scale = s.weight_plus_one ? __fadd_rn(weight, 1.0f) : weight;
    s.out[i] = __fmul_rn(scale, __fmul_rn(s.hidden[r * s.hidden_row_stride + c], root));
  }
}

}  // namespace

cudaError_t launch_rms_norm_gate(const RmsNormGate& gate, cudaStream_t stream) {
  const int64_t total = gate.rows * gate.cols;
  if (total == 0) {
    return cudaSuccess;
  }
  rms_norm_gate_kernel<<<elementwise_blocks(total), kThreads, 0, stream>>>(gate);
  return cudaGetLastError();
}

cudaError_t launch_rms_norm_scale(const RmsNormScale& scale, cudaStream_t stream) {
  const int64_t total = scale.rows * scale.cols;
  if (total == 0) {
    return cudaSuccess;
  }
  rms_norm_scale_kernel<<<elementwise_blocks(total), kThreads, 0, stream>>>(scale);
  return cudaGetLastError();
}

}  // namespace graphed::device
