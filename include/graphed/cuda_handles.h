#pragma once

/// \file cuda_handles.h
/// Move-only owners for the raw CUDA handles graphed touches directly. Torch
/// owns most handles (streams, events, the graphs inside at::cuda::CUDAGraph);
/// these cover the rest. Destructors never throw: failures there are warnings.

#include <cuda_runtime_api.h>

#include <utility>

namespace graphed {

/// Owns a `cudaGraph_t` (a captured, not yet instantiated graph).
class CudaGraphHandle {
 public:
  /// An empty owner.
  CudaGraphHandle() noexcept = default;
  /// Takes ownership of `graph` (may be null).
  explicit CudaGraphHandle(cudaGraph_t graph) noexcept : graph_(graph) {}
  ~CudaGraphHandle() { reset(); }

  CudaGraphHandle(const CudaGraphHandle&) = delete;
  CudaGraphHandle& operator=(const CudaGraphHandle&) = delete;
  /// Transfers ownership; `other` becomes empty.
  CudaGraphHandle(CudaGraphHandle&& other) noexcept
      : graph_(std::exchange(other.graph_, nullptr)) {}
  /// Destroys the owned graph, then takes `other`'s.
  CudaGraphHandle& operator=(CudaGraphHandle&& other) noexcept {
    if (this != &other) {
      reset();
      graph_ = std::exchange(other.graph_, nullptr);
    }
    return *this;
  }

  /// The owned handle (null when empty).
  cudaGraph_t get() const noexcept { return graph_; }
  /// Where a CUDA call may write a new handle; destroys the old one first.
  cudaGraph_t* out() noexcept {
    reset();
    return &graph_;
  }
  /// Destroys the owned graph, if any.
  void reset() noexcept;

 private:
  cudaGraph_t graph_ = nullptr;
};

/// Owns a `cudaGraphExec_t` (an instantiated, launchable graph).
class CudaGraphExecHandle {
 public:
  /// An empty owner.
  CudaGraphExecHandle() noexcept = default;
  /// Takes ownership of `exec` (may be null).
  explicit CudaGraphExecHandle(cudaGraphExec_t exec) noexcept : exec_(exec) {}
  ~CudaGraphExecHandle() { reset(); }

  CudaGraphExecHandle(const CudaGraphExecHandle&) = delete;
  CudaGraphExecHandle& operator=(const CudaGraphExecHandle&) = delete;
  /// Transfers ownership; `other` becomes empty.
  CudaGraphExecHandle(CudaGraphExecHandle&& other) noexcept
      : exec_(std::exchange(other.exec_, nullptr)) {}
  /// Destroys the owned executable graph, then takes `other`'s.
  CudaGraphExecHandle& operator=(CudaGraphExecHandle&& other) noexcept {
    if (this != &other) {
      reset();
      exec_ = std::exchange(other.exec_, nullptr);
    }
    return *this;
  }

  /// The owned handle (null when empty).
  cudaGraphExec_t get() const noexcept { return exec_; }
  /// Where a CUDA call may write a new handle; destroys the old one first.
  cudaGraphExec_t* out() noexcept {
    reset();
    return &exec_;
  }
  /// Destroys the owned executable graph, if any.
  void reset() noexcept;

 private:
  cudaGraphExec_t exec_ = nullptr;
};

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
