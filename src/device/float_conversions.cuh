// Conversions between graphed's kernels' element types (float, bfloat16,
// half) and the float they compute in, shared by src/device/*.cu. Plain CUDA
// without torch headers.

#pragma once

#include "float_type.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace graphed::device {

/// `value` as a float.
template <typename T>
__device__ __forceinline__ float to_float(T value);
template <>
__device__ __forceinline__ float to_float<float>(float value) {
  return value;
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 value) {
  return __bfloat162float(value);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half value) {
  return __half2float(value);
}

/// `value` rounded to the nearest T.
template <typename T>
__device__ __forceinline__ T from_float(float value);
template <>
__device__ __forceinline__ float from_float<float>(float value) {
  return value;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) {
  return __float2bfloat16_rn(value);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float value) {
  return __float2half_rn(value);
}

/// Calls `launch(T{})` with T the C++ type of `type` (float, __nv_bfloat16,
/// __half) and returns the launch's status (cudaGetLastError()).
template <typename Launch>
cudaError_t dispatch_float_type(FloatType type, Launch&& launch) {
  switch (type) {
    case FloatType::kFloat32:
      launch(float{});
      break;
    case FloatType::kBFloat16:
      launch(__nv_bfloat16{});
      break;
    case FloatType::kFloat16:
      launch(__half{});
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace graphed::device
