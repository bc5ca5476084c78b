#include "graphed/decoder.h"

#include "graphed/check.h"
#include "graphed/cuda_handles.h"
#include "graphed/memory_budget.h"
#include "graphed/nvtx.h"
#include "graphed/state_snapshot.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <chrono>

namespace graphed {

struct Decoder::Bucket {
  int64_t batch = 0;
  Graph graph;
  // "graphed/replay:decode batch <batch>", built once (Note [NVTX ranges cost
  // nothing without a profiler]).
  std::string replay_range;
  BucketReport report;
  uint64_t last_used = 0;
};

// One prefill shape: its static inputs (allocated eagerly, outside the pool,
// and kept while the shape is known), how often it ran, its graph once captured.
struct Decoder::Prefill {
  uint64_t id = 0;      // key in the memory budget's bookkeeping
  at::Tensor ids;       // [bucket, prompt_len] int64
  at::Tensor mask;      // [bucket, prompt_len] int64; undefined when not padded
  at::Tensor positions; // [bucket, prompt_len] int64; unpadded shapes only (constant)
  int64_t runs = 0;     // requests that used this shape
  bool ever_captured = false;
  Graph graph;
  BucketReport report;
  uint64_t last_used = 0;
};

namespace {

// Ids of graphs in the budget's bookkeeping: decode buckets by their batch,
// prefills above this.
constexpr uint64_t kPrefillIds = uint64_t{1} << 62;

// Shapes remembered (for their run counts) without a graph, at most.
constexpr size_t kMaxPrefillShapes = 256;

double elapsed_ms(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since)
      .count();
}

}  // namespace

std::vector<int64_t> default_batch_buckets(int64_t max_batch) {
  GRAPHED_CHECK(max_batch >= 1, "Expected max_batch >= 1, got ", max_batch,
                ". Pass the largest batch the decoder must serve.");
  std::vector<int64_t> buckets;
  for (int64_t size = 1; size < max_batch; size *= 2) {
    buckets.push_back(size);
  }
  buckets.push_back(max_batch);
  return buckets;
}

namespace {

// Note [Token ids are checked on the host]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A token id outside the vocabulary that reaches a kernel as an index is a
// device-side assert, and after one the process's CUDA context is lost:
// every later CUDA call fails. So no id a user passes is used as an index
// on the device before it is checked on the host:
// - Prompts are checked against the vocabulary (DecoderOptions::vocab_size,
//   else the logits' width once known) before they are copied in: one read
//   of their minimum and maximum per request.
// - pad_token_id is fed to the model for finished rows, so it must be in
//   the vocabulary whenever a request's row can finish; rows padding a batch
//   up to its bucket (which start finished) get it only when it is, else
//   token 0, as input and as what they emit (their results are dropped).
// - End-of-sequence ids are compared, never indexed: the suppression of
//   min_new_tokens marks them by membership (suppress_eos_until), so an id
//   outside the vocabulary never ends a row and is never suppressed, as in
//   transformers (which only warns). graphed warns too.
// - graphed's own kernels bound every index they compute from device values
//   (the token write by the step counter, the FP8 history slot), so a wrong
//   caller of the C++ API gets wrong values at worst, never an assert.
void check_token_ids_fit(const DecoderOptions& options, std::optional<int64_t> vocab) {
  if (!vocab) {
    return;
  }
  GRAPHED_CHECK(*vocab >= 1, "Expected vocab_size >= 1 (the token ids the model takes), got ",
                *vocab, ".");
  const auto inside = [&](int64_t id) { return id >= 0 && id < *vocab; };
  const bool rows_can_finish =
      std::any_of(options.eos_token_ids.begin(), options.eos_token_ids.end(), inside);
  GRAPHED_CHECK(!rows_can_finish || !options.pad_token_id || inside(*options.pad_token_id),
                "Expected pad_token_id within the model's vocabulary [0, ", *vocab, "), got ",
                *options.pad_token_id, ": rows that end on an end-of-sequence token emit it, and "
                "the model reads it as its next input (an index past its embedding: a "
                "device-side assert that kills the process, which transformers' generate would "
                "hit too). Pass a pad_token_id below ", *vocab, ", e.g. the first eos token.");
}

}  // namespace

