#pragma once

/// \file request_scheduler.h
/// graphed::RequestScheduler: continuous batching on a Decoder's decode
/// graphs. Each row of the decode buffers is a slot that holds one request;
/// a request whose row finished frees its slot, and a waiting request is
/// prefilled into a free slot between two decode steps, while the other rows
/// keep decoding. graphed.generate_batch and graphed.Decoder.submit/run adapt
/// Hugging Face models to it (python/graphed/serving.py).

#include "graphed/cuda_handles.h"
#include "graphed/decoder.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <vector>

namespace graphed {

/// Runs one request's prompt through the model into row `slot` of the
/// caller's cache and returns the last position's logits, [1, vocab] or
/// [1, 1, vocab]. `input_ids` is [1, prompt_len] int64 on the decoder's
/// device. It must overwrite the row's positions [0, prompt_len) (and, for
/// state-space layers, the row's states) and leave every other row alone.
/// Runs eagerly between two decode steps (Note [Continuous batching on
/// graphs]).
using SlotPrefill = std::function<at::Tensor(const at::Tensor& input_ids, int64_t slot)>;

/// What a RequestScheduler is built with.
struct SchedulerOptions {
  /// Decode steps launched between two looks at the device (>= 1): the
  /// tokens of each such chunk travel to the host in one asynchronous copy,
  /// so an end-of-sequence token is seen at most a chunk or two late (those
  /// steps of its row are wasted, never returned). Chunks end earlier where a
  /// request's budget ends, so a slot freed by its budget is refilled at once.
  int64_t chunk_steps = 8;
  /// Tokens that end a request (kept as its last token). Checked on the host
  /// in the copied tokens; the Decoder itself is built without them.
  std::vector<int64_t> eos_token_ids;
  /// Chunks whose copies may be in flight at once (>= 1). When all are, the
  /// host waits for the oldest: the GPU then runs at most this many chunks
  /// ahead of the host's view of it.
  int64_t copies_in_flight = 3;
  /// Waiting requests prefilled per round at most (>= 0; 0: as many as there
  /// are free slots). A limit starts decoding sooner when many requests
  /// arrive at once, so that the GPU runs decode steps while the host
  /// launches the next prefills; the tokens are the same either way.
  int64_t prefills_per_round = 0;
};

/// One finished request.
struct FinishedRequest {
  /// The id submit() returned.
  int64_t id = 0;
  /// Its new tokens (the prompt excluded), ending at its first
  /// end-of-sequence token or after max_new_tokens tokens.
  std::vector<int64_t> tokens;
  /// True when it ended on an end-of-sequence token.
  bool hit_eos = false;
};

/// Called with a request's id and the tokens it produced since the last
/// call, on the host, once per chunk (Note [Continuous batching on
/// graphs]); `finished` on its last call. It may call submit().
using RequestTokensCallback =
    std::function<void(int64_t id, const std::vector<int64_t>& tokens, bool finished)>;

/// Counters of a RequestScheduler, for measuring it.
struct SchedulerStats {
  /// Requests submitted.
  int64_t submitted = 0;
  /// Requests finished.
  int64_t finished = 0;
  /// Prefills run (one per request).
  int64_t prefills = 0;
  /// The host's wall time in those prefills, in milliseconds.
  double prefill_ms = 0.0;
  /// Decode steps (graph replays).
  int64_t decode_steps = 0;
  /// Chunks of decode steps, each with one copy of its tokens to the host.
  int64_t chunks = 0;
  /// Rows of those steps that decoded a request within its budget.
  int64_t live_row_steps = 0;
  /// All rows of those steps (bucket rows per step): live_row_steps /
  /// row_steps is the batch's occupancy.
  int64_t row_steps = 0;
  /// Times the host waited for a copy because all copies_in_flight were.
  int64_t host_waits = 0;
};

/// Continuous batching on the decode graphs of a Decoder.
///
/// Note [Continuous batching on graphs]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// A slot is one row of the Decoder's buffers and of the caller's cache: the
/// decode graph of a bucket runs rows [0, bucket), each row one request at
/// its own position. What makes that one graph serve rows of different
/// lengths is that every per-row value is device data the graph reads:
/// - Positions. Each row's position is its entry of the Decoder's position
///   counters, set by the host when the row's request is prefilled (the
///   prompt length) and advanced by the graph's one add per step, as for a
///   single request. The caller's decode step writes each row's key and
///   value at its row's position and masks every position after it
///   (Hugging Face adapter: python/graphed/serving.py), so one row's stale
///   keys from an earlier request are never read. State-space layers need
///   nothing of this: each row is its own state, overwritten by its prefill.
/// - Free slots. A row without a request still runs (its results are
///   dropped); the host knows its position and puts it back to 0 before it
///   could leave the cache. Requests take the lowest free slot, so the live
///   rows stay low and the bucket shrinks (the smallest bucket holding the
///   highest live slot) as the queue drains.
/// - Prefill. A new request is prefilled alone into its slot, eagerly,
///   between two chunks of decode steps, at its exact prompt length: its
///   keys (or states) overwrite its row from position 0, the first token is
///   chosen by the Decoder's selection on that row (it becomes the row's next
///   input), and the position set. Other rows are untouched. Per request,
///   because an exact-length prefill is the model's own computation (greedy
///   tokens equal to model.generate for that request alone), while a batched
///   prefill of arrivals would pad them to one length (another attention
///   path, other last bits); eager, because the slot is a host value and
///   prompt lengths rarely repeat, so a graph per (slot, length) would be
///   captured and never replayed. Its cost is in SchedulerStats::prefill_ms;
///   the host launches it while the GPU still runs the decode steps queued
///   before it.
/// - Finished rows. A request ends after max_new_tokens tokens, which the
///   host counts itself (every step gives every live row one token), or on
///   an end-of-sequence token. The first needs no read: a chunk ends where a
///   budget ends, and that slot is refilled before the next chunk. The second
///   is seen in the chunk's tokens, which are copied to pinned memory behind
///   an event and read only once the event has passed (as the Decoder reads
///   its done flag, Note [The decode loop]): the host never waits for the
///   GPU while fewer than copies_in_flight chunks are unread. So the decode
///   graphs carry no finished-row bookkeeping at all (the Decoder is built
///   without end-of-sequence tokens: 3 kernels of token selection per step,
///   Note [Fewer kernels per token]); a row that ended on one keeps decoding
///   until the host sees it, and those tokens are dropped.
/// - Graphs are all captured before the first request (capture writes into
///   the cache and the counters); a memory budget, which could evict and
///   recapture one while rows are live, is refused.
class RequestScheduler {
 public:
  /// Serves requests on `decoder`'s decode graphs (captured here, before any
  /// request). `decoder` must outlive the scheduler, be built without
  /// end-of-sequence tokens and without a memory budget, and be used by
  /// nothing else meanwhile: the scheduler owns its buffers' rows.
  RequestScheduler(Decoder& decoder, SlotPrefill prefill, SchedulerOptions options);
  ~RequestScheduler();
  RequestScheduler(const RequestScheduler&) = delete;
  RequestScheduler& operator=(const RequestScheduler&) = delete;

