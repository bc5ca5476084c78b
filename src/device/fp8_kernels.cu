// Note [Fused FP8 casts]
// ~~~~~~~~~~~~~~~~~~~~~~
// An FP8 matrix product is only faster than bf16 in the product itself: on
// the H200 a 4096x2048x6144 bf16 mm takes 0.171 ms and the e4m3 _scaled_mm
// 0.115 ms, while casting its input with ATen operations (amax, scale, mul,
// clamp, to) takes 0.181 ms, and transposing the FP8 result for the backward
// another 0.063 ms. Unfused casts lose more than the FP8 product wins. So each
// cast is one kernel that reads the high-precision tensor once and writes
// everything the products need from it:
//   - the FP8 tensor, x * scale saturated to the format's largest finite value
//     (cvt.rn.satfinite: round to nearest even, like ATen's conversion after
//     its clamp, so the two agree to the bit; NaN stays NaN);
//   - optionally its transpose (the column-major operand of the backward's
//     products), through a 64x64 tile in shared memory, so that the reads and
//     the writes of both outputs are coalesced;
//   - optionally the input's amax, merged with an atomic max into a device
//     float. For non-negative floats (|x|, NaN included once its sign is
//     cleared) the order of the bit patterns as unsigned integers is the
//     order of the values, so an integer atomicMax is a float max, and a NaN
//     (whose bits exceed infinity's) wins like at::amax's NaN does.
// Delayed scaling knows its scale before the cast (it comes from earlier
// steps), so recording the amax costs nothing extra. Current scaling needs
// the amax first: one reduction kernel, then the cast, which computes the
// scale from that amax itself (each thread, from one float) and writes it and
// its inverse for the product, so there is no kernel in between.
// Loads are 16 bytes wide where the row length and the pointers allow, and
// element by element at the edges otherwise. The delayed-scaling update of a
// whole model is one block that walks every tensor's history row, so a step
// ends with one launch however many layers there are. src/fp8_cast.cpp keeps
// the ATen sequences these kernels replace, for CPU tensors and as the
// reference the GPU tests compare them with (Fp8KernelsOnGpu.*).

#include "fp8_kernels.h"

#include "float_conversions.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>

namespace graphed::device {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVector = 8;  // elements per vectorized load
constexpr int kTile = 64;   // the transposing cast's square tile
constexpr int kTilePitch = kTile + 4;
constexpr int64_t kMaxBlocks = 4096;

template <typename T>
struct alignas(16) Chunk {
  T values[kVector];
};

// kVector elements starting at `source` (16-byte aligned when `vectorized`).
template <typename T>
__device__ __forceinline__ void load_chunk(const T* source, float (&out)[kVector]) {
  if constexpr (sizeof(T) == 4) {
    const float4 low = reinterpret_cast<const float4*>(source)[0];
    const float4 high = reinterpret_cast<const float4*>(source)[1];
    out[0] = low.x, out[1] = low.y, out[2] = low.z, out[3] = low.w;
    out[4] = high.x, out[5] = high.y, out[6] = high.z, out[7] = high.w;
  } else {
    const Chunk<T> chunk = *reinterpret_cast<const Chunk<T>*>(source);
#pragma unroll
    for (int i = 0; i < kVector; ++i) {
      out[i] = to_float(chunk.values[i]);
    }
  }
}

// format_max / amax / 2^margin where that is a positive finite amax's finite
// scale, `previous` otherwise: graphed::scale_from_amax, operation for
// operation (a reciprocal, then one product), so that the results agree.
__device__ __forceinline__ float scale_for_amax(float amax, float previous, float format_max,
                                                int margin) {
  const float wanted = (1.0f / amax) * ldexpf(format_max, -margin);
  const bool usable = amax > 0.0f && isfinite(amax) && isfinite(wanted);
  return usable ? wanted : previous;
}

__device__ __forceinline__ unsigned int magnitude_bits(float value) {
  return __float_as_uint(fabsf(value));
}

// Merges the block's largest magnitude bits into *amax; every thread calls it.
__device__ __forceinline__ void merge_block_amax(unsigned int bits, float* amax) {
  __shared__ unsigned int warp_bits[kWarps];
  bits = __reduce_max_sync(0xffffffffu, bits);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) {
    warp_bits[warp] = bits;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int block_bits = warp_bits[0];
    for (int w = 1; w < kWarps; ++w) {
      block_bits = max(block_bits, warp_bits[w]);
    }
    atomicMax(reinterpret_cast<unsigned int*>(amax), block_bits);
  }
}

