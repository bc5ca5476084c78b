#include "torch_graph.h"

#include "graphed/check.h"
#include "graphed/cuda_handles.h"

#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>

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
