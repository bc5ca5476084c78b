#pragma once

/// \file decoder.h
/// graphed::Decoder: autoregressive decoding with one captured CUDA graph per
/// batch-size bucket. The caller brings two functions -- a prefill (the
/// prompt through the model, eager) and a decode step (one token per row
/// through the model, reading and writing a static KV cache it owns) -- and
/// the Decoder does the rest on the device: sampling, finished rows,
/// positions, the output buffer, and a C++ token loop that only replays.
/// graphed.generate and graphed.Decoder adapt Hugging Face models to it.

#include "graphed/cuda_handles.h"
#include "graphed/graph.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace graphed {

/// The static inputs of one decode step for one batch bucket. They are views
/// of the Decoder's buffers and keep their addresses for the Decoder's life;
/// the decode step reads them, the graph updates them in place.
struct DecodeInputs {
  /// The token each row feeds the model: [bucket, 1], int64.
  at::Tensor input_ids;
  /// The position of that token in its row (left padding excluded, as
  /// Hugging Face counts): [bucket, 1], int64.
  at::Tensor position_ids;
  /// 1 where a row attends, 0 at its left padding: [bucket, max_len], int64.
  /// Positions after the prompt are 1; the causal mask hides those not yet
  /// written.
  at::Tensor attention_mask;
  /// Rows in this bucket.
  int64_t batch = 0;
};

/// One decode step: runs the model on `inputs` (one token per row), appends
/// each row's key and value to the caller's cache at a position the caller
/// keeps on the device, and returns the logits, [batch, vocab] or
/// [batch, 1, vocab]. Must be capturable: no host reads of device values.
using DecodeStep = std::function<at::Tensor(const DecodeInputs& inputs)>;

/// The prefill: runs the model on the prompts, filling rows [0, batch) of the
/// caller's (empty) cache, and returns the last position's logits,
/// [batch, vocab] or [batch, 1, vocab]. Runs eagerly. Arguments: input_ids
/// [batch, prompt_len], attention_mask [batch, prompt_len] (int64, 0 at left
/// padding), position_ids [batch, prompt_len] (int64, see prompt_positions).
using PrefillStep = std::function<at::Tensor(const at::Tensor& input_ids,
                                             const at::Tensor& attention_mask,
                                             const at::Tensor& position_ids)>;

/// How the next token is chosen from the logits, as Hugging Face's
/// `generate` does it (the same operations, in the same order).
struct SamplingOptions {
  /// Sample from the distribution; otherwise take the argmax (greedy).
  bool do_sample = false;
  /// Logits are divided by it before top-k and top-p (> 0; 1 leaves them).
  double temperature = 1.0;
  /// Keep the k largest logits (0: no top-k filter).
  int64_t top_k = 0;
  /// Keep the smallest set of tokens whose probability reaches top_p (in
  /// (0, 1]; 1: no top-p filter).
  double top_p = 1.0;
  /// Top-k and top-p never keep fewer tokens than this (>= 1).
  int64_t min_tokens_to_keep = 1;
};

/// What a Decoder is built with. Everything here is fixed in the graphs.
struct DecoderOptions {
  /// The largest batch a request may have (>= 1).
  int64_t max_batch = 1;
  /// Positions in the caller's cache: a request needs prompt length +
  /// max_new_tokens - 1 of them (>= 2).
  int64_t max_len = 0;
  /// Batch sizes to capture a graph for; a request pads its batch up to the
  /// smallest bucket not below it. Empty: powers of two below max_batch, and
  /// max_batch (see default_batch_buckets).
  std::vector<int64_t> batch_buckets;
  /// See SamplingOptions.
  SamplingOptions sampling;
  /// Tokens that finish a row. Empty: rows finish only at max_new_tokens.
  std::vector<int64_t> eos_token_ids;
  /// What finished rows emit; required when eos_token_ids is not empty.
  std::optional<int64_t> pad_token_id;
  /// The token loop reads the "all rows finished" flag from the device every
  /// this many tokens (>= 1): fewer host waits, at most check_every - 1
  /// wasted steps after the last row finishes (their tokens are dropped).
  int64_t check_every = 8;
  /// Evict least recently used bucket graphs when their memory exceeds this
  /// many bytes (Note [Decode graphs share one pool]). Unset: no limit.
  std::optional<int64_t> memory_budget_bytes;
  /// Eager decode steps before each capture, on the capture stream (>= 1).
  int warmup_iters = 2;
  /// Capture decode steps as graphs. False runs every step eagerly (CPU
  /// devices, debugging): same results, no graphs.
  bool use_graphs = true;
  /// See CaptureErrorMode.
  CaptureErrorMode error_mode = CaptureErrorMode::kGlobal;
  /// Empties the caller's cache (its length back to 0). Called before every
  /// prefill and after every capture (warm-up writes into the cache).
  std::function<void()> reset_cache;
};

/// The default buckets for `max_batch`: 1, 2, 4, ... below max_batch, then
/// max_batch itself.
std::vector<int64_t> default_batch_buckets(int64_t max_batch);