std::vector<int64_t> validate_decoder_options(const DecoderOptions& options) {
  GRAPHED_CHECK(options.max_batch >= 1, "Expected max_batch >= 1, got ", options.max_batch,
                ". Pass the largest batch the decoder must serve.");
  GRAPHED_CHECK(options.max_len >= 2, "Expected max_len (positions in the KV cache) >= 2, got ",
                options.max_len, ". A request needs prompt length + max_new_tokens - 1 positions.");
  GRAPHED_CHECK(options.warmup_iters >= 1 && options.warmup_iters < options.max_len,
                "Expected 1 <= warmup_iters < max_len (", options.max_len, "), got ",
                options.warmup_iters, ". Warm-up steps write into the cache; 2 is plenty.");
  GRAPHED_CHECK(options.check_every >= 1, "Expected check_every >= 1, got ",
                options.check_every, ". It is how many tokens pass between two reads of the "
                "done flag; 8 is a good value.");
  const SamplingOptions& sampling = options.sampling;
  GRAPHED_CHECK(sampling.temperature > 0.0, "Expected temperature > 0, got ",
                sampling.temperature, ". For greedy decoding pass do_sample=False instead.");
  GRAPHED_CHECK(sampling.top_k >= 0, "Expected top_k >= 0 (0: no top-k filter), got ",
                sampling.top_k, ".");
  GRAPHED_CHECK(sampling.top_p > 0.0 && sampling.top_p <= 1.0,
                "Expected top_p in (0, 1] (1: no top-p filter), got ", sampling.top_p, ".");
  GRAPHED_CHECK(sampling.min_tokens_to_keep >= 1, "Expected min_tokens_to_keep >= 1, got ",
                sampling.min_tokens_to_keep, ".");
  GRAPHED_CHECK(options.eos_token_ids.empty() || options.pad_token_id.has_value(),
                "End-of-sequence tokens were given (", c10::Join(", ", options.eos_token_ids),
                ") but no pad_token_id: finished rows need a token to emit. Pass pad_token_id "
                "(Hugging Face uses the first eos token when the model has no pad token).");
  check_token_ids_fit(options, options.vocab_size);
  GRAPHED_CHECK(options.prefill_graphs >= 0, "Expected prefill_graphs >= 0 (the most prefill "
                "graphs held; 0: eager prefills), got ", options.prefill_graphs, ".");
  GRAPHED_CHECK(!options.memory_budget_bytes || *options.memory_budget_bytes >= 1,
                "Expected memory_budget >= 1 byte, got ", options.memory_budget_bytes.value_or(0),
                ". Leave it unset for no limit.");
  std::vector<int64_t> buckets = options.batch_buckets.empty()
                                     ? default_batch_buckets(options.max_batch)
                                     : options.batch_buckets;
  std::sort(buckets.begin(), buckets.end());
  buckets.erase(std::unique(buckets.begin(), buckets.end()), buckets.end());
  GRAPHED_CHECK(buckets.front() >= 1, "Expected batch buckets >= 1, got ", buckets.front(),
                ". Pass sizes such as [1, 2, 4, 8].");
  GRAPHED_CHECK(buckets.back() >= options.max_batch, "The largest batch bucket (",
                buckets.back(), ") is below max_batch (", options.max_batch,
                "), so the largest batches would have no graph. Add ", options.max_batch,
                " to the buckets or lower max_batch.");
  GRAPHED_CHECK(buckets.back() == options.max_batch, "The largest batch bucket (",
                buckets.back(), ") is above max_batch (", options.max_batch,
                "): the buffers hold max_batch rows. Raise max_batch to ", buckets.back(),
                " or drop the larger buckets.");
  return buckets;
}

std::string_view graph_kind_name(GraphKind kind) {
  return kind == GraphKind::kPrefill ? "prefill" : "decode";
}

