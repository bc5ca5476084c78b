#pragma once

/// \file decoder.h
/// graphed::Decoder: autoregressive decoding with one captured CUDA graph per
/// batch-size bucket for the decode step and one per (bucket, prompt length)
/// for the prefill. The caller brings two functions -- a prefill (the prompt
/// through the model) and a decode step (one token per row through the
/// model, reading and writing a static KV cache it owns) -- and the Decoder
/// does the rest on the device: sampling, finished rows, positions, the
/// output buffer, and a C++ token loop that only replays.
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
#include <string_view>
#include <tuple>
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
/// caller's cache (emptied by DecoderOptions::reset_cache just before), and
/// returns the last position's logits, [batch, vocab] or [batch, 1, vocab].
/// Arguments: input_ids [batch, prompt_len], attention_mask [batch,
/// prompt_len] (int64, 0 at left padding) -- undefined when no row has left
/// padding, so that the step need not read the mask to find out --, and
/// position_ids [batch, prompt_len] (int64, see prompt_positions). `batch` is
/// the request's batch bucket (rows past the request's are ignored). Runs
/// eagerly for the first warmup_iters requests of a (bucket, prompt length,
/// padding) shape, then is captured (Note [The decode loop]), so it must be
/// capturable like the decode step unless DecoderOptions::prefill_graphs is 0.
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
  /// How many token ids the model takes (the rows of its input embedding).
  /// When set, prompts and pad_token_id are checked against it on the host
  /// before any kernel reads them (Note [Token ids are checked on the host]);
  /// unset, the logits' width is the vocabulary, known after the first
  /// prefill.
  std::optional<int64_t> vocab_size;
  /// The token loop reads the "all rows finished" flag from the device every
  /// this many tokens (>= 1): fewer host waits, at most check_every - 1
  /// wasted steps after the last row finishes (their tokens are dropped).
  int64_t check_every = 8;
  /// Evict least recently used graphs (decode buckets and prefills) when
  /// their memory exceeds this many bytes. Unset: no limit. See
  /// Note [Decode graphs share one pool].
  std::optional<int64_t> memory_budget_bytes;
  /// Eager decode steps before each decode capture, on the capture stream
  /// (>= 1); also the number of eager prefills of a (bucket, prompt length,
  /// padding) shape before its prefill is captured.
  int warmup_iters = 2;
  /// The most prefill graphs held at once (>= 0; 0: the prefill always runs
  /// eagerly). Least recently used ones are evicted beyond it. Ignored when
  /// use_graphs is false.
  int64_t prefill_graphs = 16;
  /// Capture decode steps as graphs. False runs every step eagerly (CPU
  /// devices, debugging): same results, no graphs.
  bool use_graphs = true;
  /// See CaptureErrorMode.
  CaptureErrorMode error_mode = CaptureErrorMode::kGlobal;
  /// Empties the caller's cache (its length back to 0). Called at the start of
  /// every prefill -- inside the prefill graph, so it must be capturable --
  /// and after every decode capture (warm-up writes into the cache).
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
  /// Read and updated only when there are end-of-sequence tokens.
  at::Tensor finished;
  /// Tokens chosen so far, per row: [batch, capacity], int64.
  at::Tensor tokens;
  /// The tokens chosen last, written in place: [batch, 1], int64. The
  /// Decoder makes it the decode step's input_ids, so no copy feeds them back.
  at::Tensor next;
  /// Counters that advance by one per chosen token, in one kernel:
  /// [2 + k], int64 -- step, generated, then k values of the caller's (the
  /// Decoder puts its position_ids there).
  at::Tensor counters;
  /// How many tokens were chosen so far (the write index): counters[0:1].
  at::Tensor step;
  /// How many of them belong to the output (steps taken while some row was
  /// unfinished, Hugging Face's loop length): counters[1:2].
  at::Tensor generated;
  /// Per vocabulary entry, the step before which it is suppressed: 0 except
  /// at end-of-sequence tokens, where it is min_new_tokens: [vocab], int64.
  /// Undefined: nothing is suppressed. See suppress_eos_until.
  at::Tensor eos_threshold;
  /// True when every row is finished: [1], bool.
  at::Tensor done;
  /// 1 + batch zeroed int32 counters the fused selection kernel counts its
  /// rows and blocks in (Note [One kernel picks the tokens]); allocated on
  /// CUDA devices only.
  at::Tensor arrivals;
  /// The fused selection kernel's per-chunk results, int32, scratch
  /// (Note [One kernel picks the tokens]); allocated on CUDA devices only.
  at::Tensor partials;
};

