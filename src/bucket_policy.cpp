#include "graphed/bucket_policy.h"

#include "graphed/check.h"
#include "graphed/static_io.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <sstream>

namespace graphed {
namespace {

std::string format_list(const std::vector<int64_t>& values) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < values.size(); ++i) {
    out << (i == 0 ? "" : ", ") << values[i];
  }
  out << "]";
  return out.str();
}

}  // namespace

bool BucketPlan::pads() const {
  return std::any_of(dims_.begin(), dims_.end(),
                     [](const BucketedDim& d) { return d.size != d.padded; });
}

std::vector<int64_t> BucketPlan::padded_sizes(c10::IntArrayRef sizes) const {
  std::vector<int64_t> out = sizes.vec();
  for (const BucketedDim& d : dims_) {
    // A broadcast size of 1 stays: Note [Bucket padding].
    if (d.dim < static_cast<int64_t>(out.size()) && out[d.dim] == d.size) {
      out[d.dim] = d.padded;
    }
  }
  return out;
}

BucketPlan BucketPlan::at_buckets() const {
  std::vector<BucketedDim> dims = dims_;
  for (BucketedDim& d : dims) {
    d.size = d.padded;
  }
  return BucketPlan(std::move(dims));
}

std::string BucketPlan::describe() const {
  if (dims_.empty()) {
    return "no bucketed dims";
  }
  std::ostringstream out;
  for (size_t i = 0; i < dims_.size(); ++i) {
    out << (i == 0 ? "" : ", ") << "dim " << dims_[i].dim << ": " << dims_[i].size;
    if (dims_[i].padded != dims_[i].size) {
      out << " -> " << dims_[i].padded;
    }
  }
  return out.str();
}

BucketPolicy::BucketPolicy(std::map<int64_t, std::vector<int64_t>> buckets) {
  for (auto& [dim, sizes] : buckets) {
    GRAPHED_CHECK(dim >= 0, "Expected bucketed dimensions counted from the front (>= 0), got ",
                  dim, ". Pass buckets={dim: sizes} with the dimension's index from the front, "
                  "e.g. buckets={0: [1, 2, 4, 8]} for the batch dimension.");
    GRAPHED_CHECK(!sizes.empty(), "Expected at least one size for bucketed dimension ", dim,
                  ", got an empty list. List the capture sizes, e.g. buckets={", dim,
                  ": [1, 2, 4, 8]}, or leave the dimension out.");
    std::sort(sizes.begin(), sizes.end());
    sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
    GRAPHED_CHECK(sizes.front() >= 1, "Expected bucket sizes >= 1, got ", sizes.front(),
                  " for dimension ", dim, ". Sizes are the lengths graphs are captured at; "
                  "remove ", sizes.front(), ".");
  }
  buckets_ = std::move(buckets);
}

std::optional<int64_t> BucketPolicy::bucket_for(int64_t dim, int64_t size) const {
  const auto found = buckets_.find(dim);
  if (found == buckets_.end()) {
    return std::nullopt;
  }
  const auto bucket = std::lower_bound(found->second.begin(), found->second.end(), size);
  if (bucket == found->second.end()) {
    return std::nullopt;
  }
  return *bucket;
}

std::optional<BucketPlan> BucketPolicy::plan_sizes(const std::vector<c10::IntArrayRef>& sizes,
                                                   BucketMiss* miss) const {
  std::vector<BucketedDim> dims;
  for (const auto& [dim, bucket_sizes] : buckets_) {
    // The call's size is the one size other than 1 (Note [Bucket padding]).
    std::optional<size_t> first;
    std::optional<size_t> any;
    int64_t having = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (static_cast<int64_t>(sizes[i].size()) <= dim) {
        continue;
      }
      ++having;
      if (!any) any = i;
      const int64_t size = sizes[i][dim];
      if (size == 1) {
        continue;
      }
      if (!first) {
        first = i;
      } else if (size != sizes[*first][dim]) {
        if (miss != nullptr) {
          *miss = BucketMiss{BucketMiss::Kind::kDisagree, dim, *first, i, sizes[*first][dim], size};
        }
        return std::nullopt;
      }
    }
    if (!any) {
      continue;  // No input has this dimension; nothing to pad.
    }
    const size_t index = first.value_or(*any);
    const int64_t size = sizes[index][dim];
    const std::optional<int64_t> bucket = bucket_for(dim, size);
    if (!bucket) {
      if (miss != nullptr) {
        *miss = BucketMiss{BucketMiss::Kind::kAboveLargest, dim, index, 0, size, 0};
      }
      return std::nullopt;
    }
    dims.push_back(BucketedDim{dim, size, *bucket, /*ambiguous=*/size == 1 && having > 1});
  }
  return BucketPlan(std::move(dims));
}

