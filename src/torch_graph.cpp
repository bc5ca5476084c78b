#include "torch_graph.h"

#include "graphed/check.h"
#include "graphed/cuda_handles.h"

#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>

namespace graphed::detail {
namespace {

// Runs `step`, turning any exception into a warning: cleanup after a failure
// must go on, and must not replace the failure the user needs to see.
template <typename Step>
void best_effort(const char* what, Step&& step) noexcept {
  try {
    step();
  } catch (const std::exception& error) {
    TORCH_WARN("graphed: while abandoning a failed capture, ", what,
               " failed: ", error.what());
  } catch (...) {
    TORCH_WARN("graphed: while abandoning a failed capture, ", what, " failed.");
  }
}

}  // namespace

TorchGraph::~TorchGraph() { capture_workspaces_.clear(); }

void TorchGraph::begin_capture(at::cuda::MempoolId_t pool, cudaStreamCaptureMode mode) {
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
  workspace_lease_ = share_stream_workspaces(stream.device_index(), stream.stream());
  workspaces_before_capture_ = workspace_keys();
  capture_begin(pool, mode);
}

void TorchGraph::end_capture() {
  capture_end();
  capture_workspaces_ = take_capture_workspaces(workspaces_before_capture_, capture_dev_,
                                                capture_stream_.stream(), workspace_lease_);
}

void TorchGraph::abandon_capture() noexcept {
  // The capture may already have ended (capture_end failed after
  // cudaStreamEndCapture) or never begun (capture_begin failed early).
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(capture_stream_.stream(), &status) == cudaSuccess &&
      status != cudaStreamCaptureStatusNone) {
    CudaGraphHandle partial;
    // Returns cudaErrorStreamCaptureInvalidated for a broken capture; either
    // way the stream stops capturing and the partial graph is discarded.
    (void)cudaStreamEndCapture(capture_stream_.stream(), partial.out());
  }
  (void)cudaGetLastError();
  // Workspaces created by the failed capture live in the pool released below:
  // free them first, and keep them out of later captures.
  if (capture_dev_ != UNDEFINED_DEVICE) {
    take_capture_workspaces(workspaces_before_capture_, capture_dev_, capture_stream_.stream(),
                            workspace_lease_);
  }
  capture_workspaces_.clear();
  workspace_lease_.reset();

  if constexpr (!reset_releases_abandoned_capture()) {
    release_pool_without_reset();
  }
  best_effort("CUDAGraph::reset", [&] { reset(); });
}

void TorchGraph::release_pool_without_reset() noexcept {
  // capture_begin flags the generators before it touches the allocator.
  for (auto& entry : captured_generator_states_) {
    clear_capturing_flag(*entry.first, 0);
  }
  if (capture_dev_ == UNDEFINED_DEVICE || capture_ended_) {
    return;  // capture_begin never reached the allocator, or reset() will release.
  }
  best_effort("ending allocation to the graph pool", [&] {
    c10::cuda::CUDACachingAllocator::endAllocateToPool(capture_dev_, mempool_id_);
  });
  best_effort("ending host allocation to the graph pool",
              [&] { at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(mempool_id_); });
  best_effort("releasing the graph pool", [&] {
    c10::cuda::CUDACachingAllocator::releasePool(capture_dev_, mempool_id_);
  });
  best_effort("releasing the host graph pool",
              [&] { at::getHostAllocator(at::kCUDA)->release_pool(mempool_id_); });
}

}  // namespace graphed::detail
