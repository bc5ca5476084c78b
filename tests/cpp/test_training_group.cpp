// Training-group planning (training_group.h): which recorded modules are
// captured together, in what order, and the recorder of a step's events.
// Host logic only.

#include "graphed/training_group.h"
#include "test_support.h"

#include <cstdlib>
#include <thread>

namespace graphed {
namespace {

std::vector<TrainingEvent> events(std::initializer_list<int64_t> steps) {
  std::vector<TrainingEvent> out;
  for (int64_t step : steps) {
    out.push_back(TrainingEvent{static_cast<size_t>(std::abs(step)) - 1, step > 0});
  }
  return out;
}

TEST(PlanTrainingGroup, KeepsTheRecordedOrderOfForwardsAndBackwards) {
  TrainingGroupPlan plan = plan_training_group(events({1, 2, 3, -3, -2, -1}));
  EXPECT_EQ(plan.modules, (std::vector<size_t>{0, 1, 2}));
  EXPECT_EQ(plan.order, (std::vector<int64_t>{1, 2, 3, -3, -2, -1}));
  EXPECT_TRUE(plan.left_out.empty());

  // Two losses backpropagated one after the other: backwards in call order.
  plan = plan_training_group(events({1, 2, -1, -2}));
  EXPECT_EQ(plan.order, (std::vector<int64_t>{1, 2, -1, -2}));

  // Modules numbered by their forwards, not by their registration.
  plan = plan_training_group(events({4, 2, -2, -4}));
  EXPECT_EQ(plan.modules, (std::vector<size_t>{3, 1}));
  EXPECT_EQ(plan.order, (std::vector<int64_t>{1, 2, -2, -1}));
}

TEST(PlanTrainingGroup, LeavesOutWhatOneGraphPairCannotServe) {
  // Module 1 runs twice per step, module 2 gets no gradient, module 4's
  // backward arrives without its forward.
  const TrainingGroupPlan plan = plan_training_group(events({1, 2, 3, 1, -4, -3, -1}));
  EXPECT_EQ(plan.modules, (std::vector<size_t>{2}));
  EXPECT_EQ(plan.order, (std::vector<int64_t>{1, -1}));
  ASSERT_EQ(plan.left_out.size(), 3u);
  EXPECT_EQ(plan.left_out[0].first, 0u);
  EXPECT_NE(plan.left_out[0].second.find("ran 2 times"), std::string::npos);
  EXPECT_EQ(plan.left_out[1].first, 1u);
  EXPECT_NE(plan.left_out[1].second.find("no gradient reached its outputs"), std::string::npos);
  EXPECT_EQ(plan.left_out[2].first, 3u);
  EXPECT_TRUE(plan_training_group({}).modules.empty());
}

TEST(TrainingRecorder, KeepsEventsFromSeveralThreadsInOrderPerThread) {
  TrainingRecorder recorder;
  recorder.record(0, /*forward=*/true);
  std::thread backward([&] { recorder.record(0, /*forward=*/false); });
  backward.join();
  recorder.record(1, /*forward=*/true);
  ASSERT_EQ(recorder.events.size(), 3u);
  EXPECT_EQ(recorder.events[0].module, 0u);
  EXPECT_TRUE(recorder.events[0].forward);
  EXPECT_EQ(recorder.events[1].module, 0u);
  EXPECT_FALSE(recorder.events[1].forward);
  EXPECT_EQ(recorder.events[2].module, 1u);
  EXPECT_TRUE(recorder.events[2].forward);
}

}  // namespace
}  // namespace graphed