// The scale of this cast, and (one thread of the grid) its publication.
__device__ __forceinline__ float cast_scale(const Fp8Cast& cast, bool first_block) {
  if (cast.scale != nullptr) {
    return *cast.scale;
  }
  const float scale = scale_for_amax(*cast.scale_amax, 1.0f, cast.format_max, cast.margin);
  if (first_block && threadIdx.x == 0) {
    if (cast.scale_out != nullptr) {
      *cast.scale_out = scale;
    }
    if (cast.scale_inv_out != nullptr) {
      *cast.scale_inv_out = 1.0f / scale;
    }
  }
  return scale;
}

template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ uint8_t to_fp8(float value) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(value, __NV_SATFINITE, kFormat));
}

// Two bytes: `low` at the lower address (little endian).
template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ uint32_t pack_pair(float low, float high) {
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(low, high), __NV_SATFINITE,
                                                        kFormat));
}

// Casts one chunk of kVector values (scaled) into two words of four FP8
// bytes, in order, and folds their magnitudes into amax_bits: the inner step
// of both cast kernels.
template <__nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ void cast_chunk(const float (&values)[kVector], float scale,
                                           unsigned int& amax_bits, uint32_t (&words)[2]) {
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const float low = values[w * 4 + p * 2];
      const float high = values[w * 4 + p * 2 + 1];
      amax_bits = max(amax_bits, max(magnitude_bits(low), magnitude_bits(high)));
      word |= pack_pair<kFormat>(low * scale, high * scale) << (16 * p);
    }
    words[w] = word;
  }
}

// --- the cast without a transpose: a flat loop over the elements ------------

template <typename T, __nv_fp8_interpretation_t kFormat, bool kVectorized>
__global__ void __launch_bounds__(kThreads) flat_cast_kernel(Fp8Cast cast) {
  const T* input = static_cast<const T*>(cast.input);
  const int64_t count = cast.rows * cast.cols;
  const float scale = cast_scale(cast, blockIdx.x == 0);
  unsigned int amax_bits = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  if constexpr (kVectorized) {
    const int64_t chunks = count / kVector;
    for (int64_t chunk = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
         chunk < chunks; chunk += stride) {
      float values[kVector];
      load_chunk(input + chunk * kVector, values);
      uint32_t words[2];
      cast_chunk<kFormat>(values, scale, amax_bits, words);
      if (cast.output != nullptr) {
        reinterpret_cast<uint2*>(cast.output)[chunk] = make_uint2(words[0], words[1]);
      }
    }
  } else {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < count;
         i += stride) {
      const float value = to_float(input[i]);
      amax_bits = max(amax_bits, magnitude_bits(value));
      if (cast.output != nullptr) {
        cast.output[i] = to_fp8<kFormat>(value * scale);
      }
    }
  }
  if (cast.amax != nullptr) {
    merge_block_amax(amax_bits, cast.amax);
  }
}

// --- the cast with a transpose: 64x64 tiles through shared memory -----------

