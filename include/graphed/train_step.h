#pragma once

/// \file train_step.h
/// graphed::TrainStep: a whole training iteration (zero-grad, forward and
/// backward over every microbatch, gradient clipping, optimizer step) captured
/// as one CUDA graph. step(batch) copies the batch into static buffers,
/// replays once and returns the loss as a device tensor, with no host sync.

#include "graphed/capture.h"
#include "graphed/grad_guard.h"
#include "graphed/optim.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace graphed {

/// One training iteration: takes the batch (one value per batch name) and
/// returns the loss, a CUDA tensor with one element (as an IValue, so that
/// host languages can return whatever they like and get a clear error).
using TrainStepFunction = CapturableFunction;

/// Options of TrainStep.
struct TrainStepOptions {
  /// Eager iterations before capture (>= 1): they create optimizer state,
  /// cuBLAS workspaces and autotuning results outside the graph.
  int warmup_iters = 3;
  /// Pool to capture into; a private pool when unset.
  std::optional<PoolId> pool;
  /// See CaptureErrorMode.
  CaptureErrorMode error_mode = CaptureErrorMode::kGlobal;
  /// Everything the iteration changes: parameters, gradients, buffers,
  /// optimizer state and step counters, loss-scaler state. Snapshotted before
  /// warm-up and restored after capture, on success and on failure, so the
  /// first step() is exactly the first step eager training would take.
  std::vector<at::Tensor> state;
  /// Names of the batch values in messages; "batch" for one value,
  /// "batch[0]", "batch[1]"... for several.
  std::vector<std::string> batch_names;
  /// What is captured, for messages.
  std::string description = "the training step";
  /// Return a copy of the loss that stays valid after the next step (one
  /// device copy); otherwise the static loss tensor, overwritten by each step.
  bool clone_loss = true;
};

/// The parts of the usual training iteration, for TrainStep::from_parts.
struct TrainStepParts {
  /// The loss of one microbatch: forward and loss function (called with the
  /// batch values split along dim 0, one microbatch at a time).
  TrainStepFunction loss;
  /// The optimizer; its parameters are what the iteration trains.
  std::shared_ptr<CapturableOptimizer> optimizer;
  /// Buffers the forward updates (BatchNorm statistics), restored after capture.
  std::vector<at::Tensor> buffers;
  /// Microbatches per iteration: the batch is split along dim 0 and their
  /// gradients accumulate.
  int microbatches = 1;
  /// Non-finite skipping, clipping and fp16 loss scaling.
  GradientGuardOptions guard;
  /// Run the forward under CUDA autocast to this dtype (bfloat16 or float16),
  /// with the autocast cache off; fp32 when unset.
  std::optional<c10::ScalarType> autocast;
};

/// A training iteration captured as one CUDA graph.
class TrainStep {
 public:
  /// Warms `step` up on `sample_batch`, captures one iteration and restores
  /// the state. Throws CaptureError (naming the operation that broke capture
  /// and the fix) when the iteration cannot be captured; the state is then
  /// restored too.
  TrainStep(TrainStepFunction step, std::vector<c10::IValue> sample_batch,
            TrainStepOptions options = {});

  /// The usual iteration built from its parts, as Python's
  /// graphed.TrainStep.from_parts: gradients dropped (the backward writes them
  /// fresh), forward and backward over each microbatch with the loss divided
  /// by their number (scaled for fp16), then GradientGuard::process (unscale,
  /// non-finite check, clipping), the optimizer step (skipped on the device
  /// for non-finite steps) and the loss-scale update. The step returns the
  /// summed microbatch losses. `options.state` may add tensors; the parts'
  /// own state is included.
  static TrainStep from_parts(TrainStepParts parts, std::vector<c10::IValue> sample_batch,
                              TrainStepOptions options = {});

  /// The gradient guard of a TrainStep built from parts, else null.
  const GradientGuard* guard() const { return guard_.get(); }

  /// Copies `batch` into the static buffers, replays the iteration on the
  /// current stream and returns the loss. Throws InputMismatchError, listing
  /// every difference, when `batch` does not match the sample.
  at::Tensor step(const std::vector<c10::IValue>& batch);

  /// Captures a forward-only function (evaluation) into the same memory pool;
  /// `inputs` are its sample inputs. It runs without autograd and restores the
  /// same state after its warm-up. Replace an earlier evaluation graph.
  void capture_eval(CapturableFunction evaluate, std::vector<c10::IValue> sample_inputs,
                    int warmup_iters = 1);
  /// Replays the evaluation graph on `inputs`.
  c10::IValue evaluate(const std::vector<c10::IValue>& inputs);
  /// True once capture_eval() succeeded.
  bool has_eval() const { return eval_ != nullptr; }

  /// The captured iteration.
  const CapturedFunction& train_graph() const { return *train_; }
  /// The captured evaluation; throws when there is none.
  const CapturedFunction& eval_graph() const;
  /// Steps taken.
  int64_t steps() const { return train_->stats().replays; }
  /// The options.
  const TrainStepOptions& options() const { return options_; }

 private:
  TrainStepOptions options_;
  std::shared_ptr<GradientGuard> guard_;
  std::unique_ptr<CapturedFunction> train_;
  std::unique_ptr<CapturedFunction> eval_;
};

}  // namespace graphed