Decoder::Decoder(DecodeStep step, PrefillStep prefill, DecoderOptions options,
                 c10::Device device)
    : step_(std::move(step)),
      prefill_(std::move(prefill)),
      options_(std::move(options)),
      device_(device.is_cuda() && !device.has_index()
                  ? c10::Device(c10::kCUDA, c10::cuda::current_device())
                  : device),
      buckets_(validate_decoder_options(options_)) {
  GRAPHED_CHECK(step_ && prefill_, "Expected a decode step and a prefill function, got ",
                step_ ? "no prefill" : "no decode step", ".");
  GRAPHED_CHECK(!options_.use_graphs || device_.is_cuda(), "Decode graphs need a CUDA device, "
                "got ", device_, ". Move the model to a GPU, or pass use_graphs=false to decode "
                "eagerly.");
  std::optional<c10::cuda::CUDAGuard> guard;
  if (device_.is_cuda()) {
    guard.emplace(device_);
  }
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device_);
  // Note [Fewer kernels per token]: the token selection writes input_ids in
  // place (state_.next) and advances the positions with step and generated.
  state_ = make_decode_state(options_.max_batch, options_.max_len, device_,
                             /*extra_counters=*/options_.max_batch);
  inputs_.input_ids = state_.next;
  inputs_.position_ids = state_.counters.narrow(0, 2, options_.max_batch).view({-1, 1});
  inputs_.attention_mask = at::ones({options_.max_batch, options_.max_len}, longs);
  inputs_.batch = options_.max_batch;
  row_index_ = at::arange(options_.max_batch, longs);
  live_rows_ = at::zeros({1}, longs);
  eos_ = at::tensor(options_.eos_token_ids, at::TensorOptions().dtype(at::kLong)).to(device_);
  if (options_.vocab_size) {
    learn_vocab(*options_.vocab_size);
  }
  if (device_.is_cuda()) {
    done_host_ = at::zeros({1}, at::TensorOptions().dtype(at::kBool).pinned_memory(true));
    done_copied_.emplace();
  }
  for (int64_t size : buckets_) {
    auto bucket = std::make_unique<Bucket>();
    bucket->batch = size;
    bucket->report.batch = size;
    bucket->report.kind = GraphKind::kDecode;
    graphs_.emplace(size, std::move(bucket));
  }
}

Decoder::~Decoder() = default;
Decoder::Decoder(Decoder&& other) noexcept = default;
Decoder& Decoder::operator=(Decoder&& other) noexcept = default;

int64_t Decoder::bucket_for(int64_t batch) const {
  const auto found = std::lower_bound(buckets_.begin(), buckets_.end(), batch);
  GRAPHED_CHECK(batch >= 1 && found != buckets_.end(), "Expected a batch of 1 to ",
                options_.max_batch, " rows (this decoder's max_batch), got ", batch,
                ". Build the decoder with max_batch >= ", batch, ", or split the batch.");
  return *found;
}

Decoder::Bucket& Decoder::bucket(int64_t batch) { return *graphs_.at(bucket_for(batch)); }

DecodeInputs Decoder::inputs_for(int64_t batch) const {
  DecodeInputs inputs;
  inputs.input_ids = inputs_.input_ids.narrow(0, 0, batch);
  inputs.position_ids = inputs_.position_ids.narrow(0, 0, batch);
  inputs.attention_mask = inputs_.attention_mask.narrow(0, 0, batch);
  inputs.batch = batch;
  return inputs;
}

DecodeState Decoder::state_for(int64_t batch) const {
  DecodeState state = state_;
  state.finished = state_.finished.narrow(0, 0, batch);
  state.tokens = state_.tokens.narrow(0, 0, batch);
  state.next = state_.next.narrow(0, 0, batch);
  state.counters = state_.counters.narrow(0, 0, 2 + batch);  // with this bucket's positions
  return state;
}

void Decoder::check_request(int64_t batch, int64_t prompt_len, int64_t max_new_tokens,
                            int64_t min_new_tokens) const {
  (void)bucket_for(batch);
  GRAPHED_CHECK(prompt_len >= 1, "Expected a prompt of at least one token, got ", prompt_len,
                ".");
  GRAPHED_CHECK(max_new_tokens >= 1, "Expected max_new_tokens >= 1, got ", max_new_tokens, ".");
  GRAPHED_CHECK(min_new_tokens >= 0, "Expected min_new_tokens >= 0, got ", min_new_tokens, ".");
  GRAPHED_CHECK(prompt_len + max_new_tokens - 1 <= options_.max_len, "The request needs ",
                prompt_len + max_new_tokens - 1, " cache positions (prompt length ", prompt_len,
                " + max_new_tokens ", max_new_tokens, " - 1), but the decoder's cache holds ",
                options_.max_len, " (max_len). Shorten the prompt, lower max_new_tokens, or "
                "build the decoder with max_len >= ", prompt_len + max_new_tokens - 1, ".");
}