template <typename T, __nv_fp8_interpretation_t kFormat>
__global__ void __launch_bounds__(kThreads) transposing_cast_kernel(Fp8Cast cast,
                                                                    bool vector_loads,
                                                                    bool vector_stores,
                                                                    bool vector_transposed) {
  __shared__ __align__(16) uint8_t tile[kTile][kTilePitch];
  const T* input = static_cast<const T*>(cast.input);
  const int64_t rows = cast.rows;
  const int64_t cols = cast.cols;
  const float scale = cast_scale(cast, blockIdx.x == 0 && blockIdx.y == 0);
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
  unsigned int amax_bits = 0;

  // Loading: 8 threads cover a tile row (8 elements each), 32 rows a pass.
  const int chunk = threadIdx.x % (kTile / kVector);
  const int load_row = threadIdx.x / (kTile / kVector);
  // Storing the transpose: 16 threads cover a transposed row (4 bytes each).
  const int segment = threadIdx.x % (kTile / 4);
  const int store_row = threadIdx.x / (kTile / 4);

  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  for (int64_t row_tile = blockIdx.y; row_tile < row_tiles; row_tile += gridDim.y) {
    const int64_t r0 = row_tile * kTile;
#pragma unroll
    for (int pass = 0; pass < kTile / (kThreads / (kTile / kVector)); ++pass) {
      const int r = load_row + pass * (kThreads / (kTile / kVector));
      const int64_t row = r0 + r;
      const int64_t col = c0 + chunk * kVector;
      float values[kVector];
      const bool full = row < rows && col + kVector <= cols;
      if (full && vector_loads) {
        load_chunk(input + row * cols + col, values);
      } else {
#pragma unroll
        for (int i = 0; i < kVector; ++i) {
          values[i] = row < rows && col + i < cols ? to_float(input[row * cols + col + i]) : 0.0f;
        }
      }
      uint32_t words[2];
      cast_chunk<kFormat>(values, scale, amax_bits, words);
      uint32_t* tile_words = reinterpret_cast<uint32_t*>(&tile[r][chunk * kVector]);
      tile_words[0] = words[0];
      tile_words[1] = words[1];
      if (cast.output != nullptr && row < rows) {
        uint8_t* out = cast.output + row * cols + col;
        if (full && vector_stores) {
          *reinterpret_cast<uint2*>(out) = make_uint2(words[0], words[1]);
        } else {
          for (int i = 0; i < kVector && col + i < cols; ++i) {
            out[i] = static_cast<uint8_t>(words[i / 4] >> (8 * (i % 4)));
          }
        }
      }
    }
    __syncthreads();
    if (cast.output_transposed != nullptr) {
#pragma unroll
      for (int pass = 0; pass < kTile / (kThreads / (kTile / 4)); ++pass) {
        const int c = store_row + pass * (kThreads / (kTile / 4));
        const int64_t col = c0 + c;  // the transposed row
        const int64_t row = r0 + segment * 4;
        if (col < cols && row < rows) {
          uint32_t word = 0;
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            word |= static_cast<uint32_t>(tile[segment * 4 + k][c]) << (8 * k);
          }
          uint8_t* out = cast.output_transposed + col * rows + row;
          if (vector_transposed && row + 4 <= rows) {
            *reinterpret_cast<uint32_t*>(out) = word;
          } else {
            for (int k = 0; k < 4 && row + k < rows; ++k) {
              out[k] = static_cast<uint8_t>(word >> (8 * k));
            }
          }
        }
      }
    }
    __syncthreads();  // the tile is rewritten by the next row tile
  }
  if (cast.amax != nullptr) {
    merge_block_amax(amax_bits, cast.amax);
  }
}

// --- current scaling's amax ----------------------------------------------------

template <typename T, bool kVectorized>
__global__ void __launch_bounds__(kThreads) amax_kernel(AmaxReduction reduction) {
  const T* input = static_cast<const T*>(reduction.input);
  unsigned int amax_bits = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  if constexpr (kVectorized) {
    const int64_t chunks = reduction.count / kVector;
    for (int64_t chunk = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
         chunk < chunks; chunk += stride) {
      float values[kVector];
      load_chunk(input + chunk * kVector, values);
#pragma unroll
      for (int i = 0; i < kVector; ++i) {
        amax_bits = max(amax_bits, magnitude_bits(values[i]));
      }
    }
  } else {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
         i < reduction.count; i += stride) {
      amax_bits = max(amax_bits, magnitude_bits(to_float(input[i])));
    }
  }
  merge_block_amax(amax_bits, reduction.amax);
}

// --- the delayed-scaling update of every tensor ---------------------------------

__global__ void __launch_bounds__(kThreads) delayed_scaling_update_kernel(
    DelayedScalingUpdate update) {
  // A slot loaded from a checkpoint may be anything: wrap it into the history.
  const int64_t slot = ((*update.slot % update.history_len) + update.history_len) %
                       update.history_len;
  for (int64_t t = threadIdx.x; t < update.tensors; t += kThreads) {
    const float amax = update.amax[t];
    float* history = update.history + t * update.history_len;
    history[slot] = amax;
    float reduced = amax;
    if (!update.most_recent) {
      // at::amax: the largest, and NaN wins.
      reduced = history[0];
      for (int64_t h = 1; h < update.history_len; ++h) {
        const float value = history[h];
        reduced = isnan(value) || value > reduced ? value : reduced;
      }
    }
    const float scale = scale_for_amax(reduced, update.scale[t], update.format_max[t],
                                       update.margin);
    update.scale[t] = scale;
    update.scale_inv[t] = 1.0f / scale;
    update.amax[t] = 0.0f;
  }
  __syncthreads();  // every thread read the slot before it moves
  if (threadIdx.x == 0) {
    *update.slot = (slot + 1) % update.history_len;
  }
}

bool aligned(const void* pointer, int bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % bytes == 0;
}

int64_t blocks_for(int64_t work_items) {
  return std::max<int64_t>(1, std::min<int64_t>((work_items + kThreads - 1) / kThreads, kMaxBlocks));
}

