// The safety check's rules (operator_rules.h), one operator call at a time:
// host reads, data-dependent shapes, host-device copies, generators, and what
// counts as GPU work. Calls are built by hand, so no GPU is needed.

#include "graphed/operator_rules.h"
#include "test_support.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

namespace graphed {
namespace {

using c10::IValue;

OperatorCall call_of(std::string_view name, const std::vector<IValue>& inputs) {
  OperatorCall call;
  call.name = name;
  call.inputs = c10::ArrayRef<const IValue>(inputs.data(), inputs.size());
  for (const IValue& input : inputs) collect_operator_tensors(input, call.tensors);
  call.on_gpu = is_gpu_work(call);
  return call;
}

TEST(OperatorRules, AHostReadOnCpuTensorsIsAPrediction) {
  const std::vector<IValue> inputs = {at::ones({1})};
  const std::vector<SafetyFinding> findings = classify_operator(call_of("aten::item", inputs));
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_EQ(findings[0].kind, BlockerKind::kHostRead);
  EXPECT_EQ(findings[0].op, "aten::item");
  EXPECT_TRUE(findings[0].predicted);
  EXPECT_EQ(findings[0].inputs, describe_tensors({at::ones({1})}));
}

TEST(OperatorRules, OperatorsInsideCpuKernelsAreNotReported) {
  const std::vector<IValue> inputs = {at::ones({1})};
  OperatorCall call = call_of("aten::item", inputs);
  call.inside_operator = true;
  EXPECT_TRUE(classify_operator(call).empty());
}

TEST(OperatorRules, BooleanMaskIndexingHasADataDependentShape) {
  const c10::List<std::optional<at::Tensor>> indices({at::ones({4}, at::kBool)});
  const std::vector<IValue> inputs = {at::ones({4}), indices};
  const std::vector<SafetyFinding> findings = classify_operator(call_of("aten::index", inputs));
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_EQ(findings[0].kind, BlockerKind::kDataDependentShape);
  EXPECT_NE(findings[0].detail.find("boolean mask"), std::string::npos) << findings[0].detail;

  const c10::List<std::optional<at::Tensor>> positions({at::zeros({2}, at::kLong)});
  const std::vector<IValue> by_position = {at::ones({4}), positions};
  EXPECT_TRUE(classify_operator(call_of("aten::index", by_position)).empty());
}

TEST(OperatorRules, AMoveToTheGpuIsAHostDeviceCopyAndGpuWork) {
  const std::vector<IValue> inputs = {at::ones({2, 2}), IValue(c10::Device(c10::kCUDA, 0))};
  const OperatorCall call = call_of("aten::to", inputs);
  EXPECT_TRUE(call.on_gpu);
  const std::vector<SafetyFinding> findings = classify_operator(call);
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_EQ(findings[0].kind, BlockerKind::kHostDeviceCopy);
  EXPECT_EQ(findings[0].detail, "copies cpu to cuda:0");

  const std::vector<IValue> empty = {at::ones({0}), IValue(c10::Device(c10::kCUDA, 0))};
  const std::vector<SafetyFinding> nothing = classify_operator(call_of("aten::to", empty));
  ASSERT_EQ(nothing.size(), 1u);
  EXPECT_EQ(nothing[0].severity, FindingSeverity::kHarmless);
}

TEST(OperatorRules, ANonDefaultGeneratorIsReported) {
  const at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(0);
  const std::vector<IValue> inputs = {at::ones({3}), IValue(generator)};
  const std::vector<SafetyFinding> findings =
      classify_operator(call_of("aten::bernoulli", inputs));
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_EQ(findings[0].kind, BlockerKind::kUnregisteredGenerator);
  EXPECT_TRUE(findings[0].predicted);
}

TEST(OperatorRules, PlainCpuWorkIsNeitherGpuWorkNorAFinding) {
  const std::vector<IValue> inputs = {at::ones({2}), at::ones({2})};
  const OperatorCall call = call_of("aten::add", inputs);
  EXPECT_FALSE(call.on_gpu);
  EXPECT_EQ(call.tensors.size(), 2u);
  EXPECT_TRUE(classify_operator(call).empty());
  EXPECT_FALSE(any_cuda(call.tensors));
}

}  // namespace
}  // namespace graphed
