// The grouped products of a mixture of experts (grouped_gemm_kernels.h; the
// design is Note [A grouped GEMM every dtype can capture] in
// src/grouped_mm.cpp). One shared-memory tiled SIMT product serves both
// kernels: a 64x64 output tile per block of 256 threads, 4x4 outputs per
// thread, the reduction in slices of 16 staged through shared memory as
// float32 (the next slice is read into registers while the current one is
// multiplied), every product a float32 FMA. Operands are read through their
// strides; each one is read along whichever of its two dimensions is closer
// to contiguous, so that a row-major input and a transposed weight view are
// both read in runs.
//
// The forward's blocks do not each own a group: block x of the grid is the
// x-th row tile of the concatenation of every group's row tiles (a group of n
// rows has ceil(n / 64) of them), followed by the row tiles of the rows past
// the last offset, which are written as zeros. Warp 0 of each block finds its
// tile from the offsets with a warp scan, 32 groups a step, so the grid is
// ceil(S / 64) + E + 1 blocks wide, of which at most E + 1 find nothing to do,
// rather than ceil(S / 64) blocks for each of the E groups. Every output row
// is written by exactly one block.
//
// A forward of at most 32 rows (a decode step: a few tokens times top-k) takes
// a kernel of its own, Note [A decode step's few rows] in src/grouped_mm.cpp:
// a block per (32 output columns, group) that splits the reduction across its
// threads, so the weights stream in parallel instead of through one block's
// serial loop over K.

#include "grouped_gemm_kernels.h"

#include "float_conversions.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace graphed::device {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 64;   // output rows and columns of a block
constexpr int kSlice = 16;  // reduction steps staged at once
constexpr int kPitch = kTile + 4;
constexpr int kLoads = kTile * kSlice / kThreads;  // elements of a slice per thread
constexpr unsigned int kFullMask = 0xffffffffu;
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kMaxGridX = 2147483647LL;
constexpr int kZeroRowsPerBlock = 16;
constexpr int64_t kMaxZeroBlocks = 1024;

static_assert(kThreads == (kTile / 4) * (kTile / 4), "one 4x4 block of outputs per thread");
static_assert(kLoads * kThreads == kTile * kSlice, "a slice is loaded in whole passes");

__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) {
  return a > b ? a : b;
}
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}

// Offset g clamped into [0, rows] (a value that fits in int32).
__device__ __forceinline__ int64_t clamped_end(const GroupOffsets& offsets, int64_t g,
                                               int64_t rows) {
  const int64_t end = offsets.ends[g * offsets.stride];
  return min64(max64(end, 0), rows);
}

__device__ __forceinline__ int64_t shuffle_up(int64_t value, int delta) {
  return static_cast<int64_t>(__shfl_up_sync(kFullMask, static_cast<long long>(value), delta));
}
__device__ __forceinline__ int64_t shuffle(int64_t value, int lane) {
  return static_cast<int64_t>(__shfl_sync(kFullMask, static_cast<long long>(value), lane));
}
__device__ __forceinline__ int64_t shuffle_xor(int64_t value, int mask) {
  return static_cast<int64_t>(__shfl_xor_sync(kFullMask, static_cast<long long>(value), mask));
}

// Inclusive scans over the 32 lanes of a warp.
__device__ __forceinline__ int64_t warp_max_scan(int64_t value, int lane) {
#pragma unroll
  for (int delta = 1; delta < 32; delta *= 2) {
    const int64_t other = shuffle_up(value, delta);
    if (lane >= delta) {
      value = max64(value, other);
    }
  }
  return value;
}
__device__ __forceinline__ int64_t warp_sum_scan(int64_t value, int lane) {
#pragma unroll
  for (int delta = 1; delta < 32; delta *= 2) {
    const int64_t other = shuffle_up(value, delta);
    if (lane >= delta) {
      value += other;
    }
  }
  return value;
}

// --- the tile product -------------------------------------------------------------

