// Graph entries (graph_entry.h): the graphs GraphManager replays. Requests
// that cannot be captured are refused without a GPU; the inference entry's
// replay, bucket padding and memory are checked on the GPU. Training entries
// are exercised on the GPU from Python (tests/python/test_auto_gpu.py).

#include "graphed/check.h"
#include "graphed/graph_entry.h"
#include "test_support.h"

#include <ATen/ATen.h>

namespace graphed {
namespace {

using c10::IValue;

// A module computing 2 * x + 1 on the first positional argument.
ModuleSpec doubling_module() {
  ModuleSpec spec;
  spec.name = "layer";
  spec.type = "Doubler";
  spec.forward = [](const std::vector<IValue>& inputs) -> IValue {
    const at::Tensor x = inputs.at(0).toTupleRef().elements().at(0).toTensor();
    return x * 2 + 1;
  };
  return spec;
}

// GraphManager's inputs: (args, kwargs, module.training).
std::vector<IValue> call_inputs(const at::Tensor& x) {
  c10::impl::GenericDict kwargs(c10::StringType::get(), c10::AnyType::get());
  return {c10::ivalue::Tuple::create({x}), kwargs, IValue(false)};
}

GraphEntryRequest request_for(const ModuleSpec& module, const at::Tensor& sample) {
  GraphEntryRequest request;
  request.module = &module;
  request.sample = call_inputs(sample);
  request.input_names = {"args", "kwargs", "module.training"};
  request.description = "module `layer` (Doubler)";
  return request;
}

TEST(TrainingEntry, RefusesCpuInputsWithTheFix) {
  const ModuleSpec module = doubling_module();
  EXPECT_THROW_WITH(make_training_entry(request_for(module, at::ones({2, 3}))), CaptureError,
                    "graphs replay GPU work only. Move the model and its inputs to the GPU");
}

TEST(TrainingGroup, NeedsAModule) {
  EXPECT_THROW_WITH(make_training_group({}, {}), Error,
                    "A training group needs at least one module");
}

TEST(GraphEntryOnGpu, InferenceEntryReplaysOnNewInputsAndPadsToItsBucket) {
  GRAPHED_REQUIRE_GPU();
  const ModuleSpec module = doubling_module();
  const at::TensorOptions cuda = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  GraphEntryRequest request = request_for(module, at::zeros({4, 8}, cuda));
  const PoolId pool = new_pool();
  request.pool = [pool] { return pool; };
  request.plan = BucketPlan({BucketedDim{0, 4, 4}});
  const std::unique_ptr<GraphEntry> entry = make_inference_entry(request);

  const at::Tensor x = at::randn({4, 8}, cuda);
  EXPECT_TRUE(at::allclose(entry->run(call_inputs(x), request.plan).toTensor(), x * 2 + 1));
  // A call of 3 rows is padded up to the captured 4 and sliced back.
  const at::Tensor short_x = at::randn({3, 8}, cuda);
  const at::Tensor got =
      entry->run(call_inputs(short_x), BucketPlan({BucketedDim{0, 3, 4}})).toTensor();
  EXPECT_EQ(got.sizes(), c10::IntArrayRef({3, 8}));
  EXPECT_TRUE(at::allclose(got, short_x * 2 + 1));
  // Static input and output buffers at least (Note [Graph memory accounting]).
  EXPECT_GE(entry->memory_bytes(), 2 * 4 * 8 * static_cast<int64_t>(sizeof(float)));
  EXPECT_GT(entry->capture_ms(), 0.0);
}

TEST(GraphEntryOnGpu, ABucketGraphKeepsItsBuffersInTheFrontOfTheLargestOnes) {
  // Note [Bucket graphs share their buffers].
  GRAPHED_REQUIRE_GPU();
  const ModuleSpec module = doubling_module();
  const at::TensorOptions cuda = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  const PoolId pool = new_pool();
  GraphEntryRequest large = request_for(module, at::zeros({8, 16}, cuda));
  large.pool = [pool] { return pool; };
  large.plan = BucketPlan({BucketedDim{0, 8, 8}});
  const std::unique_ptr<GraphEntry> largest = make_inference_entry(large);
  ASSERT_EQ(largest->static_inputs().size(), 1u);
  ASSERT_EQ(largest->static_outputs().size(), 1u);

  GraphEntryRequest small = request_for(module, at::zeros({4, 16}, cuda));
  small.pool = [pool] { return pool; };
  small.plan = BucketPlan({BucketedDim{0, 4, 4}});
  small.input_arenas = largest->static_inputs();
  small.output_arenas = largest->static_outputs();
  const std::unique_ptr<GraphEntry> shared = make_inference_entry(small);
  const at::Tensor in_arena = largest->static_inputs()[0];
  const at::Tensor out_arena = largest->static_outputs()[0];
  EXPECT_EQ(shared->static_inputs()[0].data_ptr(), in_arena.data_ptr());
  EXPECT_EQ(shared->static_outputs()[0].data_ptr(), out_arena.data_ptr());
  // Its own memory: neither buffer, at most the pool's growth.
  EXPECT_LT(shared->memory_bytes(), 2 * 4 * 16 * static_cast<int64_t>(sizeof(float)));

  // Alternating calls compute on their own inputs; each output is valid
  // until the next call of either graph.
  for (int round = 0; round < 3; ++round) {
    const at::Tensor x = at::randn({3, 16}, cuda);
    const at::Tensor y = shared->run(call_inputs(x), BucketPlan({BucketedDim{0, 3, 4}})).toTensor();
    EXPECT_TRUE(at::allclose(y, x * 2 + 1));
    EXPECT_EQ(y.data_ptr(), out_arena.data_ptr());
    const at::Tensor big = at::randn({7, 16}, cuda);
    const at::Tensor z = largest->run(call_inputs(big), BucketPlan({BucketedDim{0, 7, 8}})).toTensor();
    EXPECT_TRUE(at::allclose(z, big * 2 + 1));
  }

  // A tensor that does not fit (more elements, another dtype) gets memory of its own.
  GraphEntryRequest other = request_for(module, at::zeros({4, 16}, cuda.dtype(at::kDouble)));
  other.pool = [pool] { return pool; };
  other.plan = BucketPlan({BucketedDim{0, 4, 4}});
  other.input_arenas = largest->static_inputs();
  other.output_arenas = largest->static_outputs();
  const std::unique_ptr<GraphEntry> separate = make_inference_entry(other);
  EXPECT_NE(separate->static_inputs()[0].data_ptr(), in_arena.data_ptr());
  EXPECT_NE(separate->static_outputs()[0].data_ptr(), out_arena.data_ptr());
  const at::Tensor d = at::randn({4, 16}, cuda.dtype(at::kDouble));
  EXPECT_TRUE(at::allclose(separate->run(call_inputs(d), other.plan).toTensor(), d * 2 + 1));
}

TEST(GraphEntryOnGpu, AnOutputThatIsAnInputKeepsItsOwnMemory) {
  GRAPHED_REQUIRE_GPU();
  ModuleSpec module;
  module.name = "identity";
  module.type = "Identity";
  module.forward = [](const std::vector<IValue>& inputs) -> IValue {
    return inputs.at(0).toTupleRef().elements().at(0).toTensor();
  };
  const at::TensorOptions cuda = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  const PoolId pool = new_pool();
  GraphEntryRequest large = request_for(module, at::zeros({8, 4}, cuda));
  large.pool = [pool] { return pool; };
  large.plan = BucketPlan({BucketedDim{0, 8, 8}});
  const std::unique_ptr<GraphEntry> largest = make_inference_entry(large);
  GraphEntryRequest small = request_for(module, at::zeros({2, 4}, cuda));
  small.pool = [pool] { return pool; };
  small.plan = BucketPlan({BucketedDim{0, 2, 2}});
  small.input_arenas = largest->static_inputs();
  small.output_arenas = largest->static_outputs();
  const std::unique_ptr<GraphEntry> shared = make_inference_entry(small);
  const at::Tensor x = at::randn({2, 4}, cuda);
  EXPECT_TRUE(at::equal(shared->run(call_inputs(x), small.plan).toTensor(), x));
}

}  // namespace
}  // namespace graphed