std::string BucketPolicy::describe_miss(const BucketMiss& miss, const std::string& first_path,
                                        const std::string& other_path) const {
  if (miss.kind == BucketMiss::Kind::kDisagree) {
    return c10::str("buckets pad dimension ", miss.dim, " of every input tensor that has it "
                    "(those of size 1 there are broadcast and pass unpadded), but ", first_path,
                    " has size ", miss.first_size, " there and ", other_path, " has ",
                    miss.other_size, ". Bucket only a dimension all inputs share (the batch), "
                    "or pass inputs that agree along it.");
  }
  const std::vector<int64_t>& bucket_sizes = buckets_.at(miss.dim);
  return c10::str(first_path, " has size ", miss.first_size, " along bucketed dimension ",
                  miss.dim, ", above the largest bucket ", bucket_sizes.back(), " of ",
                  format_list(bucket_sizes), ". Add a bucket of at least ", miss.first_size,
                  " to buckets[", miss.dim, "] so that every size you call with is covered.");
}

std::optional<BucketPlan> BucketPolicy::plan(const std::vector<c10::IntArrayRef>& sizes,
                                             const std::vector<std::string>& paths,
                                             std::string* why) const {
  GRAPHED_INTERNAL_ASSERT(sizes.size() == paths.size(), "one path per tensor");
  BucketMiss miss;
  std::optional<BucketPlan> planned = plan_sizes(sizes, &miss);
  if (!planned && why != nullptr) {
    *why = describe_miss(miss, paths.at(miss.first),
                         miss.kind == BucketMiss::Kind::kDisagree ? paths.at(miss.other) : "");
  }
  return planned;
}

std::vector<BucketPlan> BucketPolicy::combinations_largest_first(const BucketPlan& like) const {
  std::vector<std::vector<BucketedDim>> combos{{}};
  for (const BucketedDim& d : like.dims()) {
    const auto found = buckets_.find(d.dim);
    GRAPHED_INTERNAL_ASSERT(found != buckets_.end(), "plan of dimension ", d.dim,
                            " which has no buckets");
    std::vector<std::vector<BucketedDim>> next;
    for (const auto& combo : combos) {
      for (int64_t size : found->second) {
        auto extended = combo;
        extended.push_back(BucketedDim{d.dim, size, size});
        next.push_back(std::move(extended));
      }
    }
    combos = std::move(next);
  }
  if (like.dims().empty()) {
    return {};
  }
  auto volume = [](const std::vector<BucketedDim>& combo) {
    int64_t product = 1;
    for (const BucketedDim& d : combo) {
      product *= d.padded;
    }
    return product;
  };
  // Stable: equal volumes keep the order of increasing sizes of later dims.
  std::stable_sort(combos.begin(), combos.end(),
                   [&](const auto& a, const auto& b) { return volume(a) > volume(b); });
  std::vector<BucketPlan> plans;
  plans.reserve(combos.size());
  for (auto& combo : combos) {
    plans.emplace_back(std::move(combo));
  }
  return plans;
}

std::string BucketPolicy::describe() const {
  std::ostringstream out;
  out << "{";
  bool first = true;
  for (const auto& [dim, sizes] : buckets_) {
    out << (first ? "" : ", ") << dim << ": " << format_list(sizes);
    first = false;
  }
  out << "}";
  return out.str();
}

at::Tensor resize_to_buckets(const at::Tensor& tensor, const BucketPlan& plan) {
  c10::NoGradGuard no_grad;
  const std::vector<int64_t> target = plan.padded_sizes(tensor.sizes());
  if (tensor.sizes().equals(target)) {
    return tensor;
  }
  at::Tensor out = at::zeros(target, tensor.options().requires_grad(false));
  at::Tensor destination = out;
  at::Tensor source = tensor;
  for (int64_t dim = 0; dim < tensor.dim(); ++dim) {
    const int64_t overlap = std::min(tensor.size(dim), target[dim]);
    destination = destination.narrow(dim, 0, overlap);
    source = source.narrow(dim, 0, overlap);
  }
  destination.copy_(source);
  return out;
}

c10::IValue slice_to_call(const c10::IValue& value, const BucketPlan& plan) {
  if (!plan.pads()) {
    return value;
  }
  return map_tensors(value, [&](const at::Tensor& tensor) {
    if (!tensor.defined()) {
      return tensor;
    }
    at::Tensor sliced = tensor;
    for (const BucketedDim& d : plan.dims()) {
      if (d.size != d.padded && d.dim < sliced.dim() && sliced.size(d.dim) == d.padded) {
        sliced = sliced.narrow(d.dim, 0, d.size);
      }
    }
    return sliced;
  });
}

}  // namespace graphed
