// The blocker catalogue and the message of a failed capture (host logic).

#include "graphed/capture_blockers.h"
#include "graphed/capture_watcher.h"
#include "graphed/check.h"
#include "test_support.h"

namespace graphed {
namespace {

TEST(CaptureBlockers, OperatorsAreClassifiedByName) {
  EXPECT_EQ(blocker_kind_of_operator("aten::_local_scalar_dense"), BlockerKind::kHostRead);
  EXPECT_EQ(blocker_kind_of_operator("aten::item"), BlockerKind::kHostRead);
  EXPECT_EQ(blocker_kind_of_operator("aten::nonzero"), BlockerKind::kDataDependentShape);
  EXPECT_EQ(blocker_kind_of_operator("aten::masked_select"), BlockerKind::kDataDependentShape);
  EXPECT_EQ(blocker_kind_of_operator("aten::_unique2"), BlockerKind::kDataDependentShape);
  EXPECT_EQ(blocker_kind_of_operator("aten::mm"), std::nullopt);
  EXPECT_EQ(blocker_kind_of_operator("aten::copy_"), std::nullopt);  // depends on devices
}

TEST(CaptureBlockers, HostFunctionsAreClassifiedByName) {
  EXPECT_EQ(blocker_kind_of_host_function("synchronize"), BlockerKind::kExplicitSync);
  EXPECT_EQ(blocker_kind_of_host_function("tolist"), BlockerKind::kHostRead);
  EXPECT_EQ(blocker_kind_of_host_function("forward"), std::nullopt);
}

TEST(CaptureBlockers, EveryKindHasAnExplanation) {
  for (BlockerKind kind :
       {BlockerKind::kHostRead, BlockerKind::kDataDependentShape, BlockerKind::kExplicitSync,
        BlockerKind::kHostDeviceCopy, BlockerKind::kCpuTensor,
        BlockerKind::kUnregisteredGenerator, BlockerKind::kAutocastCache, BlockerKind::kOther}) {
    const BlockerInfo& info = blocker_info(kind);
    EXPECT_EQ(info.kind, kind);
    EXPECT_FALSE(info.label.empty());
    EXPECT_FALSE(info.why.empty());
    EXPECT_FALSE(info.fix.empty());
  }
}

TEST(CaptureBlockers, KindNamesRoundTrip) {
  for (BlockerKind kind :
       {BlockerKind::kHostRead, BlockerKind::kDataDependentShape, BlockerKind::kExplicitSync,
        BlockerKind::kHostDeviceCopy, BlockerKind::kCpuTensor,
        BlockerKind::kUnregisteredGenerator, BlockerKind::kAutocastCache, BlockerKind::kOther}) {
    EXPECT_EQ(blocker_kind_from_name(blocker_kind_name(kind)), kind);
  }
  EXPECT_EQ(blocker_kind_name(BlockerKind::kHostRead), "host_read");
  EXPECT_THROW_WITH(blocker_kind_from_name("host read"), Error,
                    "Expected a capture blocker kind, one of 'host_read', 'data_dependent_shape'");
}

SourceFrame frame(std::string file, int line, std::string function, bool user) {
  return SourceFrame{std::move(file), line, std::move(function), user};
}

TEST(ExplainCaptureFailure, NamesTheOperatorItsCallerInputsAndLine) {
  CaptureCulprit culprit;
  culprit.op = "aten::_local_scalar_dense";
  culprit.callers = {"aten::item"};
  culprit.inputs = "(1,) float32 cuda:0";
  culprit.stack = {frame("/site/torch/_tensor.py", 10, "item", false),
                   frame("model.py", 42, "forward", true)};
  culprit.raised = true;
  const std::string message = explain_capture_failure(
      "module `Net`", culprit, "aten::mm",
      "CUDA error: operation not permitted when stream is capturing\nmore", {});
  EXPECT_NE(message.find("Capturing module `Net` into a CUDA graph failed at "
                         "`aten::_local_scalar_dense` (inside `aten::item`) on (1,) float32 "
                         "cuda:0, called at model.py:42 in forward: host read."),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("\nWhy: "), std::string::npos);
  EXPECT_NE(message.find("\nFix: keep the value on the GPU"), std::string::npos) << message;
  EXPECT_NE(message.find("Reported error: CUDA error: operation not permitted when stream is "
                         "capturing"),
            std::string::npos)
      << message;
  EXPECT_EQ(message.find("more"), std::string::npos) << "only the first line of the error";
  EXPECT_NE(message.find("memory pool was released"), std::string::npos);
}

TEST(ExplainCaptureFailure, ClassifiesThroughTheCallerChain) {
  CaptureCulprit culprit;
  culprit.op = "aten::_some_internal_op";
  culprit.callers = {"aten::nonzero", "aten::index"};
  const std::string message = explain_capture_failure("the function", culprit, "", "", {});
  EXPECT_NE(message.find("data-dependent shape"), std::string::npos) << message;
}

TEST(ExplainCaptureFailure, ACopyFromTheHostIsAHostDeviceCopy) {
  CaptureCulprit culprit;
  culprit.op = "aten::copy_";
  culprit.inputs = "(4,) float32 cuda:0, (4,) float32 cpu";
  const std::string message = explain_capture_failure("the function", culprit, "", "", {});
  EXPECT_NE(message.find("host-device copy"), std::string::npos) << message;
}

TEST(ExplainCaptureFailure, OutsideOperatorsUsesTheExceptionStack) {
  const std::vector<SourceFrame> stack{
      frame("/site/torch/cuda/__init__.py", 1083, "synchronize", false),
      frame("train.py", 7, "step", true)};
  const std::string message = explain_capture_failure(
      "function `step`", std::nullopt, "aten::addmm", "CUDA error: operation not permitted", stack);
  EXPECT_NE(message.find("outside any ATen operator, in synchronize (/site/torch/cuda/"
                         "__init__.py:1083), called at train.py:7 in step"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("`aten::addmm`"), std::string::npos) << message;
  EXPECT_NE(message.find("explicit synchronization"), std::string::npos) << message;
}

TEST(ExplainCaptureFailure, UnknownCauseStillGivesAFix) {
  const std::string message = explain_capture_failure("the function", std::nullopt, "", "", {});
  EXPECT_NE(message.find("operation not capturable"), std::string::npos) << message;
  EXPECT_NE(message.find("graphed.check()"), std::string::npos) << message;
}

}  // namespace
}  // namespace graphed
