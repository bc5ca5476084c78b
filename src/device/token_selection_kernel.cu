// Note [One kernel picks the tokens]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Inside a decode graph every kernel costs its own run time plus a gap before
// the next one starts, and the token selection of select_next_tokens is ten
// or so tiny ATen kernels per token (the eos suppression, the argmax, the pad
// fill, the append, the counters, the finished flags and the done flag):
// on the H200 those cost as much as a layer of a small model. This kernel
// does them all in one launch. Each block takes one row: it finds the row's
// argmax with the eos tokens suppressed before min_new_tokens, writes the
// token (pad for a finished row), appends it and marks the row finished on
// an eos. The last block to arrive (counted in `arrivals`, after a memory
// fence, the CUDA samples' threadFenceReduction pattern) then does the
// once-per-step work: generated -= done, every counter += 1, done = all rows
// finished, and zeroes `arrivals` for the next replay.
//
// The result is the ATen sequence's to the bit: the argmax compares the
// scores in float (exact for float16 and bfloat16), a NaN beats any number,
// and ties go to the lower index, as at::argmax does. src/token_selection.cpp
// keeps that sequence for CPU tensors and as the reference the GPU tests
// compare this kernel with (TokenSelectionOnGpu.*).

#include "token_selection_kernel.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

namespace graphed::device {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float load_score(const void* row, int64_t i, ScoreType type) {
  switch (type) {
    case ScoreType::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(row)[i]);
    case ScoreType::kFloat16:
      return __half2float(static_cast<const __half*>(row)[i]);
    default:
      return static_cast<const float*>(row)[i];
  }
}

// at::argmax's order: NaN first, then the larger value, then the lower index.
__device__ __forceinline__ bool better(float value, int64_t index, float best, int64_t best_index) {
  const bool value_nan = isnan(value);
  const bool best_nan = isnan(best);
  if (value_nan != best_nan) {
    return value_nan;
  }
  if (!value_nan && value != best) {
    return value > best;
  }
  return index < best_index;
}

__global__ void __launch_bounds__(kThreads) greedy_step_kernel(GreedyStep step) {
  __shared__ float warp_best[kWarps];
  __shared__ int64_t warp_index[kWarps];
  __shared__ bool last_block;

  const int64_t row = blockIdx.x;
  const char* scores = static_cast<const char*>(step.scores);
  const int element_bytes = step.score_type == ScoreType::kFloat32 ? 4 : 2;
  const void* row_scores = scores + row * step.score_row_stride * element_bytes;
  const int64_t position = step.counters[0];

  float best = -INFINITY;
  int64_t best_index = step.vocab;  // loses every tie against a real index
  for (int64_t v = threadIdx.x; v < step.vocab; v += kThreads) {
    float value = load_score(row_scores, v, step.score_type);
    if (step.eos_threshold != nullptr && step.eos_threshold[v] > position) {
      value = -INFINITY;
    }
    if (better(value, v, best, best_index)) {
      best = value;
      best_index = v;
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_down_sync(0xffffffffu, best, offset);
    const int64_t other_index = __shfl_down_sync(0xffffffffu, best_index, offset);
    if (better(other, other_index, best, best_index)) {
      best = other;
      best_index = other_index;
    }
  }
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) {
    warp_best[warp] = best;
    warp_index[warp] = best_index;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) {
      if (better(warp_best[w], warp_index[w], best, best_index)) {
        best = warp_best[w];
        best_index = warp_index[w];
      }
    }
    int64_t token = best_index < step.vocab ? best_index : 0;
    const bool tracks_eos = step.eos_count > 0;
    if (tracks_eos && step.has_pad_token && step.finished[row]) {
      token = step.pad_token_id;
    }
    step.next[row * step.next_row_stride] = token;
    step.tokens[row * step.tokens_row_stride + position] = token;
    if (tracks_eos) {
      bool ended = false;
      for (int64_t e = 0; e < step.eos_count; ++e) {
        ended = ended || token == step.eos[e];
      }
      if (ended) {
        step.finished[row] = true;
      }
    }
    __threadfence();
    const unsigned int arrived = atomicAdd(step.arrivals, 1u);
    last_block = arrived == static_cast<unsigned int>(step.batch - 1);
  }
  __syncthreads();
  if (!last_block || threadIdx.x != 0) {
    return;
  }
  __threadfence();
  if (step.eos_count > 0) {
    // done still says whether every row had finished before this token.
    volatile bool* done = step.done;
    step.counters[1] -= *done ? 1 : 0;
    const volatile bool* finished = step.finished;
    bool all_finished = true;
    for (int64_t r = 0; r < step.batch; ++r) {
      all_finished = all_finished && finished[r];
    }
    *done = all_finished;
  }
  for (int64_t c = 0; c < step.counter_count; ++c) {
    step.counters[c] += 1;
  }
  *step.arrivals = 0;
}

}  // namespace

cudaError_t launch_greedy_step(const GreedyStep& step, cudaStream_t stream) {
  if (step.batch <= 0) {
    return cudaSuccess;
  }
  greedy_step_kernel<<<static_cast<unsigned int>(step.batch), kThreads, 0, stream>>>(step);
  return cudaGetLastError();
}

}  // namespace graphed::device
