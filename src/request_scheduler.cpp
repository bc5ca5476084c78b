// graphed::RequestScheduler: continuous batching on a Decoder's decode graphs
// (Note [Continuous batching on graphs] in include/graphed/request_scheduler.h).
// The slot bookkeeping and the host loop live here; the graphs, buffers and
// token selection are the Decoder's (src/decoder.cpp, src/token_selection.cpp).

#include "graphed/request_scheduler.h"

#include "graphed/check.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <chrono>

namespace graphed {

struct RequestScheduler::Request {
  int64_t id = 0;
  at::Tensor prompt;  // [1, prompt_len] int64 on the decoder's device
  int64_t max_new_tokens = 0;
  std::vector<int64_t> tokens;  // read back so far
};

struct RequestScheduler::Slot {
  int64_t request = -1;  // the id decoding in this row, -1 when free
  int64_t produced = 0;  // tokens of that request chosen so far (host count)
  int64_t position = 0;  // the row's position counter on the device, as the host knows it
};

// Columns [first, first + count) of one row of a chunk's tokens belong to one request.
struct RequestScheduler::Segment {
  int64_t slot = 0;
  int64_t request = 0;
  int64_t first = 0;
  int64_t count = 0;
};

// One chunk's tokens on their way to the host.
struct RequestScheduler::Chunk {
  at::Tensor host;  // [max_batch, chunk_steps + 1] int64, pinned on CUDA devices
  std::optional<CudaEvent> copied;
  std::vector<Segment> segments;
};

namespace {

double elapsed_ms(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since)
      .count();
}

}  // namespace

RequestScheduler::RequestScheduler(Decoder& decoder, SlotPrefill prefill,
                                   SchedulerOptions options)
    : decoder_(decoder), prefill_(std::move(prefill)), options_(std::move(options)) {
  const DecoderOptions& decoding = decoder_.options_;
  GRAPHED_CHECK(prefill_, "Expected a slot prefill function, got none.");
  GRAPHED_CHECK(options_.chunk_steps >= 1, "Expected chunk_steps >= 1 (decode steps between "
                "two looks at the device), got ", options_.chunk_steps, ". 8 is a good value.");
  GRAPHED_CHECK(options_.copies_in_flight >= 1, "Expected copies_in_flight >= 1, got ",
                options_.copies_in_flight, ". 3 is a good value.");
  GRAPHED_CHECK(options_.prefills_per_round >= 0, "Expected prefills_per_round >= 0 (0: "
                "every free slot each round), got ", options_.prefills_per_round, ".");
  GRAPHED_CHECK(decoding.eos_token_ids.empty(), "Expected a Decoder built without "
                "eos_token_ids for continuous batching, got ", c10::Join(", ",
                decoding.eos_token_ids), ": the scheduler ends requests on them itself, on "
                "the host (Note [Continuous batching on graphs]). Pass them in "
                "SchedulerOptions::eos_token_ids instead.");
  GRAPHED_CHECK(!decoding.memory_budget_bytes, "Expected a Decoder without a memory budget "
                "for continuous batching, got ", *decoding.memory_budget_bytes, " bytes: an "
                "evicted decode graph would be recaptured while other rows are mid-request, "
                "and capture writes into their cache rows. Build the decoder without "
                "memory_budget (or with fewer buckets).");
  chunk_steps_ = std::min(options_.chunk_steps, decoding.max_len - 1);
  slots_.resize(static_cast<size_t>(decoding.max_batch));
  std::optional<c10::cuda::CUDAGuard> guard;
  if (decoder_.device_.is_cuda()) {
    guard.emplace(decoder_.device_);
  }
  const auto longs = at::TensorOptions().dtype(at::kLong).device(decoder_.device_);
  chunk_tokens_ = at::zeros({decoding.max_batch, chunk_steps_ + 1}, longs);
  first_token_ = make_decode_state(1, 1, decoder_.device_);
  no_eos_ = at::empty({0}, longs);
  // Note [Continuous batching on graphs]: every graph before the first request.
  decoder_.capture_all();
  decoder_.state_.counters.zero_();
  for (const BucketReport& report : decoder_.memory_report()) {
    GRAPHED_INTERNAL_ASSERT(!decoding.use_graphs || report.kind != GraphKind::kDecode ||
                                report.captured,
                            "decode bucket ", report.batch, " is not captured");
  }
}

RequestScheduler::~RequestScheduler() = default;

int64_t RequestScheduler::submit(const at::Tensor& prompt, int64_t max_new_tokens) {
  GRAPHED_CHECK(prompt.defined() && prompt.dim() == 1, "Expected a prompt as a 1-D tensor of "
                "token ids, got ", prompt.defined() ? c10::str(prompt.dim(), " dimensions ",
                prompt.sizes()) : std::string("an undefined tensor"), ". Pass one request's "
                "ids, e.g. input_ids[0].");
  GRAPHED_CHECK(!at::isFloatingType(prompt.scalar_type()) && prompt.scalar_type() != at::kBool,
                "Expected integer token ids in the prompt, got ", prompt.scalar_type(), ".");
  decoder_.check_request(1, prompt.size(0), max_new_tokens, 0);
  std::optional<c10::cuda::CUDAGuard> guard;
  if (decoder_.device_.is_cuda()) {
    guard.emplace(decoder_.device_);
  }
  decoder_.check_prompt_ids(prompt);  // Note [Token ids are checked on the host]
  Request request;
  request.id = next_id_++;
  request.prompt = prompt.to(decoder_.device_, at::kLong).view({1, -1});
  request.max_new_tokens = max_new_tokens;
  requests_.emplace(request.id, std::move(request));
  queue_.push_back(next_id_ - 1);
  ++stats_.submitted;
  return next_id_ - 1;
}