// One operand of a tile product: element (i, kk) at data + i * stride +
// kk * k_stride, where i is an output row (the left operand) or column (the
// right one) of the tile and kk the reduction index.
template <typename T>
struct Operand {
  const T* data;
  int64_t stride;
  int64_t k_stride;
  int64_t count;  // rows or columns of the tile that exist (1..64)
};

// Which way a slice is read: along the reduction when that is the closer to
// contiguous of the operand's two strides.
template <typename T>
__device__ __forceinline__ bool reads_along_k(const Operand<T>& op) {
  const int64_t k_stride = op.k_stride < 0 ? -op.k_stride : op.k_stride;
  const int64_t stride = op.stride < 0 ? -op.stride : op.stride;
  return k_stride < stride;
}

// The (kk, i) that thread `t` reads in pass `e` of a slice.
__device__ __forceinline__ void slice_position(bool along_k, int e, int& kk, int& i) {
  const int t = threadIdx.x;
  if (along_k) {
    kk = t % kSlice;
    i = t / kSlice + (kThreads / kSlice) * e;
  } else {
    i = t % kTile;
    kk = t / kTile + (kThreads / kTile) * e;
  }
}

// This thread's elements of the slice starting at reduction index k0; zero
// outside the operand.
template <typename T>
__device__ __forceinline__ void fetch_slice(const Operand<T>& op, bool along_k, int64_t k0,
                                            int64_t k_count, float (&values)[kLoads]) {
#pragma unroll
  for (int e = 0; e < kLoads; ++e) {
    int kk;
    int i;
    slice_position(along_k, e, kk, i);
    const int64_t k = k0 + kk;
    values[e] = i < op.count && k < k_count ? to_float(op.data[i * op.stride + k * op.k_stride])
                                            : 0.0f;
  }
}

__device__ __forceinline__ void store_slice(bool along_k, const float (&values)[kLoads],
                                            float (&tile)[kSlice][kPitch]) {
#pragma unroll
  for (int e = 0; e < kLoads; ++e) {
    int kk;
    int i;
    slice_position(along_k, e, kk, i);
    tile[kk][i] = values[e];
  }
}

// acc[i][j] += sum over k < k_count of left(4 ty + i, k) * right(k, 4 tx + j),
// ty = thread / 16 and tx = thread % 16. Every thread of the block calls it.
template <typename T>
__device__ void tile_product(const Operand<T>& left, const Operand<T>& right, int64_t k_count,
                             float (&acc)[4][4]) {
  __shared__ __align__(16) float left_tile[kSlice][kPitch];
  __shared__ __align__(16) float right_tile[kSlice][kPitch];
  const bool left_along_k = reads_along_k(left);
  const bool right_along_k = reads_along_k(right);
  const int tx = threadIdx.x % (kTile / 4);
  const int ty = threadIdx.x / (kTile / 4);
  float next_left[kLoads];
  float next_right[kLoads];
  fetch_slice(left, left_along_k, 0, k_count, next_left);
  fetch_slice(right, right_along_k, 0, k_count, next_right);
  for (int64_t k0 = 0; k0 < k_count; k0 += kSlice) {
    store_slice(left_along_k, next_left, left_tile);
    store_slice(right_along_k, next_right, right_tile);
    __syncthreads();
    if (k0 + kSlice < k_count) {
      fetch_slice(left, left_along_k, k0 + kSlice, k_count, next_left);
      fetch_slice(right, right_along_k, k0 + kSlice, k_count, next_right);
    }
#pragma unroll
    for (int kk = 0; kk < kSlice; ++kk) {
      const float4 a = *reinterpret_cast<const float4*>(&left_tile[kk][ty * 4]);
      const float4 b = *reinterpret_cast<const float4*>(&right_tile[kk][tx * 4]);
      const float av[4] = {a.x, a.y, a.z, a.w};
      const float bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
      }
    }
    __syncthreads();  // the tiles are rewritten by the next slice
  }
}

