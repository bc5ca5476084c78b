#pragma once

// Private to libgraphed: the subclass of at::cuda::CUDAGraph that can undo an
// abandoned capture on every supported torch version.

#include "cublas_workspace.h"

#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>

#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace graphed::detail {

// Note [Abandoning a capture]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// When the captured code raises, at::cuda::CUDAGraph is left mid-capture: the
// stream is still capturing (or invalidated), the caching allocator still
// routes the stream's allocations to the graph's private pool, and the pool's
// use count was incremented. torch 2.14 records this (capturing_to_pool_,
// allocated_pool_) and reset() undoes it; torch 2.11 does not, so its reset()
// leaks the pool and, worse, leaves the default CUDA generator flagged as
// capturing, after which every eager random op fails with "Offset increment
// outside graph capture encountered unexpectedly". abandon_capture() ends the
// CUDA capture itself and then does what the torch version at hand leaves
// undone, chosen at compile time from the members the header declares.
class TorchGraph final : public at::cuda::CUDAGraph {
 public:
  using at::cuda::CUDAGraph::CUDAGraph;
  // Frees the cuBLAS workspaces taken from the capture before the base class
  // releases the pool they live in.
  ~TorchGraph();

  // capture_begin on the current stream, with that stream's cuBLAS
  // workspaces owned by graphed (Note [cuBLAS workspaces of captured graphs]).
  void begin_capture(at::cuda::MempoolId_t pool, cudaStreamCaptureMode mode);
  // capture_end; the graph takes the cuBLAS workspaces its capture created.
  void end_capture();

  // Ends a capture that began but cannot end normally, and returns the graph,
  // the allocator and the generators to their state before capture_begin.
  // Never throws; problems become warnings.
  void abandon_capture() noexcept;

  // True when this torch's CUDAGraph::reset() undoes an abandoned capture by
  // itself (torch >= 2.14); see Note [Abandoning a capture].
  static constexpr bool reset_releases_abandoned_capture() noexcept {
    return reset_handles_abandoned_capture<TorchGraph>(0);
  }

  // The stream capture began on.
  cudaStream_t capture_stream() const noexcept { return capture_stream_.stream(); }

 private:
  template <typename Graph>
  static constexpr auto reset_handles_abandoned_capture(int)
      -> decltype(std::declval<Graph&>().capturing_to_pool_, bool()) {
    return true;
  }
  template <typename Graph>
  static constexpr bool reset_handles_abandoned_capture(...) {
    return false;
  }

  template <typename State>
  static auto clear_capturing_flag(State& state, int) -> decltype(state.capturing_, void()) {
    state.capturing_ = false;
  }
  template <typename State>
  static void clear_capturing_flag(State&, ...) {}

  void release_pool_without_reset() noexcept;

  WorkspaceKeys workspaces_before_capture_;
  std::vector<at::DataPtr> capture_workspaces_;
  // The shared cuBLAS workspace the graph's GEMMs write into, while it lives.
  std::shared_ptr<void> workspace_lease_;
};

}  // namespace graphed::detail
