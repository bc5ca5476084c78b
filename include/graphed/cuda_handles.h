#pragma once

/// \file cuda_handles.h
/// Move-only owners for the raw CUDA handles graphed touches directly. Torch
/// owns most handles (streams, events, the graphs inside at::cuda::CUDAGraph);
/// these cover the rest. Destructors never throw: failures there are warnings.

#include "graphed/check.h"

#include <cuda_runtime_api.h>

#include <utility>

namespace graphed {

/// Owns one raw CUDA handle of type `Handle`, destroyed with `Destroy`.
/// Move-only; a moved-from owner is empty. Destruction failures are warnings.
template <typename Handle, cudaError_t (*Destroy)(Handle)>
class UniqueCudaHandle {
 public:
  /// An empty owner.
  UniqueCudaHandle() noexcept = default;
  /// Takes ownership of `handle` (may be null).
  explicit UniqueCudaHandle(Handle handle) noexcept : handle_(handle) {}
  ~UniqueCudaHandle() { reset(); }

  UniqueCudaHandle(const UniqueCudaHandle&) = delete;
  UniqueCudaHandle& operator=(const UniqueCudaHandle&) = delete;
  /// Transfers ownership; `other` becomes empty.
  UniqueCudaHandle(UniqueCudaHandle&& other) noexcept
      : handle_(std::exchange(other.handle_, nullptr)) {}
  /// Destroys the owned handle, then takes `other`'s.
  UniqueCudaHandle& operator=(UniqueCudaHandle&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }

  /// The owned handle (null when empty).
  Handle get() const noexcept { return handle_; }
  /// Where a CUDA call may write a new handle; destroys the old one first.
  Handle* out() noexcept {
    reset();
    return &handle_;
  }
  /// Destroys the owned handle, if any.
  void reset() noexcept {
    if (handle_ != nullptr) {
      GRAPHED_WARN_CUDA(Destroy(handle_));
      handle_ = nullptr;
    }
  }

 private:
  Handle handle_ = nullptr;
};

/// Owns a `cudaGraph_t` (a captured, not yet instantiated graph).
using CudaGraphHandle = UniqueCudaHandle<cudaGraph_t, &cudaGraphDestroy>;
/// Owns a `cudaGraphExec_t` (an instantiated, launchable graph).
using CudaGraphExecHandle = UniqueCudaHandle<cudaGraphExec_t, &cudaGraphExecDestroy>;

/// Owns a `cudaEvent_t` created without timing (the cheapest kind), for
/// ordering work between streams.
class CudaEvent {
 public:
  /// Creates the event (cudaEventDisableTiming) on the current device.
  CudaEvent();
  ~CudaEvent() { reset(); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  /// Transfers ownership; `other` becomes empty.
  CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  /// Destroys the owned event, then takes `other`'s.
  CudaEvent& operator=(CudaEvent&& other) noexcept {
    if (this != &other) {
      reset();
      event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
  }

  /// Records the event on `stream`.
  void record(cudaStream_t stream);
  /// Makes `stream` wait until the work recorded before the event is done.
  void block(cudaStream_t stream) const;
  /// Whether the work recorded before the event is done, without waiting.
  bool query() const;
  /// The owned handle (null when moved from).
  cudaEvent_t get() const noexcept { return event_; }
  /// Destroys the owned event, if any.
  void reset() noexcept;

 private:
  cudaEvent_t event_ = nullptr;
};

/// Makes `waiter` wait for all work enqueued so far on `producer` (through a
/// fresh event; nothing when they are the same stream).
void stream_wait(cudaStream_t waiter, cudaStream_t producer);

/// Sets the calling thread's stream-capture mode for its lifetime and restores
/// the previous mode afterwards (`cudaThreadExchangeStreamCaptureMode`).
class CaptureModeGuard {
 public:
  /// Switches the thread to `mode`.
  explicit CaptureModeGuard(cudaStreamCaptureMode mode);
  /// Restores the mode that was current at construction.
  ~CaptureModeGuard();
  CaptureModeGuard(const CaptureModeGuard&) = delete;
  CaptureModeGuard& operator=(const CaptureModeGuard&) = delete;
  CaptureModeGuard(CaptureModeGuard&&) = delete;
  CaptureModeGuard& operator=(CaptureModeGuard&&) = delete;

 private:
  cudaStreamCaptureMode previous_;
};

}  // namespace graphed
