// Static input buffers and output materialisation (host logic: CPU tensors).

#include "graphed/static_io.h"
#include "test_support.h"

#include <ATen/ATen.h>

namespace graphed {
namespace {

using c10::IValue;

IValue pair(IValue a, IValue b) { return c10::ivalue::Tuple::create({std::move(a), std::move(b)}); }

TEST(TreeUtilities, FlattenAndMapVisitTensorsInOneOrder) {
  const at::Tensor a = at::ones({2});
  const at::Tensor b = at::zeros({3});
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("b", b);
  dict.insert("n", IValue(int64_t{7}));
  const IValue tree = pair(a, dict);
  const auto flat = flatten_tensors(tree);
  ASSERT_EQ(flat.size(), 2u);
  EXPECT_TRUE(flat[0].is_same(a));
  EXPECT_TRUE(flat[1].is_same(b));

  int index = 0;
  const IValue doubled = map_tensors(tree, [&](const at::Tensor& t) {
    ++index;
    return t * 2;
  });
  EXPECT_EQ(index, 2);
  const auto mapped = flatten_tensors(doubled);
  EXPECT_TRUE(at::equal(mapped[0], a * 2));
  EXPECT_TRUE(at::equal(mapped[1], b * 2));
  EXPECT_EQ(doubled.toTupleRef().elements()[1].toGenericDict().at("n").toInt(), 7);
  // Containers are rebuilt, not shared.
  EXPECT_FALSE(doubled.toTupleRef().elements()[1].isSameIdentity(tree.toTupleRef().elements()[1]));
}

TEST(StaticInputs, BuffersAreCopiesOfTheSample) {
  const at::Tensor x = at::arange(6, at::kFloat).reshape({2, 3});
  StaticInputs inputs({pair(x, IValue(1.0))});
  ASSERT_EQ(inputs.buffers().size(), 1u);
  EXPECT_FALSE(inputs.buffers()[0].is_same(x));
  EXPECT_NE(inputs.buffers()[0].data_ptr(), x.data_ptr());
  EXPECT_TRUE(at::equal(inputs.buffers()[0], x));
  EXPECT_TRUE(inputs.tree()[0].toTupleRef().elements()[0].toTensor().is_same(inputs.buffers()[0]));
  EXPECT_EQ(inputs.tree()[0].toTupleRef().elements()[1].toDouble(), 1.0);
}

TEST(StaticInputs, BuffersKeepTheSampleMemoryFormat) {
  const at::Tensor x = at::randn({2, 3, 4, 5}).contiguous(at::MemoryFormat::ChannelsLast);
  StaticInputs inputs({x});
  EXPECT_TRUE(inputs.buffers()[0].is_contiguous(at::MemoryFormat::ChannelsLast));
}

TEST(StaticInputs, LoadCopiesNewTensorsAndSkipsTheBufferItself) {
  StaticInputs inputs({pair(at::zeros({4}), at::zeros({4}))});
  const at::Tensor fresh = at::full({4}, 3.0);
  EXPECT_EQ(inputs.load({fresh, inputs.buffers()[1]}), 1u);
  EXPECT_TRUE(at::equal(inputs.buffers()[0], fresh));
  EXPECT_EQ(inputs.load({inputs.buffers()[0], inputs.buffers()[1]}), 0u);
}

TEST(StaticInputs, LoadAcceptsOtherStrides) {
  StaticInputs inputs({at::zeros({3, 2})});
  const at::Tensor transposed = at::arange(6, at::kFloat).reshape({2, 3}).t();
  inputs.load({transposed});
  EXPECT_TRUE(at::equal(inputs.buffers()[0], transposed));
}

// Note [Inputs that alias other static buffers]: the buffers swapped (a
// function returning its inputs in the other order, fed back in), and a view
// of another input's buffer. Without cloning first, the first copy would
// overwrite the second input's value before it is read.
TEST(StaticInputs, LoadReadsInputsThatAliasOtherBuffersBeforeWritingAny) {
  StaticInputs inputs({IValue(at::full({3}, 1.0)), IValue(at::full({3}, 2.0))});
  const std::vector<at::Tensor> buffers = inputs.buffers();
  EXPECT_FALSE(any_cross_alias({buffers[0], buffers[1]}, buffers)) << "each its own buffer";
  EXPECT_TRUE(any_cross_alias({buffers[1], buffers[0]}, buffers));
  EXPECT_EQ(inputs.load({buffers[1], buffers[0]}), 2u);
  EXPECT_TRUE(at::equal(buffers[0], at::full({3}, 2.0)));
  EXPECT_TRUE(at::equal(buffers[1], at::full({3}, 1.0)));

  const at::Tensor fresh = at::full({3}, 5.0);
  const at::Tensor view_of_first = buffers[0].view({3});  // holds 2.0
  EXPECT_EQ(inputs.load({fresh, view_of_first}), 2u);
  EXPECT_TRUE(at::equal(buffers[0], fresh));
  EXPECT_TRUE(at::equal(buffers[1], at::full({3}, 2.0))) << "read before buffer 0 was written";
}

TEST(StaticInputs, CloneCrossAliasesClonesOnlyInputsOfOtherBuffers) {
  const std::vector<at::Tensor> buffers{at::zeros({2}), at::ones({2})};
  const at::Tensor other = at::full({2}, 3.0);
  std::vector<at::Tensor> tensors{buffers[0], buffers[0]};
  EXPECT_EQ(clone_cross_aliases(tensors, buffers), 1u);
  EXPECT_TRUE(tensors[0].is_same(buffers[0])) << "a buffer passed at its own index stays itself";
  EXPECT_FALSE(tensors[1].is_same(buffers[0]));
  EXPECT_TRUE(at::equal(tensors[1], buffers[0]));
  tensors = {other, buffers[1]};
  EXPECT_EQ(clone_cross_aliases(tensors, buffers), 0u);
  EXPECT_TRUE(tensors[0].is_same(other));
}

TEST(StaticInputs, MutationWatchFindsInPlaceWritesAndStoresThemBack) {
  StaticInputs inputs({pair(at::zeros({2}), at::zeros({2}))});
  inputs.start_mutation_watch();
  inputs.buffers()[1].add_(1);  // the function writes its second input
  inputs.finish_mutation_watch();
  ASSERT_EQ(inputs.mutated(), std::vector<size_t>{1});

  const at::Tensor caller_a = at::zeros({2});
  const at::Tensor caller_b = at::zeros({2});
  inputs.buffers()[1].fill_(5);
  inputs.store_back({caller_a, caller_b});
  EXPECT_TRUE(at::equal(caller_b, at::full({2}, 5.0)));
  EXPECT_TRUE(at::equal(caller_a, at::zeros({2})));  // not mutated: untouched
}

TEST(StaticOutputs, MaterializeReturnsStaticTensorsOrClones) {
  const at::Tensor y = at::ones({3});
  StaticOutputs outputs(pair(y, IValue(std::string("tag"))));
  const IValue same = outputs.materialize(false);
  EXPECT_TRUE(same.toTupleRef().elements()[0].toTensor().is_same(y));
  const IValue cloned = outputs.materialize(true);
  const at::Tensor copy = cloned.toTupleRef().elements()[0].toTensor();
  EXPECT_FALSE(copy.is_same(y));
  EXPECT_NE(copy.data_ptr(), y.data_ptr());
  EXPECT_TRUE(at::equal(copy, y));
  EXPECT_EQ(cloned.toTupleRef().elements()[1].toStringRef(), "tag");
  ASSERT_EQ(outputs.tensors().size(), 1u);
}

TEST(StaticOutputs, ASingleTensorOutputIsReturnedAsIs) {
  const at::Tensor y = at::ones({3});
  StaticOutputs outputs(y);
  EXPECT_TRUE(outputs.materialize(false).toTensor().is_same(y));
  EXPECT_FALSE(outputs.materialize(true).toTensor().is_same(y));
}

}  // namespace
}  // namespace graphed
