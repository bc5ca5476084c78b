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
  /// `sizes` with every bucketed dimension it has set to its bucket.
  std::vector<int64_t> padded_sizes(c10::IntArrayRef sizes) const;
  /// The same plan with every size set to its bucket (what a graph captured
  /// for these buckets is called with).
  BucketPlan at_buckets() const;
  /// E.g. "dim 0: 13 -> 16".
  std::string describe() const;

 private:
  std::vector<BucketedDim> dims_;
};

/// Capture sizes per dimension: `{0: [1, 2, 4, 8]}` pads dimension 0 of every
/// input tensor up to the next of those sizes.
///
/// Note [Bucket padding]
/// ~~~~~~~~~~~~~~~~~~~~~
/// A call pads every input tensor that has a bucketed dimension up to the
/// smallest bucket not below the call's size there; all such tensors must
/// agree on that size (it is the batch, say, of every input). The rows added
/// hold earlier inputs' values or zeros, never uninitialised memory, and
/// their results are cut off: every output tensor whose size along a
/// bucketed dimension equals the bucket is narrowed back to the call's size.
/// This is only exact for dimensions whose rows do not influence each other
/// (a batch of independent sequences; not a dimension a layer reduces over,
/// and not BatchNorm in training mode) -- the same contract as hand-written
/// bucketed graphs. Sizes above the largest bucket are not covered: the call
/// falls back to eager execution, or raises with fallback="raise".
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
