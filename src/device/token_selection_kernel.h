// The fused greedy token selection of the decoder, one kernel per decode step
// (Note [One kernel picks the tokens] in token_selection_kernel.cu). Plain
// CUDA types only, so that src/token_selection.cpp (compiled as C++ against
// ATen) and the .cu file (compiled by nvcc without torch headers) share it.

#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace graphed::device {

/// Blocks one row's scores are split into, at most (Note [One kernel picks
/// the tokens]); GreedyStep::partials holds two ints per row and chunk.
constexpr int64_t kMaxSelectionChunks = 64;
/// The largest batch the kernel takes (rows are the grid's y dimension).
constexpr int64_t kMaxSelectionRows = 65535;
/// The largest vocabulary the kernel takes (token ids kept as int).
constexpr int64_t kMaxSelectionVocab = 2147483647;

/// The element type of the scores a GreedyStep reads.
enum class ScoreType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

/// Every pointer and size one greedy step reads and writes; the meaning of
/// each field is the one of the DecodeState field of the same name
/// (include/graphed/decoder.h). All pointers are device pointers.
struct GreedyStep {
  /// [batch, vocab] scores, row i at scores + i * score_row_stride elements,
  /// contiguous within a row.
  const void* scores = nullptr;
  ScoreType score_type = ScoreType::kFloat32;
  int64_t batch = 0;
  int64_t vocab = 0;
  int64_t score_row_stride = 0;
  /// [vocab]: a token with eos_threshold[v] > step scores -inf. Null: none.
  const int64_t* eos_threshold = nullptr;
  /// The end-of-sequence ids; eos_count 0 turns finishing off (finished and
  /// done are then neither read nor written).
  const int64_t* eos = nullptr;
  int64_t eos_count = 0;
  /// What finished rows emit, when has_pad_token.
  int64_t pad_token_id = 0;
  bool has_pad_token = false;
  int64_t* next = nullptr;
  int64_t next_row_stride = 1;
  bool* finished = nullptr;
  int64_t* tokens = nullptr;
  int64_t tokens_row_stride = 0;
  /// Columns of `tokens`: a step at or past it writes no token (the host
  /// keeps steps below it; the bound keeps a wrong caller in bounds).
  int64_t tokens_capacity = 0;
  /// step at counters[0], generated at counters[1], then the caller's.
  int64_t* counters = nullptr;
  int64_t counter_count = 0;
  bool* done = nullptr;
  /// 1 + batch zeroed uint32 counters: [0] counts finished rows, [1 + r] the
  /// blocks of row r that are done; the last to arrive zeroes each, so a
  /// replayed graph finds them zeroed again.
  unsigned int* arrivals = nullptr;
  /// [batch, kMaxSelectionChunks, 2] ints: each chunk's best score (its float
  /// bits) and index, for the row's last block to combine.
  int* partials = nullptr;
};

/// Launches the step on `stream` (capturable). Returns the launch's error.
cudaError_t launch_greedy_step(const GreedyStep& step, cudaStream_t stream);

}  // namespace graphed::device