template <typename T, __nv_fp8_interpretation_t kFormat>
cudaError_t launch_cast(const Fp8Cast& cast, cudaStream_t stream) {
  const int64_t count = cast.rows * cast.cols;
  if (cast.output_transposed == nullptr) {
    const bool vectorized = count % kVector == 0 && aligned(cast.input, 16) &&
                            (cast.output == nullptr || aligned(cast.output, 8));
    if (vectorized) {
      flat_cast_kernel<T, kFormat, true>
          <<<blocks_for(count / kVector), kThreads, 0, stream>>>(cast);
    } else {
      flat_cast_kernel<T, kFormat, false><<<blocks_for(count), kThreads, 0, stream>>>(cast);
    }
    return cudaGetLastError();
  }
  const int64_t col_tiles = (cast.cols + kTile - 1) / kTile;
  const int64_t row_tiles = (cast.rows + kTile - 1) / kTile;
  if (col_tiles > 2147483647LL) {
    return cudaErrorInvalidConfiguration;
  }
  const dim3 grid(static_cast<unsigned int>(col_tiles),
                  static_cast<unsigned int>(std::min<int64_t>(row_tiles, 65535)));
  const bool vector_loads = cast.cols % kVector == 0 && aligned(cast.input, 16);
  const bool vector_stores = cast.cols % kVector == 0 && aligned(cast.output, 8);
  const bool vector_transposed = cast.rows % 4 == 0 && aligned(cast.output_transposed, 4);
  transposing_cast_kernel<T, kFormat><<<grid, kThreads, 0, stream>>>(
      cast, vector_loads, vector_stores, vector_transposed);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_cast_for_input(const Fp8Cast& cast, cudaStream_t stream) {
  return cast.output_type == Fp8Type::kE4M3 ? launch_cast<T, __NV_E4M3>(cast, stream)
                                            : launch_cast<T, __NV_E5M2>(cast, stream);
}

template <typename T>
cudaError_t launch_amax(const AmaxReduction& reduction, cudaStream_t stream) {
  if (reduction.count % kVector == 0 && aligned(reduction.input, 16)) {
    amax_kernel<T, true>
        <<<blocks_for(reduction.count / kVector), kThreads, 0, stream>>>(reduction);
  } else {
    amax_kernel<T, false><<<blocks_for(reduction.count), kThreads, 0, stream>>>(reduction);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_fp8_cast(const Fp8Cast& cast, cudaStream_t stream) {
  if (cast.rows * cast.cols == 0) {
    // Nothing to read; current scaling still publishes the scale of an amax
    // of zero, which is 1.
    if (cast.scale == nullptr && (cast.scale_out != nullptr || cast.scale_inv_out != nullptr)) {
      Fp8Cast empty = cast;
      empty.rows = 1;
      empty.cols = 0;
      empty.output = nullptr;
      empty.output_transposed = nullptr;
      empty.amax = nullptr;
      switch (cast.input_type) {
        case HighPrecisionType::kBFloat16:
          flat_cast_kernel<__nv_bfloat16, __NV_E4M3, false><<<1, kThreads, 0, stream>>>(empty);
          break;
        case HighPrecisionType::kFloat16:
          flat_cast_kernel<__half, __NV_E4M3, false><<<1, kThreads, 0, stream>>>(empty);
          break;
        default:
          flat_cast_kernel<float, __NV_E4M3, false><<<1, kThreads, 0, stream>>>(empty);
      }
      return cudaGetLastError();
    }
    return cudaSuccess;
  }
  switch (cast.input_type) {
    case HighPrecisionType::kBFloat16:
      return launch_cast_for_input<__nv_bfloat16>(cast, stream);
    case HighPrecisionType::kFloat16:
      return launch_cast_for_input<__half>(cast, stream);
    default:
      return launch_cast_for_input<float>(cast, stream);
  }
}

cudaError_t launch_amax_reduction(const AmaxReduction& reduction, cudaStream_t stream) {
  if (reduction.count == 0) {
    return cudaSuccess;
  }
  switch (reduction.input_type) {
    case HighPrecisionType::kBFloat16:
      return launch_amax<__nv_bfloat16>(reduction, stream);
    case HighPrecisionType::kFloat16:
      return launch_amax<__half>(reduction, stream);
    default:
      return launch_amax<float>(reduction, stream);
  }
}

cudaError_t launch_delayed_scaling_update(const DelayedScalingUpdate& update,
                                          cudaStream_t stream) {
  if (update.tensors == 0) {
    return cudaSuccess;
  }
  delayed_scaling_update_kernel<<<1, kThreads, 0, stream>>>(update);
  return cudaGetLastError();
}

}  // namespace graphed::device