// Writes this thread's outputs of a tile of `rows` x `cols` at `out`.
template <typename T>
__device__ __forceinline__ void store_tile(T* out, int64_t row_stride, int64_t col_stride,
                                           int64_t rows, int64_t cols, const float (&acc)[4][4]) {
  const int tx = threadIdx.x % (kTile / 4);
  const int ty = threadIdx.x / (kTile / 4);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t r = ty * 4 + i;
    if (r < rows) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t c = tx * 4 + j;
        if (c < cols) {
          out[r * row_stride + c * col_stride] = from_float<T>(acc[i][j]);
        }
      }
    }
  }
}

// --- the forward: out[S, N] = A[rows of g] @ B[g] -------------------------------

// The rows a block of the forward covers: [row0, min(row0 + 64, row_end)) of
// `group`, or, for group -1, rows past the last offset, to be zeroed; nothing
// when row0 >= S.
struct RowTile {
  int64_t row0;
  int64_t row_end;
  int64_t group;
};

// Warp 0: the `tile`-th row tile of the concatenated groups (see the top of
// this file), from the clamped running maximum of the offsets.
__device__ void locate_row_tile(const GroupOffsets& offsets, int64_t rows, int64_t tile,
                                RowTile& spot) {
  const int lane = threadIdx.x % 32;
  int64_t carry_end = 0;    // where the groups so far end
  int64_t carry_tiles = 0;  // how many row tiles they have
  for (int64_t base = 0; base < offsets.groups; base += 32) {
    const int64_t g = base + lane;
    const bool real = g < offsets.groups;
    const int64_t end = warp_max_scan(max64(real ? clamped_end(offsets, g, rows) : 0, carry_end),
                                      lane);
    int64_t start = shuffle_up(end, 1);
    if (lane == 0) {
      start = carry_end;
    }
    const int64_t tiles = (end - start + kTile - 1) / kTile;
    const int64_t before = warp_sum_scan(tiles, lane) + carry_tiles;  // through this group
    const unsigned int hit = __ballot_sync(kFullMask, real && before > tile);
    if (hit != 0) {
      if (lane == __ffs(hit) - 1) {
        spot.group = g;
        spot.row0 = start + (tile - (before - tiles)) * kTile;
        spot.row_end = end;
      }
      return;
    }
    carry_end = shuffle(end, 31);
    carry_tiles = shuffle(before, 31);
  }
  if (lane == 0) {
    spot.group = -1;
    spot.row0 = carry_end + (tile - carry_tiles) * kTile;
    spot.row_end = rows;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) grouped_mm_kernel(GroupedMm mm) {
  __shared__ RowTile spot;
  if (threadIdx.x < 32) {
    locate_row_tile(mm.offsets, mm.rows, blockIdx.x, spot);
  }
  __syncthreads();
  const int64_t row0 = spot.row0;
  const int64_t group = spot.group;
  if (row0 >= mm.rows) {
    return;  // the whole block: past every row
  }
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t tile_rows = min64(kTile, spot.row_end - row0);
  const int64_t tile_cols = min64(kTile, mm.n - n0);
  float acc[4][4] = {};
  if (group >= 0) {
    const T* a = static_cast<const T*>(mm.a);
    const T* b = static_cast<const T*>(mm.b);
    const Operand<T> left{a + row0 * mm.a_stride[0], mm.a_stride[0], mm.a_stride[1], tile_rows};
    const Operand<T> right{b + group * mm.b_stride[0] + n0 * mm.b_stride[2], mm.b_stride[2],
                           mm.b_stride[1], tile_cols};
    tile_product(left, right, mm.k, acc);
  }
  store_tile(static_cast<T*>(mm.out) + row0 * mm.out_stride[0] + n0 * mm.out_stride[1],
             mm.out_stride[0], mm.out_stride[1], tile_rows, tile_cols, acc);
}

// --- the weight gradient: out[g] = A[rows of g]^T @ grad[rows of g] -------------

// Warp 0: group g's rows [range[0], range[1]) from the clamped running maximum.
__device__ void locate_group_rows(const GroupOffsets& offsets, int64_t rows, int64_t g,
                                  int64_t (&range)[2]) {
  const int lane = threadIdx.x % 32;
  int64_t start = 0;
  int64_t end = 0;
  for (int64_t j = lane; j <= g; j += 32) {
    const int64_t value = clamped_end(offsets, j, rows);
    end = max64(end, value);
    if (j < g) {
      start = max64(start, value);
    }
  }
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) {
    start = max64(start, shuffle_xor(start, mask));
    end = max64(end, shuffle_xor(end, mask));
  }
  if (lane == 0) {
    range[0] = start;
    range[1] = end;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) grouped_mm_weight_grad_kernel(GroupedMmWeightGrad w) {
  __shared__ int64_t range[2];
  const int64_t g = blockIdx.z;
  if (threadIdx.x < 32) {
    locate_group_rows(w.offsets, w.rows, g, range);
  }
  __syncthreads();
  const int64_t start = range[0];
  const int64_t end = range[1];
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t k0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t tile_k = min64(kTile, w.k - k0);
  const int64_t tile_n = min64(kTile, w.n - n0);
  float acc[4][4] = {};
  if (end > start) {
    const T* a = static_cast<const T*>(w.a);
    const T* grad = static_cast<const T*>(w.grad);
    // The output's rows are A's columns; the reduction runs over the group's rows.
    const Operand<T> left{a + start * w.a_stride[0] + k0 * w.a_stride[1], w.a_stride[1],
                          w.a_stride[0], tile_k};
    const Operand<T> right{grad + start * w.grad_stride[0] + n0 * w.grad_stride[1],
                           w.grad_stride[1], w.grad_stride[0], tile_n};
    tile_product(left, right, end - start, acc);
  }
  store_tile(static_cast<T*>(w.out) + g * w.out_stride[0] + k0 * w.out_stride[1] +
                 n0 * w.out_stride[2],
             w.out_stride[1], w.out_stride[2], tile_k, tile_n, acc);
}

// --- the forward of a few rows: the reduction split across a block ---------------

// Note [A decode step's few rows] in src/grouped_mm.cpp.
constexpr int64_t kFewRows = 32;   // a forward of at most this many rows takes this kernel
constexpr int kFewRowsPerPass = 4;  // rows of a group multiplied per pass over its weights
constexpr int kFewCols = 16;        // output columns of a block
constexpr int kFewWarps = kThreads / 32;
constexpr int kFewColsPerWarp = kFewCols / kFewWarps;  // weights read along K: a warp per column
constexpr int kFewSplits = kThreads / kFewCols;        // weights read along N: slices of K

static_assert(kFewColsPerWarp * kFewWarps == kFewCols, "the warps share a block's columns");
static_assert(kFewSplits * kFewCols == kThreads, "a slice of K per group of 16 threads");

// Warp 0: the rows block row `y` of the few-rows forward covers: group y's, or
// for y == groups the rows past the last offset (to be zeroed).
__device__ void locate_block_rows(const GroupOffsets& offsets, int64_t rows, int64_t y,
                                  int64_t (&range)[2]) {
  if (y < offsets.groups) {
    locate_group_rows(offsets, rows, y, range);
    return;
  }
  if (offsets.groups > 0) {
    locate_group_rows(offsets, rows, offsets.groups - 1, range);
  }
  if (threadIdx.x == 0) {
    range[0] = offsets.groups > 0 ? range[1] : 0;
    range[1] = rows;
  }
}

// Weights read along N (B[g] row-major [K, N]): 16 threads per slice of K,
// one column each (k = slice, slice + 16, ...), the loads of 8 steps issued
// before their products; the 16 partial sums of an output are added in slice
// order through shared memory.
template <typename T>
__device__ void few_rows_along_n(const GroupedMm& mm, const T* a, const T* b, int64_t r0,
                                 int64_t count, int64_t n0, int64_t cols, T* out) {
  __shared__ float partial[kFewSplits][kFewRowsPerPass][kFewCols + 1];
  const int col = threadIdx.x % kFewCols;
  const int split = threadIdx.x / kFewCols;
  float acc[kFewRowsPerPass] = {};
  if (col < cols) {
    const T* column = b + (n0 + col) * mm.b_stride[2];
    const T* rows = a + r0 * mm.a_stride[0];
#pragma unroll 8
    for (int64_t k = split; k < mm.k; k += kFewSplits) {
      const float w = to_float(column[k * mm.b_stride[1]]);
      const T* left = rows + k * mm.a_stride[1];
#pragma unroll
      for (int r = 0; r < kFewRowsPerPass; ++r) {
        if (r < count) {
          acc[r] = fmaf(to_float(left[r * mm.a_stride[0]]), w, acc[r]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kFewRowsPerPass; ++r) {
    partial[split][r][col] = acc[r];
  }
  __syncthreads();
  if (threadIdx.x < kFewRowsPerPass * kFewCols) {
    const int r = threadIdx.x / kFewCols;
    if (r < count && col < cols) {
      float sum = 0.0f;
#pragma unroll
      for (int s = 0; s < kFewSplits; ++s) {
        sum += partial[s][r][col];
      }
      out[(r0 + r) * mm.out_stride[0] + (n0 + col) * mm.out_stride[1]] = from_float<T>(sum);
    }
  }
  __syncthreads();  // `partial` is rewritten by the next pass
}

// Weights read along K (B[g] a transposed view of [N, K]): warp w owns columns
// w and w + 8, its lanes stride K; each output is reduced over the lanes by a
// butterfly, whose lane-0 order is fixed.
template <typename T>
__device__ void few_rows_along_k(const GroupedMm& mm, const T* a, const T* b, int64_t r0,
                                 int64_t count, int64_t n0, int64_t cols, T* out) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  float acc[kFewRowsPerPass][kFewColsPerWarp] = {};
  const T* rows = a + r0 * mm.a_stride[0];
#pragma unroll 4
  for (int64_t k = lane; k < mm.k; k += 32) {
    float left[kFewRowsPerPass];
#pragma unroll
    for (int r = 0; r < kFewRowsPerPass; ++r) {
      left[r] = r < count ? to_float(rows[r * mm.a_stride[0] + k * mm.a_stride[1]]) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kFewColsPerWarp; ++j) {
      const int c = warp + kFewWarps * j;
      if (c < cols) {
        const float w = to_float(b[k * mm.b_stride[1] + (n0 + c) * mm.b_stride[2]]);
#pragma unroll
        for (int r = 0; r < kFewRowsPerPass; ++r) {
          acc[r][j] = fmaf(left[r], w, acc[r][j]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kFewRowsPerPass; ++r) {
#pragma unroll
    for (int j = 0; j < kFewColsPerWarp; ++j) {
      float sum = acc[r][j];
#pragma unroll
      for (int mask = 16; mask > 0; mask /= 2) {
        sum += __shfl_xor_sync(kFullMask, sum, mask);
      }
      const int c = warp + kFewWarps * j;
      if (lane == 0 && r < count && c < cols) {
        out[(r0 + r) * mm.out_stride[0] + (n0 + c) * mm.out_stride[1]] = from_float<T>(sum);
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) grouped_mm_few_rows_kernel(GroupedMm mm) {
  __shared__ int64_t range[2];
  const int64_t y = blockIdx.y;
  if (threadIdx.x < 32) {
    locate_block_rows(mm.offsets, mm.rows, y, range);
  }
  __syncthreads();
  const int64_t start = range[0];
  const int64_t end = range[1];
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kFewCols;
  const int64_t cols = min64(kFewCols, mm.n - n0);
  T* out = static_cast<T*>(mm.out);
  if (y >= mm.offsets.groups) {
    for (int64_t i = threadIdx.x; i < (end - start) * cols; i += kThreads) {
      out[(start + i / cols) * mm.out_stride[0] + (n0 + i % cols) * mm.out_stride[1]] =
          from_float<T>(0.0f);
    }
    return;
  }
  const T* a = static_cast<const T*>(mm.a);
  const T* b = static_cast<const T*>(mm.b) + y * mm.b_stride[0];
  const bool along_k = reads_along_k(Operand<T>{b, mm.b_stride[2], mm.b_stride[1], cols});
  for (int64_t r0 = start; r0 < end; r0 += kFewRowsPerPass) {
    const int64_t count = min64(kFewRowsPerPass, end - r0);
    if (along_k) {
      few_rows_along_k(mm, a, b, r0, count, n0, cols, out);
    } else {
      few_rows_along_n(mm, a, b, r0, count, n0, cols, out);
    }
  }
}

// --- the fix-ups of torch's bfloat16 path -----------------------------------------

__global__ void __launch_bounds__(32) sanitize_offsets_kernel(GroupOffsets offsets, int64_t rows,
                                                              int32_t* out) {
  const int lane = threadIdx.x;
  int64_t carry = 0;
  for (int64_t base = 0; base < offsets.groups; base += 32) {
    const int64_t g = base + lane;
    const bool real = g < offsets.groups;
    const int64_t end =
        warp_max_scan(max64(real ? clamped_end(offsets, g, rows) : 0, carry), lane);
    if (real) {
      out[g] = static_cast<int32_t>(end);
    }
    carry = shuffle(end, 31);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) zero_rows_kernel(StridedMatrix m,
                                                             const int32_t* last_end) {
  const int64_t from = min64(max64(*last_end, 0), m.rows);
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kZeroRowsPerBlock;
  const int64_t begin = max64(r0, from);
  const int64_t end = min64(r0 + kZeroRowsPerBlock, m.rows);
  if (begin >= end) {
    return;
  }
  T* data = static_cast<T*>(m.data);
  const int64_t count = (end - begin) * m.cols;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) {
    const int64_t r = begin + i / m.cols;
    const int64_t c = i % m.cols;
    data[r * m.stride[0] + c * m.stride[1]] = from_float<T>(0.0f);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) zero_empty_groups_kernel(
    T* out, int64_t s0, int64_t s1, int64_t s2, int64_t k, int64_t n, const int32_t* ends) {
  const int64_t g = blockIdx.y;
  const int64_t start = g == 0 ? 0 : ends[g - 1];
  if (ends[g] > start) {
    return;
  }
  const int64_t count = k * n;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    out[g * s0 + (i / n) * s1 + (i % n) * s2] = from_float<T>(0.0f);
  }
}

// --- launches ----------------------------------------------------------------------

int64_t tiles(int64_t extent) {
  return (extent + kTile - 1) / kTile;
}

template <typename T>
cudaError_t launch_forward(const GroupedMm& mm, cudaStream_t stream) {
  const int64_t column_blocks = (mm.n + kFewCols - 1) / kFewCols;
  if (mm.rows <= kFewRows && mm.offsets.groups + 1 <= kMaxGridY && column_blocks <= kMaxGridX) {
    const dim3 grid(static_cast<unsigned int>(column_blocks),
                    static_cast<unsigned int>(mm.offsets.groups + 1));
    grouped_mm_few_rows_kernel<T><<<grid, kThreads, 0, stream>>>(mm);
    return cudaGetLastError();
  }
  const int64_t row_tiles = tiles(mm.rows) + mm.offsets.groups + 1;
  const int64_t col_tiles = tiles(mm.n);
  if (row_tiles > kMaxGridX || col_tiles > kMaxGridY) {
    return cudaErrorInvalidConfiguration;
  }
  const dim3 grid(static_cast<unsigned int>(row_tiles), static_cast<unsigned int>(col_tiles));
  grouped_mm_kernel<T><<<grid, kThreads, 0, stream>>>(mm);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_weight_grad(const GroupedMmWeightGrad& w, cudaStream_t stream) {
  const int64_t n_tiles = tiles(w.n);
  const int64_t k_tiles = tiles(w.k);
  if (n_tiles > kMaxGridX || k_tiles > kMaxGridY || w.offsets.groups > kMaxGridY) {
    return cudaErrorInvalidConfiguration;
  }
  const dim3 grid(static_cast<unsigned int>(n_tiles), static_cast<unsigned int>(k_tiles),
                  static_cast<unsigned int>(w.offsets.groups));
  grouped_mm_weight_grad_kernel<T><<<grid, kThreads, 0, stream>>>(w);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_zero_rows(const StridedMatrix& m, const int32_t* last_end,
                             cudaStream_t stream) {
  const int64_t blocks = (m.rows + kZeroRowsPerBlock - 1) / kZeroRowsPerBlock;
  if (blocks > kMaxGridX) {
    return cudaErrorInvalidConfiguration;
  }
  zero_rows_kernel<T><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(m, last_end);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_zero_groups(void* out, const int64_t (&stride)[3], int64_t k, int64_t n,
                               const int32_t* ends, int64_t groups, cudaStream_t stream) {
  if (groups > kMaxGridY) {
    return cudaErrorInvalidConfiguration;
  }
  const int64_t blocks =
      std::max<int64_t>(1, std::min<int64_t>((k * n + kThreads - 1) / kThreads, kMaxZeroBlocks));
  const dim3 grid(static_cast<unsigned int>(blocks), static_cast<unsigned int>(groups));
  zero_empty_groups_kernel<T><<<grid, kThreads, 0, stream>>>(
      static_cast<T*>(out), stride[0], stride[1], stride[2], k, n, ends);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_grouped_mm(const GroupedMm& mm, cudaStream_t stream) {
  if (mm.rows == 0 || mm.n == 0) {
    return cudaSuccess;
  }
  switch (mm.type) {
    case GroupedMmType::kBFloat16:
      return launch_forward<__nv_bfloat16>(mm, stream);
    case GroupedMmType::kFloat16:
      return launch_forward<__half>(mm, stream);
    default:
      return launch_forward<float>(mm, stream);
  }
}

cudaError_t launch_grouped_mm_weight_grad(const GroupedMmWeightGrad& grad, cudaStream_t stream) {
  if (grad.offsets.groups == 0 || grad.k == 0 || grad.n == 0) {
    return cudaSuccess;
  }
  switch (grad.type) {
    case GroupedMmType::kBFloat16:
      return launch_weight_grad<__nv_bfloat16>(grad, stream);
    case GroupedMmType::kFloat16:
      return launch_weight_grad<__half>(grad, stream);
    default:
      return launch_weight_grad<float>(grad, stream);
  }
}

cudaError_t launch_sanitize_group_offsets(const GroupOffsets& offsets, int64_t rows, int32_t* out,
                                          cudaStream_t stream) {
  if (offsets.groups == 0) {
    return cudaSuccess;
  }
  sanitize_offsets_kernel<<<1, 32, 0, stream>>>(offsets, rows, out);
  return cudaGetLastError();
}

cudaError_t launch_zero_rows_from(const StridedMatrix& out, const int32_t* last_end,
                                  cudaStream_t stream) {
  if (out.rows == 0 || out.cols == 0) {
    return cudaSuccess;
  }
  switch (out.type) {
    case GroupedMmType::kBFloat16:
      return launch_zero_rows<__nv_bfloat16>(out, last_end, stream);
    case GroupedMmType::kFloat16:
      return launch_zero_rows<__half>(out, last_end, stream);
    default:
      return launch_zero_rows<float>(out, last_end, stream);
  }
}

cudaError_t launch_zero_empty_groups(GroupedMmType type, void* out, const int64_t (&out_stride)[3],
                                     int64_t k, int64_t n, const int32_t* sanitized_ends,
                                     int64_t groups, cudaStream_t stream) {
  if (groups == 0 || k == 0 || n == 0) {
    return cudaSuccess;
  }
  switch (type) {
    case GroupedMmType::kBFloat16:
      return launch_zero_groups<__nv_bfloat16>(out, out_stride, k, n, sanitized_ends, groups,
                                               stream);
    case GroupedMmType::kFloat16:
      return launch_zero_groups<__half>(out, out_stride, k, n, sanitized_ends, groups, stream);
    default:
      return launch_zero_groups<float>(out, out_stride, k, n, sanitized_ends, groups, stream);
  }
}

}  // namespace graphed::device
