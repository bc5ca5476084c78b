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
#include <limits>

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

namespace {

constexpr double kMinusInfinity = -std::numeric_limits<double>::infinity();

double elapsed_ms(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since)
      .count();
}

// True where `values` equals one of `ids`: isin without its sorting path,
// whose unique() may read sizes on the host.
at::Tensor is_any_of(const at::Tensor& values, const at::Tensor& ids) {
  return values.unsqueeze(-1).eq(ids).any(-1);
}

// Hugging Face's TopKLogitsWarper: scores below the k-th largest become -inf.
at::Tensor top_k_filter(const at::Tensor& scores, int64_t top_k, int64_t min_tokens_to_keep) {
  const int64_t k = std::min(std::max(top_k, min_tokens_to_keep), scores.size(-1));
  const at::Tensor kth = std::get<0>(at::topk(scores, k)).narrow(-1, k - 1, 1);
  return scores.masked_fill(scores < kth, kMinusInfinity);
}

// Hugging Face's TopPLogitsWarper, operation for operation.
at::Tensor top_p_filter(const at::Tensor& scores, double top_p, int64_t min_tokens_to_keep) {
  const auto [sorted, indices] = at::sort(scores, /*dim=*/-1, /*descending=*/false);
  const at::Tensor cumulative = sorted.softmax(-1).cumsum(-1);
  at::Tensor remove_sorted = cumulative <= (1.0 - top_p);
  const int64_t vocab = scores.size(-1);
  const int64_t keep = std::min(min_tokens_to_keep, vocab);
  remove_sorted.narrow(-1, vocab - keep, keep).fill_(false);
  const at::Tensor remove = remove_sorted.scatter(1, indices, remove_sorted);
  return scores.masked_fill(remove, kMinusInfinity);
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

at::Tensor prompt_positions(const at::Tensor& attention_mask) {
  GRAPHED_CHECK(attention_mask.dim() == 2, "Expected an attention mask [batch, prompt_len], got ",
                attention_mask.dim(), " dimensions ", attention_mask.sizes(), ".");
  const at::Tensor mask = attention_mask.to(at::kLong);
  return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0);
}

DecodeState make_decode_state(int64_t batch, int64_t capacity, c10::Device device) {
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
  const auto bools = at::TensorOptions().dtype(at::kBool).device(device);
  DecodeState state;
  state.finished = at::zeros({batch}, bools);
  state.tokens = at::zeros({batch, capacity}, longs);
  state.step = at::zeros({1}, longs);
  state.generated = at::zeros({1}, longs);
  state.min_new_tokens = at::zeros({1}, longs);
  state.done = at::zeros({1}, bools);
  return state;
}

