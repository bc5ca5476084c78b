#pragma once

/// \file training_iteration.h
/// graphed::TrainingIteration: the order of operations of one training
/// iteration (gradient-guard bookkeeping, dropping the gradients, forward,
/// loss and backward over every microbatch, unscaling, the non-finite check,
/// clipping, the optimizer step, the loss-scale update), written once. The
/// framework-specific parts (the model's forward and loss, the optimizer, how
/// a batch splits into microbatches) come in as functions, so that LibTorch's
/// TrainStep::from_parts and Python's graphed.TrainStep.from_parts (torch.optim
/// optimizers, nn.Module) run the same iteration.

#include "graphed/capture.h"
#include "graphed/grad_guard.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/ScalarType.h>

#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace graphed {

/// Note [One training iteration]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// The usual training iteration was once written twice, in Python for
/// torch.optim and in C++ for the capturable C++ optimizers, and a fix to one
/// (where the loss is detached, when the buffers are snapshotted) did not
/// reach the other. TrainingIteration owns the sequence; the callers supply
/// only what differs between frameworks, as functions:
///
///   guard.begin_step()                  snapshot protected buffers
///   zero_grad()                         set_to_none: backward writes fresh
///                                       gradients, no memset
///   split(batch, n)                     only when n > 1 (views, no kernels)
///   for each microbatch m:
///     under autocast (cache off):       loss(m) -> a tensor with one element
///     l = float(loss) / n
///     guard.scale_loss(l).backward()    scaled for fp16 loss scaling
///     total += l.detach()               the first is the loss itself
///   found_inf = guard.process(total, grads of params that have one)
///                                       unscale, non-finite check, clip,
///                                       buffers put back on a skipped step
///   step(found_inf)                     undefined when nothing can skip
///   guard.after_step()                  loss-scale update
///   return total
///
/// Why the pieces are these:
/// - Autocast is part of the iteration, not of the loss function: only the
///   forward and the loss run under it (the cast to float32 and backward do
///   not), and its cache stays off, since the cache would keep casts made
///   during capture in the graph's pool. The scope behaves as
///   `torch.autocast("cuda", dtype, cache_enabled=False)`, nesting count
///   included, so Python code inside the forward sees autocast as it would
///   under its own `with`.
/// - The split is a piece because its rules belong to the batch's form:
///   Python splits nested tuples, lists and dicts and repeats other values
///   (graphed.train.split_batch); C++ splits every tensor of the batch values
///   evenly. The iteration only checks that n microbatches came back.
/// - The optimizer step takes found_inf: CapturableOptimizer::step reads it
///   directly, torch.optim's fused optimizers read the `found_inf` attribute
///   (as torch.amp.GradScaler sets it).
/// - The parameters are given once; the gradients are read from them after
///   the last backward, so a parameter without a gradient is left out.
/// From Python, the binding releases the GIL for the whole iteration and each
/// piece takes it to call Python: backward must run without the GIL, since
/// autograd's worker threads take it for Python nodes (custom autograd
/// functions, DDP communication hooks).

/// Splits a batch (its values) into `microbatches` microbatches, each the
/// values one call of the loss function takes.
using MicrobatchSplit = std::function<std::vector<std::vector<c10::IValue>>(
    const std::vector<c10::IValue>& batch, int microbatches)>;

/// What the usual training iteration does around its pieces: microbatches,
/// the gradient guard, autocast, and the buffers a skipped step puts back.
/// Shared by TrainingIterationParts and TrainStepParts.
struct TrainingIterationOptions {
  /// Buffers the forward updates (BatchNorm statistics), put back on the
  /// device after a skipped step (Note [Buffers of a skipped step]); a
  /// TrainStep also restores them after capture.
  std::vector<at::Tensor> buffers;
  /// Microbatches per iteration: the batch is split, their gradients
  /// accumulate and each loss is divided by their number.
  int microbatches = 1;
  /// Non-finite skipping, clipping and fp16 loss scaling.
  GradientGuardOptions guard;
  /// Run the forward and loss under CUDA autocast to this dtype (bfloat16 or
  /// float16), with the autocast cache off; fp32 when unset.
  std::optional<c10::ScalarType> autocast;
};

/// The framework-specific parts of a training iteration, and its options;
/// see Note [One training iteration].
struct TrainingIterationParts : TrainingIterationOptions {
  /// The loss of one microbatch: forward and loss function, called with the
  /// microbatch's values (as the split made them) under the autocast scope.
  /// Returns a tensor with one element.
  CapturableFunction loss;
  /// Splits the batch into `microbatches` microbatches; called once per
  /// iteration, and only when microbatches > 1.
  MicrobatchSplit split;
  /// Drops the gradients of the trained parameters (set_to_none).
  std::function<void()> zero_grad;
  /// The optimizer step. `found_inf` is the guard's skip flag (non-zero: skip
  /// the step on the device), or undefined when nothing can skip the step.
  std::function<void(const at::Tensor& found_inf)> step;
  /// The parameters the optimizer trains: their gradients are unscaled,
  /// checked and clipped. Decides the guard's device (the first one's).
  std::vector<at::Tensor> params;
};

/// One training iteration built from its parts: the sequence of Note [One
/// training iteration], run eagerly on each call, so that a capture records
/// it. Owns the GradientGuard of the iteration.
class TrainingIteration {
 public:
  /// Checks the parts, creates the gradient guard on the device of the first
  /// parameter and protects `parts.buffers` with it.
  explicit TrainingIteration(TrainingIterationParts parts);

  /// Runs one iteration on `batch` and returns the summed microbatch losses
  /// (float32, each divided by the number of microbatches, detached).
  at::Tensor operator()(const std::vector<c10::IValue>& batch);

  /// The gradient guard: its state() belongs in a capture's state.
  const std::shared_ptr<GradientGuard>& guard() const { return guard_; }
  /// The parameters whose gradients the guard processes.
  const std::vector<at::Tensor>& params() const { return parts_.params; }
  /// Microbatches per iteration.
  int microbatches() const { return parts_.microbatches; }

 private:
  std::vector<std::vector<c10::IValue>> split(const std::vector<c10::IValue>& batch) const;

  TrainingIterationParts parts_;
  std::shared_ptr<GradientGuard> guard_;
};

}  // namespace graphed