void Decoder::reset_cache() {
  if (options_.reset_cache) {
    options_.reset_cache();
  }
}

void Decoder::learn_vocab(int64_t vocab) {
  // Note [Token ids are checked on the host].
  check_token_ids_fit(options_, vocab);
  vocab_ = vocab;
  const auto inside = [&](int64_t id) { return id >= 0 && id < vocab; };
  filler_token_ = options_.pad_token_id && inside(*options_.pad_token_id) ? *options_.pad_token_id : 0;
  std::vector<int64_t> outside;
  for (int64_t id : options_.eos_token_ids) {
    if (!inside(id)) outside.push_back(id);
  }
  if (!outside.empty()) {
    TORCH_WARN("graphed.Decoder: end-of-sequence token ", c10::Join(", ", outside),
               " lies outside the model's vocabulary of ", vocab, " tokens, so it never ends "
               "a row (as in transformers, which only warns). Set the model's (or the call's) "
               "eos_token_id to a token below ", vocab, " for rows to finish early.");
  }
}

void Decoder::check_prompt_ids(const at::Tensor& input_ids) const {
  if (!vocab_ || input_ids.numel() == 0) {
    return;
  }
  // One read per request: Note [Token ids are checked on the host].
  const auto [low, high] = at::aminmax(input_ids);
  const at::Tensor range = at::stack({low, high}).to(at::kCPU);
  const int64_t lowest = range[0].item<int64_t>();
  const int64_t highest = range[1].item<int64_t>();
  GRAPHED_CHECK(lowest >= 0 && highest < *vocab_, "Expected prompt token ids in [0, ", *vocab_,
                ") (the model's vocabulary), got ids from ", lowest, " to ", highest,
                ". An id outside it indexes past the model's embedding: a device-side assert "
                "that would kill the process. Tokenize with the model's tokenizer, or check "
                "the ids (left padding included) before generating.");
}

void Decoder::select(const at::Tensor& logits, DecodeState& state) {
  if (!vocab_) {
    learn_vocab(logits.size(-1));  // from an eager run, never from a capture
  }
  if (!options_.eos_token_ids.empty() && !state_.eos_threshold.defined()) {
    // The vocabulary is known from the first logits, which come from an eager
    // run (a warm-up or an eager prefill), never from a capture.
    suppress_eos_until(state_, eos_, logits.size(-1), threshold_min_new_);
  }
  state.eos_threshold = state_.eos_threshold;
  // Finished rows emit the pad token, or token 0 when it lies outside the
  // vocabulary: then only rows padding the batch ever finish (no eos id can
  // end a real one, check_token_ids_fit), and the model reads what they emit.
  const std::optional<int64_t> pad =
      options_.pad_token_id ? std::optional<int64_t>(filler_token_) : std::nullopt;
  (void)select_next_tokens(logits, state, options_.sampling, eos_, pad);
}

void Decoder::decode_step(const DecodeInputs& inputs, DecodeState& state) {
  // The chosen token lands in inputs.input_ids and the positions advance with
  // the step counter (Note [Fewer kernels per token]).
  select(step_(inputs), state);
}

void Decoder::run_step(Bucket& bucket) {
  if (options_.use_graphs) {
    const NvtxRange range(bucket.replay_range);
    bucket.graph.replay();
  } else {
    DecodeState state = state_for(bucket.batch);
    decode_step(inputs_for(bucket.batch), state);
  }
  ++bucket.report.replays;
}

