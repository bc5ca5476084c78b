#pragma once

/// \file train_step.h
/// graphed::TrainStep: a whole training iteration (zero-grad, forward and
/// backward over every microbatch, gradient clipping, optimizer step) captured
/// as one CUDA graph. step(batch) copies the batch into static buffers,
/// replays once and returns the loss as a device tensor, with no host sync.

#include "graphed/capture.h"
#include "graphed/grad_guard.h"
#include "graphed/optim.h"
#include "graphed/training_iteration.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace graphed {

/// Eager iterations an iteration that runs DistributedDataParallel needs
/// before it can be captured; see Note [Capturing collectives].
constexpr int kCollectiveWarmupIters = 11;

/// Note [Capturing collectives]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// Under DistributedDataParallel (DDP) the backward launches NCCL all-reduces
/// from hooks on the parameters' gradient accumulators. NCCL (>= 2.9.6) lets
/// a graph capture them, and a whole-iteration graph then replays forward,
/// backward, all-reduces and optimizer as one launch. Four things decide
/// whether that capture works, and TrainStep checks each before warm-up:
///
/// 1. The accumulators' stream. Autograd runs a leaf's AccumulateGrad node,
///    and the hook DDP puts on it, on the stream that was current when the
///    node was created. DDP creates the nodes at construction and keeps them.
///    Built under the default stream, the capture's backward makes that
///    non-capturing stream wait on captured work and the capture fails with
///    an opaque "operation not permitted when stream is capturing". DDP must
///    therefore be built under graphed's capture stream (capture_stream()),
///    the stream warm-up and capture run on. Megatron builds its DDP on its
///    capture stream for the same reason.
/// 2. Warm-up of at least kCollectiveWarmupIters iterations. DDP's reducer
///    rebuilds its buckets once, after the first iteration, with a broadcast
///    that synchronizes with the host; and in iterations 1 to 10 it records
///    CUDA timing events and synchronizes on them at the start of the next
///    forward (Reducer::should_collect_runtime_stats). Neither may happen in
///    the captured iteration: warm-up takes DDP past both (PyTorch's CUDA
///    graph notes ask for 11 eager DDP iterations before capture).
/// 3. A capture error mode other than global. ProcessGroupNCCL's watchdog
///    thread polls the events of eager collectives (those of warm-up) while
///    the capture runs; in global mode such a query from any thread
///    invalidates the capture. thread_local polices only the capturing thread.
/// 4. Teardown. A graph that captured NCCL work holds a reference on the
///    communicator, and ncclCommDestroy waits until every such graph is
///    destroyed, so destroy_process_group() hangs while the graph lives
///    (pytorch#115388). release() destroys the graphs first.
/// Settings that only exist in Python (the process group's backend, NCCL's
/// environment, DDP's own options) are checked by graphed.distributed.

/// What an iteration that runs collectives from gradient hooks (DDP's
/// all-reduces) needs for them to be captured with it.
struct CollectiveCapture {
  /// Who launches the collectives, for messages.
  std::string issuer = "DistributedDataParallel";
  /// The parameters whose gradient-accumulator hooks launch the collectives;
  /// their accumulators must run on the capture stream (see Note [Capturing
  /// collectives], point 1).
  std::vector<at::Tensor> hooked_params;
};

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
  /// Reads, as they are now, the parameters and buffers of the modules the
  /// iteration trains (from the modules, not from `state`), so that a step
  /// whose module was given other tensors after capture raises instead of
  /// training tensors the module no longer holds (Note [Tensors a graph reads
  /// in place]). Unset to skip the check.
  std::function<std::vector<at::Tensor>()> read_parameters;
  /// Names of the batch values in messages; "batch" for one value,
  /// "batch[0]", "batch[1]"... for several.
  std::vector<std::string> batch_names;
  /// What is captured, for messages.
  std::string description = "the training step";
  /// Return a copy of the loss that stays valid after the next step (one
  /// device copy); otherwise the static loss tensor, overwritten by each step.
  bool clone_loss = true;
  /// Set when the iteration runs collectives that are captured with it:
  /// warm-up and error mode are then checked against Note [Capturing
  /// collectives] before warm-up starts.
  std::optional<CollectiveCapture> collectives;
};

/// The parts of the usual training iteration, for TrainStep::from_parts; the
/// options (buffers, microbatches, guard, autocast) are those of
/// TrainingIterationOptions.
struct TrainStepParts : TrainingIterationOptions {
  /// The loss of one microbatch: forward and loss function (called with the
  /// batch values split along dim 0, one microbatch at a time).
  TrainStepFunction loss;
  /// The optimizer; its parameters are what the iteration trains.
  std::shared_ptr<CapturableOptimizer> optimizer;
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

  /// The usual iteration built from its parts: a TrainingIteration (Note
  /// [One training iteration]) whose optimizer pieces are `parts.optimizer`'s
  /// and whose split divides every batch tensor evenly along dim 0, the same
  /// sequence Python's graphed.TrainStep.from_parts runs with torch.optim:
  /// gradients dropped (the backward writes them fresh), forward and
  /// backward over each microbatch with the loss divided by their number
  /// (scaled for fp16), then GradientGuard::process (unscale, non-finite
  /// check, clipping, and the buffers put back when the step is skipped), the
  /// optimizer step (skipped on the device for non-finite steps) and the
  /// loss-scale update. The step returns the summed microbatch losses.
  /// `options.state` may add tensors; the parts' own state is included.
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

  /// Destroys the captured graphs and releases their memory once the device
  /// has finished every replay. Needed before the process group of captured
  /// collectives is destroyed (Note [Capturing collectives], point 4). After
  /// it step() and evaluate() throw. Does nothing when already released.
  void release();
  /// True once release() ran.
  bool released() const { return train_ == nullptr; }

  /// The captured iteration; throws once released.
  const CapturedFunction& train_graph() const;
  /// The captured evaluation; throws when there is none.
  const CapturedFunction& eval_graph() const;
  /// Steps taken.
  int64_t steps() const { return train_ ? train_->stats().replays : steps_before_release_; }
  /// The options.
  const TrainStepOptions& options() const { return options_; }

 private:
  CapturedFunction& train_graph_mutable();

  TrainStepOptions options_;
  std::shared_ptr<GradientGuard> guard_;
  std::unique_ptr<CapturedFunction> train_;
  std::unique_ptr<CapturedFunction> eval_;
  int64_t steps_before_release_ = 0;
};

}  // namespace graphed
