// The error-macro family and the CUDA handle owners (no GPU needed).

#include "graphed/check.h"
#include "graphed/cuda_handles.h"
#include "test_support.h"

#include <c10/util/Exception.h>

#include <type_traits>

namespace graphed {
namespace {

int checked_value(int value) {
  GRAPHED_CHECK(value > 0, "Expected a positive value, got ", value, ".");
  return value;
}

TEST(Check, PassingCheckReturnsNormally) { EXPECT_EQ(checked_value(3), 3); }

TEST(Check, FailingCheckThrowsGraphedErrorWithTheMessage) {
  EXPECT_THROW_WITH(checked_value(-2), Error, "Expected a positive value, got -2.");
}

TEST(Check, GraphedErrorsAreC10Errors) {
  static_assert(std::is_base_of_v<c10::Error, Error>);
  static_assert(std::is_base_of_v<Error, CaptureError>);
  static_assert(std::is_base_of_v<Error, InputMismatchError>);
  static_assert(std::is_base_of_v<Error, CudaError>);
  EXPECT_THROW(checked_value(0), c10::Error);
}

TEST(Check, TypedCheckThrowsTheNamedType) {
  auto fail = [] { GRAPHED_CHECK_AS(InputMismatchError, 1 == 2, "shapes differ"); };
  EXPECT_THROW_WITH(fail(), InputMismatchError, "shapes differ");
}

TEST(Check, InternalAssertSaysItIsABug) {
  auto fail = [] { GRAPHED_INTERNAL_ASSERT(false, "pool count ", 3); };
  try {
    fail();
    ADD_FAILURE() << "expected c10::Error";
  } catch (const Error&) {
    ADD_FAILURE() << "an internal assert is not a user error";
  } catch (const c10::Error& error) {
    const std::string message = error.what_without_backtrace();
    EXPECT_NE(message.find("pool count 3"), std::string::npos) << message;
    EXPECT_NE(message.find("bug in graphed"), std::string::npos) << message;
  }
}

TEST(Check, CudaCheckNamesTheCallAndTheStatus) {
  auto fail = [] { GRAPHED_CHECK_CUDA(cudaErrorInvalidValue); };
  EXPECT_THROW_WITH(fail(), CudaError, "cudaErrorInvalidValue");
  EXPECT_THROW_WITH(fail(), CudaError, "`cudaErrorInvalidValue` failed");
}

TEST(Check, CudaCheckExplainsCaptureStatuses) {
  auto fail = [] { GRAPHED_CHECK_CUDA(cudaErrorStreamCaptureUnsupported); };
  EXPECT_THROW_WITH(fail(), CudaError, "graphed.check()");
}

TEST(Check, CudaWarnDoesNotThrow) {
  EXPECT_NO_THROW(GRAPHED_WARN_CUDA(cudaErrorInvalidValue));
}

TEST(CudaHandles, OwnersAreMoveOnlyWithNoexceptMoves) {
  static_assert(!std::is_copy_constructible_v<CudaGraphHandle>);
  static_assert(std::is_nothrow_move_constructible_v<CudaGraphHandle>);
  static_assert(std::is_nothrow_move_assignable_v<CudaGraphHandle>);
  static_assert(!std::is_copy_constructible_v<CudaGraphExecHandle>);
  static_assert(std::is_nothrow_move_constructible_v<CudaGraphExecHandle>);
  static_assert(std::is_nothrow_move_assignable_v<CudaGraphExecHandle>);
  static_assert(!std::is_copy_constructible_v<CudaEvent>);
  static_assert(std::is_nothrow_move_constructible_v<CudaEvent>);
  static_assert(!std::is_copy_constructible_v<CaptureModeGuard>);
  SUCCEED();
}

TEST(CudaHandles, EmptyOwnersReleaseNothing) {
  CudaGraphHandle graph;
  EXPECT_EQ(graph.get(), nullptr);
  CudaGraphHandle moved(std::move(graph));
  EXPECT_EQ(moved.get(), nullptr);
  CudaGraphExecHandle exec;
  exec = CudaGraphExecHandle();
  EXPECT_EQ(exec.get(), nullptr);
}

TEST(CudaHandlesOnGpu, EventRecordsAndOrdersStreams) {
  GRAPHED_REQUIRE_GPU();
  cudaStream_t producer = nullptr;
  cudaStream_t consumer = nullptr;
  ASSERT_EQ(cudaStreamCreate(&producer), cudaSuccess);
  ASSERT_EQ(cudaStreamCreate(&consumer), cudaSuccess);
  {
    CudaEvent event;
    ASSERT_NE(event.get(), nullptr);
    event.record(producer);
    event.block(consumer);
    CudaEvent moved(std::move(event));
    EXPECT_EQ(event.get(), nullptr);  // NOLINT(bugprone-use-after-move): checking the move.
    EXPECT_THROW(event.record(producer), Error);
    stream_wait(consumer, producer);
  }
  EXPECT_EQ(cudaStreamSynchronize(consumer), cudaSuccess);
  cudaStreamDestroy(producer);
  cudaStreamDestroy(consumer);
}

}  // namespace
}  // namespace graphed
