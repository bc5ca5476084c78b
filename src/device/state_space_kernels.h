// The fused decode-step kernels of Mamba2-family layers (Note [Fused
// state-space decode steps] in src/state_space_ops.cpp): the selective state
// update, its skip connection, and the convolution state's shift with the
// convolution of the newest position. Plain CUDA types only, so that
// src/state_space_ops.cpp (compiled as C++ against ATen) and the .cu file
// (compiled by nvcc without torch headers) share it. Every launch allocates
// nothing and synchronizes nothing: all of them can be captured. Strides
// are in elements; all pointers are float32 device pointers.

#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace graphed::device {

/// state[b, h, p, n] = state * exp(dt' * A[h, p, n]) + (dt' * B[b, g(h), n]) * x[b, h, p]
/// with dt' = softplus(dt[b, h, p] + dt_bias[h, p]) (each part optional), in
/// place, for every batch row b, head h, head channel p and state index n;
/// g(h) = h / (heads / groups); and c_heads[b, h, n] = C[b, g(h), n].
struct SelectiveStateUpdate {
  float* state = nullptr;
  int64_t state_stride[4] = {0, 0, 0, 0};
  const float* x = nullptr;
  int64_t x_stride[3] = {0, 0, 0};
  const float* dt = nullptr;
  int64_t dt_stride[3] = {0, 0, 0};
  /// Null: no bias.
  const float* dt_bias = nullptr;
  int64_t dt_bias_stride[2] = {0, 0};
  const float* a = nullptr;
  int64_t a_stride[3] = {0, 0, 0};
  const float* b = nullptr;
  int64_t b_stride[3] = {0, 0, 0};
  /// C [batch, groups, state_size], copied per head into c_heads, contiguous
  /// [batch, heads, state_size] (what the product with the state reads).
  const float* c = nullptr;
  int64_t c_stride[3] = {0, 0, 0};
  float* c_heads = nullptr;
  int64_t batch = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;
  int64_t state_size = 0;
  int64_t groups = 1;
  bool dt_softplus = false;
};

/// out[b, h, p] = y[b, h, p] + x[b, h, p] * d[h, p]; y and out contiguous
/// [batch, heads, head_dim].
struct SkipConnection {
  const float* y = nullptr;
  const float* x = nullptr;
  int64_t x_stride[3] = {0, 0, 0};
  const float* d = nullptr;
  int64_t d_stride[2] = {0, 0};
  float* out = nullptr;
  int64_t batch = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;
};

/// For every batch row b and channel c: the window [state[b, c, :], x[b, c]]
/// shifts left by one into state (the oldest input leaves), and
/// out[b, c] = act(bias[c] + sum_k weight[c, k] * state'[b, c, k]) over the
/// shifted state, act SiLU or none; out contiguous [batch, channels].
struct ConvStateUpdate {
  const float* x = nullptr;
  int64_t x_stride[2] = {0, 0};
  float* state = nullptr;
  int64_t state_stride[3] = {0, 0, 0};
  const float* weight = nullptr;
  int64_t weight_stride[2] = {0, 0};
  /// Null: no bias.
  const float* bias = nullptr;
  int64_t bias_stride = 0;
  float* out = nullptr;
  int64_t batch = 0;
  int64_t channels = 0;
  int64_t width = 0;
  bool silu = false;
};

/// The largest convolution width launch_conv_state_update takes (Mamba's is 4).
constexpr int64_t kMaxConvWidth = 16;

/// Enqueues the update on `stream`; returns the launch's error.
cudaError_t launch_selective_state_update(const SelectiveStateUpdate& update,
                                          cudaStream_t stream);
/// Enqueues the skip connection on `stream`; returns the launch's error.
cudaError_t launch_skip_connection(const SkipConnection& skip, cudaStream_t stream);
/// Enqueues the convolution step on `stream` (width <= kMaxConvWidth);
/// returns the launch's error.
cudaError_t launch_conv_state_update(const ConvStateUpdate& conv, cudaStream_t stream);

}  // namespace graphed::device