void Decoder::capture_bucket(Bucket& bucket) {
  const int64_t batch = bucket.batch;
  const auto started = std::chrono::steady_clock::now();
  // Values that keep warm-up in range: an empty cache, every row attending.
  inputs_.input_ids.zero_();
  state_.counters.zero_();  // step, generated, positions
  inputs_.attention_mask.fill_(1);
  state_.finished.fill_(false);
  state_.done.fill_(false);
  reset_cache();

  const DecodeInputs inputs = inputs_for(batch);
  DecodeState state = state_for(batch);
  const auto body = [&] { decode_step(inputs, state); };
  const std::string subject = c10::str("decode batch ", batch);
  bucket.replay_range = nvtx_range_name(NvtxPhase::kReplay, subject);
  const int64_t pool_before = pool_ ? pool_memory(*pool_, device_.index()).reserved_bytes : 0;
  const StateSnapshot random_state = StateSnapshot::take({}, device_);
  try {
    const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device_.index());
    const c10::cuda::CUDAStream stream = capture_stream(device_.index());
    {
      // Warm up on the stream that will capture: Note [One capture stream per device].
      stream_wait(stream.stream(), caller.stream());
      c10::cuda::CUDAStreamGuard on_capture_stream(stream);
      const NvtxRange range(NvtxPhase::kWarmup, subject);
      for (int i = 0; i < options_.warmup_iters; ++i) {
        body();
      }
      stream_wait(caller.stream(), stream.stream());
    }
    bucket.report.warmup_ms = elapsed_ms(started);
    state_.counters.zero_();
    reset_cache();
    GraphCaptureOptions graph_options;
    graph_options.pool = pool_;
    graph_options.error_mode = options_.error_mode;
    graph_options.description = c10::str("the decode step for batch bucket ", batch);
    Graph graph;
    {
      const NvtxRange range(NvtxPhase::kCapture, subject);
      graph.capture(body, graph_options);
    }
    bucket.graph = std::move(graph);
  } catch (...) {
    random_state.restore();
    reset_cache();
    throw;
  }
  random_state.restore();
  reset_cache();
  if (!pool_) {
    pool_ = bucket.graph.pool();
  }
  bucket.report.captured = true;
  bucket.report.graph_bytes =
      std::max<int64_t>(0, pool_memory(*pool_, device_.index()).reserved_bytes - pool_before);
  bucket.report.kernels = bucket.graph.stats().kernels;
  bucket.report.capture_ms = elapsed_ms(started);
}

