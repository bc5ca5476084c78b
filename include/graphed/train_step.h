#pragma once

/// \file train_step.h
/// graphed::TrainStep: a whole training iteration (zero-grad, forward and
/// backward over every microbatch, gradient clipping, optimizer step) captured
/// as one CUDA graph. step(batch) copies the batch into static buffers,
/// replays once and returns the loss as a device tensor, with no host sync.

#include "graphed/capture.h"

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

/// A training iteration captured as one CUDA graph.
class TrainStep {
 public:
  /// Warms `step` up on `sample_batch`, captures one iteration and restores
  /// the state. Throws CaptureError (naming the operation that broke capture
  /// and the fix) when the iteration cannot be captured; the state is then
  /// restored too.
  TrainStep(TrainStepFunction step, std::vector<c10::IValue> sample_batch,
            TrainStepOptions options = {});

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
  std::unique_ptr<CapturedFunction> train_;
  std::unique_ptr<CapturedFunction> eval_;
};

}  // namespace graphed
