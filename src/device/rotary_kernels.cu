// graphed's rotary embedding kernel (rotary_kernels.h): transformers'
// apply_rotary_pos_emb, (x * cos) + (rotate_half(x) * sin), is five ATen
// kernels a tensor (a negation, a concatenation, two products, a sum), each
// rounding its result to the tensor's dtype. Here one thread computes one
// element with the same roundings: the negation is exact, the products and
// the sum round to nearest (__fmul_rn, __fadd_rn: no contraction into an
// FMA, which ATen's separate kernels cannot make) and each result is rounded
// to the dtype as ATen's opmath kernels round it (float_conversions.cuh).

#include "rotary_kernels.h"

#include "elementwise_grid.h"
#include "float_conversions.cuh"

namespace graphed::device {
namespace {

constexpr int kThreads = kElementwiseThreads;

template <typename T>
__device__ __forceinline__ float rounded(float value) {
  return to_float(from_float<T>(value));
}

template <typename T>
__global__ void rotary_apply_kernel(RotaryApply a) {
  const T* x = static_cast<const T*>(a.x);
  const T* cos = static_cast<const T*>(a.cos);
  const T* sin = static_cast<const T*>(a.sin);
  T* out = static_cast<T*>(a.out);
  const int64_t half = a.dim / 2;
  const int64_t total = a.batch * a.heads * a.seq * a.dim;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t rest = i;
    const int64_t d = rest % a.dim;
    rest /= a.dim;
    const int64_t s = rest % a.seq;
    rest /= a.seq;
    const int64_t h = rest % a.heads;
    const int64_t b = rest / a.heads;
    const T* row = x + b * a.x_strides[0] + h * a.x_strides[1] + s * a.x_strides[2];
    const float value = to_float(row[d]);
    const float partner = d < half ? -to_float(row[d + half]) : to_float(row[d - half]);
    const float c = to_float(cos[b * a.cos_strides[0] + s * a.cos_strides[1] + d]);
    const float sn = to_float(sin[b * a.sin_strides[0] + s * a.sin_strides[1] + d]);
    const float sum = __fadd_rn(rounded<T>(__fmul_rn(value, c)), rounded<T>(__fmul_rn(partner, sn)));
    out[b * a.out_strides[0] + h * a.out_strides[1] + s * a.out_strides[2] + d] =
        from_float<T>(sum);
  }
}

}  // namespace

cudaError_t launch_rotary_apply(const RotaryApply& apply, cudaStream_t stream) {
  const int64_t total = apply.batch * apply.heads * apply.seq * apply.dim;
  if (total == 0) {
    return cudaSuccess;
  }
  return dispatch_float_type(apply.type, [&](auto element) {
    using T = decltype(element);
    rotary_apply_kernel<T><<<elementwise_blocks(total), kThreads, 0, stream>>>(apply);
  });
}

}  // namespace graphed::device
