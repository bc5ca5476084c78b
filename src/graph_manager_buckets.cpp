// GraphManager's buckets picked for a module's inference calls and the check
// of the first padded call against eager: Note [Buckets graphed picks itself]
// in include/graphed/auto_buckets.h.

#include "graph_manager_internal.h"

#include "graphed/static_io.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <string>

namespace graphed {
namespace {

std::string shown(const std::string& name) { return name.empty() ? "<root>" : name; }

}  // namespace

void GraphManager::evict_inference_slots(Module& module) {
  std::vector<uint64_t> ids;
  for (const auto& slot : module.slots) {
    if (slot->mode == CallMode::kInference) ids.push_back(slot->id);
  }
  for (uint64_t id : ids) evict(id);
}

bool GraphManager::pick_buckets_for(Module& module, const std::vector<c10::IValue>& inputs) {
  // Note [Buckets graphed picks itself].
  if (!module.auto_buckets.observe(inputs)) {
    return false;
  }
  module.picked_buckets = AutoBuckets::policy();
  evict_inference_slots(module);
  return true;
}

std::optional<c10::IValue> GraphManager::check_picked_buckets(
    Module& module, const std::vector<c10::IValue>& inputs, const c10::IValue& replayed,
    GraphEntry& entry, const BucketPlan& plan) {
  // Note [Buckets graphed picks itself]: the first padded replay against
  // eager, then a second replay whose padding rows repeat the call's rows
  // (zeros alone can leave a reduction over the rows unchanged).
  module.picked_checked = true;
  const c10::IValue eager = run_eager(module, inputs);
  OutputAgreement agreement = compare_outputs(replayed, eager);
  if (agreement.agrees) {
    std::vector<c10::IValue> repeated;
    {
      c10::NoGradGuard no_grad;
      for (const c10::IValue& input : inputs) {
        repeated.push_back(map_tensors(input, [&](const at::Tensor& tensor) {
          at::Tensor out = tensor;
          for (const BucketedDim& d : plan.dims()) {
            if (d.dim < out.dim() && out.size(d.dim) == d.size && d.padded > d.size) {
              const at::Tensor rows = at::arange(d.padded, out.options().dtype(at::kLong))
                                          .remainder_(d.size);
              out = out.index_select(d.dim, rows);
            }
          }
          return out;
        }));
      }
    }
    ++depth_;
    c10::IValue again;
    try {
      again = slice_to_call(entry.run(repeated, plan.at_buckets()), plan);
      --depth_;
    } catch (...) {
      --depth_;
      throw;
    }
    const OutputAgreement second = compare_outputs(again, eager);
    agreement.max_relative_diff = std::max(agreement.max_relative_diff, second.max_relative_diff);
    if (!second.agrees) {
      agreement.agrees = false;
      agreement.disagreement = second.disagreement + ", padding rows repeating the call's";
    }
  }
  if (agreement.agrees) {
    counters_.notes.push_back(c10::str(
        shown(module.spec.name), ": inference calls came at ", options_.pick_buckets_after,
        " batch sizes, so graphed pads them to power-of-two sizes along dimension 0 (outputs "
        "sliced back; the first padded call matched eager, largest relative difference ",
        agreement.max_relative_diff, "). Pass buckets= to choose the sizes, or buckets=None "
        "for one graph per size."));
    return std::nullopt;
  }
  module.picked_buckets.reset();
  module.picking_refused = true;
  evict_inference_slots(module);
  counters_.notes.push_back(c10::str(
      shown(module.spec.name), ": graphed tried padding its inference calls to power-of-two "
      "sizes along dimension 0, but a padded call did not match eager (", agreement.disagreement,
      "): its rows along dimension 0 are not independent, so it keeps one graph per size."));
  return eager;
}

}  // namespace graphed
