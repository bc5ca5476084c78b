// Signature: structure, specs, constants, and the messages of a mismatch.
// Signatures are pure host logic, so CPU tensors exercise all of it.

#include "graphed/check.h"
#include "graphed/signature.h"
#include "test_support.h"

#include <ATen/ATen.h>

namespace graphed {
namespace {

using c10::IValue;

IValue tuple(std::vector<IValue> elements) { return c10::ivalue::Tuple::create(std::move(elements)); }

IValue dict(std::vector<std::pair<std::string, IValue>> entries) {
  c10::impl::GenericDict result(c10::StringType::get(), c10::AnyType::get());
  for (auto& [key, value] : entries) {
    result.insert(key, value);
  }
  return result;
}

IValue list(std::vector<IValue> elements) {
  c10::impl::GenericList result(c10::AnyType::get());
  for (auto& element : elements) {
    result.push_back(element);
  }
  return result;
}

std::vector<IValue> sample() {
  return {tuple({at::zeros({32, 512}), IValue(2.0)}),
          dict({{"mask", at::ones({32}, at::kBool)}, {"mode", IValue(std::string("fast"))}})};
}

const std::vector<std::string> kNames{"args", "kwargs"};

TEST(Signature, NumbersTensorsDepthFirstWithPaths) {
  const Signature signature(sample(), kNames);
  ASSERT_EQ(signature.num_tensors(), 2u);
  EXPECT_EQ(signature.tensor_path(0), "args[0]");
  EXPECT_EQ(signature.tensor_path(1), "kwargs['mask']");
  EXPECT_EQ(signature.tensor_specs()[0].describe(), "(32, 512) float32 cpu");
  EXPECT_EQ(signature.tensor_specs()[1].describe(), "(32,) bool cpu");
}

TEST(Signature, MatchingInputsCollectTheirTensors) {
  const Signature signature(sample(), kNames);
  std::vector<IValue> call = sample();
  std::vector<at::Tensor> tensors;
  ASSERT_TRUE(signature.collect_tensors(call, tensors));
  ASSERT_EQ(tensors.size(), 2u);
  EXPECT_TRUE(tensors[0].is_same(call[0].toTupleRef().elements()[0].toTensor()));
  EXPECT_TRUE(signature.differences(call).empty());
}

TEST(Signature, DictKeyOrderDoesNotMatter) {
  const Signature signature(sample(), kNames);
  std::vector<IValue> call{tuple({at::zeros({32, 512}), IValue(2.0)}),
                           dict({{"mode", IValue(std::string("fast"))},
                                 {"mask", at::ones({32}, at::kBool)}})};
  std::vector<at::Tensor> tensors;
  ASSERT_TRUE(signature.collect_tensors(call, tensors));
  EXPECT_EQ(tensors[1].scalar_type(), at::kBool);  // still signature order
}

TEST(Signature, ShapeMismatchIsSpelledOut) {
  const Signature signature(sample(), kNames);
  std::vector<IValue> call{tuple({at::zeros({16, 512}), IValue(2.0)}), sample()[1]};
  std::vector<at::Tensor> tensors;
  EXPECT_FALSE(signature.collect_tensors(call, tensors));
  const auto differences = signature.differences(call);
  ASSERT_EQ(differences.size(), 1u);
  EXPECT_EQ(differences[0], "args[0]: expected (32, 512) float32 cpu, got (16, 512) float32 cpu");
}

TEST(Signature, DtypeAndConstantMismatchesAreAllListed) {
  const Signature signature(sample(), kNames);
  std::vector<IValue> call{tuple({at::zeros({32, 512}, at::kDouble), IValue(3.0)}),
                           dict({{"mask", at::ones({32}, at::kBool)},
                                 {"mode", IValue(std::string("slow"))}})};
  const auto differences = signature.differences(call);
  ASSERT_EQ(differences.size(), 3u);
  EXPECT_EQ(differences[0], "args[0]: expected (32, 512) float32 cpu, got (32, 512) float64 cpu");
  EXPECT_NE(differences[1].find("args[1]: expected 2"), std::string::npos) << differences[1];
  EXPECT_NE(differences[2].find("kwargs['mode']: expected"), std::string::npos)
      << differences[2];
}

TEST(Signature, MissingAndUnexpectedKeywordsAreNamed) {
  const Signature signature(sample(), kNames);
  std::vector<IValue> call{sample()[0], dict({{"mask", at::ones({32}, at::kBool)},
                                              {"scale", IValue(1.0)}})};
  const auto differences = signature.differences(call);
  ASSERT_EQ(differences.size(), 2u);
  EXPECT_NE(differences[0].find("kwargs['mode']: missing"), std::string::npos) << differences[0];
  EXPECT_NE(differences[1].find("kwargs['scale']: not present"), std::string::npos)
      << differences[1];
}

TEST(Signature, ContainerKindAndLengthMatter) {
  const Signature signature({list({at::zeros({2}), at::zeros({3})})}, {"xs"});
  std::vector<at::Tensor> tensors;
  EXPECT_FALSE(signature.collect_tensors({tuple({at::zeros({2}), at::zeros({3})})}, tensors));
  EXPECT_EQ(signature.differences({tuple({at::zeros({2}), at::zeros({3})})})[0],
            "xs: expected a list of 2, got a tuple of 2");
  EXPECT_EQ(signature.differences({list({at::zeros({2})})})[0],
            "xs: expected a list of 2, got a list of 1");
}

TEST(Signature, ATensorWhereAConstantWasIsAMismatch) {
  const Signature signature({IValue(int64_t{4})}, {"n"});
  std::vector<at::Tensor> tensors;
  EXPECT_FALSE(signature.collect_tensors({at::zeros({4})}, tensors));
  EXPECT_TRUE(signature.collect_tensors({IValue(int64_t{4})}, tensors));
  EXPECT_FALSE(signature.collect_tensors({IValue(4.0)}, tensors));  // int and float differ
}

TEST(Signature, RequiresGradIsCheckedOnlyWhenAsked) {
  const at::Tensor plain = at::zeros({2});
  const at::Tensor tracked = at::zeros({2}).requires_grad_();
  std::vector<at::Tensor> tensors;
  EXPECT_TRUE(Signature({plain}, {"x"}).collect_tensors({tracked}, tensors));
  const Signature strict({plain}, {"x"}, SignatureOptions{/*match_requires_grad=*/true});
  EXPECT_FALSE(strict.collect_tensors({tracked}, tensors));
  EXPECT_EQ(strict.differences({tracked})[0],
            "x: expected (2,) float32 cpu, got (2,) float32 cpu requires_grad");
}

TEST(Signature, WrongNumberOfInputs) {
  const Signature signature(sample(), kNames);
  std::vector<at::Tensor> tensors;
  EXPECT_FALSE(signature.collect_tensors({sample()[0]}, tensors));
  EXPECT_EQ(signature.differences({sample()[0]})[0], "expected 2 inputs, got 1");
}

TEST(Signature, DescribeListsEveryLeaf) {
  const Signature signature(sample(), kNames);
  const std::string text = signature.describe();
  EXPECT_NE(text.find("args[0]: (32, 512) float32 cpu"), std::string::npos) << text;
  EXPECT_NE(text.find("kwargs['mask']: (32,) bool cpu"), std::string::npos) << text;
  EXPECT_NE(text.find("kwargs['mode']:"), std::string::npos) << text;
}

TEST(Signature, ConstantsCompareByKindAndValue) {
  EXPECT_TRUE(constants_equal(IValue(1.5), IValue(1.5)));
  EXPECT_FALSE(constants_equal(IValue(1.5), IValue(2.5)));
  EXPECT_TRUE(constants_equal(IValue(std::nan("")), IValue(std::nan(""))));
  EXPECT_FALSE(constants_equal(IValue(0.0), IValue(-0.0)));
  EXPECT_FALSE(constants_equal(IValue(true), IValue(int64_t{1})));
  EXPECT_TRUE(constants_equal(IValue(), IValue()));
  EXPECT_TRUE(constants_equal(IValue(c10::Device("cuda:1")), IValue(c10::Device("cuda:1"))));
  EXPECT_FALSE(constants_equal(IValue(c10::Device("cuda:0")), IValue(c10::Device("cuda:1"))));
}

TEST(Signature, NamesMustMatchInputs) {
  EXPECT_THROW_WITH(Signature(sample(), {"args"}), Error, "one name per input");
}

}  // namespace
}  // namespace graphed
