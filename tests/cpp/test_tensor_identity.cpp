// TensorIdentities: what a graph reads in place, as it was at capture
// (Note [Tensors a graph reads in place]). Host logic: CPU tensors.

#include "graphed/tensor_identity.h"
#include "test_support.h"

#include <ATen/ATen.h>

namespace graphed {
namespace {

TEST(TensorIdentities, TheSameTensorsMatch) {
  const std::vector<at::Tensor> tensors{at::ones({4}), at::zeros({2, 3}, at::kLong), at::Tensor()};
  const TensorIdentities identities(tensors);
  EXPECT_EQ(identities.size(), 3u);
  EXPECT_EQ(identities.first_difference(tensors), "");
  tensors[0].mul_(2);  // values changed in place: what graphs are for
  EXPECT_EQ(identities.first_difference(tensors), "");
  EXPECT_EQ(TensorIdentities().first_difference({}), "");
}

TEST(TensorIdentities, AReplacedTensorIsNamed) {
  const std::vector<at::Tensor> tensors{at::ones({4}), at::zeros({4})};
  const TensorIdentities identities(tensors);
  const std::string found =
      identities.first_difference({tensors[0], at::zeros({4})}, "parameter or buffer");
  EXPECT_NE(found.find("parameter or buffer 1 ((4,) float32 cpu at capture) was replaced by "
                       "another tensor"), std::string::npos) << found;
}

TEST(TensorIdentities, NewStorageOrDtypeOfTheSameTensorIsFound) {
  // What module.double() and `param.data = t` do: the same tensor object
  // (TensorImpl) gets other storage, and the graph's old address is freed.
  at::Tensor param = at::ones({4});
  const TensorIdentities identities({param});
  param.set_data(at::ones({4}, at::kDouble));
  const std::string moved = identities.first_difference({param});
  EXPECT_NE(moved.find("tensor 0 ((4,) float32 cpu at capture) now is (4,) float64 cpu at "
                       "another address"), std::string::npos) << moved;

  at::Tensor other = at::ones({4});
  const TensorIdentities same_dtype({other});
  other.set_data(at::zeros({4}));
  EXPECT_NE(same_dtype.first_difference({other}).find("at another address"), std::string::npos);
}

TEST(TensorIdentities, ResizedInPlaceIsFound) {
  at::Tensor buffer = at::ones({8});
  const TensorIdentities identities({buffer});
  buffer.resize_({2});  // shrinks in place: same address, other sizes
  const std::string found = identities.first_difference({buffer});
  EXPECT_NE(found.find("now is (2,) float32 cpu"), std::string::npos) << found;
}

TEST(TensorIdentities, CountsThatDifferAreReported) {
  const TensorIdentities identities({at::ones({1})});
  EXPECT_EQ(identities.first_difference({at::ones({1}), at::ones({1})}),
            "there are 2 tensors now, 1 at capture");
}

}  // namespace
}  // namespace graphed
