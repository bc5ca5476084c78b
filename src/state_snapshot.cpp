#include "graphed/state_snapshot.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <mutex>

namespace graphed {
namespace {

// at::Generator is a shared handle: copies refer to the same generator.
at::Tensor generator_state(at::Generator generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_generator_state(at::Generator generator, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

}  // namespace

StateSnapshot StateSnapshot::take(std::vector<at::Tensor> tensors,
                                  std::optional<c10::Device> cuda_device) {
  c10::NoGradGuard no_grad;
  StateSnapshot snapshot;
  snapshot.copies_.reserve(tensors.size());
  for (const at::Tensor& tensor : tensors) {
    snapshot.copies_.push_back(tensor.defined() ? tensor.detach().clone() : at::Tensor());
  }
  snapshot.targets_ = std::move(tensors);
  snapshot.cpu_generator_state_ = generator_state(at::detail::getDefaultCPUGenerator());
  if (cuda_device && cuda_device->is_cuda()) {
    snapshot.cuda_generator_ = at::cuda::detail::getDefaultCUDAGenerator(cuda_device->index());
    snapshot.cuda_generator_state_ = generator_state(snapshot.cuda_generator_);
  }
  return snapshot;
}

void StateSnapshot::restore() const {
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < targets_.size(); ++i) {
    if (targets_[i].defined()) {
      targets_[i].detach().copy_(copies_[i]);
    }
  }
  if (cpu_generator_state_.defined()) {
    set_generator_state(at::detail::getDefaultCPUGenerator(), cpu_generator_state_);
  }
  if (cuda_generator_state_.defined()) {
    set_generator_state(cuda_generator_, cuda_generator_state_);
  }
}

int64_t StateSnapshot::bytes() const {
  int64_t total = 0;
  for (const at::Tensor& copy : copies_) {
    if (copy.defined() && copy.is_cuda()) {
      total += static_cast<int64_t>(copy.nbytes());
    }
  }
  return total;
}

}  // namespace graphed
