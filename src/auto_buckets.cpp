#include "graphed/auto_buckets.h"

#include "graphed/check.h"
#include "graphed/signature.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <sstream>

namespace graphed {
namespace {

constexpr int64_t kLargestPickedBucket = int64_t{1} << 16;
// Calls alike but for dimension 0 remembered at most (each a few codes).
constexpr size_t kMaxRemembered = 64;

// Relative tolerance of a padded replay against eager, by dtype: Note
// [Buckets graphed picks itself]. Kernels chosen for another row count may
// round differently (TF32 too); rows that influence each other differ by far more.
double tolerance_for(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf:
    case at::kBFloat16:
      return 2e-2;
    case at::kFloat:
    case at::kDouble:
    case at::kComplexFloat:
    case at::kComplexDouble:
      return 1e-3;
    default:
      return 0.0;  // integers, bools: equal
  }
}

void compare(const c10::IValue& a, const c10::IValue& b, const std::string& path,
             OutputAgreement& out) {
  if (!out.agrees) return;
  const auto disagree = [&](std::string why) {
    out.agrees = false;
    out.disagreement = c10::str(path, ": ", why);
  };
  if (a.isTensor() != b.isTensor() || a.isTuple() != b.isTuple() || a.isList() != b.isList() ||
      a.isGenericDict() != b.isGenericDict()) {
    disagree(c10::str("a ", a.tagKind(), " and a ", b.tagKind()));
    return;
  }
  if (a.isTensor()) {
    const at::Tensor& x = a.toTensor();
    const at::Tensor& y = b.toTensor();
    if (x.defined() != y.defined()) {
      disagree("one tensor is undefined");
      return;
    }
    if (!x.defined()) return;
    if (!x.sizes().equals(y.sizes()) || x.scalar_type() != y.scalar_type()) {
      disagree(c10::str("shapes ", x.sizes(), " ", x.scalar_type(), " and ", y.sizes(), " ",
                        y.scalar_type()));
      return;
    }
    if (x.numel() == 0) return;
    c10::NoGradGuard no_grad;
    const double tolerance = tolerance_for(x.scalar_type());
    if (tolerance == 0.0) {
      if (!at::equal(x, y)) disagree("values differ");
      return;
    }
    const at::Tensor xd = x.to(at::kDouble);
    const at::Tensor yd = y.to(at::kDouble);
    // NaN where eager has NaN is agreement; anywhere else it is not.
    const at::Tensor nan_mismatch = xd.isnan().ne(yd.isnan());
    if (nan_mismatch.any().item<bool>()) {
      disagree("NaN in one and not the other");
      return;
    }
    const at::Tensor finite = yd.isfinite();
    const double scale =
        std::max(at::where(finite, yd.abs(), at::zeros_like(yd)).max().item<double>(), 1e-30);
    const at::Tensor diff = at::where(finite, (xd - yd).abs(), at::zeros_like(yd));
    const double relative = diff.max().item<double>() / scale;
    const bool same_infinities = at::equal(at::where(xd.isinf(), xd, at::zeros_like(xd)),
                                           at::where(yd.isinf(), yd, at::zeros_like(yd)));
    out.max_relative_diff = std::max(out.max_relative_diff, relative);
    if (!same_infinities) {
      disagree("infinities differ");
    } else if (!(relative <= tolerance)) {
      disagree(c10::str("relative difference ", relative, " above ", tolerance));
    }
    return;
  }
  if (a.isTuple() || a.isList()) {
    const std::vector<c10::IValue> xs =
        a.isTuple() ? a.toTupleRef().elements().vec() : a.toListRef().vec();
    const std::vector<c10::IValue> ys =
        b.isTuple() ? b.toTupleRef().elements().vec() : b.toListRef().vec();
    if (xs.size() != ys.size()) {
      disagree(c10::str(xs.size(), " and ", ys.size(), " elements"));
      return;
    }
    for (size_t i = 0; i < xs.size(); ++i) compare(xs[i], ys[i], c10::str(path, "[", i, "]"), out);
    return;
  }
  if (a.isGenericDict()) {
    const auto xs = a.toGenericDict();
    const auto ys = b.toGenericDict();
    if (xs.size() != ys.size()) {
      disagree(c10::str(xs.size(), " and ", ys.size(), " entries"));
      return;
    }
    for (const auto& entry : xs) {
      const auto found = ys.find(entry.key());
      if (found == ys.end()) {
        disagree("keys differ");
        return;
      }
      std::ostringstream key;
      key << entry.key();
      compare(entry.value(), found->value(), c10::str(path, "[", key.str(), "]"), out);
    }
    return;
  }
  if (!constants_equal(a, b)) disagree("constants differ");
}

}  // namespace

AutoBuckets::AutoBuckets(int64_t after) : after_(after) {
  GRAPHED_CHECK(after >= 2, "Expected buckets to be picked after at least 2 sizes, got ", after,
                ".");
}

BucketPolicy AutoBuckets::policy() {
  std::vector<int64_t> sizes;
  for (int64_t size = 1; size <= kLargestPickedBucket; size *= 2) sizes.push_back(size);
  return BucketPolicy({{0, sizes}});
}

bool AutoBuckets::observe(const std::vector<c10::IValue>& inputs) {
  static const BucketPolicy candidate = policy();
  std::vector<at::Tensor> tensors;
  const std::optional<BucketPlan> plan =
      plan_call_buckets(candidate, inputs, tensors, /*why=*/nullptr);
  if (!plan || plan->dims().empty()) {
    return false;
  }
  // The key with dimension 0 erased (-1) where the call's size is.
  BucketedDim erased = plan->dims().front();
  const int64_t size = erased.size;
  erased.padded = -1;
  CallKey key = key_of(inputs, BucketPlan({erased}), CallMode::kInference);
  auto found = std::find_if(seen_.begin(), seen_.end(),
                            [&](const auto& entry) { return entry.first == key; });
  if (found == seen_.end()) {
    if (seen_.size() >= kMaxRemembered) seen_.erase(seen_.begin());
    seen_.emplace_back(std::move(key), std::set<int64_t>{});
    found = std::prev(seen_.end());
  }
  found->second.insert(size);
  return static_cast<int64_t>(found->second.size()) >= after_;
}

OutputAgreement compare_outputs(const c10::IValue& replayed, const c10::IValue& eager) {
  OutputAgreement out;
  compare(replayed, eager, "output", out);
  return out;
}

}  // namespace graphed
