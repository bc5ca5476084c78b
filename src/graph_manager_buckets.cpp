// GraphManager's buckets picked for a module's inference calls and the check
// of the first padded call against eager: Note [Buckets graphed picks itself]
// in include/graphed/auto_buckets.h.

#include "graph_manager_internal.h"

#include "graphed/cuda_handles.h"
#include "graphed/static_io.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

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
// Inputs go further: a graph reads its input buffers only during its own
// call (the copy in, the replay, the copy back of inputs it writes), so the
// largest bucket graph of every module keeps its input buffers in the fronts
// of one set (SharedInputs, the buffers of the first such graph whose inputs
// hold all earlier ones: same tensors, none smaller, so that two modules
// never take turns evicting each other). A model of twelve alike layers
// then holds one layer's input buffers, not twelve. Two guards keep that
// right. An output that is (a view of) an input would be overwritten by the
// next call of another module, so a graph with one is captured again with
// inputs of its own (capture_in_buckets). And calls of different modules
// may come on different streams: a replay on another stream than the last
// one that read the shared inputs first waits for that stream
// (order_shared_inputs; a host-side check per call, an event only on a
// switch).
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

bool fits_bucket_arena(const std::vector<c10::IValue>& sample,
                       const std::vector<at::Tensor>& arena) {
  size_t index = 0;
  bool fits = true;
  for (const c10::IValue& input : sample) {
    for_each_tensor(input, [&](const at::Tensor& tensor) {
      if (index >= arena.size()) {
        fits = false;
      } else if (tensor.defined() && arena[index].defined() &&
                 tensor.numel() > arena[index].numel()) {
        fits = false;
      }
      ++index;
    });
  }
  return fits && index == arena.size();
}

bool outputs_alias_inputs(const std::vector<at::Tensor>& outputs,
                          const std::vector<at::Tensor>& inputs) {
  const auto storage = [](const at::Tensor& t) -> const void* {
    return t.defined() && t.unsafeGetTensorImpl()->has_storage() ? t.storage().data() : nullptr;
  };
  for (const at::Tensor& output : outputs) {
    const void* address = storage(output);
    if (address == nullptr) continue;
    for (const at::Tensor& input : inputs) {
      if (storage(input) == address) return true;
    }
  }
  return false;
}

void GraphManager::rehome_shared_inputs(const SharedInputs* old, const Slot& keep) {
  // Note [Bucket graphs share their buffers]: `keep` holds the new shared inputs.
  if (old == nullptr) return;
  std::vector<uint64_t> ids;
  for (const auto& module : modules_) {
    for (const auto& slot : module->slots) {
      if (slot.get() != &keep && slot->arena && slot->arena->inputs_in.get() == old) {
        ids.push_back(slot->id);
      }
    }
  }
  for (uint64_t id : ids) evict(id);
}

BucketBuffers GraphManager::choose_bucket_buffers(Module& module, GraphEntryRequest& request) {
  // Note [Bucket graphs share their buffers].
  BucketBuffers out;
  std::shared_ptr<const BucketArena> arena = module.arena.lock();
  if (arena && fits_bucket_arena(request.sample, arena->inputs)) {
    out.module_arena = arena;
    out.shared = arena->inputs_in;
    request.input_arenas = arena->inputs;
    request.output_arenas = arena->outputs;
    return out;
  }
  std::shared_ptr<const SharedInputs> shared = shared_inputs_.lock();
  if (shared && fits_bucket_arena(request.sample, shared->buffers)) {
    out.shared = shared;
    request.input_arenas = shared->buffers;
  }
  return out;
}

std::unique_ptr<GraphEntry> GraphManager::capture_in_buckets(const GraphEntryFactory& factory,
                                                             GraphEntryRequest& request,
                                                             BucketBuffers& buffers) {
  if (buffers.shared) order_shared_inputs(*buffers.shared);
  std::unique_ptr<GraphEntry> entry = factory(request);
  if (entry && buffers.shared &&
      outputs_alias_inputs(entry->static_outputs(), entry->static_inputs())) {
    // Outputs that are (views of) its inputs would be overwritten by the next
    // call of another module: inputs of its own for this graph.
    entry.reset();
    request.input_arenas.clear();
    buffers.shared.reset();
    entry = factory(request);
  }
  return entry;
}

const SharedInputs* GraphManager::adopt_bucket_buffers(Slot& slot, const BucketBuffers& buffers,
                                                       bool& new_arena) {
  new_arena = false;
  if (buffers.module_arena) {
    slot.arena = buffers.module_arena;
    return nullptr;
  }
  BucketArena own{slot.entry->static_inputs(), slot.entry->static_outputs(), buffers.shared};
  if (own.inputs.empty() && own.outputs.empty()) {
    return nullptr;  // an entry that keeps its buffers private has none to share
  }
  new_arena = true;
  const SharedInputs* replaced = nullptr;
  if (!buffers.shared && !own.inputs.empty() && !outputs_alias_inputs(own.outputs, own.inputs)) {
    // Its inputs become the shared inputs only when they hold every earlier
    // shared input (the same tensors, none smaller), so that two modules
    // never take turns evicting each other's graphs.
    const std::shared_ptr<const SharedInputs> old = shared_inputs_.lock();
    bool dominates = true;
    if (old) {
      dominates = old->buffers.size() == own.inputs.size();
      for (size_t i = 0; dominates && i < own.inputs.size(); ++i) {
        const at::Tensor& a = own.inputs[i];
        const at::Tensor& b = old->buffers[i];
        dominates = a.defined() == b.defined() &&
                    (!a.defined() || (a.scalar_type() == b.scalar_type() &&
                                      a.device() == b.device() && a.numel() >= b.numel()));
      }
    }
    if (dominates) {
      auto made = std::make_shared<const SharedInputs>(SharedInputs{own.inputs});
      shared_inputs_ = made;
      own.inputs_in = made;
      replaced = old.get();
    }
  }
  slot.arena = std::make_shared<const BucketArena>(std::move(own));
  return replaced;
}

void GraphManager::order_shared_inputs(const SharedInputs& inputs) {
  // Note [Bucket graphs share their buffers]: a replay on another stream than
  // the last one that read the shared inputs waits for that stream first.
  if (inputs.buffers.empty() || !inputs.buffers.front().is_cuda()) return;
  const c10::DeviceIndex device = inputs.buffers.front().device().index();
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device);
  if (shared_inputs_stream_ && *shared_inputs_stream_ != current.unwrap() &&
      shared_inputs_stream_->device() == current.device()) {
    const c10::cuda::CUDAGuard on_device(device);  // the event is made on that device
    stream_wait(current.stream(), c10::cuda::CUDAStream(*shared_inputs_stream_).stream());
  }
  shared_inputs_stream_ = current.unwrap();
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
