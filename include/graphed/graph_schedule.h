#pragma once

/// \file graph_schedule.h
/// The order in which make_graphed_callables warms up, captures and expects
/// to replay forward and backward graphs, and which graphs may share static
/// input buffers. Pure bookkeeping: no CUDA, testable anywhere.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace graphed {

/// One forward or backward graph of one (callable, microbatch) pair.
struct GraphPass {
  /// A forward graph when true, a backward graph otherwise.
  bool forward = true;
  /// Index of the (callable, microbatch) pair; see GraphSchedule::pair_index.
  size_t pair = 0;
};

/// Which pairs of graphs exist and the order of their passes.
///
/// Note [Pipeline order]
/// ~~~~~~~~~~~~~~~~~~~~~
/// Without an order, every callable gets one forward and one backward graph,
/// and they are captured as they run in a training step: forward 1..N, then
/// backward N..1. All share one pool, which is safe only because replays
/// follow the same order (Invariant 6).
///
/// With an order (Transformer Engine's convention, used by Megatron-LM's
/// pipeline schedules), the callables are split into `num_chunks` model chunks
/// of equal size, `order` lists 1-based chunk ids, +c for the forward of chunk
/// c's next microbatch and -c for the backward of its oldest outstanding one,
/// and each chunk appears `num_microbatches` times with each sign. Every
/// (callable, microbatch) pair gets its own graphs, so several microbatches can
/// be in flight at once; samples are laid out chunk-major, then microbatch,
/// then layer within the chunk, as in Transformer Engine. A chunk's forward
/// runs its layers first to last and its backward last to first. Warm-up and
/// capture follow exactly that order, and calls must follow it too.
class GraphSchedule {
 public:
  /// No pairs.
  GraphSchedule() = default;

  /// Plans the graphs for `num_callables` callables given `num_samples` sample
  /// inputs and an optional pipeline `order` (empty: one microbatch, forwards
  /// in order and backwards reversed). Throws graphed::Error saying what is
  /// inconsistent (counts that do not divide, a chunk whose backward precedes
  /// its forward, ...).
  static GraphSchedule plan(size_t num_callables, size_t num_samples,
                            const std::vector<int64_t>& order);

  /// Number of model chunks (1 without an order).
  size_t num_chunks() const { return num_chunks_; }
  /// Microbatches per chunk in one pass over the order (1 without an order).
  size_t num_microbatches() const { return num_microbatches_; }
  /// Callables per chunk.
  size_t layers_per_chunk() const { return layers_per_chunk_; }
  /// Number of (callable, microbatch) pairs, which equals the number of samples.
  size_t num_pairs() const { return num_chunks_ * num_microbatches_ * layers_per_chunk_; }

  /// The pair of `callable` for `microbatch`; also the index of its sample.
  size_t pair_index(size_t callable, size_t microbatch) const;
  /// The callable of a pair.
  size_t callable_of(size_t pair) const;
  /// The microbatch of a pair.
  size_t microbatch_of(size_t pair) const;

  /// Every forward and backward pass, in capture (and replay) order.
  const std::vector<GraphPass>& passes() const { return passes_; }
  /// Position in passes() of a pair's forward pass.
  size_t forward_position(size_t pair) const { return forward_position_.at(pair); }
  /// Position in passes() of a pair's backward pass.
  size_t backward_position(size_t pair) const { return backward_position_.at(pair); }

  /// For each pair, the earlier pair whose static input buffers it can take
  /// over, or nullopt. A pair's inputs are live from its forward to its
  /// backward; `keys[p]` describes pair p's inputs (equal keys: buffers of the
  /// same shapes, dtypes and devices). A buffer set passes to the first later
  /// pair with an equal key whose forward comes after the owner's backward.
  std::vector<std::optional<size_t>> shared_inputs(const std::vector<std::string>& keys) const;

 private:
  size_t num_chunks_ = 0;
  size_t num_microbatches_ = 0;
  size_t layers_per_chunk_ = 0;
  std::vector<GraphPass> passes_;
  std::vector<size_t> forward_position_;
  std::vector<size_t> backward_position_;
};

}  // namespace graphed
