// The launch shape of graphed's grid-stride elementwise kernels
// (state_space_kernels.cu, rms_norm_kernels.cu): 256 threads a block, one
// element a thread, the grid capped so that very large tensors loop.

#pragma once

#include <cstdint>

namespace graphed::device {

/// Threads per block of the elementwise kernels.
constexpr int kElementwiseThreads = 256;

/// Blocks for `elements` elements, one a thread, at most 65535 * 16.
inline unsigned int elementwise_blocks(int64_t elements) {
  const int64_t blocks = (elements + kElementwiseThreads - 1) / kElementwiseThreads;
  return static_cast<unsigned int>(blocks < 65535 * 16 ? blocks : 65535 * 16);
}

}  // namespace graphed::device
