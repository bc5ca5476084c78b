// The element types of graphed's elementwise decode-step kernels
// (rms_norm_kernels, rotary_kernels): plain C++, so that the .cu files
// (compiled by nvcc without torch headers) and the ops that launch them
// share it. src/device_float_type.h maps ATen's dtypes to it;
// float_conversions.cuh's dispatch_float_type picks the C++ type.

#pragma once

namespace graphed::device {

/// float32, bfloat16 or float16.
enum class FloatType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

}  // namespace graphed::device