/// Allocates a DecodeState for `batch` rows and `capacity` tokens on `device`,
/// with `extra_counters` values after step and generated in `counters`.
DecodeState make_decode_state(int64_t batch, int64_t capacity, c10::Device device,
                              int64_t extra_counters = 0);

/// Makes select_next_tokens suppress the `eos` tokens (int64, on the state's
/// device) while state.step < min_new_tokens, as Hugging Face's
/// MinNewTokensLengthLogitsProcessor does: allocates state.eos_threshold for
/// `vocab` entries when it has another size (not while capturing), then
/// writes min_new_tokens at the eos entries (one kernel). Nothing when `eos`
/// is empty.
void suppress_eos_until(DecodeState& state, const at::Tensor& eos, int64_t vocab,
                        int64_t min_new_tokens);

/// Which kernels select_next_tokens launches.
enum class TokenSelectionKernels {
  /// One fused kernel for the choice and the bookkeeping, where the tensors
  /// are CUDA tensors it takes (float32, bfloat16 or float16 scores with
  /// contiguous rows); the ATen sequence elsewhere. Note [One kernel picks
  /// the tokens].
  kFused,
  /// Always the ATen sequence: the reference the fused kernel is tested
  /// against.
  kAten,
};

/// Chooses each row's next token from `logits` ([batch, vocab] or [batch, 1,
/// vocab], any floating dtype) and records it in `state` -- all on the
/// device, no host reads, so it can be captured:
/// 1. with end-of-sequence tokens, those with state.eos_threshold > step get
///    -inf (MinNewTokensLengthLogitsProcessor);
/// 2. greedy: argmax of the logits in their own dtype (converting them to
///    float32 first, as Hugging Face does, is exact and changes no argmax);
///    sampling: float32, temperature, top-k, top-p (Hugging Face's warpers),
///    softmax, and one categorical draw per row from the default generator
///    (Note [Sampling inside a graph]); the tokens land in state.next;
/// 3. with end-of-sequence tokens: finished rows emit pad_token_id, a row
///    emitting an eos token finishes, done is refreshed; without them no row
///    finishes and finished, done are neither read nor written;
/// 4. the tokens are written at column state.step of state.tokens, and the
///    counters advance by one (generated only if some row was unfinished).
/// Returns state.next as [batch], int64. `eos` is an int64 tensor of the eos
/// ids on the logits' device (may be empty). For the kernels it launches see
/// Note [Fewer kernels per token] and TokenSelectionKernels.
at::Tensor select_next_tokens(const at::Tensor& logits, DecodeState& state,
                              const SamplingOptions& sampling, const at::Tensor& eos,
                              std::optional<int64_t> pad_token_id,
                              TokenSelectionKernels kernels = TokenSelectionKernels::kFused);

/// Which step of decoding a graph holds.
enum class GraphKind {
  /// One decode step for a batch bucket.
  kDecode,
  /// The prefill of one (batch bucket, prompt length, padding) shape, with
  /// the first token's selection and the request's state set-up.
  kPrefill,
};

/// "decode" or "prefill".
std::string_view graph_kind_name(GraphKind kind);