bool RequestScheduler::idle() const { return requests_.empty(); }

int64_t RequestScheduler::slots() const { return static_cast<int64_t>(slots_.size()); }

void RequestScheduler::prefill_into(int64_t slot, Request& request) {
  const auto started = std::chrono::steady_clock::now();
  const int64_t prompt_len = request.prompt.size(1);
  const at::Tensor logits = prefill_(request.prompt, slot);
  if (!decoder_.vocab_) {
    decoder_.learn_vocab(logits.size(-1));
  }
  // The first token, chosen by the Decoder's selection on this row alone: it
  // lands in the row's next input and in column 0 of its tokens.
  DecodeState row = first_token_;
  row.next = decoder_.state_.next.narrow(0, slot, 1);
  row.tokens = decoder_.state_.tokens.narrow(0, slot, 1);
  row.counters.zero_();
  (void)select_next_tokens(logits, row, decoder_.options_.sampling, no_eos_, std::nullopt);
  // The first decode step feeds that token at position prompt_len.
  decoder_.state_.counters.narrow(0, 2 + slot, 1).fill_(prompt_len);
  Slot& held = slots_[static_cast<size_t>(slot)];
  held.request = request.id;
  held.produced = 1;
  held.position = prompt_len;
  ++stats_.prefills;
  stats_.prefill_ms += elapsed_ms(started);
}

std::vector<FinishedRequest> RequestScheduler::step(const RequestTokensCallback& callback) {
  std::vector<FinishedRequest> out;
  std::optional<c10::cuda::CUDAGuard> guard;
  if (decoder_.device_.is_cuda()) {
    guard.emplace(decoder_.device_);
  }
  read_landed(static_cast<int64_t>(chunks_.size()) >= options_.copies_in_flight, out, callback);

  // Waiting requests into free slots, lowest first; a slot at most once per round
  // (a request done after its first token keeps its column 0 until it is read).
  std::vector<bool> fresh(slots_.size(), false);
  int64_t prefilled = 0;
  for (size_t s = 0; s < slots_.size() && !queue_.empty(); ++s) {
    if (slots_[s].request >= 0) {
      continue;
    }
    if (options_.prefills_per_round > 0 && prefilled++ >= options_.prefills_per_round) {
      break;
    }
    Request& request = requests_.at(queue_.front());
    queue_.pop_front();
    prefill_into(static_cast<int64_t>(s), request);
    fresh[s] = true;
  }

  // The chunk ends where the first budget ends (Note [Continuous batching on graphs]).
  int64_t steps = chunk_steps_;
  int64_t highest = -1;
  for (size_t s = 0; s < slots_.size(); ++s) {
    const Slot& slot = slots_[s];
    if (slot.request < 0) {
      continue;
    }
    const int64_t left = requests_.at(slot.request).max_new_tokens - slot.produced;
    if (left > 0) {
      steps = std::min(steps, left);
      highest = static_cast<int64_t>(s);
    }
  }
  const int64_t rows = highest < 0 ? 0 : decoder_.bucket_for(highest + 1);
  if (highest < 0) {
    steps = 0;
  }
  std::vector<Segment> segments;
  std::vector<bool> decoding(slots_.size(), false);
  for (size_t s = 0; s < slots_.size(); ++s) {
    Slot& slot = slots_[s];
    if (slot.request < 0) {
      continue;
    }
    const int64_t left = requests_.at(slot.request).max_new_tokens - slot.produced;
    const int64_t decoded = std::min(steps, left);
    decoding[s] = decoded > 0;
    const int64_t count = (fresh[s] ? 1 : 0) + decoded;
    if (count > 0) {
      segments.push_back({static_cast<int64_t>(s), slot.request, fresh[s] ? 0 : 1, count});
    }
    slot.produced += decoded;
    if (slot.produced == requests_.at(slot.request).max_new_tokens) {
      slot.request = -1;  // its last tokens are in this chunk
    }
  }
  const int64_t max_len = decoder_.options_.max_len;
  for (int64_t s = 0; s < rows; ++s) {
    Slot& slot = slots_[static_cast<size_t>(s)];
    // A row without a request still runs: keep its position inside the cache.
    if (!decoding[static_cast<size_t>(s)] && slot.position + steps > max_len - 1) {
      decoder_.state_.counters.narrow(0, 2 + s, 1).zero_();
      slot.position = 0;
    }
    slot.position += steps;
  }

  if (segments.empty()) {
    GRAPHED_INTERNAL_ASSERT(!chunks_.empty() || idle(), "requests ", requests_.size(),
                            " are neither waiting, decoding nor in flight");
    read_landed(true, out, callback);
    return out;
  }
  if (steps > 0) {
    Decoder::Bucket& bucket = decoder_.bucket(rows);
    decoder_.state_.step.fill_(1);  // the chunk's tokens go to columns 1..steps
    for (int64_t i = 0; i < steps; ++i) {
      decoder_.run_step(bucket);
    }
    stats_.decode_steps += steps;
    stats_.row_steps += steps * rows;
    for (const Segment& segment : segments) {
      stats_.live_row_steps += segment.count - (segment.first == 0 ? 1 : 0);
    }
  }
  launch_chunk(std::move(segments));
  ++stats_.chunks;
  return out;
}

