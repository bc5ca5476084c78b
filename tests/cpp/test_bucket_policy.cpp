// BucketPolicy: validation, bucket choice, call plans, capture-ahead order,
// padding and slicing. Host logic; CPU tensors exercise all of it.

#include "graphed/bucket_policy.h"
#include "graphed/check.h"
#include "test_support.h"

#include <ATen/ATen.h>

namespace graphed {
namespace {

using Buckets = std::map<int64_t, std::vector<int64_t>>;

TEST(BucketPolicy, SortsAndDeduplicatesSizes) {
  const BucketPolicy policy(Buckets{{0, {8, 1, 4, 2, 4}}});
  EXPECT_EQ(policy.buckets().at(0), (std::vector<int64_t>{1, 2, 4, 8}));
  EXPECT_EQ(policy.describe(), "{0: [1, 2, 4, 8]}");
}

TEST(BucketPolicy, RefusesBadBucketsWithTheFix) {
  EXPECT_THROW_WITH(BucketPolicy(Buckets{{-1, {1, 2}}}), Error, "counted from the front (>= 0), got -1");
  EXPECT_THROW_WITH(BucketPolicy(Buckets{{0, {}}}), Error, "at least one size for bucketed dimension 0");
  EXPECT_THROW_WITH(BucketPolicy(Buckets{{1, {0, 4}}}), Error, "Expected bucket sizes >= 1, got 0");
}

TEST(BucketPolicy, PadsUpToTheSmallestCoveringBucket) {
  const BucketPolicy policy(Buckets{{0, {1, 2, 4, 8, 16, 32, 64}}});
  EXPECT_EQ(policy.bucket_for(0, 1), 1);
  EXPECT_EQ(policy.bucket_for(0, 13), 16);
  EXPECT_EQ(policy.bucket_for(0, 64), 64);
  EXPECT_EQ(policy.bucket_for(0, 65), std::nullopt);
  EXPECT_EQ(policy.bucket_for(1, 3), std::nullopt);
}

TEST(BucketPolicy, PlansEveryTensorThatHasTheDimension) {
  const BucketPolicy policy(Buckets{{0, {4, 8}}, {1, {16, 32}}});
  const std::vector<int64_t> x{5, 20};
  const std::vector<int64_t> mask{5};
  std::string why;
  const auto plan = policy.plan({x, mask}, {"args[0]", "args[1]"}, &why);
  ASSERT_TRUE(plan.has_value()) << why;
  ASSERT_EQ(plan->dims().size(), 2u);
  EXPECT_EQ(plan->dims()[0], (BucketedDim{0, 5, 8}));
  EXPECT_EQ(plan->dims()[1], (BucketedDim{1, 20, 32}));
  EXPECT_TRUE(plan->pads());
  EXPECT_EQ(plan->padded_sizes(x), (std::vector<int64_t>{8, 32}));
  EXPECT_EQ(plan->padded_sizes(mask), (std::vector<int64_t>{8}));
  EXPECT_EQ(plan->describe(), "dim 0: 5 -> 8, dim 1: 20 -> 32");
  EXPECT_FALSE(plan->at_buckets().pads());
}

TEST(BucketPolicy, ExactSizeNeedsNoPadding) {
  const BucketPolicy policy(Buckets{{0, {4, 8}}});
  const std::vector<int64_t> x{8, 3};
  const auto plan = policy.plan({x}, {"args[0]"}, nullptr);
  ASSERT_TRUE(plan.has_value());
  EXPECT_FALSE(plan->pads());
}

TEST(BucketPolicy, SizeAboveTheLargestBucketSaysWhatToAdd) {
  const BucketPolicy policy(Buckets{{0, {1, 2, 4}}});
  const std::vector<int64_t> x{7, 3};
  std::string why;
  EXPECT_FALSE(policy.plan({x}, {"args[0]"}, &why).has_value());
  EXPECT_NE(why.find("args[0] has size 7 along bucketed dimension 0, above the largest bucket 4 "
                     "of [1, 2, 4]. Add a bucket of at least 7 to buckets[0]"),
            std::string::npos)
      << why;
}

TEST(BucketPolicy, TensorsThatDisagreeAlongADimensionAreNamed) {
  const BucketPolicy policy(Buckets{{0, {8}}});
  const std::vector<int64_t> a{3, 2};
  const std::vector<int64_t> b{5, 2};
  std::string why;
  EXPECT_FALSE(policy.plan({a, b}, {"args[0]", "kwargs['h']"}, &why).has_value());
  EXPECT_NE(why.find("args[0] has size 3 there and kwargs['h'] has 5"), std::string::npos) << why;
}

TEST(BucketPolicy, TensorsOfSizeOneAreBroadcastAndStayUnpadded) {
  // Note [Bucket padding]: transformers' position ids and rotary tables.
  const BucketPolicy policy(Buckets{{0, {4, 8}}});
  const std::vector<int64_t> hidden{5, 7, 16};
  const std::vector<int64_t> positions{1, 7};
  const auto plan = policy.plan({positions, hidden}, {"kwargs['position_ids']", "args[0]"}, nullptr);
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->dims()[0], (BucketedDim{0, 5, 8}));
  EXPECT_FALSE(plan->dims()[0].ambiguous);
  EXPECT_EQ(plan->padded_sizes(hidden), (std::vector<int64_t>{8, 7, 16}));
  EXPECT_EQ(plan->padded_sizes(positions), (std::vector<int64_t>{1, 7}));
  // Every tensor of size 1: the call's size is 1, and all of them pad.
  const auto ones = policy.plan({positions, std::vector<int64_t>{1, 7, 16}}, {"a", "b"}, nullptr);
  ASSERT_TRUE(ones.has_value());
  EXPECT_EQ(ones->dims()[0], (BucketedDim{0, 1, 4}));
  EXPECT_TRUE(ones->dims()[0].ambiguous);
  EXPECT_EQ(ones->padded_sizes(positions), (std::vector<int64_t>{4, 7}));
  // One tensor alone is never ambiguous.
  EXPECT_FALSE(policy.plan({positions}, {"a"}, nullptr)->dims()[0].ambiguous);
}

TEST(BucketPolicy, PlanSizesReportsTheMissByTensorIndex) {
  const BucketPolicy policy(Buckets{{0, {4}}});
  const std::vector<int64_t> a{3, 2};
  const std::vector<int64_t> one{1, 2};
  const std::vector<int64_t> b{2, 2};
  BucketMiss miss;
  EXPECT_FALSE(policy.plan_sizes({a, one, b}, &miss).has_value());
  EXPECT_EQ(miss, (BucketMiss{BucketMiss::Kind::kDisagree, 0, 0, 2, 3, 2}));
  EXPECT_NE(policy.describe_miss(miss, "x", "y").find("(those of size 1 there are broadcast and "
                                                      "pass unpadded), but x has size 3 there and "
                                                      "y has 2"),
            std::string::npos);
  const std::vector<int64_t> big{9, 2};
  EXPECT_FALSE(policy.plan_sizes({one, big}, &miss).has_value());
  EXPECT_EQ(miss, (BucketMiss{BucketMiss::Kind::kAboveLargest, 0, 1, 0, 9, 0}));
}

TEST(BucketPolicy, DimensionNoTensorHasIsLeftOut) {
  const BucketPolicy policy(Buckets{{2, {8}}});
  const std::vector<int64_t> x{3, 2};
  const auto plan = policy.plan({x}, {"args[0]"}, nullptr);
  ASSERT_TRUE(plan.has_value());
  EXPECT_TRUE(plan->dims().empty());
}

TEST(BucketPolicy, CombinationsComeLargestFirst) {
  const BucketPolicy policy(Buckets{{0, {1, 4}}, {1, {2, 3}}});
  const BucketPlan like({BucketedDim{0, 1, 1}, BucketedDim{1, 2, 2}});
  const std::vector<BucketPlan> combos = policy.combinations_largest_first(like);
  ASSERT_EQ(combos.size(), 4u);
  std::vector<std::pair<int64_t, int64_t>> sizes;
  for (const BucketPlan& combo : combos) {
    EXPECT_FALSE(combo.pads());
    sizes.emplace_back(combo.dims()[0].padded, combo.dims()[1].padded);
  }
  EXPECT_EQ(sizes, (std::vector<std::pair<int64_t, int64_t>>{{4, 3}, {4, 2}, {1, 3}, {1, 2}}));
  EXPECT_TRUE(policy.combinations_largest_first(BucketPlan()).empty());
}

TEST(BucketPolicy, ResizeCopiesTheOverlapAndZerosTheRest) {
  const at::Tensor x = at::arange(6, at::kFloat).reshape({3, 2}) + 1;
  const at::Tensor padded = resize_to_buckets(x, BucketPlan({BucketedDim{0, 3, 4}}));
  ASSERT_EQ(padded.sizes(), (c10::IntArrayRef{4, 2}));
  EXPECT_TRUE(at::equal(padded.narrow(0, 0, 3), x));
  EXPECT_TRUE(at::equal(padded.narrow(0, 3, 1), at::zeros({1, 2})));
  const at::Tensor shrunk = resize_to_buckets(x, BucketPlan({BucketedDim{0, 3, 2}}));
  EXPECT_TRUE(at::equal(shrunk, x.narrow(0, 0, 2)));
  EXPECT_TRUE(resize_to_buckets(x, BucketPlan({BucketedDim{0, 3, 3}})).is_same(x));
}

TEST(BucketPolicy, SlicesOutputsThatHaveTheBucketSize) {
  const BucketPlan plan({BucketedDim{0, 3, 4}});
  const at::Tensor y = at::ones({4, 5});
  const at::Tensor scalar = at::ones({});
  const at::Tensor other = at::ones({2, 4});
  const c10::IValue out =
      slice_to_call(c10::ivalue::Tuple::create({y, scalar, other}), plan);
  const auto& elements = out.toTupleRef().elements();
  EXPECT_EQ(elements[0].toTensor().sizes(), (c10::IntArrayRef{3, 5}));
  EXPECT_EQ(elements[0].toTensor().data_ptr(), y.data_ptr());  // a view, not a copy
  EXPECT_EQ(elements[1].toTensor().dim(), 0);
  EXPECT_EQ(elements[2].toTensor().sizes(), (c10::IntArrayRef{2, 4}));
}

}  // namespace
}  // namespace graphed