/// One graph's entry of Decoder::memory_report().
struct BucketReport {
  /// A decode bucket's graph or a prefill's.
  GraphKind kind = GraphKind::kDecode;
  /// Rows of the bucket.
  int64_t batch = 0;
  /// Prefills: the prompt length the graph takes (0 for decode buckets).
  int64_t prompt_len = 0;
  /// Prefills: whether the graph takes an attention mask with left padding.
  bool padded = false;
  /// True while its graph is held.
  bool captured = false;
  /// Growth of the shared pool's reserved bytes when it was captured.
  int64_t graph_bytes = 0;
  /// Wall time of warm-up and capture, in milliseconds (0 before capture).
  double capture_ms = 0.0;
  /// The warm-up's part of capture_ms: where a compiled step compiles
  /// (Note [A compiled decode step] in python/graphed/generate.py).
  double warmup_ms = 0.0;
  /// Kernel nodes of its graph.
  int64_t kernels = 0;
  /// Times its graph was replayed (decode buckets: also eager steps when
  /// use_graphs is false).
  int64_t replays = 0;
  /// Times its graph was evicted for the memory budget (or, for prefills,
  /// for DecoderOptions::prefill_graphs).
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
/// A request is one prefill launch, then max_new_tokens - 1 replays of its
/// bucket's decode graph.
///
/// The prefill runs on the request's batch bucket and exact prompt length
/// (no padding of the prompt, so greedy tokens stay Hugging Face's). Its body
/// empties the cache (reset_cache), computes the prompt's positions, runs the
/// PrefillStep, sets up the decode inputs (attention mask, positions) and the
/// state (finished rows from the request's batch, counters, done), and
/// chooses the first token with select_next_tokens. The first warmup_iters
/// requests of a (bucket, prompt length, padding) shape run that body
/// eagerly; the next one captures it (one more warm-up on the capture stream
/// first) and from then on it is a graph replay. The host's per-request work
/// is copying the prompt (and mask) into the shape's static buffers, and,
/// only when they change, writing the batch size and the min_new_tokens
/// thresholds: one small launch each. Whether the prompts have left padding
/// is part of the shape because Hugging Face picks a different attention
/// path for each (SDPA's is_causal without padding, an explicit mask with
/// it); the host learns it from one read of the mask, free when the mask is
/// on the CPU. At most prefill_graphs prefill graphs are held (least recently
/// used evicted); they count under memory_budget like decode buckets.
///
/// One decode replay is a whole decode step: the model on DecodeInputs, then
/// select_next_tokens, which writes the chosen token straight into input_ids
/// (DecodeState::next is that buffer), advances step, generated and
/// position_ids with one add (they share DecodeState::counters) and writes
/// the token into the output buffer at a device-side index. So the host loop
/// only launches graphs: no Python, no copies, no per-token synchronisation.
/// Every check_every tokens it copies the done flag to pinned memory behind
/// an event and, at a later check, reads it only if the event has passed:
/// the host never waits on the flag, so the GPU's queue of replays never
/// drains (a blocking read every 8 tokens cost 9% of the step time at batch
/// 1 on the H200). It stops when every row finished; steps run after that
/// are cut off using the device's `generated` count, so the output has
/// exactly Hugging Face's length. Without end-of-sequence tokens, and before
/// min_new_tokens, no row can finish and nothing is read. Positions and
/// masks are device tensors that the graphs themselves advance, never host
/// values baked into a graph (the bug of hand-written graphs around a static
/// cache).
///
/// Note [Decode graphs share one pool]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// Every graph -- each bucket's decode step and each prefill -- is captured
/// into one memory pool. That is safe in any replay order because all of
/// them replay on one stream, one after the other, and no graph's
/// temporaries are read after its replay ends: the inputs and state they
/// share live outside the pool (the Decoder's buffers, the prefill shapes'
/// static inputs, the caller's cache, all allocated eagerly), and the logits
/// each graph leaves behind are only read inside it -- the prefill's by the
/// first token's selection, which is part of the prefill graph, so no other
/// graph can overwrite them first. The buffers are allocated once for
/// max_batch rows, and each bucket's graphs work on views of their first
/// rows. A graph's reported memory is the pool's growth at its capture;
/// with a budget, least recently used graphs are dropped when the sum
/// exceeds it (their memory returns to the pool and serves the next capture)
/// and recaptured on their next use; the graphs of the request under way
/// are never dropped.
///
/// Note [Fewer kernels per token]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// At batch 1 on the H200 a decode step's model kernels take 0.43 ms, and
/// every other kernel in the graph costs about 2 us (its run time plus the
/// launch gap inside the graph), so the token selection launches as few as
/// it can. Greedy without end-of-sequence tokens is 3 kernels: argmax over
/// the logits in their own dtype straight into input_ids (argmax_out), the
/// index_copy_ into the output buffer, one add on the counters (step,
/// generated and the positions share a tensor). End-of-sequence tokens add
/// 8: the min_new_tokens suppression as a compare against a per-token
/// threshold and a where with -inf (whose scalar is one more fill), instead
/// of building the eos mask each step; the pad of finished rows; "generated
/// -= done" (done is the previous step's flag, so it says whether some row
/// was unfinished); the eos test and its or into finished (one more any()
/// for several eos tokens); and all() written into done (all_out). Casts,
/// copies, reshapes that copy and the input_ids copy are gone (25 kernels
/// before, with eos). A CPU test counts the operators per step
/// (tests/python/test_generate.py) so that this cannot silently regress.
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

