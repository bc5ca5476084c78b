// Note [The reference's roundings]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// These kernels replace transformers' torch path for one decode step of a
// Mamba2 layer (mamba2_selective_state_update and causal_conv1d_update in
// models/mamba2/modeling_mamba2.py, 5.17) and must give its results to the
// bit, so that greedy tokens stay transformers'. That path is a sequence of
// float32 ATen kernels, each rounding its result once; fused into one kernel
// the same expressions would be contracted into fused multiply-adds, which
// round once where the sequence rounds twice. So every product and sum that
// was its own ATen kernel is written with an explicit round-to-nearest
// intrinsic (__fmul_rn, __fadd_rn), which nvcc never contracts, in the
// reference's order:
//   dt' = softplus(dt + dt_bias)   (add; softplus: x > 20 ? x : log1p(exp(x)))
//   dA  = exp(dt' * A)             (mul, exp)
//   dBx = (dt' * B) * x            (mul, mul)
//   s   = state * dA + dBx         (mul, add)
// and the skip connection y + x * D (mul, add). exp and log1p are the same
// libdevice functions ATen's kernels call (no fast-math in either build). The
// convolution is ATen's depthwise kernel's loop, whose `value += w * x` nvcc
// does contract: it starts from the bias and takes one fused multiply-add per
// tap in tap order (__fmaf_rn), then SiLU as ATen writes it, x / (1 + exp(-x)).
// The state's product with C stays cuBLAS's (at::bmm on the same shapes and
// strides as the reference, C repeated per head into a fresh contiguous
// tensor as the reference's .contiguous() makes one, by the update kernel),
// so its summation order is the reference's too. The GPU
// tests (test_state_space_kernels_gpu.py) compare every output with
// transformers' functions with torch.equal.

#include "state_space_kernels.h"

#include "elementwise_grid.h"

#include <cmath>

namespace graphed::device {
namespace {

constexpr int kThreads = kElementwiseThreads;

__device__ float softplus(float v) {
  // ATen's softplus with beta 1 and threshold 20 (multiplying and dividing
  // by a beta of 1 is exact).
  return v > 20.0f ? v : log1pf(expf(v));
}

__global__ void selective_state_update_kernel(SelectiveStateUpdate u) {
  const int64_t total = u.batch * u.heads * u.head_dim * u.state_size;
  const int64_t heads_per_group = u.heads / u.groups;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i % u.state_size;
    int64_t rest = i / u.state_size;
    const int64_t p = rest % u.head_dim;
    rest /= u.head_dim;
    const int64_t h = rest % u.heads;
    const int64_t b = rest / u.heads;
    float dt = u.dt[b * u.dt_stride[0] + h * u.dt_stride[1] + p * u.dt_stride[2]];
    if (u.dt_bias != nullptr) {
      dt = __fadd_rn(dt, u.dt_bias[h * u.dt_bias_stride[0] + p * u.dt_bias_stride[1]]);
    }
    if (u.dt_softplus) {
      dt = softplus(dt);
    }
    const float a = u.a[h * u.a_stride[0] + p * u.a_stride[1] + n * u.a_stride[2]];
    const float decay = expf(__fmul_rn(dt, a));
    const float bn = u.b[b * u.b_stride[0] + (h / heads_per_group) * u.b_stride[1] +
                         n * u.b_stride[2]];
    if (p == 0) {
      u.c_heads[(b * u.heads + h) * u.state_size + n] =
          u.c[b * u.c_stride[0] + (h / heads_per_group) * u.c_stride[1] + n * u.c_stride[2]];
    }
    const float x = u.x[b * u.x_stride[0] + h * u.x_stride[1] + p * u.x_stride[2]];
    const float input = __fmul_rn(__fmul_rn(dt, bn), x);
    float* state = u.state + b * u.state_stride[0] + h * u.state_stride[1] +
                   p * u.state_stride[2] + n * u.state_stride[3];
    *state = __fadd_rn(__fmul_rn(*state, decay), input);
  }
}

__global__ void skip_connection_kernel(SkipConnection s) {
  const int64_t total = s.batch * s.heads * s.head_dim;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = i % s.head_dim;
    const int64_t h = (i / s.head_dim) % s.heads;
    const int64_t b = i / (s.head_dim * s.heads);
    const float x = s.x[b * s.x_stride[0] + h * s.x_stride[1] + p * s.x_stride[2]];
    const float d = s.d[h * s.d_stride[0] + p * s.d_stride[1]];
    s.out[i] = __fadd_rn(s.y[i], __fmul_rn(x, d));
  }
}

__global__ void conv_state_update_kernel(ConvStateUpdate c) {
  const int64_t total = c.batch * c.channels;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t channel = i % c.channels;
    const int64_t b = i / c.channels;
    float* state = c.state + b * c.state_stride[0] + channel * c.state_stride[1];
    float window[kMaxConvWidth];
    for (int64_t k = 1; k < c.width; ++k) {
      window[k - 1] = state[k * c.state_stride[2]];
    }
    window[c.width - 1] = c.x[b * c.x_stride[0] + channel * c.x_stride[1]];
    float value = c.bias != nullptr ? c.bias[channel * c.bias_stride] : 0.0f;
    for (int64_t k = 0; k < c.width; ++k) {
      value = __fmaf_rn(c.weight[channel * c.weight_stride[0] + k * c.weight_stride[1]],
                        window[k], value);
      state[k * c.state_stride[2]] = window[k];
    }
    c.out[i] = c.silu ? value / (1.0f + expf(-value)) : value;
  }
}

}  // namespace

cudaError_t launch_selective_state_update(const SelectiveStateUpdate& update,
                                          cudaStream_t stream) {
  const int64_t total = update.batch * update.heads * update.head_dim * update.state_size;
  if (total == 0) {
    return cudaSuccess;
  }
  selective_state_update_kernel<<<elementwise_blocks(total), kThreads, 0, stream>>>(update);
  return cudaGetLastError();
}

cudaError_t launch_skip_connection(const SkipConnection& skip, cudaStream_t stream) {
  const int64_t total = skip.batch * skip.heads * skip.head_dim;
  if (total == 0) {
    return cudaSuccess;
  }
  skip_connection_kernel<<<elementwise_blocks(total), kThreads, 0, stream>>>(skip);
  return cudaGetLastError();
}

cudaError_t launch_conv_state_update(const ConvStateUpdate& conv, cudaStream_t stream) {
  const int64_t total = conv.batch * conv.channels;
  if (total == 0 || conv.width < 1 || conv.width > kMaxConvWidth) {
    return total == 0 ? cudaSuccess : cudaErrorInvalidValue;
  }
  conv_state_update_kernel<<<elementwise_blocks(total), kThreads, 0, stream>>>(conv);
  return cudaGetLastError();
}

}  // namespace graphed::device