  /// Queues a request: `prompt` 1-D int64 token ids (any device), at most
  /// `max_new_tokens` new tokens. Checks it against the decoder's limits
  /// and vocabulary now. Returns its id (0, 1, ... in submission order).
  int64_t submit(const at::Tensor& prompt, int64_t max_new_tokens);

  /// One round: reads the copies that have landed, prefills waiting requests
  /// into free slots, launches one chunk of decode steps and its copy.
  /// Returns the requests that finished in it.
  std::vector<FinishedRequest> step(const RequestTokensCallback& callback = {});

  /// Runs rounds until every submitted request (also those submitted from
  /// `callback`) finished; returns them in the order they finished.
  std::vector<FinishedRequest> run(const RequestTokensCallback& callback = {});

  /// True when no request is waiting, decoding or in flight to the host.
  bool idle() const;
  /// Requests waiting for a slot.
  int64_t waiting() const { return static_cast<int64_t>(queue_.size()); }
  /// See SchedulerStats.
  const SchedulerStats& stats() const { return stats_; }
  /// Slots: the decoder's max_batch.
  int64_t slots() const;

 private:
  struct Request;
  struct Slot;
  struct Segment;
  struct Chunk;
  void prefill_into(int64_t slot, Request& request);
  void launch_chunk(std::vector<Segment> segments);
  void read_chunk(Chunk& chunk, std::vector<FinishedRequest>& out,
                  const RequestTokensCallback& callback);
  void read_landed(bool wait_for_oldest, std::vector<FinishedRequest>& out,
                   const RequestTokensCallback& callback);
  void finish(Request& request, bool hit_eos, std::vector<FinishedRequest>& out);

  Decoder& decoder_;
  SlotPrefill prefill_;
  SchedulerOptions options_;
  int64_t chunk_steps_ = 1;
  std::vector<Slot> slots_;
  std::map<int64_t, Request> requests_;  // unfinished, by id
  std::deque<int64_t> queue_;            // waiting ids
  std::deque<Chunk> chunks_;             // copies in flight, oldest first
  std::vector<Chunk> spare_;             // pinned buffers to reuse
  at::Tensor chunk_tokens_;              // [max_batch, chunk_steps + 1] on the device
  DecodeState first_token_;              // scratch for one row's first-token selection
  at::Tensor no_eos_;                    // empty int64 on the device
  int64_t next_id_ = 0;
  SchedulerStats stats_;
};

}  // namespace graphed
