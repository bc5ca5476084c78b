// AutoBuckets: when buckets are picked (Note [Buckets graphed picks itself])
// and how a padded replay's outputs are compared with eager. Host logic on
// CPU tensors; GraphManager's use of it is in test_graph_manager.cpp.

#include "graphed/auto_buckets.h"
#include "graphed/check.h"
#include "test_support.h"

#include <ATen/ATen.h>

namespace graphed {
namespace {

using c10::IValue;

std::vector<IValue> call_of(const at::Tensor& x, const at::Tensor& positions) {
  c10::impl::GenericDict kwargs(c10::StringType::get(), c10::AnyType::get());
  kwargs.insert("position_ids", positions);
  return {c10::ivalue::Tuple::create({x}), kwargs, IValue(false)};
}

TEST(AutoBuckets, PicksOnceCallsAlikeButForTheBatchCameAtFourSizes) {
  AutoBuckets picker(4);
  const at::Tensor positions = at::zeros({1, 7}, at::kLong);
  EXPECT_FALSE(picker.observe(call_of(at::ones({3, 7, 8}), positions)));
  EXPECT_FALSE(picker.observe(call_of(at::ones({5, 7, 8}), positions)));
  EXPECT_FALSE(picker.observe(call_of(at::ones({5, 7, 8}), positions)));  // a size seen
  // Another sequence length is another kind of call, counted apart.
  EXPECT_FALSE(picker.observe(call_of(at::ones({6, 9, 8}), at::zeros({1, 9}, at::kLong))));
  EXPECT_FALSE(picker.observe(call_of(at::ones({6, 7, 8}), positions)));
  EXPECT_TRUE(picker.observe(call_of(at::ones({12, 7, 8}), positions)));
  // Inputs that disagree along dimension 0 cannot be bucketed: never counted.
  AutoBuckets other(2);
  EXPECT_FALSE(other.observe(call_of(at::ones({3, 7}), at::zeros({2, 7}, at::kLong))));
  EXPECT_FALSE(other.observe(call_of(at::ones({4, 7}), at::zeros({2, 7}, at::kLong))));
  EXPECT_THROW_WITH(AutoBuckets(1), Error, "at least 2 sizes, got 1");
}

TEST(AutoBuckets, PolicyIsPowersOfTwoAlongTheBatch) {
  const BucketPolicy policy = AutoBuckets::policy();
  EXPECT_EQ(policy.bucket_for(0, 1), 1);
  EXPECT_EQ(policy.bucket_for(0, 33), 64);
  EXPECT_EQ(policy.bucket_for(0, 65536), 65536);
  EXPECT_EQ(policy.bucket_for(0, 65537), std::nullopt);
  EXPECT_EQ(policy.bucket_for(1, 3), std::nullopt);
}

TEST(CompareOutputs, AgreesWithinTheDtypesToleranceOnly) {
  const at::Tensor x = at::randn({4, 8});
  EXPECT_TRUE(compare_outputs(x, x.clone()).agrees);
  EXPECT_TRUE(compare_outputs(x, x * (1 + 1e-5)).agrees);
  const OutputAgreement far = compare_outputs(x + 0.5, x);
  EXPECT_FALSE(far.agrees);
  EXPECT_NE(far.disagreement.find("output: relative difference"), std::string::npos)
      << far.disagreement;
  const at::Tensor h = x.to(at::kBFloat16);
  EXPECT_TRUE(compare_outputs(h, (x * (1 + 4e-3)).to(at::kBFloat16)).agrees);
  const at::Tensor ids = at::arange(5);
  EXPECT_FALSE(compare_outputs(ids, ids + 1).agrees);
  const at::Tensor nan = at::full({2}, std::nan(""));
  EXPECT_TRUE(compare_outputs(nan, nan.clone()).agrees);
  EXPECT_FALSE(compare_outputs(nan, at::zeros({2})).agrees);
  const OutputAgreement shapes = compare_outputs(
      c10::ivalue::Tuple::create({x, at::ones({3})}), c10::ivalue::Tuple::create({x, at::ones({4})}));
  EXPECT_FALSE(shapes.agrees);
  EXPECT_NE(shapes.disagreement.find("output[1]: shapes [3] Float and [4] Float"),
            std::string::npos)
      << shapes.disagreement;
}

}  // namespace
}  // namespace graphed