at::Tensor select_next_tokens(const at::Tensor& logits, DecodeState& state,
                              const SamplingOptions& sampling, const at::Tensor& eos,
                              std::optional<int64_t> pad_token_id) {
  const at::Tensor last = logits.dim() == 3 ? logits.select(1, -1) : logits;
  GRAPHED_CHECK(last.dim() == 2 && last.size(0) == state.finished.size(0),
                "Expected logits [", state.finished.size(0), ", vocab] or [",
                state.finished.size(0), ", 1, vocab] from the model, got ", logits.sizes(),
                ". The step must return the logits of one position per row.");
  GRAPHED_CHECK(at::isFloatingType(last.scalar_type()), "Expected floating-point logits, got ",
                last.scalar_type(), ".");
  // Hugging Face: outputs.logits[:, -1].to(copy=True, dtype=torch.float32).
  at::Tensor scores = last.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  const bool has_eos = eos.defined() && eos.numel() > 0;
  if (has_eos) {
    // MinNewTokensLengthLogitsProcessor, with its host condition on the device.
    const at::Tensor vocab = at::arange(scores.size(-1), eos.options());
    const at::Tensor suppress = is_any_of(vocab, eos).logical_and(state.step < state.min_new_tokens);
    scores = at::where(suppress, at::scalar_tensor(kMinusInfinity, scores.options()), scores);
  }
  at::Tensor next;
  if (sampling.do_sample) {
    if (sampling.temperature != 1.0) {
      scores = scores / sampling.temperature;
    }
    if (sampling.top_k > 0) {
      scores = top_k_filter(scores, sampling.top_k, sampling.min_tokens_to_keep);
    }
    if (sampling.top_p < 1.0) {
      scores = top_p_filter(scores, sampling.top_p, sampling.min_tokens_to_keep);
    }
    // Note [Sampling inside a graph]: multinomial(probs, 1) without its host checks.
    const at::Tensor probs = at::softmax(scores, -1);
    const at::Tensor draws = at::empty_like(probs).exponential_(1.0);
    next = probs.div(draws).argmax(-1);
  } else {
    next = scores.argmax(-1);
  }
  const at::Tensor some_unfinished = state.finished.logical_not().any().reshape({1});
  if (pad_token_id) {
    next = next.masked_fill(state.finished, *pad_token_id);
  }
  if (has_eos) {
    state.finished.logical_or_(is_any_of(next, eos));
  }
  state.generated.add_(some_unfinished.to(at::kLong));
  state.tokens.index_copy_(1, state.step, next.unsqueeze(1));
  state.step.add_(1);
  state.done.copy_(state.finished.all().reshape({1}));
  return next;
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
  inputs_.input_ids = at::zeros({options_.max_batch, 1}, longs);
  inputs_.position_ids = at::zeros({options_.max_batch, 1}, longs);
  inputs_.attention_mask = at::ones({options_.max_batch, options_.max_len}, longs);
  inputs_.batch = options_.max_batch;
  state_ = make_decode_state(options_.max_batch, options_.max_len, device_);
  eos_ = at::tensor(options_.eos_token_ids, at::TensorOptions().dtype(at::kLong)).to(device_);
  if (device_.is_cuda()) {
    done_host_ = at::zeros({1}, at::TensorOptions().dtype(at::kBool).pinned_memory(true));
    done_copied_.emplace();
  }
  for (int64_t size : buckets_) {
    auto bucket = std::make_unique<Bucket>();
    bucket->batch = size;
    bucket->report.batch = size;
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

void Decoder::decode_step(const DecodeInputs& inputs, DecodeState& state) {
  const at::Tensor next = select_next_tokens(step_(inputs), state, options_.sampling, eos_,
                                             options_.pad_token_id);
  // The chosen token is the next step's input, one position further on.
  inputs.input_ids.copy_(next.unsqueeze(1));
  inputs.position_ids.add_(1);
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
  inputs_.position_ids.zero_();
  inputs_.attention_mask.fill_(1);
  state_.finished.fill_(false);
  state_.step.zero_();
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
    state_.step.zero_();
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

void Decoder::evict_over_budget(int64_t keep) {
  if (!options_.memory_budget_bytes) {
    return;
  }
  LruBudget budget(options_.memory_budget_bytes);
  std::vector<Bucket*> by_age;
  for (auto& [size, bucket] : graphs_) {
    if (bucket->graph.is_captured()) {
      by_age.push_back(bucket.get());
    }
  }
  std::sort(by_age.begin(), by_age.end(),
            [](const Bucket* a, const Bucket* b) { return a->last_used < b->last_used; });
  for (const Bucket* bucket : by_age) {
    // A graph that fit in memory the pool already held still counts a byte:
    // a budget below every graph keeps only the bucket in use.
    budget.add(static_cast<uint64_t>(bucket->batch),
               std::max<int64_t>(bucket->report.graph_bytes, 1));
  }
  for (uint64_t size : budget.over_budget(static_cast<uint64_t>(keep))) {
    Bucket& evicted = *graphs_.at(static_cast<int64_t>(size));
    evicted.graph = Graph();
    evicted.report.captured = false;
    ++evicted.report.evictions;
  }
}

void Decoder::ensure_captured(Bucket& bucket) {
  bucket.last_used = ++clock_;
  if (!options_.use_graphs || bucket.graph.is_captured()) {
    return;
  }
  capture_bucket(bucket);
  evict_over_budget(bucket.batch);
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
  Bucket& bucket = this->bucket(batch);
  ensure_captured(bucket);
  const int64_t rows = bucket.batch;

  const at::Tensor mask = attention_mask.defined() ? attention_mask.to(device_, at::kLong)
                                                   : at::ones_like(input_ids, at::kLong);
  const at::Tensor positions = prompt_positions(mask);
  reset_cache();
  const at::Tensor logits = prefill_(input_ids, mask, positions);

  // The request's rows attend to their prompt and everything after it; rows
  // padding the batch up to the bucket attend everywhere, start finished and
  // are cut off.
  inputs_.attention_mask.narrow(0, 0, rows).fill_(1);
  inputs_.attention_mask.narrow(0, 0, batch).narrow(1, 0, prompt_len).copy_(mask);
  inputs_.position_ids.narrow(0, 0, rows).zero_();
  inputs_.position_ids.narrow(0, 0, batch).copy_(positions.narrow(1, prompt_len - 1, 1) + 1);
  inputs_.input_ids.narrow(0, 0, rows).fill_(options_.pad_token_id.value_or(0));
  state_.finished.narrow(0, 0, rows).fill_(true);
  state_.finished.narrow(0, 0, batch).fill_(false);
  state_.step.zero_();
  state_.generated.zero_();
  state_.min_new_tokens.fill_(min_new_tokens);
  state_.done.fill_(false);

  DecodeState request = state_for(batch);
  const at::Tensor first =
      select_next_tokens(logits, request, options_.sampling, eos_, options_.pad_token_id);
  inputs_.input_ids.narrow(0, 0, batch).copy_(first.unsqueeze(1));

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
  return report;
}

int64_t Decoder::pool_bytes() const {
  return pool_ ? pool_memory(*pool_, device_.index()).reserved_bytes : 0;
}

}  // namespace graphed
