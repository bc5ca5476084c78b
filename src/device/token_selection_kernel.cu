// Note [One kernel picks the tokens]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Inside a decode graph every kernel costs its own run time plus a gap before
// the next one starts, and the token selection of select_next_tokens is ten
// or so tiny ATen kernels per token (the eos suppression, the argmax, the pad
// fill, the append, the counters, the finished flags and the done flag):
// on the H200 those cost as much as a layer of a small model. This kernel
// does them all in one launch.
//
// A row's scores are split into chunks, one block each (grid: chunks x
// rows), so that a batch of one still spreads its vocabulary over dozens of
// SMs: one block per row took 35 us per token for a 32000-token vocabulary
// with the eos suppression on (H200), longer than the fused decode step's
// largest kernel. Each block finds its chunk's argmax with the eos tokens
// suppressed before min_new_tokens and, when the row has more than one
// chunk, leaves it in `partials` and counts itself in the row's arrivals
// counter. The row's last block (after a memory fence, the CUDA samples'
// threadFenceReduction pattern) reduces the row's partials, writes the token
// (pad for a finished row), appends it, marks the row finished on an eos,
// zeroes the row's counter and counts the row in arrivals[0]. The last row
// to arrive then does the once-per-step work: generated -= done, every
// counter += 1, done = all rows finished, and zeroes arrivals[0]. Every
// counter is zero again when the kernel ends, so a replayed graph finds them
// as the first launch did.
//
// The result is the ATen sequence's to the bit: the argmax compares the
// scores in float (exact for float16 and bfloat16), a NaN beats any number,
// and ties go to the lower index, as at::argmax does. That order is total,
// so the chunks' partial results combine to the same answer in any order.
// src/token_selection.cpp keeps that sequence for CPU tensors and as the
// reference the GPU tests compare this kernel with (TokenSelectionOnGpu.*).

#include "token_selection_kernel.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

namespace graphed::device {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Fewer scores than this per block would spend more on the block than on
// the scores.
constexpr int64_t kMinChunk = kThreads * 4;

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

__device__ __forceinline__ void warp_best(float& best, int64_t& best_index) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_down_sync(0xffffffffu, best, offset);
    const int64_t other_index = __shfl_down_sync(0xffffffffu, best_index, offset);
    if (better(other, other_index, best, best_index)) {
      best = other;
      best_index = other_index;
    }
  }
}

// The chunk's argmax, in thread 0.
__device__ void chunk_best(const GreedyStep& step, const void* row_scores, int64_t begin,
                           int64_t end, int64_t position, float& best, int64_t& best_index) {
  __shared__ float warp_scores[kWarps];
  __shared__ int64_t warp_indices[kWarps];
  best = -INFINITY;
  best_index = step.vocab;  // loses every tie against a real index
  for (int64_t v = begin + threadIdx.x; v < end; v += kThreads) {
    float value = load_score(row_scores, v, step.score_type);
    if (step.eos_threshold != nullptr && step.eos_threshold[v] > position) {
      value = -INFINITY;
    }
    if (better(value, v, best, best_index)) {
      best = value;
      best_index = v;
    }
  }
  warp_best(best, best_index);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) {
    warp_scores[warp] = best;
    warp_indices[warp] = best_index;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) {
      if (better(warp_scores[w], warp_indices[w], best, best_index)) {
        best = warp_scores[w];
        best_index = warp_indices[w];
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) greedy_step_kernel(GreedyStep step, int64_t chunk) {
  __shared__ bool last_of_row;
  __shared__ bool last_row;

  const int64_t row = blockIdx.y;
  const int64_t chunks = gridDim.x;
  const char* scores = static_cast<const char*>(step.scores);
  const int element_bytes = step.score_type == ScoreType::kFloat32 ? 4 : 2;
  const void* row_scores = scores + row * step.score_row_stride * element_bytes;
  const int64_t position = step.counters[0];
  const int64_t begin = blockIdx.x * chunk;
  const int64_t end = begin + chunk < step.vocab ? begin + chunk : step.vocab;

  float best;
  int64_t best_index;
  chunk_best(step, row_scores, begin, end, position, best, best_index);

  if (chunks > 1) {
    // Leave this chunk's answer; the row's last block combines them.
    int* partial = step.partials + (row * kMaxSelectionChunks + blockIdx.x) * 2;
    if (threadIdx.x == 0) {
      partial[0] = __float_as_int(best);
      partial[1] = static_cast<int>(best_index);
      __threadfence();
      const unsigned int arrived = atomicAdd(step.arrivals + 1 + row, 1u);
      last_of_row = arrived == static_cast<unsigned int>(chunks - 1);
    }
    __syncthreads();
    if (!last_of_row) {
      return;
    }
    if (threadIdx.x < 32) {
      __threadfence();
      best = -INFINITY;
      best_index = step.vocab;
      const int* row_partials = step.partials + row * kMaxSelectionChunks * 2;
      for (int64_t c = threadIdx.x; c < chunks; c += 32) {
        // __ldcg: from L2, where the other blocks' writes are; L1 is not coherent.
        const float value = __int_as_float(__ldcg(row_partials + 2 * c));
        const int64_t index = __ldcg(row_partials + 2 * c + 1);
        if (better(value, index, best, best_index)) {
          best = value;
          best_index = index;
        }
      }
      warp_best(best, best_index);
    }
  }

  if (threadIdx.x == 0) {
    if (chunks > 1) {
      step.arrivals[1 + row] = 0;  // every block of the row has counted itself
    }
    int64_t token = best_index < step.vocab ? best_index : 0;
    const bool tracks_eos = step.eos_count > 0;
    if (tracks_eos && step.has_pad_token && step.finished[row]) {
      token = step.pad_token_id;
    }
    step.next[row * step.next_row_stride] = token;
    if (position >= 0 && position < step.tokens_capacity) {
      step.tokens[row * step.tokens_row_stride + position] = token;
    }
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
    last_row = arrived == static_cast<unsigned int>(step.batch - 1);
  }
  __syncthreads();
  if (!last_row || threadIdx.x != 0) {
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
  step.arrivals[0] = 0;
}

}  // namespace

cudaError_t launch_greedy_step(const GreedyStep& step, cudaStream_t stream) {
  if (step.batch <= 0) {
    return cudaSuccess;
  }
  if (step.batch > kMaxSelectionRows || step.vocab > kMaxSelectionVocab) {
    return cudaErrorInvalidValue;  // fused_selection_applies checks these limits first
  }
  // As many chunks as keep each block busy, at most kMaxSelectionChunks.
  int64_t chunk = (step.vocab + kMaxSelectionChunks - 1) / kMaxSelectionChunks;
  chunk = chunk < kMinChunk ? kMinChunk : (chunk + kThreads - 1) / kThreads * kThreads;
  const int64_t chunks = (step.vocab + chunk - 1) / chunk;
  const dim3 grid(static_cast<unsigned int>(chunks), static_cast<unsigned int>(step.batch));
  greedy_step_kernel<<<grid, kThreads, 0, stream>>>(step, chunk);
  return cudaGetLastError();
}

}  // namespace graphed::device
