#pragma once

/// \file grouped_mm.h
/// The grouped matrix product of mixture-of-experts layers (issue 28), which
/// CUDA graphs can capture in every dtype: out[S, N] = a[rows of g] @ b[g]
/// for the groups of rows that int32 offsets delimit, with autograd. torch's
/// aten::_grouped_mm is capturable for bfloat16 on compute capability 9.x and
/// 10.x only; for float32 and float16 it copies the offsets to the host, so
/// capture fails. graphed runs torch's kernel where it is capturable and its
/// own kernels everywhere else (Note [A grouped GEMM every dtype can capture]
/// in src/grouped_mm.cpp).

#include <ATen/core/Tensor.h>

namespace graphed {

/// Which implementation grouped_mm runs.
enum class GroupedMmKernels {
  /// torch's at::_grouped_mm where it is capturable and takes the operands'
  /// layout (grouped_mm_uses_torch), graphed's kernels everywhere else.
  kAuto,
  /// graphed's kernels always (for tests and comparisons).
  kGraphed,
};

/// Whether grouped_mm(a, b, offs) with GroupedMmKernels::kAuto runs torch's
/// own capturable kernel (at::_grouped_mm): bfloat16 CUDA operands on a GPU
/// of compute capability 9.x or 10.x, in layouts that kernel takes (16-byte
/// aligned, each operand row- or column-major with 16-byte aligned leading
/// strides) and without an empty dimension. False for anything else,
/// including arguments grouped_mm would refuse; graphed's kernels run then.
bool grouped_mm_uses_torch(const at::Tensor& a, const at::Tensor& b);

/// The grouped product of a mixture of experts: `a` is [S, K] (the rows of
/// every group, sorted by group), `b` [E, K, N] (one weight per group; a
/// transposed view w.transpose(-2, -1) of [E, N, K] weights needs no copy),
/// `offs` int32 [E] on their GPU, the cumulative row counts: group g owns the
/// rows [offs[g-1], offs[g]) (offs[-1] is 0). Returns out [S, N] with
/// out[rows of g] = a[rows of g] @ b[g], in a's dtype (float32, bfloat16 or
/// float16; products accumulated in float32), and zeros in the rows past
/// offs[E-1] (torch leaves those uninitialized). An autograd function:
/// backward gives a's gradient, grouped_mm(grad, b.transpose(-2, -1), offs),
/// and b's, grouped_mm_weight_grad(a, grad, offs) (no higher-order
/// gradients). The offsets are read on the device only, so a capture
/// replays with whatever offsets the tensor holds then; offsets out of range
/// or out of order give wrong rows, never a fault (each is clamped into
/// [0, S], then the running maximum is taken). Throws graphed::Error, before
/// anything runs, naming the argument and the fix when the shapes, dtypes or
/// devices do not fit.
at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                      GroupedMmKernels kernels = GroupedMmKernels::kAuto);

/// The weight gradient of grouped_mm (no autograd): for `a` [S, K] and the
/// output gradient `grad` [S, N], returns [E, K, N] (E = offs.size(0)) with
/// [g] = a[rows of g]^T @ grad[rows of g], zeros for a group without rows.
/// Rows past offs[E-1] contribute nothing. Checks its arguments as
/// grouped_mm does.
at::Tensor grouped_mm_weight_grad(const at::Tensor& a, const at::Tensor& grad,
                                  const at::Tensor& offs,
                                  GroupedMmKernels kernels = GroupedMmKernels::kAuto);

}  // namespace graphed
