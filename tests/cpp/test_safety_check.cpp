// check_safety on CPU tensors: each blocker kind is found once per user call,
// static-shaped lookalikes are not, state comes back, and the report reads
// right. The CUDA-only kinds (copies, CPU tensors in GPU work) run where a GPU is.

#include "graphed/safety_check.h"
#include "graphed/check.h"
#include "test_support.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>

#include <functional>
#include <stdexcept>

namespace graphed {
namespace {

// Reports the line the test sets, in a user file, below one library frame.
class TestLocator final : public SourceLocator {
 public:
  std::vector<SourceFrame> current_stack() const override {
    return {SourceFrame{"/site/torch/_tensor.py", 7, "item", false},
            SourceFrame{"model.py", line, "forward", true}};
  }
  static inline int line = 1;
};

class SafetyCheck : public ::testing::Test {
 protected:
  void SetUp() override { set_source_locator(std::make_shared<TestLocator>()); }
  void TearDown() override { set_source_locator(nullptr); }

  static std::vector<SafetyFinding> of_kind(const SafetyReport& report, BlockerKind kind) {
    std::vector<SafetyFinding> found;
    for (const SafetyFinding& finding : report.findings()) {
      if (finding.kind == kind) {
        found.push_back(finding);
      }
    }
    return found;
  }