/// Checks `options` without touching a device. Throws graphed::Error naming
/// the option, the value found and the fix. Returns the sorted, deduplicated
/// buckets the Decoder will use.
std::vector<int64_t> validate_decoder_options(const DecoderOptions& options);

/// Hugging Face's positions for left-padded prompts: the running count of
/// attended tokens minus one, 0 at padding. `attention_mask` is [batch, len].
at::Tensor prompt_positions(const at::Tensor& attention_mask);

/// The device state of a request that the token selection reads and updates.
/// All tensors live on one device; Decoder owns one per batch (views per
/// bucket). Rows past the request's batch start finished.
struct DecodeState {
  /// Per row: true once it emitted an end-of-sequence token: [batch], bool.
  at::Tensor finished;
  /// Tokens chosen so far, per row: [batch, capacity], int64.
  at::Tensor tokens;
  /// How many tokens were chosen so far (the write index): [1], int64.
  at::Tensor step;
  /// How many of them belong to the output (steps taken while some row was
  /// unfinished, Hugging Face's loop length): [1], int64.
  at::Tensor generated;
  /// End-of-sequence tokens are suppressed while step < min_new_tokens:
  /// [1], int64.
  at::Tensor min_new_tokens;
  /// True when every row is finished: [1], bool.
  at::Tensor done;
};

/// Allocates a DecodeState for `batch` rows and `capacity` tokens on `device`.
DecodeState make_decode_state(int64_t batch, int64_t capacity, c10::Device device);

/// Chooses each row's next token from `logits` ([batch, vocab], any floating
/// dtype) and records it in `state` -- all on the device, no host reads, so
/// it can be captured:
/// 1. scores = logits as float32; end-of-sequence tokens get -inf while
///    state.step < state.min_new_tokens (MinNewTokensLengthLogitsProcessor);
/// 2. greedy: argmax; sampling: temperature, top-k, top-p (Hugging Face's
///    warpers), softmax, and one categorical draw per row from the default
///    generator (Note [Sampling inside a graph]);
/// 3. finished rows emit pad_token_id; a row emitting an eos token finishes;
/// 4. the tokens are written at column state.step of state.tokens, step and
///    (when some row was unfinished) generated advance, done is refreshed.
/// Returns the chosen tokens, [batch], int64. `eos` is an int64 tensor of
/// the eos ids on the logits' device (may be empty).
at::Tensor select_next_tokens(const at::Tensor& logits, DecodeState& state,
                              const SamplingOptions& sampling, const at::Tensor& eos,
                              std::optional<int64_t> pad_token_id);

/// One bucket's entry of Decoder::memory_report().
struct BucketReport {
  /// Rows of the bucket.
  int64_t batch = 0;
  /// True while its graph is held.
  bool captured = false;
  /// Growth of the shared pool's reserved bytes when it was captured.
  int64_t graph_bytes = 0;
  /// Wall time of warm-up and capture, in milliseconds (0 before capture).
  double capture_ms = 0.0;
  /// Kernel nodes of its graph.
  int64_t kernels = 0;
  /// Times its graph was replayed.
  int64_t replays = 0;
  /// Times its graph was evicted for the memory budget.
  int64_t evictions = 0;
};

/// What one request produced.
struct DecodeResult {
  /// The new tokens, [batch, n] int64, n <= max_new_tokens: Hugging Face's
  /// length (it stops once every row finished). Owned by the caller.
  at::Tensor tokens;
  /// Decode steps replayed (or run eagerly), including wasted ones after
  /// the last row finished.
  int64_t steps = 0;
  /// The bucket the request ran in.
  int64_t bucket = 0;
};

/// Called after each new token with the tokens of the request's rows, [batch]
/// int64 on the CPU (a streamer). Calling it makes the loop wait for every
/// token.
using TokenCallback = std::function<void(const at::Tensor& tokens)>;

