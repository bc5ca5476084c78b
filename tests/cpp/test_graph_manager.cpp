// GraphManager's host logic: the warm-up -> capture -> replay state machine,
// bucket plans, budgets and fallbacks with their reasons, training groups.
// Entries are fakes that run the module on CPU tensors, so no GPU is needed;
// make_inference_entry is tested on the GPU in test_graph_entry.cpp and from
// Python (tests/python/test_auto_gpu.py); the GraphManagerOnGpu cases use it
// for what only real buffers show (bucket graphs sharing them). Memory sizes, module selection and
// training-group plans have test files of their own.

#include "graphed/check.h"
#include "graphed/graph_manager.h"
#include "test_support.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

namespace graphed {
namespace {

using c10::IValue;
using Buckets = std::map<int64_t, std::vector<int64_t>>;

TEST(GraphManagerOptions, AreValidated) {
  GraphManagerOptions options;
  options.warmup = 0;
  EXPECT_THROW_WITH(GraphManager{options}, Error, "Expected warmup >= 1, got 0");
  EXPECT_THROW_WITH(parse_fallback_policy("ignore"), Error,
                    "Expected fallback to be \"eager\"");
  EXPECT_EQ(parse_fallback_policy("raise"), FallbackPolicy::kRaise);
  GraphManagerOptions picking;
  picking.pick_buckets_after = 1;
  EXPECT_THROW_WITH(GraphManager{picking}, Error, "Expected pick_buckets_after >= 2 (the batch sizes seen before buckets are "
                    "picked), got 1");
}

// What the fake factories saw and did.
struct Journal {
  std::vector<std::string> captured;  // request descriptions, in capture order
  std::vector<std::vector<int64_t>> sample_sizes;
  int64_t runs = 0;
  int64_t bytes_per_graph = 100;
  bool fail_capture = false;
};

// Replays by running the module's forward on the padded sample sizes, so that
// bucket padding and slicing are visible in the outputs.
class FakeEntry final : public GraphEntry {
 public:
  FakeEntry(const GraphEntryRequest& request, Journal& journal)
      : module_(request.module), signature_(request.sample, request.input_names),
        journal_(journal) {}
  IValue run(const std::vector<IValue>& inputs, const BucketPlan& plan) override {
    ++journal_.runs;
    std::vector<IValue> padded;
    for (const IValue& input : inputs) {
      padded.push_back(map_tensors(input, [&](const at::Tensor& t) {
        return resize_to_buckets(t, plan);
      }));
    }
    return slice_to_call(module_->forward(padded), plan);
  }
  int64_t memory_bytes() const override { return journal_.bytes_per_graph; }
  const Signature& signature() const override { return signature_; }
  int64_t pool_reserved_bytes() const override { return 0; }
  double capture_ms() const override { return 1.0; }

 private:
  const ModuleSpec* module_;
  Signature signature_;
  Journal& journal_;
};

GraphEntryFactory fake_factory(Journal& journal) {
  return [&journal](const GraphEntryRequest& request) -> std::unique_ptr<GraphEntry> {
    if (journal.fail_capture) {
      GRAPHED_THROW(CaptureError, "Capturing ", request.description, " failed: aten::nonzero "
                    "has a data-dependent shape.");
    }
    journal.captured.push_back(request.description);
    journal.sample_sizes.push_back(
        request.sample.at(0).toTupleRef().elements().at(0).toTensor().sizes().vec());
    return std::make_unique<FakeEntry>(request, journal);
  };
}

// A module computing 2 * x + 1 and counting its eager runs.
ModuleSpec doubling_module(const std::string& name, int64_t* eager_runs) {
  ModuleSpec spec;
  spec.name = name;
  spec.type = "Doubler";
  spec.forward = [eager_runs](const std::vector<IValue>& inputs) -> IValue {
    ++*eager_runs;
    const at::Tensor x = inputs.at(0).toTupleRef().elements().at(0).toTensor();
    return x * 2 + 1;
  };
  return spec;
}

std::vector<IValue> call_inputs(const at::Tensor& x, bool training = false) {
  c10::impl::GenericDict kwargs(c10::StringType::get(), c10::AnyType::get());
  return {c10::ivalue::Tuple::create({x}), kwargs, IValue(training)};
}

struct ManagerFixture : ::testing::Test {
  Journal journal;
  int64_t eager_runs = 0;