void Decoder::evict_over_budget(const std::vector<uint64_t>& keep) {
  const auto kept = [&](uint64_t id) {
    return std::find(keep.begin(), keep.end(), id) != keep.end();
  };
  // DecoderOptions::prefill_graphs: the least recently used prefill graphs
  // beyond it go first (one unit each in an LruBudget of that many).
  LruBudget count(std::max<int64_t>(options_.prefill_graphs, 1));
  std::vector<std::pair<uint64_t, Prefill*>> prefills_by_age;
  for (auto& [key, prefill] : prefills_) {
    if (prefill->graph.is_captured()) {
      prefills_by_age.emplace_back(prefill->last_used, prefill.get());
    }
  }
  std::sort(prefills_by_age.begin(), prefills_by_age.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::map<uint64_t, Prefill*> prefill_by_id;
  for (const auto& [age, prefill] : prefills_by_age) {
    count.add(prefill->id, 1);
    prefill_by_id[prefill->id] = prefill;
  }
  const auto evict_prefill = [&](uint64_t id) {
    Prefill& evicted = *prefill_by_id.at(id);
    evicted.graph = Graph();
    evicted.report.captured = false;
    ++evicted.report.evictions;
  };
  for (uint64_t id : count.over_budget()) {
    if (!kept(id)) {
      evict_prefill(id);
    }
  }
  if (!options_.memory_budget_bytes) {
    return;
  }
  // Note [Decode graphs share one pool]: decode buckets and prefills share
  // the byte budget, least recently used first.
  LruBudget budget(options_.memory_budget_bytes);
  std::vector<std::pair<uint64_t, uint64_t>> by_age;  // last_used, id
  for (auto& [size, bucket] : graphs_) {
    if (bucket->graph.is_captured()) {
      by_age.emplace_back(bucket->last_used, static_cast<uint64_t>(bucket->batch));
    }
  }
  for (const auto& [age, prefill] : prefills_by_age) {
    if (prefill->graph.is_captured()) {
      by_age.emplace_back(prefill->last_used, prefill->id);
    }
  }
  std::sort(by_age.begin(), by_age.end());
  for (const auto& [age, id] : by_age) {
    // A graph that fit in memory the pool already held still counts a byte:
    // a budget below every graph keeps only the graphs in use.
    const int64_t bytes = id >= kPrefillIds ? prefill_by_id.at(id)->report.graph_bytes
                                            : graphs_.at(static_cast<int64_t>(id))->report.graph_bytes;
    budget.add(id, std::max<int64_t>(bytes, 1));
  }
  for (uint64_t id : budget.over_budget()) {
    if (kept(id)) {
      continue;
    }
    if (id >= kPrefillIds) {
      evict_prefill(id);
    } else {
      Bucket& evicted = *graphs_.at(static_cast<int64_t>(id));
      evicted.graph = Graph();
      evicted.report.captured = false;
      ++evicted.report.evictions;
    }
  }
}

void Decoder::ensure_captured(Bucket& bucket) {
  bucket.last_used = ++clock_;
  if (!options_.use_graphs || bucket.graph.is_captured()) {
    return;
  }
  capture_bucket(bucket);
  evict_over_budget({static_cast<uint64_t>(bucket.batch)});
}

void Decoder::capture_all(const BucketCaptured& on_captured) {
  if (!options_.use_graphs) {
    return;
  }
  c10::cuda::CUDAGuard guard(device_);
  // Largest first, so that smaller graphs reuse the largest one's memory.
  size_t done = 0;
  for (auto it = graphs_.rbegin(); it != graphs_.rend(); ++it) {
    ensure_captured(*it->second);
    if (on_captured) {
      on_captured(it->second->batch, ++done, graphs_.size());
    }
  }
}

Decoder::Prefill& Decoder::prefill_for(int64_t rows, int64_t prompt_len, bool padded) {
  const PrefillKey key{rows, prompt_len, padded};
  auto found = prefills_.find(key);
  if (found == prefills_.end()) {
    if (prefills_.size() >= kMaxPrefillShapes) {
      // Forget the least recently used shape that holds no graph (and its row
      // of the memory report, if it had one).
      auto oldest = prefills_.end();
      for (auto it = prefills_.begin(); it != prefills_.end(); ++it) {
        if (!it->second->graph.is_captured() &&
            (oldest == prefills_.end() || it->second->last_used < oldest->second->last_used)) {
          oldest = it;
        }
      }
      if (oldest != prefills_.end()) {
        prefills_.erase(oldest);
      }
    }
    const auto longs = at::TensorOptions().dtype(at::kLong).device(device_);
    auto prefill = std::make_unique<Prefill>();
    prefill->id = kPrefillIds + next_prefill_id_++;
    prefill->ids = at::zeros({rows, prompt_len}, longs);
    if (padded) {
      prefill->mask = at::ones({rows, prompt_len}, longs);
    } else {
      prefill->positions = prompt_positions(at::ones({rows, prompt_len}, longs));
    }
    prefill->report.kind = GraphKind::kPrefill;
    prefill->report.batch = rows;
    prefill->report.prompt_len = prompt_len;
    prefill->report.padded = padded;
    found = prefills_.emplace(key, std::move(prefill)).first;
  }
  return *found->second;
}

void Decoder::prefill_body(Prefill& prefill) {
  // Note [The decode loop]: everything a request needs before its first
  // decode step, in one graph once the shape is captured.
  const int64_t rows = prefill.report.batch;
  const int64_t prompt_len = prefill.report.prompt_len;
  reset_cache();
  const at::Tensor positions = prefill.mask.defined() ? prompt_positions(prefill.mask)
                                                      : prefill.positions;
  const at::Tensor logits = prefill_(prefill.ids, prefill.mask, positions);
  // The request's rows attend to their prompt and everything after it; rows
  // padding the batch up to the bucket attend everywhere, start finished and
  // are cut off.
  at::Tensor mask = inputs_.attention_mask.narrow(0, 0, rows);
  mask.fill_(1);
  if (prefill.mask.defined()) {
    mask.narrow(1, 0, prompt_len).copy_(prefill.mask);
  }
  DecodeState state = state_for(rows);
  state.counters.narrow(0, 0, 2).zero_();  // step, generated
  // The selection advances the positions with the step: start at the prompt's last.
  inputs_.position_ids.narrow(0, 0, rows).copy_(positions.narrow(1, prompt_len - 1, 1));
  if (!options_.eos_token_ids.empty()) {
    at::ge_out(state.finished, row_index_.narrow(0, 0, rows), live_rows_);
    state_.done.zero_();
  }
  select(logits, state);
}

bool Decoder::capture_prefill(Prefill& prefill, const Bucket& bucket) {
  const auto started = std::chrono::steady_clock::now();
  const int64_t pool_before = pool_ ? pool_memory(*pool_, device_.index()).reserved_bytes : 0;
  const StateSnapshot random_state = StateSnapshot::take({}, device_);
  const auto body = [&] { prefill_body(prefill); };
  try {
    const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device_.index());
    const c10::cuda::CUDAStream stream = capture_stream(device_.index());
    {
      // One warm-up on the stream that will capture, as for decode steps; the
      // eager prefills before ran on the caller's stream.
      // See Note [One capture stream per device].
      stream_wait(stream.stream(), caller.stream());
      c10::cuda::CUDAStreamGuard on_capture_stream(stream);
      body();
      stream_wait(caller.stream(), stream.stream());
    }
    prefill.report.warmup_ms = elapsed_ms(started);
    GraphCaptureOptions graph_options;
    graph_options.pool = pool_;
    graph_options.error_mode = options_.error_mode;
    graph_options.description = c10::str("the prefill for batch bucket ", prefill.report.batch,
                                         " and prompt length ", prefill.report.prompt_len);
    Graph graph;
    graph.capture(body, graph_options);
    prefill.graph = std::move(graph);
  } catch (const CaptureError& error) {
    // A prefill that cannot be captured still runs eagerly, as before graphs
    // of prefills existed; say why once, and stop trying.
    random_state.restore();
    prefill_graphs_broken_ = true;
    TORCH_WARN("graphed.Decoder: the prefill could not be captured, so prefills run eagerly "
               "from now on (decode steps are still graphs). Expected a capturable prefill "
               "function (no host reads of device values); found: ", error.what_without_backtrace(),
               " Fix the prefill, or pass prefill_graphs=0 to keep prefills eager without "
               "this warning.");
    return false;
  } catch (...) {
    random_state.restore();
    throw;
  }
  random_state.restore();
  if (!pool_) {
    pool_ = prefill.graph.pool();
  }
  prefill.ever_captured = true;
  prefill.report.captured = true;
  prefill.report.graph_bytes =
      std::max<int64_t>(0, pool_memory(*pool_, device_.index()).reserved_bytes - pool_before);
  prefill.report.kernels = prefill.graph.stats().kernels;
  prefill.report.capture_ms = elapsed_ms(started);
  evict_over_budget({prefill.id, static_cast<uint64_t>(bucket.batch)});
  return true;
}

