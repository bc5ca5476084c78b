// graphed's RMSNorm kernels (rms_norm_kernels.h). Each expression is one
// ATen kernel of transformers' RMSNorm, rounded as that kernel rounds it
// (Note [The reference's roundings] in state_space_kernels.cu): products
// with __fmul_rn, sums with __fadd_rn, SiLU as ATen writes it
// (x / (1 + exp(-x)), expf and an IEEE division), the square as ATen's pow
// with exponent 2 (x * x), the root as ATen's rsqrt (rsqrtf), and a cast or
// a bfloat16/half product's result rounded to nearest even, as ATen's
// opmath kernels round (float_conversions.cuh). No fast-math in either build.

#include "rms_norm_kernels.h"

#include "elementwise_grid.h"
#include "float_conversions.cuh"

namespace graphed::device {
namespace {

constexpr int kThreads = kElementwiseThreads;

template <typename T>
__global__ void rms_norm_gate_kernel(RmsNormGate g) {
  const T* hidden = static_cast<const T*>(g.hidden);
  const T* gate = static_cast<const T*>(g.gate);
  const int64_t total = g.rows * g.cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / g.cols;
    const int64_t c = i - r * g.cols;
    const float z = to_float(gate[r * g.gate_row_stride + c]);
    const float silu = z / (1.0f + expf(-z));
    const float h = __fmul_rn(to_float(hidden[r * g.hidden_row_stride + c]), silu);
    g.gated[i] = h;
    g.squares[i] = __fmul_rn(h, h);
  }
}

template <typename T>
__global__ void rms_norm_squares_kernel(RmsNormSquares s) {
  const T* hidden = static_cast<const T*>(s.hidden);
  const int64_t total = s.rows * s.cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / s.cols;
    const int64_t c = i - r * s.cols;
    const float h = to_float(hidden[r * s.hidden_row_stride + c]);
    s.squares[r * s.squares_row_stride + c] = __fmul_rn(h, h);
  }
}

// In: the type the normalized values are read in (float for the gated
// product, else T); T: the weight's and the result's.
template <typename In, typename T>
__global__ void rms_norm_scale_kernel(RmsNormScale s) {
  const In* hidden = static_cast<const In*>(s.hidden);
  const T* weights = static_cast<const T*>(s.weight);
  T* out = static_cast<T*>(s.out);
  const int64_t total = s.rows * s.cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / s.cols;
    const int64_t c = i - r * s.cols;
    const float root = rsqrtf(__fadd_rn(s.variance[r], s.eps));
    float normed = __fmul_rn(to_float(hidden[r * s.hidden_row_stride + c]), root);
    if (s.round_before_weight) {
      normed = to_float(from_float<T>(normed));  // h.to(input_dtype)
    }
    float weight = to_float(weights[c * s.weight_stride]);
    // Gemma's (1.0 + weight) is its own ATen kernel (weight + 1.0), then a
    // product; a product of two floats rounds the same in either order.
    if (s.weight_plus_one) {
      weight = __fadd_rn(weight, 1.0f);
    }
    out[i] = from_float<T>(__fmul_rn(weight, normed));
  }
}

}  // namespace

cudaError_t launch_rms_norm_gate(const RmsNormGate& gate, cudaStream_t stream) {
  const int64_t total = gate.rows * gate.cols;
  if (total == 0) {
    return cudaSuccess;
  }
  return dispatch_float_type(gate.type, [&](auto element) {
    using T = decltype(element);
    rms_norm_gate_kernel<T><<<elementwise_blocks(total), kThreads, 0, stream>>>(gate);
  });
}

cudaError_t launch_rms_norm_squares(const RmsNormSquares& squares, cudaStream_t stream) {
  const int64_t total = squares.rows * squares.cols;
  if (total == 0) {
    return cudaSuccess;
  }
  return dispatch_float_type(squares.type, [&](auto element) {
    using T = decltype(element);
    rms_norm_squares_kernel<T><<<elementwise_blocks(total), kThreads, 0, stream>>>(squares);
  });
}

cudaError_t launch_rms_norm_scale(const RmsNormScale& scale, cudaStream_t stream) {
  const int64_t total = scale.rows * scale.cols;
  if (total == 0) {
    return cudaSuccess;
  }
  return dispatch_float_type(scale.type, [&](auto element) {
    using T = decltype(element);
    // The gated product is read in float32, the input in its own type.
    if (scale.hidden_is_float32) {
      rms_norm_scale_kernel<float, T><<<elementwise_blocks(total), kThreads, 0, stream>>>(scale);
    } else {
      rms_norm_scale_kernel<T, T><<<elementwise_blocks(total), kThreads, 0, stream>>>(scale);
    }
  });
}

}  // namespace graphed::device
