// The elementwise kernels of graphed's RMSNorm (Note [RMSNorm in three
// kernels] in src/rms_norm_ops.cpp): the gate with the squares, the squares
// of a bfloat16 or half input, and the scaling by the reciprocal root. Plain
// CUDA types only, so that src/rms_norm_ops.cpp (compiled as C++ against
// ATen) and the .cu file (compiled by nvcc without torch headers) share it.
// Every launch allocates nothing and synchronizes nothing: all can be
// captured. Tensors are [rows, cols] device pointers whose columns are
// contiguous; strides are the rows', in elements. Every product, sum and
// rounding is the one its ATen kernel in transformers' forward makes.

#pragma once

#include "float_type.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace graphed::device {

/// gated[r, c] = float(hidden[r, c]) * silu(float(gate[r, c])) and
/// squares[r, c] = gated[r, c]^2, both float32 and contiguous.
struct RmsNormGate {
  const void* hidden = nullptr;
  int64_t hidden_row_stride = 0;
  const void* gate = nullptr;
  int64_t gate_row_stride = 0;
  FloatType type = FloatType::kFloat32;  // hidden, gate, weight, result
  float* gated = nullptr;
  float* squares = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
};

/// squares[r, c] = float(hidden[r, c])^2 in float32, at squares' own row
/// stride (the layout of hidden.to(float32), which the reference squares).
struct RmsNormSquares {
  const void* hidden = nullptr;
  int64_t hidden_row_stride = 0;
  FloatType type = FloatType::kBFloat16;
  float* squares = nullptr;
  int64_t squares_row_stride = 0;
  int64_t rows = 0;
  int64_t cols = 0;
};

/// out[r, c] = w[c] * round(h[r, c] * rsqrt(variance[r] + eps)) with h =
/// float(hidden) (or the float32 gated product when hidden_is_float32), w =
/// float(weight) or 1 + float(weight) (weight_plus_one: Gemma's), round() the
/// rounding to `type` when round_before_weight (Llama's weight *
/// h.to(input_dtype)) and none otherwise (gpt-oss's and Gemma's product in
/// float32, then the cast), and the product rounded to `type`. In float32
/// every rounding is the identity and the forms agree. `out` contiguous,
/// variance one float32 a row (contiguous).
struct RmsNormScale {
  const void* hidden = nullptr;
  int64_t hidden_row_stride = 0;
  bool hidden_is_float32 = false;
  const float* variance = nullptr;
  const void* weight = nullptr;
  int64_t weight_stride = 1;
  FloatType type = FloatType::kFloat32;  // hidden, gate, weight, result
  float eps = 0.0f;
  bool weight_plus_one = false;
  bool round_before_weight = true;
  void* out = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
};

/// Launches RmsNormGate on `stream`.
cudaError_t launch_rms_norm_gate(const RmsNormGate& gate, cudaStream_t stream);

/// Launches RmsNormSquares on `stream`.
cudaError_t launch_rms_norm_squares(const RmsNormSquares& squares, cudaStream_t stream);

/// Launches RmsNormScale on `stream`.
cudaError_t launch_rms_norm_scale(const RmsNormScale& scale, cudaStream_t stream);

}  // namespace graphed::device
