#include "graphed/training_iteration.h"

#include "graphed/check.h"
#include "graphed/static_io.h"

#include <ATen/autocast_mode.h>

namespace graphed {
namespace {

// Autocast on CUDA to `dtype` (when set) for its lifetime, cache off, as
// torch.autocast("cuda", dtype, cache_enabled=False) does it (nesting count
// and cache clearing included): Note [One training iteration].
class AutocastScope {
 public:
  explicit AutocastScope(std::optional<c10::ScalarType> dtype) : active_(dtype.has_value()) {
    if (!active_) {
      return;
    }
    cache_was_enabled_ = at::autocast::is_autocast_cache_enabled();
    was_enabled_ = at::autocast::is_autocast_enabled(at::kCUDA);
    previous_dtype_ = at::autocast::get_autocast_dtype(at::kCUDA);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, *dtype);
    at::autocast::increment_nesting();
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~AutocastScope() {
    if (!active_) {
      return;
    }
    if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
    at::autocast::set_autocast_enabled(at::kCUDA, was_enabled_);
    at::autocast::set_autocast_dtype(at::kCUDA, previous_dtype_);
    at::autocast::set_autocast_cache_enabled(cache_was_enabled_);
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_;
  bool was_enabled_ = false;
  c10::ScalarType previous_dtype_ = c10::kHalf;
  bool cache_was_enabled_ = true;
};

void check_piece(bool present, const char* name, const char* what) {
  GRAPHED_CHECK(present, "Expected the training iteration's ", name, " (TrainingIterationParts::",
                name, "): ", what, "; got an empty function.");
}

}  // namespace

TrainingIteration::TrainingIteration(TrainingIterationParts parts) : parts_(std::move(parts)) {
  check_piece(static_cast<bool>(parts_.loss), "loss", "the forward and loss of one microbatch");
  check_piece(static_cast<bool>(parts_.split), "split", "the split of a batch into microbatches");
  check_piece(static_cast<bool>(parts_.zero_grad), "zero_grad",
              "the function that drops the gradients");
  check_piece(static_cast<bool>(parts_.step), "step", "the optimizer step");
  GRAPHED_CHECK(parts_.microbatches >= 1, "Expected microbatches >= 1, got ", parts_.microbatches,
                ".");
  GRAPHED_CHECK(!parts_.autocast || *parts_.autocast == c10::kBFloat16 ||
                    *parts_.autocast == c10::kHalf,
                "Expected autocast to be bfloat16 or float16, got ", *parts_.autocast, ".");
  GRAPHED_CHECK(!parts_.params.empty(), "Expected the parameters the training iteration trains "
                "(TrainingIterationParts::params), got none. Pass the optimizer's parameters.");
  guard_ = std::make_shared<GradientGuard>(parts_.params.front().device(), parts_.guard);
  // A skipped step leaves the buffers too as they were: Note [Buffers of a skipped step].
  guard_->protect_buffers(parts_.buffers);
}

std::vector<std::vector<c10::IValue>> TrainingIteration::split(
    const std::vector<c10::IValue>& batch) const {
  if (parts_.microbatches == 1) {
    return {batch};
  }
  std::vector<std::vector<c10::IValue>> microbatches = parts_.split(batch, parts_.microbatches);
  GRAPHED_CHECK(microbatches.size() == static_cast<size_t>(parts_.microbatches),
                "Expected the split of a batch to give ", parts_.microbatches,
                " microbatches (microbatches=", parts_.microbatches, "), got ",
                microbatches.size(), ". Make TrainingIterationParts::split return one list of "
                "values per microbatch.");
  return microbatches;
}

// The sequence of Note [One training iteration]; keep the two in step.
at::Tensor TrainingIteration::operator()(const std::vector<c10::IValue>& batch) {
  guard_->begin_step();
  parts_.zero_grad();
  const int count = parts_.microbatches;
  at::Tensor total;
  for (const std::vector<c10::IValue>& microbatch : split(batch)) {
    at::Tensor loss;
    {
      AutocastScope autocast(parts_.autocast);
      const c10::IValue value = parts_.loss(microbatch);
      GRAPHED_CHECK(value.isTensor() && value.toTensor().numel() == 1, "The microbatch loss "
                    "must be a tensor with one element, got ", describe_value(value), ".");
      loss = value.toTensor();
    }
    loss = loss.to(at::kFloat) / count;
    guard_->scale_loss(loss).backward();
    total = total.defined() ? total + loss.detach() : loss.detach();
  }
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : parts_.params) {
    if (p.grad().defined()) {
      grads.push_back(p.grad());
    }
  }
  parts_.step(guard_->process(total, grads));
  guard_->after_step();
  return total;
}

}  // namespace graphed
