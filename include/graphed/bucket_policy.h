#pragma once

/// \file bucket_policy.h
/// graphed::BucketPolicy: padding chosen dimensions of a call's inputs up to a
/// few capture sizes, so that a handful of graphs serve every size seen (a
/// decode loop whose batch varies from 1 to 64 replays one of seven graphs
/// instead of capturing sixty-four), and slicing the outputs back.

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace graphed {

/// One bucketed dimension of one call: the call's size along `dim` and the
/// capture size it is padded up to.
struct BucketedDim {
  /// The dimension, counted from the front of every input tensor.
  int64_t dim = 0;
  /// The call's size along `dim`.
  int64_t size = 0;
  /// The bucket `size` is padded up to (>= size).
  int64_t padded = 0;
  /// True when `size` is 1 and several tensors have the dimension: which of
  /// them are broadcast (Note [Bucket padding]) cannot be told from this
  /// call, so no graph is captured ahead from it.
  bool ambiguous = false;

  /// Equal dims, sizes and buckets.
  bool operator==(const BucketedDim& other) const {
    return dim == other.dim && size == other.size && padded == other.padded;
  }
};

/// How one call maps onto the buckets: one BucketedDim per bucketed dimension
/// that the call's tensors have. An empty plan pads nothing.
class BucketPlan {
 public:
  /// A plan that pads nothing.
  BucketPlan() = default;
  /// A plan of these dimensions, in increasing `dim` order.
  explicit BucketPlan(std::vector<BucketedDim> dims) : dims_(std::move(dims)) {}

  /// The bucketed dimensions.
  const std::vector<BucketedDim>& dims() const { return dims_; }
  /// True when some size is smaller than its bucket, so inputs need padding
  /// and outputs slicing.
  bool pads() const;
  /// `sizes` with every bucketed dimension whose size is the call's set to
  /// its bucket (a broadcast size of 1 stays: Note [Bucket padding]).
  std::vector<int64_t> padded_sizes(c10::IntArrayRef sizes) const;
  /// The same plan with every size set to its bucket (what a graph captured
  /// for these buckets is called with).
  BucketPlan at_buckets() const;
  /// E.g. "dim 0: 13 -> 16".
  std::string describe() const;

 private:
  std::vector<BucketedDim> dims_;
};

/// Note [Bucket padding]
/// ~~~~~~~~~~~~~~~~~~~~~
/// A call pads every input tensor that carries a bucketed dimension up to the
/// smallest bucket not below the call's size there. The call's size is the
/// one size, other than 1, that the tensors have there; a tensor of size 1
/// there is broadcast against the others (transformers hands every decoder
/// layer position ids, rotary tables and causal masks of batch size 1) and
/// passes unpadded, so a graph captured at a bucket reads it as eager does.
/// When every tensor has size 1 there the call's size is 1 and all of them
/// are padded (harmless for broadcast ones: their rows repeat the same
/// values); graphs are not captured ahead from such a call, since the
/// broadcast tensors cannot be told apart in it. Tensors of two different
/// sizes other than 1 cannot be bucketed: the call falls back, naming both.
/// The rows added hold earlier inputs' values or zeros, never uninitialised
/// memory, and their results are cut off: every output tensor whose size
/// along a bucketed dimension equals the bucket is narrowed back to the
/// call's size. This is only exact for dimensions whose rows do not
/// influence each other (a batch of independent sequences; not a dimension a
/// layer reduces over, and not BatchNorm in training mode) -- the same
/// contract as hand-written bucketed graphs. Sizes above the largest bucket
/// are not covered: the call falls back to eager execution, or raises with
/// fallback="raise".

/// Why a call cannot be bucketed, by tensor index, so that the caller names
/// the tensors only when it reports the reason (BucketPolicy::plan_sizes).
struct BucketMiss {
  /// Two tensors have different sizes other than 1 (kDisagree), or the
  /// call's size is above the largest bucket (kAboveLargest).
  enum class Kind { kDisagree, kAboveLargest };
  /// What went wrong.
  Kind kind = Kind::kAboveLargest;
  /// The bucketed dimension.
  int64_t dim = 0;
  /// The tensor whose size is the call's.
  size_t first = 0;
  /// kDisagree: the tensor of another size.
  size_t other = 0;
  /// Their sizes along `dim` (`other_size` only for kDisagree).
  int64_t first_size = 0;
  /// See first_size.
  int64_t other_size = 0;

  /// Same kind, dimension, tensors and sizes.
  bool operator==(const BucketMiss& o) const {
    return kind == o.kind && dim == o.dim && first == o.first && other == o.other &&
           first_size == o.first_size && other_size == o.other_size;
  }
};

/// Capture sizes per dimension: `{0: [1, 2, 4, 8]}` pads dimension 0 of every
/// input tensor that carries it up to the next of those sizes (Note [Bucket
/// padding]).
class BucketPolicy {
 public:
  /// No buckets: every distinct size is its own graph.
  BucketPolicy() = default;
  /// Buckets per dimension. Sizes are sorted and deduplicated. Throws
  /// graphed::Error for a negative dimension, an empty size list or a size
  /// below 1, saying what to pass instead.
  explicit BucketPolicy(std::map<int64_t, std::vector<int64_t>> buckets);

  /// True when no dimension is bucketed.
  bool empty() const { return buckets_.empty(); }
  /// The sorted sizes per dimension.
  const std::map<int64_t, std::vector<int64_t>>& buckets() const { return buckets_; }
  /// The smallest bucket of `dim` not below `size`; nullopt when `size` is
  /// above the largest (or `dim` is not bucketed).
  std::optional<int64_t> bucket_for(int64_t dim, int64_t size) const;

  /// The plan for a call whose input tensors have `sizes` (in signature
  /// order; `paths[i]` names tensor i in messages). Returns nullopt and sets
  /// `why` when the call cannot be bucketed: tensors disagree along a
  /// bucketed dimension, or a size is above the largest bucket. `why` then
  /// says what was found and how to fix it.
  std::optional<BucketPlan> plan(const std::vector<c10::IntArrayRef>& sizes,
                                 const std::vector<std::string>& paths, std::string* why) const;

  /// plan() without names: returns nullopt and sets `miss` (when not null)
  /// when the call cannot be bucketed. Builds no strings: the call path.
  std::optional<BucketPlan> plan_sizes(const std::vector<c10::IntArrayRef>& sizes,
                                       BucketMiss* miss) const;

  /// The reason and fix for `miss`, naming its tensors by these paths.
  std::string describe_miss(const BucketMiss& miss, const std::string& first_path,
                            const std::string& other_path) const;

  /// Every combination of buckets of the dimensions in `like` (a plan of a
  /// call), largest first: descending by the product of the sizes, so that
  /// graphs captured in this order into one pool reuse the largest one's
  /// memory. Empty when `like` has no dimensions.
  std::vector<BucketPlan> combinations_largest_first(const BucketPlan& like) const;

  /// E.g. "{0: [1, 2, 4, 8]}".
  std::string describe() const;

 private:
  std::map<int64_t, std::vector<int64_t>> buckets_;
};

/// A new tensor of `tensor`'s dtype and device with sizes plan.padded_sizes:
/// the overlap with `tensor` copied, the rest zeros. Also shrinks a dimension
/// when the plan's bucket is below the tensor's size (capture-ahead samples).
at::Tensor resize_to_buckets(const at::Tensor& tensor, const BucketPlan& plan);

/// Narrows every tensor of `value` whose size along a padded dimension of
/// `plan` equals the bucket back to the call's size. Views, no copies.
c10::IValue slice_to_call(const c10::IValue& value, const BucketPlan& plan);

}  // namespace graphed
