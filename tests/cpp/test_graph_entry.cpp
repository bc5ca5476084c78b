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

}  // namespace
}  // namespace graphed
