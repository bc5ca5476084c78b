// The grouped matrix products of a mixture of experts, see
// Note [A grouped GEMM every dtype can capture] in src/grouped_mm.cpp:
// out = A[rows of g] @ B[g] for every group g of rows, the weight gradient
// that reduces over each group's rows, and the small fix-ups that make
// torch's bfloat16 path as deterministic as these kernels. Plain CUDA types only, so that
// src/grouped_mm.cpp (compiled as C++ against ATen) and the .cu file
// (compiled by nvcc without torch headers) share it.
//
// Every launch reads the group offsets on the device, never on the host,
// allocates nothing and synchronizes nothing: all of them can be captured.
// Offsets are int32 "ends": group g owns rows [offs[g-1], offs[g]) (offs[-1]
// is 0). The kernels clamp every offset into [0, rows] and take the running
// maximum, so offsets out of range or out of order give wrong rows, never an
// access out of bounds.

#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace graphed::device {

/// The element type of a grouped product's operands and output (all alike;
/// the products accumulate in float32 whatever it is).
enum class GroupedMmType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

/// The group offsets: `groups` int32 ends, `stride` elements apart, on the device.
struct GroupOffsets {
  const int32_t* ends = nullptr;
  int64_t stride = 1;
  int64_t groups = 0;
};

/// out[S, N] = A[rows of g, K] @ B[g][K, N] for every group g; rows past the
/// last offset are written as zeros. Strides are in elements and may be
/// anything (a transposed view of the weights needs no copy); all pointers
/// are device pointers, `out` must not overlap the operands.
struct GroupedMm {
  GroupedMmType type = GroupedMmType::kFloat32;
  const void* a = nullptr;  // [rows, k]
  int64_t a_stride[2] = {0, 0};
  const void* b = nullptr;  // [groups, k, n]
  int64_t b_stride[3] = {0, 0, 0};
  void* out = nullptr;  // [rows, n]
  int64_t out_stride[2] = {0, 0};
  GroupOffsets offsets;
  int64_t rows = 0;
  int64_t k = 0;
  int64_t n = 0;
};

/// Launches the grouped product on `stream` (capturable). Returns the launch's error.
cudaError_t launch_grouped_mm(const GroupedMm& mm, cudaStream_t stream);

/// The weight gradient of a GroupedMm: out[g][K, N] = A[rows of g]^T @
/// grad[rows of g] for every group g, zeros for a group without rows. Rows
/// past the last offset contribute nothing.
struct GroupedMmWeightGrad {
  GroupedMmType type = GroupedMmType::kFloat32;
  const void* a = nullptr;  // [rows, k]
  int64_t a_stride[2] = {0, 0};
  const void* grad = nullptr;  // [rows, n]
  int64_t grad_stride[2] = {0, 0};
  void* out = nullptr;  // [groups, k, n]
  int64_t out_stride[3] = {0, 0, 0};
  GroupOffsets offsets;
  int64_t rows = 0;
  int64_t k = 0;
  int64_t n = 0;
};

/// Launches the weight gradient on `stream` (capturable). Returns the launch's error.
cudaError_t launch_grouped_mm_weight_grad(const GroupedMmWeightGrad& grad, cudaStream_t stream);

/// Writes `offsets` clamped into [0, rows] and made non-decreasing (the
/// running maximum), as the kernels read them, into `out` (contiguous int32
/// [groups]): the offsets torch's bfloat16 kernel is given, so that no offset
/// makes it read out of bounds. One warp on `stream` (capturable).
cudaError_t launch_sanitize_group_offsets(const GroupOffsets& offsets, int64_t rows, int32_t* out,
                                          cudaStream_t stream);

/// A matrix of `rows` x `cols` elements of `type` at `data` with strides in elements.
struct StridedMatrix {
  GroupedMmType type = GroupedMmType::kFloat32;
  void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t stride[2] = {0, 0};
};

/// Zeroes the rows of `out` from *last_end (a device int32, clamped into
/// [0, rows]) on: the rows a grouped product leaves to no group. On `stream`
/// (capturable).
cudaError_t launch_zero_rows_from(const StridedMatrix& out, const int32_t* last_end,
                                  cudaStream_t stream);

/// Zeroes out[g] ([groups, k, n] with strides `out_stride`) for every group g
/// whose sanitized offsets (non-decreasing, from launch_sanitize_group_offsets)
/// give it no rows. On `stream` (capturable).
cudaError_t launch_zero_empty_groups(GroupedMmType type, void* out, const int64_t (&out_stride)[3],
                                     int64_t k, int64_t n, const int32_t* sanitized_ends,
                                     int64_t groups, cudaStream_t stream);

}  // namespace graphed::device