  /// Captures every bucket's decode graph, largest first, into the shared
  /// pool (nothing when use_graphs is false), calling `on_captured` (when
  /// set) after each. Leaves the cache empty. Prefill graphs are captured by
  /// generate() (Note [The decode loop]).
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
  /// One entry per decode bucket, ascending, then one per prefill graph
  /// captured so far (held or evicted), by batch, prompt length, padding.
  std::vector<BucketReport> memory_report() const;
  /// Reserved bytes of the shared pool now (0 before any capture).
  int64_t pool_bytes() const;
  /// The options it was built with.
  const DecoderOptions& options() const { return options_; }

 private:
  // Continuous batching drives the decode graphs and buffers row by row
  // (Note [Continuous batching on graphs] in request_scheduler.h).
  friend class RequestScheduler;
  struct Bucket;
  struct Prefill;
  using PrefillKey = std::tuple<int64_t, int64_t, bool>;  // bucket, prompt_len, padded
  Bucket& bucket(int64_t batch);
  void ensure_captured(Bucket& bucket);
  void capture_bucket(Bucket& bucket);
  void run_step(Bucket& bucket);
  void decode_step(const DecodeInputs& inputs, DecodeState& state);
  void select(const at::Tensor& logits, DecodeState& state);
  void learn_vocab(int64_t vocab);
  void check_prompt_ids(const at::Tensor& input_ids) const;
  Prefill& prefill_for(int64_t rows, int64_t prompt_len, bool padded);
  void prefill_body(Prefill& prefill);
  void run_prefill(Prefill& prefill, const Bucket& bucket);
  bool capture_prefill(Prefill& prefill, const Bucket& bucket);
  void reset_cache();
  void evict_over_budget(const std::vector<uint64_t>& keep);
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
  // The vocabulary once known (DecoderOptions::vocab_size, else the first
  // logits' width), and the token of rows padding a batch to its bucket:
  // Note [Token ids are checked on the host] in decoder.cpp.
  std::optional<int64_t> vocab_;
  int64_t filler_token_ = 0;
  bool poll_done();

  at::Tensor done_host_;  // pinned, [1] bool: the done flag's last copy
  std::optional<CudaEvent> done_copied_;  // passes when done_host_ holds it
  bool done_copy_pending_ = false;
  std::map<int64_t, std::unique_ptr<Bucket>> graphs_;
  std::map<PrefillKey, std::unique_ptr<Prefill>> prefills_;
  at::Tensor row_index_;   // [max_batch] int64: 0, 1, ...
  at::Tensor live_rows_;   // [1] int64: the request's batch; rows at or past it start finished
  int64_t live_rows_value_ = -1;       // what live_rows_ holds (-1: unknown)
  int64_t threshold_min_new_ = 0;      // what state_.eos_threshold holds at the eos ids
  bool prefill_graphs_broken_ = false; // a prefill failed to capture: prefills stay eager
  uint64_t next_prefill_id_ = 0;
  std::optional<PoolId> pool_;
  uint64_t clock_ = 0;
};

}  // namespace graphed