void Decoder::run_prefill(Prefill& prefill, const Bucket& bucket) {
  prefill.last_used = ++clock_;
  ++prefill.runs;
  const bool graphs = options_.use_graphs && options_.prefill_graphs > 0 && !prefill_graphs_broken_;
  if (graphs && !prefill.graph.is_captured() && prefill.runs > options_.warmup_iters) {
    (void)capture_prefill(prefill, bucket);
  }
  if (prefill.graph.is_captured()) {
    prefill.graph.replay();
    ++prefill.report.replays;
  } else {
    prefill_body(prefill);
  }
}

DecodeResult Decoder::generate(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                               int64_t max_new_tokens, int64_t min_new_tokens,
                               const TokenCallback& callback) {
  GRAPHED_CHECK(input_ids.dim() == 2, "Expected input_ids [batch, prompt_len], got ",
                input_ids.dim(), " dimensions ", input_ids.sizes(), ".");
  GRAPHED_CHECK(input_ids.device() == device_, "Expected input_ids on ", device_,
                " (the decoder's device), got ", input_ids.device(), ". Move them with .to(",
                device_, ").");
  GRAPHED_CHECK(!attention_mask.defined() || attention_mask.sizes() == input_ids.sizes(),
                "Expected an attention_mask of input_ids' shape ", input_ids.sizes(), ", got ",
                attention_mask.sizes(), ".");
  const int64_t batch = input_ids.size(0);
  const int64_t prompt_len = input_ids.size(1);
  check_request(batch, prompt_len, max_new_tokens, min_new_tokens);
  std::optional<c10::cuda::CUDAGuard> guard;
  if (device_.is_cuda()) {
    guard.emplace(device_);
  }
  check_prompt_ids(input_ids);
  Bucket& bucket = this->bucket(batch);
  ensure_captured(bucket);
  const int64_t rows = bucket.batch;

  // Note [The decode loop]: whether any row has left padding picks the
  // prefill's attention path, so it is part of the prefill's shape. One read
  // of the mask, free when it is on the CPU.
  const bool padded = attention_mask.defined() && !attention_mask.ne(0).all().item<bool>();
  Prefill& prefill = prefill_for(rows, prompt_len, padded);
  prefill.ids.narrow(0, 0, batch).copy_(input_ids);
  if (padded) {
    prefill.mask.narrow(0, 0, batch).copy_(attention_mask);
  }
  if (batch < rows) {
    prefill.ids.narrow(0, batch, rows - batch).fill_(filler_token_);
    if (padded) {
      prefill.mask.narrow(0, batch, rows - batch).fill_(1);
    }
  }
  if (!options_.eos_token_ids.empty()) {
    // Device values the prefill reads, written only when they change.
    if (live_rows_value_ != batch) {
      live_rows_.fill_(batch);
      live_rows_value_ = batch;
    }
    if (threshold_min_new_ != min_new_tokens) {
      threshold_min_new_ = min_new_tokens;
      if (state_.eos_threshold.defined()) {
        suppress_eos_until(state_, eos_, state_.eos_threshold.numel(), min_new_tokens);
      }
    }
  }
  run_prefill(prefill, bucket);

  const at::Tensor last_tokens = inputs_.input_ids.narrow(0, 0, batch).select(1, 0);
  int64_t steps = 1;
  bool done = false;
  if (callback) {
    callback(last_tokens.cpu());
    done = state_.done.item<bool>();
  }
  // Note [The decode loop]: rows finish only on an end-of-sequence token at
  // or after min_new_tokens; until then there is no flag worth reading.
  const bool can_finish = !options_.eos_token_ids.empty();
  done_copy_pending_ = false;  // the last request ended with a synchronising read
  while (!done && steps < max_new_tokens) {
    run_step(bucket);
    ++steps;
    if (callback) {
      callback(last_tokens.cpu());
      done = state_.done.item<bool>();
    } else if (can_finish && steps >= min_new_tokens && steps % options_.check_every == 0) {
      done = poll_done();
    }
  }
  DecodeResult result;
  const int64_t generated = state_.generated.item<int64_t>();
  result.tokens = state_.tokens.narrow(0, 0, batch).narrow(1, 0, generated).clone();
  result.steps = steps;
  result.bucket = rows;
  return result;
}

bool Decoder::poll_done() {
  if (!done_copied_) {
    return state_.done.item<bool>();  // eager decoding on the CPU: a read costs nothing
  }
  // Note [The decode loop]: read the copy only once it has landed; start the
  // next copy only after reading the last, so done_host_ is never overwritten
  // while being read.
  if (done_copy_pending_) {
    if (!done_copied_->query()) {
      return false;
    }
    done_copy_pending_ = false;
    if (done_host_.item<bool>()) {
      return true;
    }
  }
  done_host_.copy_(state_.done, /*non_blocking=*/true);
  done_copied_->record(c10::cuda::getCurrentCUDAStream(device_.index()).stream());
  done_copy_pending_ = true;
  return false;
}

std::vector<BucketReport> Decoder::memory_report() const {
  std::vector<BucketReport> report;
  for (const auto& [size, bucket] : graphs_) {
    report.push_back(bucket->report);
  }
  for (const auto& [key, prefill] : prefills_) {
    if (prefill->ever_captured) {
      report.push_back(prefill->report);
    }
  }
  return report;
}

int64_t Decoder::pool_bytes() const {
  return pool_ ? pool_memory(*pool_, device_.index()).reserved_bytes : 0;
}

}  // namespace graphed
