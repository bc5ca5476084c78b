// The two elementwise kernels of graphed's RMSNorm (Note [RMSNorm in three
// kernels] in src/rms_norm_ops.cpp): the gate with the squares, and the
// scaling by the reciprocal root. Plain CUDA types only, so that
// src/rms_norm_ops.cpp (compiled as C++ against ATen) and the .cu file
// (compiled by nvcc without torch headers) share it. Every launch allocates
// nothing and synchronizes nothing: both can be captured. Tensors are
// [rows, cols] float32 device pointers whose columns are contiguous; strides
// are the rows', in elements.

#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace graphed::device {

/// gated[r, c] = hidden[r, c] * silu(gate[r, c]) and squares[r, c] =
/// gated[r, c]^2, gated and squares contiguous.
struct RmsNormGate {
  const float* hidden = nullptr;
  int64_t hidden_row_stride = 0;
  const float* gate = nullptr;
  int64_t gate_row_stride = 0;
  float* gated = nullptr;
  float* squares = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
};

/// out[r, c] = weight[c] * (hidden[r, c] * rsqrt(variance[r] + eps)), out
/// contiguous, variance one value per row (contiguous); with
/// weight_plus_one, (1 + weight[c]) in place of weight[c] (Gemma's norms).
struct RmsNormScale {
  const float* hidden = nullptr;
  int64_t hidden_row_stride = 0;
  const float* variance = nullptr;
  const float* weight = nullptr;
  int64_t weight_stride = 1;
  float eps = 0.0f;
  bool weight_plus_one = false;
  float* out = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
};

/// Launches RmsNormGate on `stream`.
cudaError_t launch_rms_norm_gate(const RmsNormGate& gate, cudaStream_t stream);

/// Launches RmsNormScale on `stream`.
cudaError_t launch_rms_norm_scale(const RmsNormScale& scale, cudaStream_t stream);

}  // namespace graphed::device