void RequestScheduler::launch_chunk(std::vector<Segment> segments) {
  int64_t rows = 0;
  for (const Segment& segment : segments) {
    rows = std::max(rows, segment.slot + 1);
  }
  Chunk chunk;
  if (!spare_.empty()) {
    chunk = std::move(spare_.back());
    spare_.pop_back();
  } else {
    const bool cuda = decoder_.device_.is_cuda();
    chunk.host = at::empty(chunk_tokens_.sizes(),
                           at::TensorOptions().dtype(at::kLong).pinned_memory(cuda));
    if (cuda) {
      chunk.copied.emplace();
    }
  }
  chunk.segments = std::move(segments);
  const at::Tensor columns =
      decoder_.state_.tokens.narrow(0, 0, rows).narrow(1, 0, chunk_steps_ + 1);
  if (chunk.copied) {
    // Contiguous on the device first, so that the copy to pinned memory is one
    // asynchronous transfer; read once the event passed.
    at::Tensor staged = chunk_tokens_.narrow(0, 0, rows);
    staged.copy_(columns);
    chunk.host.narrow(0, 0, rows).copy_(staged, /*non_blocking=*/true);
    chunk.copied->record(c10::cuda::getCurrentCUDAStream(decoder_.device_.index()).stream());
  } else {
    chunk.host.narrow(0, 0, rows).copy_(columns);
  }
  chunks_.push_back(std::move(chunk));
}

void RequestScheduler::read_landed(bool wait_for_oldest, std::vector<FinishedRequest>& out,
                                   const RequestTokensCallback& callback) {
  while (!chunks_.empty()) {
    Chunk& chunk = chunks_.front();
    if (chunk.copied && !chunk.copied->query()) {
      if (!wait_for_oldest) {
        return;
      }
      GRAPHED_CHECK_CUDA(cudaEventSynchronize(chunk.copied->get()));
      ++stats_.host_waits;
      wait_for_oldest = false;
    }
    Chunk landed = std::move(chunk);
    chunks_.pop_front();
    read_chunk(landed, out, callback);
    spare_.push_back(std::move(landed));
  }
}

void RequestScheduler::read_chunk(Chunk& chunk, std::vector<FinishedRequest>& out,
                                  const RequestTokensCallback& callback) {
  const at::Tensor host = chunk.host;
  const int64_t* data = host.data_ptr<int64_t>();
  const int64_t stride = host.stride(0);
  const std::vector<int64_t>& eos = options_.eos_token_ids;
  for (const Segment& segment : chunk.segments) {
    auto found = requests_.find(segment.request);
    if (found == requests_.end()) {
      continue;  // ended on an eos token in an earlier chunk: these are dropped
    }
    Request& request = found->second;
    const int64_t* row = data + segment.slot * stride + segment.first;
    std::vector<int64_t> fresh;
    bool hit_eos = false;
    for (int64_t i = 0; i < segment.count && !hit_eos; ++i) {
      fresh.push_back(row[i]);
      hit_eos = std::find(eos.begin(), eos.end(), row[i]) != eos.end();
    }
    request.tokens.insert(request.tokens.end(), fresh.begin(), fresh.end());
    const bool done =
        hit_eos || static_cast<int64_t>(request.tokens.size()) >= request.max_new_tokens;
    if (callback) {
      callback(request.id, fresh, done);
    }
    if (done) {
      finish(request, hit_eos, out);
    }
  }
}

void RequestScheduler::finish(Request& request, bool hit_eos, std::vector<FinishedRequest>& out) {
  for (Slot& slot : slots_) {
    if (slot.request == request.id) {
      slot.request = -1;  // ended on eos while its row still decodes: free it now
    }
  }
  FinishedRequest done;
  done.id = request.id;
  done.tokens = std::move(request.tokens);
  done.hit_eos = hit_eos;
  out.push_back(std::move(done));
  ++stats_.finished;
  requests_.erase(request.id);
}

std::vector<FinishedRequest> RequestScheduler::run(const RequestTokensCallback& callback) {
  std::vector<FinishedRequest> out;
  while (!idle()) {
    std::vector<FinishedRequest> round = step(callback);
    out.insert(out.end(), std::make_move_iterator(round.begin()),
               std::make_move_iterator(round.end()));
  }
  return out;
}

}  // namespace graphed