  GraphManager make(GraphManagerOptions options) {
    options.check_blockers = false;
    GraphEntryFactories factories;
    factories.inference = fake_factory(journal);
    return GraphManager(options, factories);
  }
};

TEST_F(ManagerFixture, WarmsUpAgainWhenTheModuleTensorsMoveOrAreReplaced) {
  // See Note [Modules whose tensors moved]: the module's graphs are released
  // and it warms up again, with the new tensors as its parameters.
  GraphManagerOptions options;
  options.warmup = 1;
  GraphManager manager = make(options);
  auto weight = std::make_shared<at::Tensor>(at::ones({3}));
  ModuleSpec spec = doubling_module("blocks.0", &eager_runs);
  spec.parameters = {*weight};
  spec.read_parameters = [weight] { return std::vector<at::Tensor>{*weight, *weight}; };
  spec.read_buffers = [] { return std::vector<at::Tensor>{}; };
  const size_t index = manager.add_module(std::move(spec));
  const at::Tensor x = at::ones({4, 3});
  for (int call = 0; call < 3; ++call) manager.call(index, call_inputs(x));
  EXPECT_EQ(manager.stats().warmup_calls, 1);
  EXPECT_EQ(manager.stats().captures, 1);
  EXPECT_EQ(manager.stats().replays, 2);

  // Values changed in place keep the graphs.
  weight->add_(1);
  manager.call(index, call_inputs(x));
  EXPECT_EQ(manager.stats().tensor_changes, 0);
  EXPECT_EQ(manager.stats().replays, 3);

  // New storage (as `.double()` gives): the call runs eagerly, warming up.
  *weight = at::ones({3}, at::kDouble);
  manager.call(index, call_inputs(x));
  GraphManagerStats stats = manager.stats();
  EXPECT_EQ(stats.tensor_changes, 1);
  EXPECT_EQ(stats.graphs, 0);
  EXPECT_EQ(stats.warmup_calls, 2);
  EXPECT_EQ(stats.replays, 3);
  // Then it captures again and replays.
  manager.call(index, call_inputs(x));
  manager.call(index, call_inputs(x));
  stats = manager.stats();
  EXPECT_EQ(stats.captures, 2);
  EXPECT_EQ(stats.replays, 5);
  EXPECT_EQ(stats.tensor_changes, 1);
}

TEST_F(ManagerFixture, WarmsUpThenCapturesOnceAndReplays) {
  GraphManagerOptions options;
  options.warmup = 2;
  GraphManager manager = make(options);
  const size_t first = manager.add_module(doubling_module("blocks.0", &eager_runs));
  const size_t second = manager.add_module(doubling_module("blocks.1", &eager_runs));
  const at::Tensor x = at::ones({4, 3});
  for (int step = 0; step < 5; ++step) {
    // The second module is called first: the recorded order is call order.
    EXPECT_TRUE(at::equal(manager.call(second, call_inputs(x)).toTensor(), x * 2 + 1));
    EXPECT_TRUE(at::equal(manager.call(first, call_inputs(x)).toTensor(), x * 2 + 1));
  }
  const GraphManagerStats stats = manager.stats();
  EXPECT_EQ(stats.calls, 10);
  EXPECT_EQ(stats.warmup_calls, 4);
  EXPECT_EQ(stats.captures, 2);
  EXPECT_EQ(stats.replays, 6);
  EXPECT_EQ(stats.graphs, 2);
  EXPECT_EQ(stats.graph_memory_bytes, 200);
  EXPECT_EQ(stats.order, (std::vector<std::string>{"blocks.1", "blocks.0"}));
  EXPECT_EQ(journal.captured, (std::vector<std::string>{"module `blocks.1` (Doubler)",
                                                        "module `blocks.0` (Doubler)"}));
  ASSERT_EQ(stats.modules.size(), 2u);
  EXPECT_EQ(stats.modules[0].state, "graphed");
  EXPECT_EQ(stats.modules[0].replays, 3);
  EXPECT_EQ(stats.modules[0].graphs, 1);
  EXPECT_TRUE(stats.fallbacks.empty());
  EXPECT_EQ(eager_runs, 4 + 6);  // the fake replays by running forward
}

TEST_F(ManagerFixture, NewSignatureGetsItsOwnGraph) {
  GraphManagerOptions options;
  options.warmup = 1;
  GraphManager manager = make(options);
  const size_t m = manager.add_module(doubling_module("layer", &eager_runs));
  for (int64_t batch : {2, 3, 2, 3, 5}) {
    const at::Tensor x = at::ones({batch, 4});
    EXPECT_EQ(manager.call(m, call_inputs(x)).toTensor().size(0), batch);
  }
  EXPECT_EQ(manager.stats().captures, 3);  // 3, 2 and 5 after the warm-up call with 2
  EXPECT_EQ(manager.stats().replays, 4);
  // The training flag is an input: flipping it needs another graph, not a wrong replay.
  (void)manager.call(m, call_inputs(at::ones({5, 4}), /*training=*/true));
  EXPECT_EQ(manager.stats().captures, 4);
}

TEST_F(ManagerFixture, BucketsCaptureLargestFirstThenPadAndSlice) {
  GraphManagerOptions options;
  options.warmup = 1;
  options.buckets = BucketPolicy(Buckets{{0, {1, 2, 4, 8}}});
  GraphManager manager = make(options);
  const size_t m = manager.add_module(doubling_module("layer", &eager_runs));
  (void)manager.call(m, call_inputs(at::ones({3, 2})));  // warm-up
  const at::Tensor x = at::arange(6, at::kFloat).reshape({3, 2});
  const at::Tensor y = manager.call(m, call_inputs(x)).toTensor();
  EXPECT_TRUE(at::equal(y, x * 2 + 1));
  EXPECT_EQ(journal.captured,
            (std::vector<std::string>{"module `layer` (Doubler) at dim 0: 8",
                                      "module `layer` (Doubler) at dim 0: 4",
                                      "module `layer` (Doubler) at dim 0: 2",
                                      "module `layer` (Doubler) at dim 0: 1"}));
  EXPECT_EQ(journal.sample_sizes[0], (std::vector<int64_t>{8, 2}));
  EXPECT_EQ(journal.sample_sizes[3], (std::vector<int64_t>{1, 2}));
  for (int64_t batch : {1, 2, 5, 7, 8}) {
    const at::Tensor input = at::full({batch, 2}, 3.0);
    EXPECT_TRUE(at::equal(manager.call(m, call_inputs(input)).toTensor(), input * 2 + 1));
  }
  const GraphManagerStats stats = manager.stats();
  EXPECT_EQ(stats.captures, 4);
  EXPECT_EQ(stats.replays, 6);
}

// x * 2 + bias (its mean over dimension 0), the bias broadcast along
// dimension 0 (as transformers hands its layers position ids of batch size 1).
ModuleSpec broadcasting_module(int64_t* eager_runs) {
  ModuleSpec spec;
  spec.name = "layer";
  spec.type = "Shifter";
  spec.forward = [eager_runs](const std::vector<IValue>& inputs) -> IValue {
    ++*eager_runs;
    const at::Tensor x = inputs.at(0).toTupleRef().elements().at(0).toTensor();
    const at::Tensor bias = inputs.at(1).toGenericDict().at("bias").toTensor();
    return x * 2 + bias.mean(0, /*keepdim=*/true);
  };
  return spec;
}

std::vector<IValue> inputs_with_bias(const at::Tensor& x, const at::Tensor& bias) {
  c10::impl::GenericDict kwargs(c10::StringType::get(), c10::AnyType::get());
  kwargs.insert("bias", bias);
  return {c10::ivalue::Tuple::create({x}), kwargs, IValue(false)};
}

TEST_F(ManagerFixture, BroadcastInputsOfSizeOnePassUnpadded) {
  // Note [Bucket padding].
  GraphManagerOptions options;
  options.warmup = 1;
  options.buckets = BucketPolicy(Buckets{{0, {1, 2, 4, 8}}});
  GraphManager manager = make(options);
  const size_t m = manager.add_module(broadcasting_module(&eager_runs));
  const at::Tensor bias = at::arange(2, at::kFloat).reshape({1, 2});
  (void)manager.call(m, inputs_with_bias(at::ones({3, 2}), bias));  // warm-up
  for (int64_t batch : {3, 5, 8, 1, 2}) {
    const at::Tensor x = at::rand({batch, 2});
    EXPECT_TRUE(at::allclose(manager.call(m, inputs_with_bias(x, bias)).toTensor(), x * 2 + bias));
  }
  const GraphManagerStats stats = manager.stats();
  EXPECT_TRUE(stats.fallbacks.empty()) << stats.fallbacks.front().reason;
  EXPECT_EQ(stats.captures, 4);  // 8, 4, 2, 1 ahead from the call of 3
  EXPECT_EQ(stats.replays, 5);
  // Two sizes other than 1 cannot be bucketed: both tensors are named.
  (void)manager.call(m, inputs_with_bias(at::ones({3, 2}), at::ones({2, 2})));
  ASSERT_EQ(manager.stats().fallbacks.size(), 1u);
  EXPECT_NE(manager.stats().fallbacks[0].reason.find(
                "args[0] has size 3 there and kwargs['bias'] has 2"),
            std::string::npos)
      << manager.stats().fallbacks[0].reason;
}

TEST_F(ManagerFixture, ACallOfSizeOneCapturesNothingAhead) {
  // Which tensors are broadcast cannot be told from it (Note [Bucket padding]).
  GraphManagerOptions options;
  options.warmup = 1;
  options.buckets = BucketPolicy(Buckets{{0, {1, 2, 4}}});
  GraphManager manager = make(options);
  const size_t m = manager.add_module(broadcasting_module(&eager_runs));
  const at::Tensor bias = at::ones({1, 2});
  (void)manager.call(m, inputs_with_bias(at::ones({1, 2}), bias));
  (void)manager.call(m, inputs_with_bias(at::ones({1, 2}), bias));
  EXPECT_EQ(manager.stats().captures, 1);
  // The first call that tells them apart captures the rest, not 1 again.
  (void)manager.call(m, inputs_with_bias(at::ones({3, 2}), bias));
  EXPECT_EQ(manager.stats().captures, 3);
  (void)manager.call(m, inputs_with_bias(at::ones({1, 2}), bias));
  EXPECT_EQ(manager.stats().captures, 3);
  EXPECT_EQ(manager.stats().replays, 3);
}

TEST_F(ManagerFixture, PicksBucketsAfterFourBatchSizesAndChecksThemAgainstEager) {
  // Note [Buckets graphed picks itself].
  GraphManagerOptions options;
  options.warmup = 1;
  options.pick_buckets = true;
  GraphManager manager = make(options);
  const size_t m = manager.add_module(doubling_module("layer", &eager_runs));
  for (int64_t batch : {3, 3, 5, 6, 7, 9, 13, 16, 2}) {
    const at::Tensor x = at::rand({batch, 2});
    EXPECT_TRUE(at::allclose(manager.call(m, call_inputs(x)).toTensor(), x * 2 + 1)) << batch;
  }
  const GraphManagerStats stats = manager.stats();
  // 3, 5 and 6 each their own graph; 7 picks buckets, dropping them: 8, 16 and 2.
  EXPECT_EQ(stats.captures, 6);
  EXPECT_EQ(stats.graphs, 3);
  ASSERT_EQ(stats.notes.size(), 1u);
  EXPECT_NE(stats.notes[0].find("layer: inference calls came at 4 batch sizes, so graphed pads "
                                "them to power-of-two sizes"),
            std::string::npos)
      << stats.notes[0];
  EXPECT_TRUE(stats.fallbacks.empty());
}

// x minus its mean over dimension 0: rows that influence each other, which
// padding along dimension 0 changes.
ModuleSpec centering_module() {
  ModuleSpec spec;
  spec.name = "centering";
  spec.type = "Centering";
  spec.forward = [](const std::vector<IValue>& inputs) -> IValue {
    const at::Tensor x = inputs.at(0).toTupleRef().elements().at(0).toTensor();
    return x - x.mean(0, /*keepdim=*/true);
  };
  return spec;
}

TEST_F(ManagerFixture, PickedBucketsThatChangeTheResultAreDropped) {
  // Rows that influence each other (x minus its mean over dimension 0):
  // padding changes every row, and the module keeps one graph per size.
  GraphManagerOptions options;
  options.warmup = 1;
  options.pick_buckets = true;
  GraphManager manager = make(options);
  const size_t m = manager.add_module(centering_module());
  for (int64_t batch : {3, 3, 5, 6, 7, 9, 7}) {
    const at::Tensor x = at::rand({batch, 2}) + 1;
    EXPECT_TRUE(at::allclose(manager.call(m, call_inputs(x)).toTensor(),
                             x - x.mean(0, true), 1e-5, 1e-6))
        << batch;
  }
  const GraphManagerStats stats = manager.stats();
  ASSERT_EQ(stats.notes.size(), 1u);
  EXPECT_NE(stats.notes[0].find("did not match eager (output: relative difference"),
            std::string::npos)
      << stats.notes[0];
  EXPECT_NE(stats.notes[0].find("keeps one graph per size"), std::string::npos);
  EXPECT_EQ(stats.graphs, 2);  // 7 (after the refusal) and 9
}

TEST_F(ManagerFixture, ZeroPaddingThatHidesDependentRowsIsCaughtByRepeatedRows) {
  // The picking call's rows have mean 0, so zero padding leaves x - mean(x)
  // unchanged; padding rows that repeat the call's rows do not.
  GraphManagerOptions options;
  options.warmup = 1;
  options.pick_buckets = true;
  GraphManager manager = make(options);
  const size_t m = manager.add_module(centering_module());
  for (int64_t batch : {2, 2, 3, 4}) {
    (void)manager.call(m, call_inputs(at::rand({batch, 2})));
  }
  const at::Tensor half = at::rand({3, 2}) + 1;
  const at::Tensor x = at::cat({half, -half});  // 6 rows of mean 0: picks bucket 8
  EXPECT_TRUE(at::allclose(manager.call(m, call_inputs(x)).toTensor(), x, 1e-5, 1e-6));
  const GraphManagerStats stats = manager.stats();
  ASSERT_EQ(stats.notes.size(), 1u);
  EXPECT_NE(stats.notes[0].find("padding rows repeating the call's"), std::string::npos)
      << stats.notes[0];
}

TEST_F(ManagerFixture, TryCallLeavesFallbacksToTheCallerAndSaysWhenBlocked) {
  // Note [A fallback costs nothing].
  GraphManagerOptions options;
  options.warmup = 1;
  options.buckets = BucketPolicy(Buckets{{0, {2, 4}}});
  GraphManager manager = make(options);
  const size_t m = manager.add_module(doubling_module("layer", &eager_runs));
  (void)manager.try_call(m, call_inputs(at::ones({2, 2})));  // warm-up runs here
  const int64_t runs = eager_runs;
  EXPECT_FALSE(manager.try_call(m, call_inputs(at::ones({9, 2}))).has_value());
  EXPECT_FALSE(manager.try_call(m, call_inputs(at::ones({9, 2}))).has_value());
  EXPECT_EQ(eager_runs, runs);  // the caller runs them
  EXPECT_EQ(manager.stats().fallback_calls, 2);
  EXPECT_EQ(manager.stats().fallbacks.at(0).count, 2);
  EXPECT_TRUE(manager.try_call(m, call_inputs(at::ones({2, 2}))).has_value());
  EXPECT_FALSE(manager.blocked(m));
  journal.fail_capture = true;
  EXPECT_FALSE(manager.try_call(m, call_inputs(at::ones({3, 3}))).has_value());
  EXPECT_TRUE(manager.blocked(m));
}

// A doubling module managed as a part of `part_of`: Note [Graphing the parts
// of a block].
ModuleSpec doubling_part(const std::string& name, const std::string& part_of,
                         int64_t* eager_runs) {
  ModuleSpec spec = doubling_module(name, eager_runs);
  spec.part_of = part_of;
  spec.steady_shapes = true;
  return spec;
}

TEST_F(ManagerFixture, APartWhoseWarmupShapesChangeStaysEagerWithWhy) {
  // ModuleSpec::steady_shapes: Note [Graphing the parts of a block].
  GraphManagerOptions options;
  options.warmup = 2;
  GraphManager manager = make(options);
  const size_t e = manager.add_module(doubling_part("moe.experts.0", "moe", &eager_runs));
  const size_t a = manager.add_module(doubling_part("attn", "block", &eager_runs));
  for (int64_t tokens : {5, 3, 7}) {
    (void)manager.call(e, call_inputs(at::ones({tokens, 2})));
    (void)manager.call(a, call_inputs(at::ones({4, 2})));
  }
  EXPECT_TRUE(manager.blocked(e));
  EXPECT_FALSE(manager.blocked(a));
  EXPECT_EQ(journal.captured.size(), 1u);  // the attention only
  const GraphManagerStats stats = manager.stats();
  ASSERT_EQ(stats.fallbacks.size(), 1u);
  EXPECT_EQ(stats.fallbacks[0].module, "moe.experts.0");
  EXPECT_NE(stats.fallbacks[0].reason.find("different shapes"), std::string::npos);
  EXPECT_NE(stats.fallbacks[0].reason.find("part of moe"), std::string::npos);
  EXPECT_EQ(stats.modules[0].part_of, "moe");
  EXPECT_EQ(stats.modules[1].state, "graphed");
}

TEST_F(ManagerFixture, APartWhoseShapesChangeAfterCaptureStaysEagerAndDropsItsGraph) {
  GraphManagerOptions options;
  options.warmup = 2;
  GraphManager manager = make(options);
  const size_t e = manager.add_module(doubling_part("moe.experts.1", "moe", &eager_runs));
  for (int i = 0; i < 3; ++i) (void)manager.call(e, call_inputs(at::ones({4, 2})));
  EXPECT_EQ(manager.stats().graphs, 1);
  const IValue out = manager.call(e, call_inputs(at::ones({6, 2})));
  EXPECT_TRUE(at::equal(out.toTensor(), at::full({6, 2}, 3.0)));
  EXPECT_TRUE(manager.blocked(e));
  EXPECT_EQ(manager.stats().graphs, 0);
  EXPECT_EQ(journal.captured.size(), 1u);
}

TEST_F(ManagerFixture, UncoveredSizeFallsBackWithTheFix) {
  GraphManagerOptions options;
  options.warmup = 1;
  options.buckets = BucketPolicy(Buckets{{0, {2, 4}}});
  GraphManager manager = make(options);
  const size_t m = manager.add_module(doubling_module("layer", &eager_runs));
  (void)manager.call(m, call_inputs(at::ones({2, 2})));
  const at::Tensor big = at::ones({9, 2});
  EXPECT_TRUE(at::equal(manager.call(m, call_inputs(big)).toTensor(), big * 2 + 1));
  (void)manager.call(m, call_inputs(big));
  const GraphManagerStats stats = manager.stats();
  ASSERT_EQ(stats.fallbacks.size(), 1u);
  EXPECT_EQ(stats.fallbacks[0].module, "layer");
  EXPECT_EQ(stats.fallbacks[0].count, 2);
  EXPECT_NE(stats.fallbacks[0].reason.find("above the largest bucket 4 of [2, 4]. Add a bucket "
                                           "of at least 9 to buckets[0]"),
            std::string::npos)
      << stats.fallbacks[0].reason;
  EXPECT_EQ(stats.fallback_calls, 2);
}

TEST_F(ManagerFixture, RaisePolicyRaisesForACallNoGraphServes) {
  GraphManagerOptions options;
  options.warmup = 1;
  options.buckets = BucketPolicy(Buckets{{0, {2, 4}}});
  options.fallback = FallbackPolicy::kRaise;
  GraphManager manager = make(options);
  const size_t m = manager.add_module(doubling_module("layer", &eager_runs));
  (void)manager.call(m, call_inputs(at::ones({2, 2})));
  EXPECT_THROW_WITH(manager.call(m, call_inputs(at::ones({9, 2}))), Error,
                    "module `layer` (Doubler) cannot run as a graph: args[0] has size 9");
}

TEST_F(ManagerFixture, BudgetEvictsTheLeastRecentlyUsedGraph) {
  GraphManagerOptions options;
  options.warmup = 1;
  options.memory_budget_bytes = 250;
  GraphManager manager = make(options);
  const size_t m = manager.add_module(doubling_module("layer", &eager_runs));
  auto call = [&](int64_t batch) {
    const at::Tensor x = at::ones({batch, 2});
    EXPECT_TRUE(at::equal(manager.call(m, call_inputs(x)).toTensor(), x * 2 + 1));
  };
  call(1);  // warm-up
  call(1);
  call(2);
  call(1);  // 2 is now least recently used
  call(3);  // over budget: evicts 2
  EXPECT_EQ(manager.stats().evictions, 1);
  EXPECT_EQ(manager.stats().graphs, 2);
  call(1);  // still there
  EXPECT_EQ(manager.stats().captures, 3);
  call(2);  // captured again, evicting 3
  EXPECT_EQ(manager.stats().captures, 4);
  EXPECT_EQ(manager.stats().evictions, 2);
  EXPECT_EQ(manager.stats().graph_memory_bytes, 200);
}

TEST_F(ManagerFixture, BudgetSmallerThanOneGraphSaysSo) {
  GraphManagerOptions options;
  options.warmup = 1;
  options.memory_budget_bytes = 50;
  GraphManager manager = make(options);
  const size_t m = manager.add_module(doubling_module("layer", &eager_runs));
  (void)manager.call(m, call_inputs(at::ones({1, 2})));
  EXPECT_THROW_WITH(manager.call(m, call_inputs(at::ones({1, 2}))), Error,
                    "memory_budget=50 B is smaller than one graph: module `layer` (Doubler) "
                    "holds 100 B. Raise memory_budget to at least 100 B");
  EXPECT_EQ(manager.stats().graphs, 0);
}

TEST_F(ManagerFixture, CaptureErrorFallsBackForThatModuleOnly) {
  GraphManagerOptions options;
  options.warmup = 1;
  GraphManager manager = make(options);
  const size_t bad = manager.add_module(doubling_module("bad", &eager_runs));
  const size_t good = manager.add_module(doubling_module("good", &eager_runs));
  const at::Tensor x = at::ones({2, 2});
  (void)manager.call(bad, call_inputs(x));
  (void)manager.call(good, call_inputs(x));
  journal.fail_capture = true;
  EXPECT_TRUE(at::equal(manager.call(bad, call_inputs(x)).toTensor(), x * 2 + 1));
  journal.fail_capture = false;
  (void)manager.call(good, call_inputs(x));
  (void)manager.call(bad, call_inputs(x));  // stays eager without trying again
  const GraphManagerStats stats = manager.stats();
  ASSERT_EQ(stats.fallbacks.size(), 1u);
  EXPECT_EQ(stats.fallbacks[0].module, "bad");
  EXPECT_EQ(stats.fallbacks[0].count, 2);
  EXPECT_NE(stats.fallbacks[0].reason.find("capture failed: Capturing module `bad` (Doubler) "
                                           "failed: aten::nonzero"),
            std::string::npos)
      << stats.fallbacks[0].reason;
  EXPECT_EQ(stats.modules[0].state, "eager");
  EXPECT_EQ(stats.modules[1].state, "graphed");
  EXPECT_EQ(stats.replays, 1);
}

TEST_F(ManagerFixture, TrainingCallsFallBackUntilTrainingGraphsArePluggedIn) {
  GraphManagerOptions options;
  options.warmup = 1;
  GraphManager manager = make(options);
  int64_t runs = 0;
  ModuleSpec spec = doubling_module("layer", &runs);
  const at::Tensor weight = at::ones({2}).requires_grad_();
  spec.parameters = {weight};
  const size_t m = manager.add_module(std::move(spec));
  const at::Tensor x = at::ones({2, 2});
  (void)manager.call(m, call_inputs(x));
  (void)manager.call(m, call_inputs(x));  // grad mode on, a parameter requires grad
  {
    c10::NoGradGuard no_grad;
    (void)manager.call(m, call_inputs(x));  // inference: graphed
  }
  const GraphManagerStats stats = manager.stats();
  ASSERT_EQ(stats.fallbacks.size(), 1u);
  EXPECT_EQ(stats.fallbacks[0].reason, std::string(kTrainingGraphsUnavailable));
  EXPECT_EQ(stats.replays, 1);

  // With a training factory, the same call is captured as a training entry.
  Journal training_journal;
  GraphEntryFactories factories;
  factories.inference = fake_factory(journal);
  factories.training = fake_factory(training_journal);
  options.check_blockers = false;
  GraphManager with_training(options, factories);
  ModuleSpec again = doubling_module("layer", &runs);
  again.parameters = {weight};
  const size_t n = with_training.add_module(std::move(again));
  (void)with_training.call(n, call_inputs(x));
  (void)with_training.call(n, call_inputs(x));
  EXPECT_EQ(training_journal.captured.size(), 1u);
  EXPECT_TRUE(with_training.stats().fallbacks.empty());
}

// A module computing x * weight, for training calls on CPU tensors.
ModuleSpec scaling_module(const std::string& name, const at::Tensor& weight) {
  ModuleSpec spec;
  spec.name = name;
  spec.type = "Scale";
  spec.parameters = {weight};
  spec.forward = [weight](const std::vector<IValue>& inputs) -> IValue {
    return inputs.at(0).toTupleRef().elements().at(0).toTensor() * weight;
  };
  return spec;
}

struct GroupJournal {
  std::vector<std::vector<std::string>> modules;  // per group capture
  std::vector<std::vector<int64_t>> orders;
  bool fail = false;
};

GraphGroupFactory fake_group_factory(GroupJournal& groups, Journal& journal) {
  return [&groups, &journal](const std::vector<GraphEntryRequest>& requests,
                             const std::vector<int64_t>& order) {
    if (groups.fail) {
      GRAPHED_THROW(CaptureError, "Capturing the group failed: aten::nonzero.");
    }
    std::vector<std::string> names;
    std::vector<std::unique_ptr<GraphEntry>> entries;
    for (const GraphEntryRequest& request : requests) {
      names.push_back(request.module->name);
      entries.push_back(std::make_unique<FakeEntry>(request, journal));
    }
    groups.modules.push_back(names);
    groups.orders.push_back(order);
    return entries;
  };
}

TEST(GraphManager, TrainingGraphsOfAStepAreCapturedTogetherInTheRecordedOrder) {
  GraphManagerOptions options;
  options.warmup = 2;
  options.check_blockers = false;
  Journal journal;
  Journal training_journal;
  GroupJournal groups;
  GraphEntryFactories factories;
  factories.inference = fake_factory(journal);
  factories.training = fake_factory(training_journal);
  factories.training_group = fake_group_factory(groups, training_journal);
  GraphManager manager(options, factories);
  const at::Tensor w0 = at::full({3}, 2.0).requires_grad_();
  const at::Tensor w1 = at::full({3}, 3.0).requires_grad_();
  const at::Tensor w2 = at::full({3}, 5.0).requires_grad_();
  const size_t first = manager.add_module(scaling_module("blocks.0", w0));
  const size_t second = manager.add_module(scaling_module("blocks.1", w1));
  const size_t head = manager.add_module(scaling_module("head", w2));
  const at::Tensor x = at::ones({2, 3});
  for (int step = 0; step < 4; ++step) {
    // blocks.1 runs before blocks.0; the head has a loss of its own that is
    // backpropagated first.
    const at::Tensor a = manager.call(second, call_inputs(x)).toTensor();
    const at::Tensor b = manager.call(first, call_inputs(a)).toTensor();
    const at::Tensor c = manager.call(head, call_inputs(x)).toTensor();
    c.sum().backward();
    b.sum().backward();
  }
  ASSERT_EQ(groups.modules.size(), 1u);
  EXPECT_EQ(groups.modules[0], (std::vector<std::string>{"blocks.1", "blocks.0", "head"}));
  EXPECT_EQ(groups.orders[0], (std::vector<int64_t>{1, 2, 3, -3, -2, -1}));
  EXPECT_TRUE(training_journal.captured.empty());  // nothing captured on its own
  const GraphManagerStats stats = manager.stats();
  ASSERT_EQ(stats.training_groups.size(), 1u);
  EXPECT_EQ(stats.training_groups[0].order, groups.orders[0]);
  EXPECT_TRUE(stats.training_groups[0].failure.empty());
  EXPECT_EQ(stats.captures, 3);
  EXPECT_EQ(stats.replays, 6);
  EXPECT_TRUE(stats.fallbacks.empty());
  // The fakes replay eagerly: gradients are those of four eager steps.
  EXPECT_TRUE(at::allclose(w0.grad(), at::full({3}, 4 * 2 * 3.0)));
}

TEST(GraphManager, AFailedTrainingGroupCapturesEachModuleOnItsOwn) {
  GraphManagerOptions options;
  options.warmup = 1;
  options.check_blockers = false;
  Journal journal;
  Journal training_journal;
  GroupJournal groups;
  groups.fail = true;
  GraphEntryFactories factories;
  factories.inference = fake_factory(journal);
  factories.training = fake_factory(training_journal);
  factories.training_group = fake_group_factory(groups, training_journal);
  GraphManager manager(options, factories);
  const at::Tensor w = at::full({3}, 2.0).requires_grad_();
  const size_t first = manager.add_module(scaling_module("first", w));
  const size_t other = manager.add_module(scaling_module("other", w));
  const at::Tensor x = at::ones({2, 3});
  for (int step = 0; step < 3; ++step) {
    const at::Tensor y = manager.call(first, call_inputs(x)).toTensor();
    const at::Tensor z = manager.call(other, call_inputs(y)).toTensor();
    z.sum().backward();
  }
  const GraphManagerStats stats = manager.stats();
  ASSERT_EQ(stats.training_groups.size(), 1u);
  EXPECT_NE(stats.training_groups[0].failure.find("Capturing the group failed"),
            std::string::npos);
  EXPECT_EQ(training_journal.captured,
            (std::vector<std::string>{"module `first` (Scale)", "module `other` (Scale)"}));
  EXPECT_TRUE(stats.fallbacks.empty());
}

TEST(GraphManager, CheckedWarmupFindsAHostReadAndFallsBack) {
  GraphManagerOptions options;
  options.warmup = 2;
  Journal journal;
  GraphEntryFactories factories;
  factories.inference = fake_factory(journal);
  GraphManager manager(options, factories);
  ModuleSpec spec;
  spec.name = "blocks.3";
  spec.type = "Block";
  spec.forward = [](const std::vector<IValue>& inputs) -> IValue {
    const at::Tensor x = inputs.at(0).toTupleRef().elements().at(0).toTensor();
    const float scale = x.abs().max().item<float>();  // a host read
    return x / scale;
  };
  const size_t m = manager.add_module(std::move(spec));
  const at::Tensor x = at::full({2, 2}, 4.0);
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(at::equal(manager.call(m, call_inputs(x)).toTensor(), at::ones({2, 2})));
  }
  const GraphManagerStats stats = manager.stats();
  EXPECT_TRUE(journal.captured.empty());
  ASSERT_EQ(stats.fallbacks.size(), 1u);
  EXPECT_EQ(stats.fallbacks[0].count, 2);  // the two calls after warm-up
  EXPECT_NE(stats.fallbacks[0].reason.find("graphed.check found a host read, `aten::item`"),
            std::string::npos)
      << stats.fallbacks[0].reason;
  EXPECT_EQ(stats.modules[0].state, "eager");
}

// GraphManager with real graphs (make_inference_entry) of a module computing
// 2 * x + 1 on the GPU.
struct GpuManager {
  explicit GpuManager(GraphManagerOptions options) : manager(with_defaults(options)) {
    index = manager.add_module(doubling_module("layer", &eager_runs));
  }
  static GraphManagerOptions with_defaults(GraphManagerOptions options) {
    options.warmup = 1;
    options.check_blockers = false;
    return options;
  }
  // Rows of 128 KiB, so that the buffers outweigh the pool's 2 MiB segments.
  at::Tensor call(int64_t batch) {
    const at::Tensor x = at::randn({batch, 32768}, at::TensorOptions().device(at::kCUDA));
    const at::Tensor y = manager.call(index, call_inputs(x)).toTensor();
    EXPECT_TRUE(at::allclose(y, x * 2 + 1)) << "batch " << batch;
    return y;
  }
  int64_t eager_runs = 0;
  GraphManager manager;
  size_t index = 0;
};

TEST(GraphManagerOnGpu, BucketGraphsOfAModuleShareTheLargestOnesBuffers) {
  // Note [Bucket graphs share their buffers].
  GRAPHED_REQUIRE_GPU();
  GraphManagerOptions options;
  options.buckets = BucketPolicy(Buckets{{0, {1, 2, 4, 8, 16, 32}}});
  GpuManager shared(options);
  options.share_bucket_buffers = false;
  GpuManager separate(options);
  for (GpuManager* m : {&shared, &separate}) {
    for (int64_t batch : {3, 3, 32, 17, 9, 5, 3, 2, 1, 30}) (void)m->call(batch);
    EXPECT_EQ(m->manager.stats().captures, 6);
    EXPECT_EQ(m->manager.stats().replays, 9);
  }
  // Outputs of every bucket in the largest graph's: valid until the next call.
  const at::Tensor small = shared.call(3);
  const at::Tensor large = shared.call(20);
  EXPECT_EQ(small.data_ptr(), large.data_ptr());
  // Buffers for 32 rows instead of 63, inputs and outputs alike (the pool's
  // scratch, which every graph counts where it grew, is the same in both).
  const int64_t with = shared.manager.stats().graph_memory_bytes;
  const int64_t without = separate.manager.stats().graph_memory_bytes;
  EXPECT_LT(with, without) << with << " vs " << without;
}

TEST(GraphManagerOnGpu, ModulesKeepTheirLargestInputBuffersInOneSetButNotTheirOutputs) {
  // Note [Bucket graphs share their buffers]: inputs are read only during
  // their own call, outputs live until the module's next call.
  GRAPHED_REQUIRE_GPU();
  GraphManagerOptions options;
  options.warmup = 1;
  options.check_blockers = false;
  options.buckets = BucketPolicy(Buckets{{0, {4, 8}}});
  GraphManager manager(options);
  int64_t runs = 0;
  const size_t first = manager.add_module(doubling_module("first", &runs));
  const size_t second = manager.add_module(doubling_module("second", &runs));
  ModuleSpec identity;
  identity.name = "identity";
  identity.type = "Identity";
  identity.forward = [](const std::vector<IValue>& inputs) -> IValue {
    return inputs.at(0).toTupleRef().elements().at(0).toTensor();
  };
  const size_t third = manager.add_module(std::move(identity));
  const at::TensorOptions cuda = at::TensorOptions().device(at::kCUDA);
  for (int round = 0; round < 3; ++round) {
    const at::Tensor x = at::randn({6, 16}, cuda);
    const at::Tensor a = manager.call(first, call_inputs(x)).toTensor();
    const at::Tensor a_values = a.clone();
    const at::Tensor b = manager.call(second, call_inputs(a)).toTensor();
    // The second module's inputs live where the first one's did, its outputs do not.
    EXPECT_TRUE(at::allclose(a, x * 2 + 1));
    EXPECT_TRUE(at::allclose(b, a_values * 2 + 1));
    EXPECT_NE(a.data_ptr(), b.data_ptr());
    const at::Tensor c = manager.call(third, call_inputs(b)).toTensor();
    const at::Tensor c_values = c.clone();
    EXPECT_TRUE(at::equal(c, b));
    // Another module's call copies into the shared inputs: the identity's
    // output, which is its input buffer, must not be there.
    (void)manager.call(first, call_inputs(at::randn({3, 16}, cuda)));
    EXPECT_TRUE(at::equal(c, c_values)) << "the identity's output is its input buffer: not shared";
  }
  EXPECT_TRUE(manager.stats().fallbacks.empty());
}

TEST(GraphManagerOnGpu, AGraphLargerThanTheArenaTakesItsPlaceAndTheOthersFollow) {
  // Buckets graphed picked, calls growing: each larger graph becomes the
  // module's arena and its smaller graphs are captured again inside it.
  GRAPHED_REQUIRE_GPU();
  GraphManagerOptions options;
  options.pick_buckets = true;
  GpuManager m(options);
  for (int64_t batch : {1, 2, 3, 5, 7, 12, 30}) (void)m.call(batch);
  const int64_t captures = m.manager.stats().captures;
  for (int round = 0; round < 2; ++round) {
    for (int64_t batch : {1, 2, 3, 5, 7, 12, 30}) (void)m.call(batch);
  }
  // At most one more capture per bucket below 32 (evicted by a larger one), then none.
  const int64_t recaptures = m.manager.stats().captures - captures;
  EXPECT_GT(recaptures, 0);
  EXPECT_LE(recaptures, 5);
  for (int64_t batch : {1, 2, 3, 5, 7, 12, 30}) (void)m.call(batch);
  EXPECT_EQ(m.manager.stats().captures, captures + recaptures);
  EXPECT_TRUE(m.manager.stats().fallbacks.empty());
}

TEST(GraphManager, UnknownModuleIndexIsRefused) {
  GraphManager manager(GraphManagerOptions{});
  EXPECT_THROW_WITH(manager.call(3, {}), Error, "Expected a module index below 0, got 3");
}

}  // namespace
}  // namespace graphed
