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

// Note [Bucket graphs share their buffers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A module served at buckets 1, 2, 4, ..., 32 has six graphs, and each held
// static inputs and outputs of its own size: 63 rows' worth for a largest
// call of 32, most of a bucketed model's graph memory (the intermediates are
// scratch that all graphs of the shared pool reuse). The graphs of one
// module never run at once (calls are serialised, each replay on the
// caller's stream), and graphed.auto documents a module's outputs as valid
// until its next call, so they can live in one place: the module's largest
// bucket graph owns its buffers (the arena), and every other bucket graph of
// the module keeps each input buffer in the front of the arena's (a
// contiguous view of its first elements, StaticInputs) and ends its graph
// by copying each output into the front of the arena's output
// (CaptureOptions::output_arenas; the tensor the forward allocated becomes
// scratch after capture). The copy is one device-side kernel per output in
// the graph, no host work; inputs cost nothing. Memory per module drops to
// the largest bucket's buffers, about half of the sum over power-of-two
// buckets.
//
// Which graph is the largest is known only when it is captured. With
// buckets given, a module's first capture captures every bucket largest
// first (GraphManagerOptions::max_capture_ahead), so the first graph is the
// arena. Captured on demand (buckets graphed picked, calls that came before
// any broadcast tensor could be told apart) a graph whose inputs do not fit
// becomes the new arena, and the module's graphs in the old one are evicted
// (rehome_bucket_graphs) and captured again, in the new arena, when next
// called: with sizes that grow by powers of two, a few captures per module.
// Only bucketed graphs share: without buckets the sizes have no bound, and
// growth would evict graphs without end. Tensors that do not fit (another
// dtype or layout, a structure that changed) keep memory of their own, as do
// outputs that are (views of) inputs. An entry counts only its own memory
// (Note [Graph memory accounting]). GraphManagerOptions::share_bucket_buffers
// = false gives every graph private buffers.

bool fits_bucket_arena(const std::vector<c10::IValue>& sample, const BucketArena& arena) {
  size_t index = 0;
  bool fits = true;
  for (const c10::IValue& input : sample) {
    for_each_tensor(input, [&](const at::Tensor& tensor) {
      if (index >= arena.inputs.size()) {
        fits = false;
      } else if (tensor.defined() && arena.inputs[index].defined() &&
                 tensor.numel() > arena.inputs[index].numel()) {
        fits = false;
      }
      ++index;
    });
  }
  return fits && index == arena.inputs.size();
}

void GraphManager::rehome_bucket_graphs(Module& module, const Slot& keep) {
  // Note [Bucket graphs share their buffers]: `keep` is the new arena.
  std::vector<uint64_t> ids;
  for (const auto& slot : module.slots) {
    if (slot.get() != &keep && slot->arena && slot->arena != keep.arena) ids.push_back(slot->id);
  }
  for (uint64_t id : ids) evict(id);
}

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
