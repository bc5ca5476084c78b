#pragma once

/// \file state_snapshot.h
/// Invariant 1 of DESIGN.md: capture never changes user state. Warm-up runs the
/// user's code eagerly, which advances random generators and updates buffers
/// such as BatchNorm running statistics; a snapshot taken before warm-up and
/// restored after capture (on success and on failure) undoes that.

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <vector>

namespace graphed {

/// A copy of some tensors' values and of the default random generators' states.
class StateSnapshot {
 public:
  /// An empty snapshot: restore() does nothing.
  StateSnapshot() = default;

  /// Saves the values of `tensors`, the default CPU generator's state and, when
  /// `cuda_device` is a CUDA device, that device's default CUDA generator state.
  /// Copies are made on the current stream.
  static StateSnapshot take(std::vector<at::Tensor> tensors,
                            std::optional<c10::Device> cuda_device);

  /// Writes the saved values back into the same tensors (in place, so
  /// references held elsewhere see the restored values) and restores the
  /// generators.
  void restore() const;

  /// Bytes of device memory the saved copies occupy.
  int64_t bytes() const;

 private:
  std::vector<at::Tensor> targets_;
  std::vector<at::Tensor> copies_;
  at::Tensor cpu_generator_state_;
  at::Generator cuda_generator_;
  at::Tensor cuda_generator_state_;
};

}  // namespace graphed