/// Autoregressive decoding on captured graphs.
///
/// Note [The decode loop]
/// ~~~~~~~~~~~~~~~~~~~~~~
/// A request runs: reset the cache, prefill (eager), choose the first token
/// from the prefill's logits (select_next_tokens, eager), then
/// max_new_tokens - 1 replays of the bucket's graph. One replay is a whole
/// decode step: the model on DecodeInputs, then select_next_tokens, which
/// feeds the chosen token back into input_ids, advances position_ids and
/// writes the token into the output buffer at a device-side index. So the
/// host loop only launches graphs: no Python, no copies, no per-token
/// synchronisation. Every check_every tokens it copies the done flag to
/// pinned memory behind an event and, at a later check, reads it only if
/// the event has passed: the host never waits on the flag, so the GPU's
/// queue of replays never drains (a blocking read every 8 tokens cost 9% of
/// the step time at batch 1 on the H200). It stops when every row finished;
/// steps run after that are cut off using the device's `generated` count, so
/// the output has exactly Hugging Face's length. Without end-of-sequence
/// tokens, and before min_new_tokens, no row can finish and nothing is read. Positions and masks are device tensors that
/// the graph itself advances, never host values baked into the graph (the
/// bug of hand-written graphs around a static cache).
///
/// Note [Decode graphs share one pool]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// Every bucket's graph is captured into one memory pool. That is safe in any
/// replay order because all of them replay on one stream, one after the
/// other, and no graph's temporaries are read after its replay ends: the
/// inputs and state they share live outside the pool (the Decoder's
/// buffers), and the logits each graph leaves behind are only read inside it.
/// The buffers are allocated once for max_batch, and each bucket's graph
/// works on views of their first rows. A bucket's reported memory is the
/// pool's growth at its capture; with a budget, least recently used graphs
/// are dropped when the sum exceeds it (their memory returns to the pool and
/// serves the next capture) and recaptured on their next use.
///
/// Note [Sampling inside a graph]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// torch.multinomial with one sample is argmax(probs / q) with q drawn from
/// Exp(1) (Distributions.cpp), but it checks its input with host reads on
/// some versions; select_next_tokens draws q with exponential_ itself. The
/// draw uses the default CUDA generator, which at::cuda::CUDAGraph registers
/// at capture (torch 2.11 and 2.14 alike): each replay advances the Philox
/// offset, so every replay draws new numbers, and torch.manual_seed before a
/// request makes the request reproducible. Warm-up draws are undone (the
/// generator state is restored after capture).
class Decoder {
 public:
  /// Validates `options` (validate_decoder_options) and allocates the
  /// buffers on `device`. Captures nothing yet: see capture_all() and
  /// generate(). Graphs need a CUDA device; on a CPU device set
  /// options.use_graphs = false.
  Decoder(DecodeStep step, PrefillStep prefill, DecoderOptions options, c10::Device device);
  /// Releases the graphs. Never throws.
  ~Decoder();
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;
  /// Moves the graphs and buffers; `other` becomes unusable.
  Decoder(Decoder&& other) noexcept;
  /// Releases this decoder's graphs, then takes `other`'s.
  Decoder& operator=(Decoder&& other) noexcept;

  /// Called by capture_all() after each bucket: its batch size, the buckets
  /// done so far and their number (for progress bars).
  using BucketCaptured = std::function<void(int64_t batch, size_t done, size_t total)>;

  /// Captures every bucket's graph, largest first, into the shared pool
  /// (nothing when use_graphs is false), calling `on_captured` (when set)
  /// after each. Leaves the cache empty.
  void capture_all(const BucketCaptured& on_captured = {});

  /// Checks a request against the limits without doing any work: batch <=
  /// max_batch, prompt_len >= 1, max_new_tokens >= 1, prompt_len +
  /// max_new_tokens - 1 <= max_len, min_new_tokens >= 0. Throws graphed::Error
  /// naming the limit.
  void check_request(int64_t batch, int64_t prompt_len, int64_t max_new_tokens,
                     int64_t min_new_tokens) const;

  /// Runs one request: `input_ids` [batch, prompt_len] int64 on the device,
  /// `attention_mask` of the same shape (1 = token, 0 = left padding; all
  /// ones when undefined). Returns the new tokens (Note [The decode loop]).
  DecodeResult generate(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                        int64_t max_new_tokens, int64_t min_new_tokens = 0,
                        const TokenCallback& callback = {});

  /// The bucket a batch of `batch` rows runs in. Throws when above the largest.
  int64_t bucket_for(int64_t batch) const;
  /// The buckets, ascending.
  const std::vector<int64_t>& buckets() const { return buckets_; }
  /// One entry per bucket, ascending.
  std::vector<BucketReport> memory_report() const;
  /// Reserved bytes of the shared pool now (0 before any capture).
  int64_t pool_bytes() const;
  /// The options it was built with.
  const DecoderOptions& options() const { return options_; }

 private:
  struct Bucket;
  Bucket& bucket(int64_t batch);
  void ensure_captured(Bucket& bucket);
  void capture_bucket(Bucket& bucket);
  void run_step(Bucket& bucket);
  void decode_step(const DecodeInputs& inputs, DecodeState& state);
  void reset_cache();
  void evict_over_budget(int64_t keep);
  DecodeInputs inputs_for(int64_t batch) const;
  DecodeState state_for(int64_t batch) const;

  DecodeStep step_;
  PrefillStep prefill_;
  DecoderOptions options_;
  c10::Device device_;
  std::vector<int64_t> buckets_;
  // Buffers for max_batch rows; buckets use views of their first rows.
  DecodeInputs inputs_;
  DecodeState state_;
  at::Tensor eos_;
  bool poll_done();

  at::Tensor done_host_;  // pinned, [1] bool: the done flag's last copy
  std::optional<CudaEvent> done_copied_;  // passes when done_host_ holds it
  bool done_copy_pending_ = false;
  std::map<int64_t, std::unique_ptr<Bucket>> graphs_;
  std::optional<PoolId> pool_;
  uint64_t clock_ = 0;
};

}  // namespace graphed
