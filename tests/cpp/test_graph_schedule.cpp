#include "graphed/graph_schedule.h"

#include "graphed/check.h"
#include "test_support.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace {

using graphed::GraphPass;
using graphed::GraphSchedule;

std::string describe(const GraphSchedule& schedule) {
  std::string out;
  for (const GraphPass& pass : schedule.passes()) {
    out += (pass.forward ? "F" : "B") + std::to_string(pass.pair) + " ";
  }
  return out;
}

TEST(GraphSchedule, WithoutOrderForwardsRunInOrderAndBackwardsReversed) {
  const GraphSchedule schedule = GraphSchedule::plan(3, 3, {});
  EXPECT_EQ(schedule.num_chunks(), 1u);
  EXPECT_EQ(schedule.num_microbatches(), 1u);
  EXPECT_EQ(describe(schedule), "F0 F1 F2 B2 B1 B0 ");
  EXPECT_EQ(schedule.forward_position(2), 2u);
  EXPECT_EQ(schedule.backward_position(2), 3u);
  for (size_t c = 0; c < 3; ++c) {
    EXPECT_EQ(schedule.pair_index(c, 0), c);
    EXPECT_EQ(schedule.callable_of(c), c);
  }
}

TEST(GraphSchedule, PipelineOrderFollowsTransformerEngineLayout) {
  // 2 chunks of 2 layers, 3 microbatches; samples chunk-major, then
  // microbatch, then layer.
  const GraphSchedule schedule =
      GraphSchedule::plan(4, 12, {1, 1, 2, -2, 1, 2, -2, -1, 2, -2, -1, -1});
  EXPECT_EQ(schedule.num_chunks(), 2u);
  EXPECT_EQ(schedule.num_microbatches(), 3u);
  EXPECT_EQ(schedule.layers_per_chunk(), 2u);
  EXPECT_EQ(schedule.pair_index(0, 0), 0u);
  EXPECT_EQ(schedule.pair_index(1, 0), 1u);
  EXPECT_EQ(schedule.pair_index(0, 1), 2u);
  EXPECT_EQ(schedule.pair_index(2, 0), 6u);
  EXPECT_EQ(schedule.pair_index(3, 2), 11u);
  for (size_t pair = 0; pair < 12; ++pair) {
    EXPECT_EQ(schedule.pair_index(schedule.callable_of(pair), schedule.microbatch_of(pair)), pair);
  }
  EXPECT_EQ(describe(schedule),
            "F0 F1 F2 F3 F6 F7 B7 B6 F4 F5 F8 F9 B9 B8 B1 B0 F10 F11 B11 B10 B3 B2 B5 B4 ");
}

TEST(GraphSchedule, InputBuffersPassToLaterPairsWithTheSameShape) {
  // One chunk, one layer, 3 microbatches, at most 2 in flight.
  const GraphSchedule schedule = GraphSchedule::plan(1, 3, {1, 1, -1, 1, -1, -1});
  const auto donors = schedule.shared_inputs({"a", "a", "a"});
  EXPECT_FALSE(donors[0].has_value());
  EXPECT_FALSE(donors[1].has_value());  // microbatch 0 is still in flight
  ASSERT_TRUE(donors[2].has_value());
  EXPECT_EQ(*donors[2], 0u);
  // Different shapes never share.
  const auto none = schedule.shared_inputs({"a", "b", "c"});
  for (const auto& donor : none) {
    EXPECT_FALSE(donor.has_value());
  }
  // Without an order every pair is in flight together.
  const auto overlapping = GraphSchedule::plan(3, 3, {}).shared_inputs({"a", "a", "a"});
  for (const auto& donor : overlapping) {
    EXPECT_FALSE(donor.has_value());
  }
}

TEST(GraphSchedule, SharedBuffersChainThroughSeveralOwners) {
  // Sequential microbatches: each takes over the first one's buffers.
  const GraphSchedule schedule = GraphSchedule::plan(1, 3, {1, -1, 1, -1, 1, -1});
  const auto donors = schedule.shared_inputs({"a", "a", "a"});
  ASSERT_TRUE(donors[1].has_value());
  ASSERT_TRUE(donors[2].has_value());
  EXPECT_EQ(*donors[1], 0u);
  EXPECT_EQ(*donors[2], 0u);
}

TEST(GraphSchedule, RejectsInconsistentArguments) {
  EXPECT_THROW_WITH(GraphSchedule::plan(0, 0, {}), graphed::Error, "at least one callable");
  EXPECT_THROW_WITH(GraphSchedule::plan(2, 3, {}), graphed::Error, "one sample input per callable");
  EXPECT_THROW_WITH(GraphSchedule::plan(2, 2, {1, 0, -1}), graphed::Error, "contains 0");
  EXPECT_THROW_WITH(GraphSchedule::plan(2, 4, {1, -1, 2}), graphed::Error, "divisible");
  EXPECT_THROW_WITH(GraphSchedule::plan(2, 2, {-1, 1}), graphed::Error, "comes before forward");
  EXPECT_THROW_WITH(GraphSchedule::plan(3, 6, {1, 2, -2, -1}), graphed::Error,
                    "split evenly");
  EXPECT_THROW_WITH(GraphSchedule::plan(2, 3, {1, 2, -2, -1}), graphed::Error,
                    "Expected 2 sample inputs");
  EXPECT_THROW_WITH(GraphSchedule::plan(2, 4, {1, 1, 1, -1, -1, -1, 2, -2}), graphed::Error,
                    "has 3 forwards");
}

}  // namespace
