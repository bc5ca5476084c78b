// graphed's NVTX ranges (include/graphed/nvtx.h): names, the switch, moves,
// and (on a GPU) the ranges of a capture and of graphed callables. No
// profiler is needed: ctest makes nvtx_recorder (a small NVTX tool, see
// nvtx_recorder.h) NVTX's tool for this test, and it records every range.

#include "graphed/nvtx.h"

#include "graphed/capture.h"
#include "graphed/graphed_callable.h"
#include "test_support.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if GRAPHED_NVTX_RECORDER
#include "nvtx_recorder.h"
#endif

namespace {

// The ranges recorded since the last call (none without the recorder).
std::vector<std::string> take_events() {
#if GRAPHED_NVTX_RECORDER
  return graphed::nvtx_test::take_nvtx_events();
#else
  return {};
#endif
}

// True when the ranges graphed emits are recorded: graphed has NVTX and the
// recorder is NVTX's tool (ctest sets NVTX_INJECTION64_PATH for this test).
bool recording() {
#if GRAPHED_NVTX_RECORDER
  const char* tool = std::getenv("NVTX_INJECTION64_PATH");
  return graphed::nvtx_available() && tool != nullptr &&
         std::strstr(tool, "graphed_nvtx_recorder") != nullptr;
#else
  return false;
#endif
}

}  // namespace

namespace graphed {
namespace {

using Events = std::vector<std::string>;

constexpr const char* kNotRecorded =
    "ranges are not recorded: graphed was built without the nvtx3 headers, or the test runs "
    "outside ctest (set NVTX_INJECTION64_PATH to the graphed_nvtx_recorder library)";

// Each test starts with ranges on and no recorded events, and leaves the
// switch as it found it.
class Nvtx : public ::testing::Test {
 protected:
  void SetUp() override {
    was_enabled_ = set_nvtx_enabled(true);
    take_events();
  }
  void TearDown() override { set_nvtx_enabled(was_enabled_); }
  // False where ranges are not recorded: graphed built without NVTX, or the
  // test run outside ctest (without NVTX_INJECTION64_PATH).
  static bool emits() { return recording(); }

