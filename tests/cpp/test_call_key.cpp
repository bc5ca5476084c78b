// Call keys (call_key.h): what identifies the graph a call of a managed module
// needs, and the bucket plan of a call. Host logic on CPU tensors.

#include "graphed/call_key.h"
#include "test_support.h"

#include <ATen/ATen.h>

namespace graphed {
namespace {

using c10::IValue;
using Buckets = std::map<int64_t, std::vector<int64_t>>;

// GraphManager's inputs: (args, kwargs, module.training).
std::vector<IValue> call_inputs(const at::Tensor& x, IValue extra = IValue(1)) {
  c10::impl::GenericDict kwargs(c10::StringType::get(), c10::AnyType::get());
  kwargs.insert("scale", std::move(extra));
  return {c10::ivalue::Tuple::create({x}), kwargs, IValue(false)};
}

TEST(CallMode, HasNames) {
  EXPECT_EQ(call_mode_name(CallMode::kInference), "inference");
  EXPECT_EQ(call_mode_name(CallMode::kTraining), "training");
}

TEST(CallKey, EqualForTheSameStructureSizesAndConstants) {
  const BucketPlan none;
  const CallKey key = key_of(call_inputs(at::ones({2, 3})), none, CallMode::kInference);
  EXPECT_TRUE(key == key_of(call_inputs(at::zeros({2, 3})), none, CallMode::kInference));
  EXPECT_FALSE(key == key_of(call_inputs(at::ones({2, 3})), none, CallMode::kTraining));
  EXPECT_FALSE(key == key_of(call_inputs(at::ones({2, 4})), none, CallMode::kInference));
  EXPECT_FALSE(key == key_of(call_inputs(at::ones({2, 3}, at::kDouble)), none,
                             CallMode::kInference));
  EXPECT_FALSE(key == key_of(call_inputs(at::ones({2, 3}), IValue(2)), none,
                             CallMode::kInference));
  EXPECT_FALSE(key == key_of(call_inputs(at::ones({2, 3}).requires_grad_()), none,
                             CallMode::kInference));
}

TEST(CallKey, SizesAlongABucketedDimensionAreKeyedAtTheBucket) {
  const BucketPolicy buckets(Buckets{{0, {2, 4}}});
  std::vector<at::Tensor> tensors;
  std::string why;
  const std::vector<IValue> three = call_inputs(at::ones({3, 5}));
  const std::vector<IValue> four = call_inputs(at::ones({4, 5}));
  const std::optional<BucketPlan> plan3 = plan_call_buckets(buckets, three, tensors, &why);
  tensors.clear();
  const std::optional<BucketPlan> plan4 = plan_call_buckets(buckets, four, tensors, &why);
  ASSERT_TRUE(plan3 && plan4) << why;
  EXPECT_TRUE(key_of(three, *plan3, CallMode::kInference) ==
              key_of(four, *plan4, CallMode::kInference));
  EXPECT_FALSE(key_of(three, BucketPlan(), CallMode::kInference) ==
               key_of(four, BucketPlan(), CallMode::kInference));
}

TEST(PlanCallBuckets, WithoutBucketsPadsNothingAndCollectsTheTensors) {
  std::vector<at::Tensor> tensors;
  std::string why;
  const std::optional<BucketPlan> plan =
      plan_call_buckets(BucketPolicy(), call_inputs(at::ones({3, 5})), tensors, &why);
  ASSERT_TRUE(plan.has_value());
  EXPECT_TRUE(plan->dims().empty());
  EXPECT_FALSE(plan->pads());
  ASSERT_EQ(tensors.size(), 1u);
  EXPECT_EQ(tensors[0].sizes(), c10::IntArrayRef({3, 5}));
}

TEST(PlanCallBuckets, PadsUpToTheBucketOrNamesTheUncoveredInput) {
  const BucketPolicy buckets(Buckets{{0, {2, 4}}});
  std::vector<at::Tensor> tensors;
  std::string why;
  const std::optional<BucketPlan> plan =
      plan_call_buckets(buckets, call_inputs(at::ones({3, 5})), tensors, &why);
  ASSERT_TRUE(plan.has_value()) << why;
  EXPECT_TRUE(plan->pads());
  EXPECT_EQ(plan->describe(), "dim 0: 3 -> 4");

  tensors.clear();
  EXPECT_FALSE(plan_call_buckets(buckets, call_inputs(at::ones({9, 5})), tensors, &why));
  EXPECT_NE(why.find("args[0] has size 9 along bucketed dimension 0"), std::string::npos)
      << why;
}

}  // namespace
}  // namespace graphed
