#pragma once

/// \file static_io.h
/// The fixed memory a graph reads from and writes to. A graph replays with the
/// addresses it was captured with, so inputs live in static buffers that each
/// call refreshes (Invariant 2 in DESIGN.md: a replay computes on the current
/// input values), and outputs are the tensors the capture produced.

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <vector>

namespace graphed {

/// Calls `visit` on every tensor in `value`, depth-first; dict entries in
/// insertion order (the order Signature numbers tensors in).
void for_each_tensor(const c10::IValue& value, const std::function<void(const at::Tensor&)>& visit);

/// A copy of `value` with every container rebuilt and every tensor replaced by
/// `replace(tensor)`, in the same order as for_each_tensor.
c10::IValue map_tensors(const c10::IValue& value,
                        const std::function<at::Tensor(const at::Tensor&)>& replace);

/// The tensors of `value`, in for_each_tensor order.
std::vector<at::Tensor> flatten_tensors(const c10::IValue& value);

/// Note [Inputs that alias other static buffers]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// A call copies its input tensors into the static buffers one by one. When
/// an input is (or is a view of) the static buffer of another input, e.g. a
/// function returning its inputs swapped, `h, c = fast(*fast(h, c))`, or a
/// caller reusing `static_inputs[0]` as the second argument, an earlier copy
/// can overwrite it before it is read, and the graph computes on the wrong
/// value. Such inputs are therefore cloned first, before any copy, which
/// keeps the value they had when the call was made, as eager execution
/// would see it. An input that is its own buffer is not copied at all.
/// Finding them compares storage addresses, a few loads per input pair.

/// True when one of `tensors` shares storage with a buffer other than
/// `buffers[i]` (same index): see Note [Inputs that alias other static buffers].
bool any_cross_alias(const std::vector<at::Tensor>& tensors,
                     const std::vector<at::Tensor>& buffers);

/// Replaces each of `tensors` that shares storage with a buffer other than
/// `buffers[i]` (same index) by a clone; enqueued on the current stream.
/// See Note [Inputs that alias other static buffers]. Returns how many it
/// cloned.
size_t clone_cross_aliases(std::vector<at::Tensor>& tensors,
                           const std::vector<at::Tensor>& buffers);

/// A contiguous view of the first `like.numel()` elements of `arena`, shaped
/// like `like`, when `like` fits there: same dtype and device, `arena`
/// contiguous, no more elements, and `like` not in `arena`'s storage.
/// Undefined otherwise. Graphs of one module at several buckets keep their
/// buffers in the fronts of the largest one's (Note [Bucket graphs share
/// their buffers] in src/graph_manager_buckets.cpp).
at::Tensor arena_front(const at::Tensor& arena, const at::Tensor& like);

/// Static input buffers: one per tensor of the sample inputs.
///
/// Note [Static input buffers]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// The buffers are copies of the sample tensors, never the samples themselves:
/// refreshing a buffer must not overwrite a tensor the caller still owns. A
/// call that passes a buffer itself (see buffers()) skips its copy, so a
/// caller that writes inputs in place pays nothing. If the function writes to
/// an input (an in-place op on an argument), warm-up sees the buffer's version
/// counter move; every replay then copies that buffer back into the caller's
/// tensor, as eager execution would have modified it.
class StaticInputs {
 public:
  /// No buffers.
  StaticInputs() = default;
  /// Allocates a buffer for each tensor of `sample` (same sizes, dtype,
  /// device and memory format) holding the sample's values. Where
  /// `arenas[i]` (signature order) is given and the i-th tensor fits there
  /// (arena_front), its buffer is that front instead of new memory.
  explicit StaticInputs(const std::vector<c10::IValue>& sample,
                        const std::vector<at::Tensor>& arenas = {});

  /// The sample with each tensor replaced by its buffer: what the captured
  /// function is called with during warm-up and capture.
  const std::vector<c10::IValue>& tree() const { return tree_; }
  /// The buffers, in signature order.
  const std::vector<at::Tensor>& buffers() const { return buffers_; }

  /// Copies each of `tensors` into its buffer, skipping tensors that are the
  /// buffer itself; enqueued on the current stream. Tensors that alias
  /// another input's buffer are read before any buffer is written (Note
  /// [Inputs that alias other static buffers]). Returns how many it copied.
  size_t load(const std::vector<at::Tensor>& tensors);

  /// Starts watching the buffers for writes by the function.
  void start_mutation_watch();
  /// Marks the buffers written since start_mutation_watch() as mutated inputs.
  void finish_mutation_watch();
  /// Indices of the buffers the function writes.
  const std::vector<size_t>& mutated() const { return mutated_; }
  /// Copies each mutated buffer back into the caller's tensor (unless the
  /// caller passed the buffer itself); enqueued on the current stream.
  void store_back(const std::vector<at::Tensor>& tensors) const;

 private:
  std::vector<c10::IValue> tree_;
  std::vector<at::Tensor> buffers_;
  std::vector<int64_t> versions_;
  std::vector<size_t> mutated_;
};

/// The outputs of a capture: the tensors the graph writes on every replay.
/// Their values are valid until the next replay of the same graph
/// (Invariant 3); materialize(true) returns clones that stay valid.
class StaticOutputs {
 public:
  /// No outputs.
  StaticOutputs() = default;
  /// Takes the value the captured function returned during capture.
  explicit StaticOutputs(c10::IValue captured);

  /// The outputs as a fresh value tree: the static tensors themselves, or
  /// clones of them when `clone` is true.
  c10::IValue materialize(bool clone) const;
  /// The static output tensors, in for_each_tensor order.
  const std::vector<at::Tensor>& tensors() const { return tensors_; }

 private:
  c10::IValue captured_;
  std::vector<at::Tensor> tensors_;
};

}  // namespace graphed