 private:
  bool was_enabled_ = true;
};

TEST(NvtxNames, PhaseAndSubject) {
  EXPECT_EQ(nvtx_phase_name(NvtxPhase::kWarmup), "warmup");
  EXPECT_EQ(nvtx_phase_name(NvtxPhase::kCapture), "capture");
  EXPECT_EQ(nvtx_phase_name(NvtxPhase::kReplay), "replay");
  EXPECT_EQ(nvtx_range_name(NvtxPhase::kReplay, "layers.0"), "graphed/replay:layers.0");
  EXPECT_EQ(nvtx_range_name(NvtxPhase::kWarmup, "step"), "graphed/warmup:step");
  EXPECT_EQ(nvtx_range_name(NvtxPhase::kCapture, ""), "graphed/capture:");
}

TEST(NvtxNames, SubjectIsTheNamedPartOfADescription) {
  EXPECT_EQ(nvtx_subject("module `layers.0` (Block)"), "layers.0 (Block)");
  EXPECT_EQ(nvtx_subject("function `step`"), "step");
  EXPECT_EQ(nvtx_subject("training step `train_step`"), "train_step");
  EXPECT_EQ(nvtx_subject("module `Block` (microbatch 1)"), "Block (microbatch 1)");
  EXPECT_EQ(nvtx_subject("the function"), "the function");
  EXPECT_EQ(nvtx_subject(""), "");
}

TEST_F(Nvtx, SwitchReturnsThePreviousSetting) {
  EXPECT_TRUE(set_nvtx_enabled(false));
  EXPECT_FALSE(nvtx_enabled());
  EXPECT_FALSE(set_nvtx_enabled(true));
  EXPECT_EQ(nvtx_enabled(), nvtx_available());
}

TEST_F(Nvtx, DisabledRangesEmitNothing) {
  set_nvtx_enabled(false);
  {
    const NvtxRange range("graphed/replay:off");
    EXPECT_FALSE(range.open());
    const NvtxRange phase(NvtxPhase::kCapture, "off");
    EXPECT_FALSE(phase.open());
  }
  EXPECT_EQ(take_events(), Events{});
}

TEST_F(Nvtx, RangePushesAndPopsOnce) {
  if (!emits()) GTEST_SKIP() << kNotRecorded;
  {
    const NvtxRange outer(NvtxPhase::kCapture, "f");
    EXPECT_TRUE(outer.open());
    const NvtxRange inner(std::string("graphed/replay:g"));
    EXPECT_TRUE(inner.open());
  }
  EXPECT_EQ(take_events(),
            (Events{"push graphed/capture:f", "push graphed/replay:g", "pop", "pop"}));
}

TEST_F(Nvtx, EndIsIdempotent) {
  if (!emits()) GTEST_SKIP() << kNotRecorded;
  {
    NvtxRange range("r");
    range.end();
    EXPECT_FALSE(range.open());
    range.end();
  }
  EXPECT_EQ(take_events(), (Events{"push r", "pop"}));
}

TEST_F(Nvtx, MovedRangeEndsOnce) {
  if (!emits()) GTEST_SKIP() << kNotRecorded;
  {
    NvtxRange first("a");
    NvtxRange second(std::move(first));
    EXPECT_FALSE(first.open());  // NOLINT(bugprone-use-after-move): the contract under test
    EXPECT_TRUE(second.open());
  }
  EXPECT_EQ(take_events(), (Events{"push a", "pop"}));
}

TEST_F(Nvtx, MoveAssignmentEndsTheTargetFirst) {
  if (!emits()) GTEST_SKIP() << kNotRecorded;
  {
    NvtxRange target("a");
    NvtxRange source("b");
    target = std::move(source);
    EXPECT_EQ(take_events(), (Events{"push a", "push b", "pop"}));
    EXPECT_TRUE(target.open());
    EXPECT_FALSE(source.open());  // NOLINT(bugprone-use-after-move)
    NvtxRange& alias = target;
    target = std::move(alias);  // self-move keeps the range open
    EXPECT_TRUE(target.open());
  }
  EXPECT_EQ(take_events(), (Events{"pop"}));
  static_assert(std::is_nothrow_move_constructible_v<NvtxRange>);
  static_assert(std::is_nothrow_move_assignable_v<NvtxRange>);
  static_assert(!std::is_copy_constructible_v<NvtxRange>);
}

TEST_F(Nvtx, RangeOpenedBeforeSwitchingOffStillEnds) {
  if (!emits()) GTEST_SKIP() << kNotRecorded;
  {
    const NvtxRange range("r");
    set_nvtx_enabled(false);
  }
  EXPECT_EQ(take_events(), (Events{"push r", "pop"}));
}

TEST_F(Nvtx, RecorderIsNvtxsTool) {
  if (!emits()) GTEST_SKIP() << kNotRecorded;
  { const NvtxRange range("first"); }
#if GRAPHED_NVTX_RECORDER
  EXPECT_TRUE(nvtx_test::nvtx_recorder_attached());
#endif
  EXPECT_EQ(take_events(), (Events{"push first", "pop"}));
}

TEST_F(Nvtx, DefaultRangeIsClosed) {
  const NvtxRange range;
  EXPECT_FALSE(range.open());
  EXPECT_EQ(take_events(), Events{});
}

// The tests that capture graphs (suites named *OnGpu need a GPU).
class NvtxOnGpu : public Nvtx {};

// The ranges a capture and its calls emit: warm-up, capture, one replay per call.
TEST_F(NvtxOnGpu, CaptureMarksWarmupCaptureAndReplay) {
  GRAPHED_REQUIRE_GPU();
  if (!emits()) GTEST_SKIP() << kNotRecorded;
  const at::Tensor weight = at::randn({16, 16}, at::kCUDA);
  CaptureOptions options;
  options.description = "function `affine`";
  CapturedFunction captured = capture(
      [weight](const std::vector<c10::IValue>& inputs) -> c10::IValue {
        return at::mm(inputs[0].toTensor(), weight);
      },
      {at::randn({4, 16}, at::kCUDA)}, options);
  EXPECT_EQ(take_events(),
            (Events{"push graphed/warmup:affine", "pop", "push graphed/capture:affine", "pop"}));
  (void)captured({at::randn({4, 16}, at::kCUDA)});
  (void)captured({at::randn({4, 16}, at::kCUDA)});
  EXPECT_EQ(take_events(), (Events{"push graphed/replay:affine", "pop",
                                   "push graphed/replay:affine", "pop"}));
  set_nvtx_enabled(false);
  (void)captured({at::randn({4, 16}, at::kCUDA)});
  EXPECT_EQ(take_events(), Events{});
}

TEST_F(NvtxOnGpu, GraphedCallableMarksForwardAndBackward) {
  GRAPHED_REQUIRE_GPU();
  if (!emits()) GTEST_SKIP() << kNotRecorded;
  auto linear = std::make_shared<torch::nn::LinearImpl>(8, 8);
  linear->to(torch::kCUDA);
  GraphableCallable callable = graphable_module(
      linear,
      [linear](const std::vector<c10::IValue>& inputs) -> c10::IValue {
        return linear->forward(inputs[0].toTensor());
      },
      "module `proj`");
  const at::Tensor sample = at::randn({4, 8}, at::kCUDA).requires_grad_(true);
  auto graphed = make_graphed_callables({std::move(callable)}, {{sample}});
  const Events captured = take_events();
  EXPECT_EQ(captured, (Events{"push graphed/warmup:proj", "pop",
                              "push graphed/capture:proj forward", "pop",
                              "push graphed/capture:proj backward", "pop"}));
  const at::Tensor x = at::randn({4, 8}, at::kCUDA).requires_grad_(true);
  const at::Tensor y = (*graphed.front())({x}).toTensor();
  y.sum().backward();
  torch::cuda::synchronize();
  EXPECT_EQ(take_events(), (Events{"push graphed/replay:proj forward", "pop",
                                   "push graphed/replay:proj backward", "pop"}));
}

}  // namespace
}  // namespace graphed
