#include "graphed/check.h"
#include "graphed/cuda_handles.h"

namespace graphed {
namespace detail {

std::string describe_cuda_failure(const char* call, cudaError_t status) {
  std::string message = c10::str("CUDA call `", call, "` failed with ", cudaGetErrorName(status),
                                 ": ", cudaGetErrorString(status), ".");
  switch (status) {
    case cudaErrorStreamCaptureUnsupported:
    case cudaErrorStreamCaptureInvalidated:
    case cudaErrorStreamCaptureImplicit:
      message += " The operation is not allowed while a stream is being captured; run it "
                 "before or after capture, or find it with graphed.check().";
      break;
    case cudaErrorMemoryAllocation:
      message += " The GPU is out of memory; free tensors or capture with a smaller batch.";
      break;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      message += " graphed needs an NVIDIA GPU and a driver that supports CUDA " +
                 std::to_string(CUDART_VERSION / 1000) + ".";
      break;
    default:
      break;
  }
  return message;
}

}  // namespace detail

CudaEvent::CudaEvent() {
  GRAPHED_CHECK_CUDA(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
}

void CudaEvent::record(cudaStream_t stream) {
  GRAPHED_CHECK(event_ != nullptr, "Expected a live CudaEvent, got a moved-from one.");
  GRAPHED_CHECK_CUDA(cudaEventRecord(event_, stream));
}

void CudaEvent::block(cudaStream_t stream) const {
  GRAPHED_CHECK(event_ != nullptr, "Expected a live CudaEvent, got a moved-from one.");
  GRAPHED_CHECK_CUDA(cudaStreamWaitEvent(stream, event_, 0));
}

bool CudaEvent::query() const {
  GRAPHED_CHECK(event_ != nullptr, "Expected a live CudaEvent, got a moved-from one.");
  const cudaError_t status = cudaEventQuery(event_);
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error: clear it so later checks do not see it
    return false;
  }
  GRAPHED_CHECK_CUDA(status);
  return true;
}

void CudaEvent::reset() noexcept {
  if (event_ != nullptr) {
    GRAPHED_WARN_CUDA(cudaEventDestroy(event_));
    event_ = nullptr;
  }
}

void stream_wait(cudaStream_t waiter, cudaStream_t producer) {
  if (waiter == producer) {
    return;
  }
  CudaEvent event;
  event.record(producer);
  event.block(waiter);
}

CaptureModeGuard::CaptureModeGuard(cudaStreamCaptureMode mode) : previous_(mode) {
  GRAPHED_CHECK_CUDA(cudaThreadExchangeStreamCaptureMode(&previous_));
}

CaptureModeGuard::~CaptureModeGuard() {
  GRAPHED_WARN_CUDA(cudaThreadExchangeStreamCaptureMode(&previous_));
}

}  // namespace graphed