  static std::string describe(const SafetyReport& report) { return report.to_string(); }
};

TEST_F(SafetyCheck, ItemIsOneHostReadAtTheUserLine) {
  const at::Tensor x = at::ones({3});
  TestLocator::line = 12;
  const SafetyReport report = check_safety([&] { (void)x.sum().item<float>(); });
  ASSERT_EQ(report.findings().size(), 1u) << describe(report);
  const SafetyFinding& finding = report.findings()[0];
  EXPECT_EQ(finding.kind, BlockerKind::kHostRead);
  EXPECT_EQ(finding.op, "aten::item");  // not also its aten::_local_scalar_dense
  EXPECT_EQ(finding.inputs, "() float32 cpu");
  EXPECT_EQ(finding.where(), "model.py:12 in forward");
  EXPECT_TRUE(finding.predicted);
  EXPECT_EQ(finding.count, 1);
  EXPECT_FALSE(report.ran_on_gpu());
}

TEST_F(SafetyCheck, TruthValueAndEqualAreHostReads) {
  const at::Tensor x = at::ones({3});
  const SafetyReport report = check_safety([&] {
    TestLocator::line = 1;
    (void)at::is_nonzero(x.sum());
    TestLocator::line = 2;
    (void)at::equal(x, x);
  });
  ASSERT_EQ(report.findings().size(), 2u) << describe(report);
  EXPECT_EQ(report.findings()[0].op, "aten::is_nonzero");
  EXPECT_EQ(report.findings()[1].op, "aten::equal");
  EXPECT_EQ(of_kind(report, BlockerKind::kHostRead).size(), 2u);
}

TEST_F(SafetyCheck, DataDependentShapesAreFound) {
  const at::Tensor x = at::arange(6, at::kFloat);
  const at::Tensor mask = x > 2;
  const std::vector<std::pair<std::string, std::function<void()>>> cases{
      {"aten::nonzero", [&] { (void)at::nonzero(x); }},
      {"aten::masked_select", [&] { (void)at::masked_select(x, mask); }},
      {"aten::_unique2", [&] { (void)at::_unique2(x); }},
      {"aten::unique_consecutive", [&] { (void)at::unique_consecutive(x); }},
      {"aten::index", [&] { (void)x.index({mask}); }},
      {"aten::where", [&] { (void)at::where(mask); }},
      {"aten::repeat_interleave", [&] { (void)at::repeat_interleave(at::ones({3}, at::kLong)); }},
      {"aten::index_put_", [&] { (void)x.clone().index_put_({mask}, at::zeros({3})); }},
  };
  for (const auto& [op, run] : cases) {
    SCOPED_TRACE(op);
    const SafetyReport report = check_safety(run);
    ASSERT_EQ(report.findings().size(), 1u) << describe(report);
    EXPECT_EQ(report.findings()[0].kind, BlockerKind::kDataDependentShape);
    EXPECT_EQ(report.findings()[0].op, op);
  }
}

TEST_F(SafetyCheck, StaticShapedLookalikesAreClean) {
  const at::Tensor x = at::arange(6, at::kFloat);
  const at::Tensor mask = x > 2;
  const SafetyReport report = check_safety([&] {
    (void)x.index({at::arange(2)});                             // integer indexing
    (void)x.clone().index_put_({mask}, at::scalar_tensor(0.));  // becomes masked_fill_
    (void)x.repeat_interleave(2);                               // integer repeats
    (void)at::repeat_interleave(at::ones({3}, at::kLong), 3);   // output_size given
    (void)at::where(mask, x, 0.0);                              // three-argument where
    (void)x.masked_fill(mask, 1.0);
    (void)at::nonzero_static(x, 4);
  });
  EXPECT_TRUE(report.empty()) << describe(report);
}

TEST_F(SafetyCheck, CleanFunctionGivesAnEmptyReport) {
  const at::Tensor x = at::randn({8, 16});
  const at::Tensor weight = at::randn({16, 16}).requires_grad_();
  const SafetyReport report = check_safety([&] {
    at::Tensor y = at::relu(at::matmul(x, weight));
    y = at::layer_norm(at::softmax(y, -1), {16});
    y = at::dropout(y, 0.5, /*train=*/true);  // the default generator
    y.sum().backward();
    (void)x.to(at::kCPU);  // already on the CPU: no copy
  });
  EXPECT_TRUE(report.empty()) << describe(report);
  EXPECT_GT(report.operators_observed(), 10);
  EXPECT_NE(describe(report).find("no capture blockers among"), std::string::npos)
      << describe(report);
}

TEST_F(SafetyCheck, RepeatsAtOneLineAreCountedAndLinesAreSeparate) {
  const at::Tensor x = at::ones({3});
  const SafetyReport report = check_safety([&] {
    for (int i = 0; i < 3; ++i) {
      TestLocator::line = 20;
      (void)x.sum().item<float>();
    }
    TestLocator::line = 21;
    (void)x.sum().item<float>();
  });
  ASSERT_EQ(report.findings().size(), 2u) << describe(report);
  EXPECT_EQ(report.findings()[0].where(), "model.py:20 in forward");
  EXPECT_EQ(report.findings()[0].count, 3);
  EXPECT_EQ(report.findings()[1].where(), "model.py:21 in forward");
  EXPECT_EQ(report.findings()[1].count, 1);
  EXPECT_NE(describe(report).find("2 capture blockers (4 occurrences)"), std::string::npos)
      << describe(report);
}

TEST_F(SafetyCheck, NonDefaultGeneratorsAreUnregistered) {
  at::Generator own = at::make_generator<at::CPUGeneratorImpl>(7);
  at::Tensor x = at::empty({4});
  const SafetyReport report = check_safety([&] {
    TestLocator::line = 30;
    (void)at::randn({3}, own);
    TestLocator::line = 31;
    x.normal_(0, 1, own);
    TestLocator::line = 32;
    (void)at::randn({3}, at::detail::getDefaultCPUGenerator());
    (void)at::randn({3});
  });
  ASSERT_EQ(report.findings().size(), 2u) << describe(report);
  EXPECT_EQ(report.findings()[0].op, "aten::randn");  // not also its aten::normal_
  EXPECT_EQ(report.findings()[1].op, "aten::normal_");
  for (const SafetyFinding& finding : report.findings()) {
    EXPECT_EQ(finding.kind, BlockerKind::kUnregisteredGenerator);
    EXPECT_NE(finding.detail.find("not the default generator"), std::string::npos);
  }
}

TEST_F(SafetyCheck, AutocastCacheIsOneFindingForThePass) {
  const at::Tensor x = at::randn({2, 4});
  const at::Tensor weight = at::randn({4, 4}).requires_grad_();
  auto run_under_autocast = [&](bool cache_enabled) {
    const bool previous_cache = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_cache_enabled(cache_enabled);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    SafetyReport report;
    try {
      report = check_safety([&] {
        TestLocator::line = 40;
        (void)at::linear(x, weight);
        TestLocator::line = 41;
        (void)at::linear(x, weight);
      });
    } catch (...) {
      at::autocast::set_autocast_enabled(at::kCPU, false);
      throw;
    }
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::set_autocast_cache_enabled(previous_cache);
    at::autocast::clear_cache();
    return report;
  };
  const SafetyReport cached = run_under_autocast(true);
  ASSERT_EQ(cached.findings().size(), 1u) << describe(cached);
  const SafetyFinding& finding = cached.findings()[0];
  EXPECT_EQ(finding.kind, BlockerKind::kAutocastCache);
  EXPECT_EQ(finding.op, "aten::linear");
  EXPECT_EQ(finding.where(), "model.py:40 in forward");
  EXPECT_EQ(finding.count, 2);
  EXPECT_NE(finding.detail.find("(4, 4) float32 cpu requires_grad"), std::string::npos)
      << finding.detail;
  EXPECT_TRUE(run_under_autocast(false).empty());
}

TEST_F(SafetyCheck, BlockersInBackwardNameTheirAutogradNode) {
  const at::Tensor x = at::arange(6, at::kFloat).requires_grad_();
  const SafetyReport report = check_safety([&] {
    const at::Tensor picked = x.index({x.detach() > 2});
    picked.sum().backward();
  });
  ASSERT_EQ(report.findings().size(), 2u) << describe(report);
  EXPECT_EQ(report.findings()[0].op, "aten::index");
  EXPECT_EQ(report.findings()[0].inside, "");
  EXPECT_EQ(report.findings()[1].kind, BlockerKind::kDataDependentShape);
  EXPECT_EQ(report.findings()[1].inside, "IndexBackward0") << describe(report);
}

TEST_F(SafetyCheck, RestoresStateAndGenerators) {
  at::Tensor running_mean = at::zeros({4});
  const SafetyCheckOptions options{{running_mean}, "module `Norm`"};
  at::manual_seed(3);
  const at::Tensor expected_draw = at::randn({5});
  at::manual_seed(3);
  const SafetyReport report = check_safety(
      [&] {
        running_mean.add_(1);
        (void)at::randn({100});
      },
      options);
  EXPECT_TRUE(at::equal(running_mean, at::zeros({4})));
  EXPECT_TRUE(at::equal(at::randn({5}), expected_draw));
  EXPECT_EQ(report.description(), "module `Norm`");
}

TEST_F(SafetyCheck, AnExceptionPropagatesAfterRestoring) {
  at::Tensor buffer = at::zeros({2});
  SafetyCheckOptions options;
  options.state = {buffer};
  EXPECT_THROW(check_safety(
                   [&] {
                     buffer.fill_(5);
                     throw std::runtime_error("user code failed");
                   },
                   options),
               std::runtime_error);
  EXPECT_TRUE(at::equal(buffer, at::zeros({2})));
  // The observer is gone: a new check runs and sees its own operators only.
  const at::Tensor x = at::ones({2});
  const SafetyReport report = check_safety([&] { (void)at::nonzero(x); });
  ASSERT_EQ(report.findings().size(), 1u) << describe(report);
}

TEST_F(SafetyCheck, OneCheckAtATime) {
  EXPECT_THROW_WITH(check_safety([] { check_safety([] {}); }), Error,
                    "one safety check at a time");
  EXPECT_THROW_WITH(check_safety(std::function<void()>()), Error, "Expected a function");
  EXPECT_NO_THROW(check_safety([] {}));
}

TEST_F(SafetyCheck, HostCallsAreRecordedOnlyDuringACheck) {
  const at::Tensor x = at::ones({3});
  EXPECT_FALSE(record_host_blocker(BlockerKind::kExplicitSync, "torch.cuda.synchronize", {}));
  const SafetyReport report = check_safety([&] {
    TestLocator::line = 50;
    EXPECT_TRUE(record_host_blocker(BlockerKind::kExplicitSync, "torch.cuda.synchronize", {}));
    TestLocator::line = 51;
    EXPECT_TRUE(record_host_blocker(BlockerKind::kHostRead, "Tensor.tolist", {x}));
    QuietOperatorsGuard quiet;
    (void)x.sum().item<float>();  // part of the host call recorded above
    EXPECT_FALSE(record_host_blocker(BlockerKind::kHostRead, "Tensor.tolist", {x}));
  });
  ASSERT_EQ(report.findings().size(), 2u) << describe(report);
  const SafetyFinding& sync = report.findings()[0];
  EXPECT_EQ(sync.kind, BlockerKind::kExplicitSync);
  EXPECT_EQ(sync.op, "torch.cuda.synchronize");
  EXPECT_EQ(sync.where(), "model.py:50 in forward");
  EXPECT_FALSE(sync.predicted);  // a sync is a sync on any machine
  const SafetyFinding& tolist = report.findings()[1];
  EXPECT_EQ(tolist.inputs, "(3,) float32 cpu");
  EXPECT_TRUE(tolist.predicted);
}

TEST_F(SafetyCheck, TensorsFromHostDataBlockOnlyForCuda) {
  const SafetyReport report = check_safety([] {
    EXPECT_FALSE(record_tensor_from_host_data("torch.tensor", c10::Device(c10::kCPU)));
    EXPECT_TRUE(record_tensor_from_host_data("torch.tensor", c10::Device(c10::kCUDA, 0)));
  });
  ASSERT_EQ(report.findings().size(), 1u) << describe(report);
  EXPECT_EQ(report.findings()[0].kind, BlockerKind::kHostDeviceCopy);
  EXPECT_NE(report.findings()[0].detail.find("builds a tensor on cuda:0 from host data"),
            std::string::npos);
}

TEST_F(SafetyCheck, AnEmptyTensorFromHostDataIsHarmlessAndKeptApart) {
  const SafetyReport report = check_safety([] {
    EXPECT_TRUE(record_tensor_from_host_data("torch.tensor", c10::Device(c10::kCUDA, 0), 0));
  });
  EXPECT_TRUE(report.empty()) << describe(report);
  ASSERT_EQ(report.harmless().size(), 1u);
  EXPECT_EQ(report.harmless()[0].severity, FindingSeverity::kHarmless);
  EXPECT_EQ(capture_verdict(report), CaptureVerdict::kClean);
  EXPECT_NE(describe(report).find("Not counted (harmless"), std::string::npos) << describe(report);
}

TEST_F(SafetyCheck, FindingsTakeTheSeverityOfTheirKind) {
  const at::Tensor x = at::ones({3});
  const SafetyReport report = check_safety([&] {
    (void)x.sum().item<float>();
    at::Generator other = at::make_generator<at::CPUGeneratorImpl>(7);
    (void)at::rand({2}, other);
  });
  ASSERT_EQ(report.findings().size(), 2u) << describe(report);
  EXPECT_EQ(report.findings()[0].severity, FindingSeverity::kBreaksCapture);
  EXPECT_EQ(report.findings()[1].severity, FindingSeverity::kSpoilsReplay);
  EXPECT_TRUE(report.spoils_replay());
}

TEST_F(SafetyCheck, TheWrapperRunsEveryPassOnceAndLetsExceptionsThrough) {
  int wrapped = 0;
  set_check_pass_wrapper([&](const std::function<void()>& pass) {
    ++wrapped;
    pass();
  });
  int ran = 0;
  (void)check_safety([&] { ++ran; });
  EXPECT_EQ(wrapped, 1);
  EXPECT_EQ(ran, 1);
  EXPECT_THROW((void)check_safety([] { throw std::runtime_error("user"); }), std::runtime_error);
  set_check_pass_wrapper([](const std::function<void()>& /*pass*/) {});
  EXPECT_THROW((void)check_safety([] {}), c10::Error);  // a wrapper that skips the pass
  set_check_pass_wrapper({});
}

SafetyFinding finding_at(BlockerKind kind, std::optional<SourceFrame> where) {
  SafetyFinding finding;
  finding.kind = kind;
  finding.op = "aten::item";
  finding.severity = default_severity(kind);
  finding.location = std::move(where);
  return finding;
}

TEST(CaptureVerdict, CaptureDecidesWhatTheUserCannotEditAndTheCheckTheRest) {
  const SourceFrame user{"train.py", 3, "step", true, false};
  const SourceFrame package{"/venv/lib/python3.12/site-packages/transformers/masking_utils.py",
                            260, "sdpa_mask", true, true};
  const auto verdict = [](std::vector<SafetyFinding> findings) {
    return capture_verdict(SafetyReport("f", std::move(findings), true, 1));
  };
  EXPECT_EQ(verdict({}), CaptureVerdict::kClean);
  EXPECT_EQ(verdict({finding_at(BlockerKind::kHostRead, package)}), CaptureVerdict::kTryCapture);
  EXPECT_EQ(verdict({finding_at(BlockerKind::kHostRead, std::nullopt)}),
            CaptureVerdict::kBlocked);  // no line (LibTorch, autograd's threads): whose code?
  EXPECT_EQ(verdict({finding_at(BlockerKind::kHostRead, package),
                     finding_at(BlockerKind::kExplicitSync, user)}),
            CaptureVerdict::kBlocked);
  // What spoils replay a capture cannot reveal: blocked wherever it is.
  EXPECT_EQ(verdict({finding_at(BlockerKind::kCpuTensor, package)}), CaptureVerdict::kBlocked);
  EXPECT_EQ(capture_verdict_name(CaptureVerdict::kTryCapture), "try_capture");
  EXPECT_TRUE(is_installed_package_file(package.file));
  EXPECT_FALSE(is_installed_package_file(user.file));
}

TEST(SafetyReportText, ListsEachFindingWithWhyAndFix) {
  SafetyFinding finding;
  finding.kind = BlockerKind::kHostRead;
  finding.op = "aten::item";
  finding.inputs = "() float32 cpu";
  finding.location = SourceFrame{"model.py", 12, "forward", true};
  finding.count = 2;
  finding.predicted = true;
  const SafetyReport report("function `step`", {finding}, /*ran_on_gpu=*/false, 9);
  const std::string text = report.to_string();
  const BlockerInfo& info = blocker_info(BlockerKind::kHostRead);
  EXPECT_NE(text.find("graphed.check of function `step`: 1 capture blocker (2 occurrences) among "
                      "9 operators."),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("1. host read (breaks capture): `aten::item` at model.py:12 in forward, "
                      "2 times\n"
                      "   inputs: () float32 cpu\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("   why:    " + std::string(info.why)), std::string::npos) << text;
  EXPECT_NE(text.find("   fix:    " + std::string(info.fix)), std::string::npos) << text;
  EXPECT_NE(text.find("ran on CPU tensors only"), std::string::npos) << text;
  const SafetyReport on_gpu("the function", {}, /*ran_on_gpu=*/true, 3);
  EXPECT_EQ(on_gpu.to_string(), "graphed.check of the function: no capture blockers among 3 "
                                "operators.");
}

// --- on a GPU -----------------------------------------------------------------

class SafetyCheckOnGpu : public SafetyCheck {};

TEST_F(SafetyCheckOnGpu, CopiesAreFoundAndPredictionsDropped) {
  GRAPHED_REQUIRE_GPU();
  const at::Tensor on_gpu = at::ones({4}, at::kCUDA);
  const at::Tensor on_cpu = at::ones({4});
  const SafetyReport report = check_safety([&] {
    TestLocator::line = 60;
    (void)on_gpu.cpu();
    TestLocator::line = 61;
    (void)(on_gpu + on_cpu.to(at::kCUDA));
    TestLocator::line = 62;
    (void)(on_gpu + at::scalar_tensor(2.0));  // 0-dim CPU scalars are fine
    TestLocator::line = 63;
    (void)on_cpu.sum().item<float>();  // a CPU value costs the GPU nothing
  });
  EXPECT_TRUE(report.ran_on_gpu());
  const auto copies = of_kind(report, BlockerKind::kHostDeviceCopy);
  ASSERT_GE(copies.size(), 2u) << describe(report);
  EXPECT_EQ(copies[0].where(), "model.py:60 in forward");
  EXPECT_NE(copies[0].detail.find("copies cuda:0 to cpu"), std::string::npos) << copies[0].detail;
  EXPECT_FALSE(copies[0].predicted);
  EXPECT_EQ(copies[1].where(), "model.py:61 in forward");
  EXPECT_TRUE(of_kind(report, BlockerKind::kHostRead).empty()) << describe(report);
  EXPECT_TRUE(of_kind(report, BlockerKind::kCpuTensor).empty()) << describe(report);
}

TEST_F(SafetyCheckOnGpu, CpuTensorMixedIntoGpuWork) {
  GRAPHED_REQUIRE_GPU();
  const at::Tensor on_gpu = at::ones({4}, at::kCUDA);
  const at::Tensor index = at::arange(2);  // a CPU index into a GPU tensor
  const SafetyReport report = check_safety([&] {
    TestLocator::line = 70;
    (void)on_gpu.index({index});
    TestLocator::line = 71;
    (void)on_gpu.sum().item<float>();
  });
  const auto mixed = of_kind(report, BlockerKind::kCpuTensor);
  ASSERT_EQ(mixed.size(), 1u) << describe(report);
  EXPECT_EQ(mixed[0].where(), "model.py:70 in forward");
  EXPECT_NE(mixed[0].detail.find("(2,) int64 cpu"), std::string::npos) << mixed[0].detail;
  const auto reads = of_kind(report, BlockerKind::kHostRead);
  ASSERT_EQ(reads.size(), 1u) << describe(report);
  EXPECT_FALSE(reads[0].predicted);
}

}  // namespace
}  // namespace graphed
