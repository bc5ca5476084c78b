// The kernel of graphed's rotary position embedding (Note [Rotary embedding
// in one kernel] in src/rotary_ops.cpp). Plain CUDA types only, so that
// src/rotary_ops.cpp (compiled as C++ against ATen) and the .cu file
// (compiled by nvcc without torch headers) share it. A launch allocates
// nothing and synchronizes nothing: it can be captured.

#pragma once

#include "float_type.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace graphed::device {

/// out[b, h, s, d] = x[b, h, s, d] * cos[b, s, d] + rotated[b, h, s, d] *
/// sin[b, s, d], rotated = cat(-x[..., half:], x[..., :half]), each product
/// and the sum rounded to `type` as ATen's kernels round them. x and out are
/// [batch, heads, seq, dim] with contiguous last dimensions; cos and sin
/// [batch, seq, dim] (a batch stride of 0 broadcasts one row), strides in
/// elements; dim even.
struct RotaryApply {
  const void* x = nullptr;
  int64_t x_strides[3] = {0, 0, 0};  // batch, heads, seq
  const void* cos = nullptr;
  int64_t cos_strides[2] = {0, 0};  // batch, seq
  const void* sin = nullptr;
  int64_t sin_strides[2] = {0, 0};
  void* out = nullptr;
  int64_t out_strides[3] = {0, 0, 0};
  FloatType type = FloatType::kFloat32;  // states, cosines, sines, result
  int64_t batch = 0;
  int64_t heads = 0;
  int64_t seq = 0;
  int64_t dim = 0;
};

/// Launches RotaryApply on `stream`.
cudaError_t launch_rotary_apply(const RotaryApply& apply, cudaStream_t stream);

}  // namespace graphed::device
