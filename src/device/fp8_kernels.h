// The fused FP8 kernels of float8 training (Note [Fused FP8 casts] in
// fp8_kernels.cu): the scaled saturating cast with its optional transpose and
// amax, the amax reduction of current scaling, and the delayed-scaling update
// of every tensor of a model in one launch. Plain CUDA types only, so that
// src/fp8_cast.cpp (compiled as C++ against ATen) and the .cu file (compiled
// by nvcc without torch headers) share it.

#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace graphed::device {

/// The element type of a high-precision input.
enum class HighPrecisionType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

/// The FP8 format of an output (the values of graphed::Float8Format).
enum class Fp8Type : int { kE4M3 = 0, kE5M2 = 1 };

/// One fused cast of a contiguous [rows, cols] tensor (any tensor is [1, numel]
/// when no transposed output is wanted). All pointers are device pointers.
struct Fp8Cast {
  const void* input = nullptr;
  HighPrecisionType input_type = HighPrecisionType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  Fp8Type output_type = Fp8Type::kE4M3;
  /// The scale the values are multiplied by before the saturating cast
  /// (float32). Null: the scale follows `scale_amax` (current scaling).
  const float* scale = nullptr;
  /// Current scaling: the input's amax, already reduced; the scale is
  /// format_max / amax / 2^margin, or 1 where that is not a positive finite
  /// number. Read when `scale` is null.
  const float* scale_amax = nullptr;
  float format_max = 448.0f;
  int margin = 0;
  /// Where the scale used and its inverse are written (current scaling); may be null.
  float* scale_out = nullptr;
  float* scale_inv_out = nullptr;
  /// [rows, cols] row-major FP8 output; may be null.
  uint8_t* output = nullptr;
  /// [cols, rows] row-major FP8 output (the transpose); may be null.
  uint8_t* output_transposed = nullptr;
  /// max(|input|) is merged into *amax (atomic max); may be null.
  float* amax = nullptr;
};

/// Launches the cast on `stream` (capturable). Returns the launch's error.
cudaError_t launch_fp8_cast(const Fp8Cast& cast, cudaStream_t stream);

/// max(|input|) of `count` elements, merged into *amax (atomic max; zero it
/// first for the amax of this input alone).
struct AmaxReduction {
  const void* input = nullptr;
  HighPrecisionType input_type = HighPrecisionType::kFloat32;
  int64_t count = 0;
  float* amax = nullptr;
};

/// Launches the reduction on `stream` (capturable). Returns the launch's error.
cudaError_t launch_amax_reduction(const AmaxReduction& reduction, cudaStream_t stream);

/// The delayed-scaling update of `tensors` tensors at once (the semantics of
/// graphed::update_delayed_scaling): for each row t, history[t, *slot] =
/// amax[t]; the reduced amax (max of the row, or amax[t]) gives scale[t] =
/// format_max[t] / amax / 2^margin where that is positive and finite, else the
/// old one; scale_inv[t] = 1 / scale[t]; amax[t] = 0. Then *slot advances.
struct DelayedScalingUpdate {
  float* history = nullptr;  // [tensors, history_len], row-major
  float* amax = nullptr;     // [tensors]
  float* scale = nullptr;    // [tensors]
  float* scale_inv = nullptr;
  const float* format_max = nullptr;  // [tensors]
  int64_t* slot = nullptr;            // [1]
  int64_t tensors = 0;
  int64_t history_len = 1;
  int margin = 0;
  bool most_recent = false;
};

/// Launches the update, one block, on `stream` (capturable).
cudaError_t launch_delayed_scaling_update(const DelayedScalingUpdate& update,
                                          cudaStream_t stream);

}  // namespace graphed::device
