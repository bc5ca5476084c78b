#include "graphed/graph_manager.h"

#include "graph_manager_internal.h"

#include "graphed/check.h"
#include "graphed/nvtx.h"
#include "graphed/safety_check.h"
#include "graphed/state_snapshot.h"
#include "graphed/static_io.h"
#include "graphed/tensor_identity.h"
#include "graphed/training_group.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <sstream>
#include <unordered_set>

namespace graphed {

namespace {

std::string shown(const std::string& name) { return name.empty() ? "<root>" : name; }

std::string describe_finding(const SafetyFinding& finding) {
  std::ostringstream out;
  const std::string_view label = finding.info().label;
  const bool vowel =
      !label.empty() && std::string_view("aeiou").find(label.front()) != std::string_view::npos;
  out << "graphed.check found " << (vowel ? "an " : "a ") << label << ", `" << finding.op << "`";
  if (!finding.inside.empty()) out << " inside " << finding.inside;
  const std::string where = finding.where();
  if (!where.empty()) out << " at " << where;
  const std::string_view why = finding.info().why;
  out << ": " << why << (!why.empty() && why.back() == '.' ? "" : ".") << " Fix: "
      << finding.info().fix;
  return out.str();
}

std::string first_line(const std::string& text) {
  const size_t end = text.find('\n');
  return end == std::string::npos ? text : text.substr(0, end);
}

}  // namespace

FallbackPolicy parse_fallback_policy(std::string_view name) {
  if (name == "eager") return FallbackPolicy::kEager;
  if (name == "raise") return FallbackPolicy::kRaise;
  GRAPHED_THROW(Error, "Expected fallback to be \"eager\" (run what cannot be graphed eagerly "
                "and count it in stats()) or \"raise\", got \"", name, "\".");
}

namespace {

// Parameters then buffers, as ModuleSpec's readers see them now.
std::vector<at::Tensor> read_module_tensors(const ModuleSpec& spec) {
  std::vector<at::Tensor> tensors = spec.read_parameters();
  std::vector<at::Tensor> buffers = spec.read_buffers();
  tensors.insert(tensors.end(), std::make_move_iterator(buffers.begin()),
                 std::make_move_iterator(buffers.end()));
  return tensors;
}

// `tensors` without repeats (a weight tied between two submodules), in order.
std::vector<at::Tensor> distinct(std::vector<at::Tensor> tensors) {
  std::vector<at::Tensor> kept;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (at::Tensor& tensor : tensors) {
    if (seen.insert(tensor.unsafeGetTensorImpl()).second) kept.push_back(std::move(tensor));
  }
  return kept;
}

}  // namespace

GraphManager::GraphManager(GraphManagerOptions options, GraphEntryFactories factories)
    : options_(std::move(options)), factories_(std::move(factories)),
      lru_(options_.memory_budget_bytes), recorder_(std::make_shared<TrainingRecorder>()) {
  GRAPHED_CHECK(options_.warmup >= 1, "Expected warmup >= 1, got ", options_.warmup,
                ". Warm-up calls run eagerly to initialise lazy state and record the call "
                "order before anything is captured; use at least 1.");
  GRAPHED_CHECK(options_.capture_warmup_iters >= 1, "Expected capture_warmup_iters >= 1, got ",
                options_.capture_warmup_iters, ". Each capture needs one eager run on the "
                "capture stream first.");
  GRAPHED_CHECK(options_.max_capture_ahead >= 0, "Expected max_capture_ahead >= 0, got ",
                options_.max_capture_ahead, ".");
  GRAPHED_CHECK(options_.pick_buckets_after >= 2, "Expected pick_buckets_after >= 2 (the batch "
                "sizes seen before buckets are picked), got ", options_.pick_buckets_after, ".");
  if (!factories_.inference) {
    factories_.inference = &make_inference_entry;
  }
  counters_.memory_budget_bytes = options_.memory_budget_bytes.value_or(-1);
}

GraphManager::~GraphManager() = default;

size_t GraphManager::add_module(ModuleSpec spec) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  GRAPHED_CHECK(static_cast<bool>(spec.forward), "Module '", shown(spec.name),
                "' has no forward function.");
  for (const auto& module : modules_) {
    GRAPHED_CHECK(module->spec.name != spec.name, "Module '", shown(spec.name),
                  "' is registered twice; register each module once.");
  }
  auto module = std::make_unique<Module>(options_.pick_buckets_after);
  module->index = modules_.size();
  module->description = c10::str("module `", shown(spec.name), "` (", spec.type, ")");
  module->nvtx_subject = nvtx_subject(module->description);
  module->spec = std::move(spec);
  modules_.push_back(std::move(module));
  return modules_.size() - 1;
}

const std::vector<std::string>& GraphManager::input_names(size_t count) const {
  auto [found, inserted] = input_names_.try_emplace(count);
  if (inserted) {
    if (count == 3) {
      // Python passes (args, kwargs, module.training); see python/graphed/auto.py.
      found->second = {"args", "kwargs", "module.training"};
    } else {
      for (size_t i = 0; i < count; ++i) found->second.push_back(c10::str("inputs[", i, "]"));
    }
  }
  return found->second;
}

PoolId GraphManager::shared_pool() {
  if (!pool_) pool_ = new_pool();
  return *pool_;
}

c10::IValue GraphManager::run_eager(Module& module, const std::vector<c10::IValue>& inputs) {
  ++depth_;
  try {
    c10::IValue out = module.spec.forward(inputs);
    --depth_;
    return out;
  } catch (...) {
    --depth_;
    throw;
  }
}

// Note [A fallback costs nothing]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// graphed.auto must never make a model slower than eager. A module that can
// never use a graph (a capture blocker found in warm-up, a failed capture)
// is blocked(): the Python layer then puts the module's own forward back, so
// its calls run no graphed code at all (its fallback count stops with the
// calls made until then). A call that falls back for itself (a size above
// the largest bucket, inputs that cannot be bucketed, a signature whose
// capture failed) still passes through the manager, which decides on the
// inputs' sizes, counts it and returns nullopt from try_call(): the caller
// runs the forward on the Python objects it already has, with no conversion
// of the inputs back or of the outputs into the core. The reason is built
// once per kind of miss (Module::last_miss) and counted without a lookup
// when it repeats (Module::last_fallback). bench/run.py auto_overhead
// measures both: a model whose every block is refused against eager, and
// one call that falls back for its shape.
std::optional<c10::IValue> GraphManager::fall_back(Module& module, const std::string& reason,
                                                   const std::vector<c10::IValue>& inputs,
                                                   bool caller_runs_fallbacks) {
  if (options_.fallback == FallbackPolicy::kRaise) {
    GRAPHED_THROW(Error, module.description, " cannot run as a graph: ", reason,
                  "\n(fallback=\"raise\"; pass fallback=\"eager\" to run it eagerly and count "
                  "the fallback in stats() instead.)");
  }
  if (!module.last_fallback || counters_.fallbacks[*module.last_fallback].reason != reason) {
    const std::string key = module.spec.name + '\0' + reason;
    auto [found, inserted] = fallback_index_.emplace(key, counters_.fallbacks.size());
    if (inserted) {
      counters_.fallbacks.push_back(FallbackStats{module.spec.name, reason, 0});
    }
    module.last_fallback = found->second;
  }
  ++counters_.fallbacks[*module.last_fallback].count;
  ++counters_.fallback_calls;
  if (caller_runs_fallbacks) {
    return std::nullopt;
  }
  return run_eager(module, inputs);
}

c10::IValue GraphManager::run_warmup(Module& module, const std::vector<c10::IValue>& inputs,
                                     bool last) {
  ++counters_.warmup_calls;
  if (!last || !options_.check_blockers) {
    return run_eager(module, inputs);
  }
  // The last warm-up call runs under the safety check. The check restores the
  // random generators it found; this call is a real one, so the generators
  // are put back where the eager call left them.
  std::optional<c10::Device> device;
  if (c10::cuda::device_count() > 0) {
    device = c10::Device(c10::kCUDA, c10::cuda::current_device());
  }
  c10::IValue output;
  bool ran = false;
  StateSnapshot after;
  SafetyReport report;
  SafetyCheckOptions check_options;
  check_options.description = module.description;
  ++depth_;
  try {
    // The check sees what a capture would run (Note [Autocast's cache while
    // graphed.auto captures]): casts of the weights inside the module.
    const AutocastCacheOff cache_off;
    report = check_safety(
        [&] {
          ran = true;
          output = module.spec.forward(inputs);
          after = StateSnapshot::take({}, device);
        },
        check_options);
    --depth_;
  } catch (const Error&) {
    --depth_;
    if (ran) throw;
    // Another check is running (the user checks the managed model): this
    // call is part of it, so run it plainly.
    return run_eager(module, inputs);
  } catch (...) {
    --depth_;
    throw;
  }
  after.restore();
  // See Note [Capture is the verdict] in safety_check.cpp.
  if (capture_verdict(report) == CaptureVerdict::kTryCapture) {
    for (const SafetyFinding& finding : report.findings()) {
      module.unconfirmed_findings.push_back(describe_finding(finding));
    }
  } else if (!report.empty()) {
    const std::string reason = describe_finding(report.findings().front());
    module.blocked = reason;
    if (options_.fallback == FallbackPolicy::kRaise) {
      GRAPHED_THROW(Error, module.description, " cannot be captured: ", reason,
                    "\n(fallback=\"raise\"; pass fallback=\"eager\" to run it eagerly while the "
                    "other modules stay graphed.)");
    }
    const std::string key = module.spec.name + '\0' + reason;
    if (fallback_index_.emplace(key, counters_.fallbacks.size()).second) {
      counters_.fallbacks.push_back(FallbackStats{module.spec.name, reason, 0});
    }
  }
  return output;
}

bool GraphManager::shapes_changed(Module& module, const std::vector<c10::IValue>& inputs,
                                  CallMode mode) {
  // See ModuleSpec::steady_shapes and Note [Graphing the parts of a block].
  CallKey key = key_of(inputs, BucketPlan(), mode);
  if (!module.warmup_key) {
    module.warmup_key = std::move(key);
    return false;
  }
  if (*module.warmup_key == key) return false;
  module.blocked = changing_shapes_reason(module);
  return true;
}

std::string GraphManager::changing_shapes_reason(const Module& module) const {
  return c10::str(
      "its calls come at different shapes from call to call (data-dependent sizes, such as "
      "the tokens routed to one expert), so each would need a graph of its own; it runs "
      "eagerly as a part of ", module.spec.part_of.empty() ? "its block" : module.spec.part_of,
      ", whose other parts stay graphed. Fix, for the experts of a mixture-of-experts layer: "
      "dispatch at fixed sizes (sort the routed rows by expert and run each expert's rows as "
      "one group of graphed.moe.grouped_mm over the stacked expert weights; docs/guide.md, "
      "section 8), and the layer captures whole");
}

GraphManager::Slot* GraphManager::find_slot(Module& module, CallMode mode, const BucketPlan& plan,
                                            const std::vector<c10::IValue>& inputs) {
  if (module.slots.empty()) return nullptr;
  const CallKey key = key_of(inputs, plan, mode);
  for (size_t i = 0; i < module.slots.size(); ++i) {
    if (module.slots[i]->key == key) {
      if (i != 0) {
        // Most recently used first: a loop over a few sizes finds its slot early.
        std::rotate(module.slots.begin(), module.slots.begin() + i,
                    module.slots.begin() + i + 1);
      }
      return module.slots.front().get();
    }
  }
  return nullptr;
}

// Note [Modules whose tensors moved]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A module's graphs read its parameters and buffers at the addresses they
// had at capture (Note [Tensors a graph reads in place]). `model.double()`,
// `.half()`, `.to()` and `param.data = t` give those tensors new storage and
// free the old, and `module.weight = nn.Parameter(t)` swaps the object: a
// replay would compute on freed memory, or keep training the old weights.
// graphed.capture and TrainStep raise then, since their user holds the
// graph; graphed.auto exists so that the user holds none, so it does what
// the user would: each call after warm-up compares the module's tensors
// (read from the module, a few loads per tensor) with those recorded at the
// end of its warm-up, and on a difference releases the module's graphs and
// warms it up again. The call that notices runs eagerly, so it behaves as
// eager would with the new tensors (a float input to a module made double
// raises the same error); later calls capture graphs of the new tensors.
// stats()["tensor_changes"] counts the restarts.
void GraphManager::restart_warmup(Module& module) {
  ++counters_.tensor_changes;
  while (!module.slots.empty()) evict(module.slots.front()->id);
  module.warmup_calls = 0;
  module.captured_ahead = false;
  module.training_sample.reset();
  module.tensors = TensorIdentities();
  module.spec.parameters = distinct(module.spec.read_parameters());
  module.spec.state = distinct(module.spec.read_buffers());
}

void GraphManager::evict(uint64_t id) {
  const auto found = slots_by_id_.find(id);
  GRAPHED_INTERNAL_ASSERT(found != slots_by_id_.end(), "eviction of unknown graph ", id);
  lru_.remove(id);
  for (auto& module : modules_) {
    auto& slots = module->slots;
    const auto it = std::find_if(slots.begin(), slots.end(),
                                 [&](const std::unique_ptr<Slot>& s) { return s->id == id; });
    if (it != slots.end()) {
      slots.erase(it);
      break;
    }
  }
  slots_by_id_.erase(found);
  // The shared pool goes with the last inference graph: the allocator counts
  // the graphs that use a pool, and once that count is zero the pool may be
  // freed at the next empty_cache(), so capturing into it again is an error
  // (torch 2.11 asserts). The next capture takes a new pool.
  const bool any_inference = std::any_of(modules_.begin(), modules_.end(), [](const auto& m) {
    return std::any_of(m->slots.begin(), m->slots.end(), [](const auto& slot) {
      return slot->entry != nullptr && slot->mode == CallMode::kInference;
    });
  });
  if (!any_inference) {
    pool_.reset();
  }
}

void GraphManager::enforce_budget(const Slot& keep) {
  for (uint64_t id : lru_.over_budget(keep.id)) {
    evict(id);
    ++counters_.evictions;
  }
}

GraphManager::Slot& GraphManager::capture_slot(Module& module, CallMode mode,
                                               const BucketPlan& plan,
                                               const std::vector<c10::IValue>& inputs,
                                               const BucketPolicy& policy) {
  const GraphEntryFactory& factory =
      mode == CallMode::kTraining ? factories_.training : factories_.inference;
  GRAPHED_INTERNAL_ASSERT(static_cast<bool>(factory), "no factory for ", call_mode_name(mode));

  // Which bucket combinations to capture now: the call's, or on a module's
  // first capture with the user's buckets every combination, largest first,
  // so that the smaller graphs reuse the pool memory of the largest (Note
  // [Bucket padding]; not from a call whose broadcast tensors cannot be
  // told, nor for buckets graphed picked, which have no end in sight).
  std::vector<BucketPlan> targets;
  const bool ambiguous = std::any_of(plan.dims().begin(), plan.dims().end(),
                                     [](const BucketedDim& d) { return d.ambiguous; });
  if (!module.captured_ahead && &policy == &options_.buckets && !plan.dims().empty() &&
      !ambiguous && options_.max_capture_ahead > 0) {
    module.captured_ahead = true;
    targets = policy.combinations_largest_first(plan);
    if (targets.size() > static_cast<size_t>(options_.max_capture_ahead)) targets.clear();
  }
  const BucketPlan wanted = plan.at_buckets();
  if (targets.empty()) targets.push_back(wanted);

  // Progress of a capture ahead (GraphManagerOptions::on_capture_ahead).
  size_t done = 0;
  const auto report = [&] {
    if (options_.on_capture_ahead && targets.size() > 1) {
      options_.on_capture_ahead(module.spec.name, done, targets.size());
    }
  };
  Slot* result = nullptr;
  for (const BucketPlan& target : targets) {
    ++done;
    // `key_plan` keys the call's inputs as if they came at `target`'s sizes.
    std::vector<BucketedDim> key_dims = plan.dims();
    for (size_t i = 0; i < key_dims.size(); ++i) key_dims[i].padded = target.dims()[i].padded;
    const BucketPlan key_plan(std::move(key_dims));
    const bool is_wanted = target.dims() == wanted.dims();

    CallKey key = key_of(inputs, key_plan, mode);
    if (!is_wanted && std::any_of(module.slots.begin(), module.slots.end(),
                                  [&](const auto& held) { return held->key == key; })) {
      report();
      continue;  // captured before the module captured ahead
    }
    auto slot = std::make_unique<Slot>();
    slot->id = next_slot_id_++;
    slot->key = std::move(key);
    slot->mode = mode;
    slot->plan = target;

    GraphEntryRequest request;
    request.module = &module.spec;
    for (const c10::IValue& input : inputs) {
      request.sample.push_back(map_tensors(input, [&](const at::Tensor& tensor) {
        return resize_to_buckets(tensor, key_plan);
      }));
    }
    request.plan = target;
    request.input_names = input_names(inputs.size());
    request.pool = [this] { return shared_pool(); };
    request.warmup_iters = options_.capture_warmup_iters;
    request.error_mode = options_.error_mode;
    request.input_update = options_.input_update;
    // Note [Bucket graphs share their buffers].
    const bool bucketed = mode == CallMode::kInference && !target.dims().empty() &&
                          options_.share_bucket_buffers;
    BucketBuffers buffers;
    if (bucketed) buffers = choose_bucket_buffers(module, request);
    request.description = target.dims().empty()
                              ? module.description
                              : c10::str(module.description, " at ", target.describe());
    try {
      ++depth_;
      const AutocastCacheOff cache_off;  // Note [Autocast's cache while graphed.auto captures]
      slot->entry = bucketed ? capture_in_buckets(factory, request, buffers) : factory(request);
      --depth_;
    } catch (const CaptureError&) {
      --depth_;
      throw;  // The module cannot be captured: call_locked blocks it.
    } catch (const Error& error) {
      --depth_;
      if (!is_wanted) {
        report();
        continue;  // Capture-ahead is best effort.
      }
      slot->failure = first_line(error.what_without_backtrace());
    } catch (...) {
      --depth_;
      throw;
    }
    bool new_arena = false;
    const SharedInputs* replaced_inputs = nullptr;
    if (slot->entry && bucketed) replaced_inputs = adopt_bucket_buffers(*slot, buffers, new_arena);
    if (slot->entry) {
      ++counters_.captures;
      counters_.capture_ms += slot->entry->capture_ms();
      const int64_t bytes = slot->entry->memory_bytes();
      if (lru_.budget() && bytes > *lru_.budget()) {
        GRAPHED_THROW(Error, "memory_budget=", format_bytes(*lru_.budget()), " is smaller than "
                      "one graph: ", request.description, " holds ", format_bytes(bytes),
                      ". Raise memory_budget to at least ", format_bytes(bytes),
                      " (a few graphs' worth, so that they need not be captured again), or "
                      "pass memory_budget=None for no limit.");
      }
      lru_.add(slot->id, bytes);
    }
    Slot* raw = slot.get();
    slots_by_id_[slot->id] = raw;
    report();
    if (is_wanted) {
      module.slots.insert(module.slots.begin(), std::move(slot));
      result = raw;
    } else {
      module.slots.push_back(std::move(slot));
    }
    if (new_arena) {
      module.arena = raw->arena;
      rehome_bucket_graphs(module, *raw);
    }
    rehome_shared_inputs(replaced_inputs, *raw);
    if (!is_wanted) {
      if (raw->entry && !lru_.over_budget(raw->id).empty()) {
        // No room for graphs captured ahead: capture the rest on demand.
        if (result == nullptr) {
          evict(raw->id);
          continue;
        }
        evict(raw->id);
        break;
      }
    }
  }
  if (done < targets.size()) {
    done = targets.size();
    report();
  }
  GRAPHED_INTERNAL_ASSERT(result != nullptr, "the wanted bucket was not captured");
  if (result->entry) {
    lru_.touch(result->id);
    enforce_budget(*result);
  }
  return *result;
}

c10::IValue GraphManager::call(size_t index, const std::vector<c10::IValue>& inputs) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  GRAPHED_CHECK(index < modules_.size(), "Expected a module index below ", modules_.size(),
                ", got ", index, ".");
  Module& module = *modules_[index];
  if (depth_ > 0) {
    return module.spec.forward(inputs);  // Part of another managed module's call.
  }
  return *call_locked(module, inputs, /*caller_runs_fallbacks=*/false);
}

std::optional<c10::IValue> GraphManager::try_call(size_t index,
                                                  const std::vector<c10::IValue>& inputs) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  GRAPHED_CHECK(index < modules_.size(), "Expected a module index below ", modules_.size(),
                ", got ", index, ".");
  if (depth_ > 0) {
    return std::nullopt;  // Part of another managed module's call: its own forward, uncounted.
  }
  return call_locked(*modules_[index], inputs, /*caller_runs_fallbacks=*/true);
}

bool GraphManager::blocked(size_t index) const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  GRAPHED_CHECK(index < modules_.size(), "Expected a module index below ", modules_.size(),
                ", got ", index, ".");
  return modules_[index]->blocked.has_value();
}

std::optional<BucketPlan> GraphManager::plan_call(Module& module, const BucketPolicy& policy,
                                                  const std::vector<c10::IValue>& inputs,
                                                  const std::vector<at::Tensor>& tensors,
                                                  std::string& why) {
  BucketMiss miss;
  std::optional<BucketPlan> planned =
      plan_collected_buckets(policy, inputs, tensors, /*why=*/nullptr, &miss);
  if (!planned) {
    // Note [A fallback costs nothing]: the message is built once per kind of miss.
    if (!module.last_miss || !(*module.last_miss == miss)) {
      (void)plan_collected_buckets(policy, inputs, tensors, &module.last_miss_reason);
      module.last_miss = miss;
    }
    why = module.last_miss_reason;
  }
  return planned;
}

std::optional<c10::IValue> GraphManager::call_locked(Module& module,
                                                     const std::vector<c10::IValue>& inputs,
                                                     bool caller_runs_fallbacks) {
  ++counters_.calls;
  ++module.calls;
  if (!module.seen) {
    module.seen = true;
    counters_.order.push_back(module.spec.name);
  }
  if (module.blocked) {
    return fall_back(module, *module.blocked, inputs, caller_runs_fallbacks);
  }

  std::vector<at::Tensor> tensors;
  collect_input_tensors(inputs, tensors);
  CallMode mode = CallMode::kInference;
  if (c10::GradMode::is_enabled()) {
    const auto requires_grad = [](const at::Tensor& t) { return t.defined() && t.requires_grad(); };
    if (std::any_of(tensors.begin(), tensors.end(), requires_grad) ||
        std::any_of(module.spec.parameters.begin(), module.spec.parameters.end(),
                    requires_grad)) {
      mode = CallMode::kTraining;
    }
  }

  const bool follows_tensors = module.spec.read_parameters && module.spec.read_buffers;
  if (module.warmup_calls == options_.warmup && follows_tensors &&
      !module.tensors.first_difference(read_module_tensors(module.spec)).empty()) {
    restart_warmup(module);
  }
  if (module.warmup_calls < options_.warmup) {
    if (module.spec.steady_shapes && shapes_changed(module, inputs, mode)) {
      return fall_back(module, *module.blocked, inputs, caller_runs_fallbacks);
    }
    ++module.warmup_calls;
    const bool last = module.warmup_calls == options_.warmup;
    if (last && follows_tensors) {
      module.tensors = TensorIdentities(read_module_tensors(module.spec));
    }
    c10::IValue output;
    {
      const NvtxRange range(NvtxPhase::kWarmup, module.nvtx_subject);
      output = run_warmup(module, inputs, last);
    }
    if (last && mode == CallMode::kTraining && !module.blocked && factories_.training &&
        factories_.training_group) {
      record_training_call(module, inputs, output);
    }
    return output;
  }
  if (std::optional<std::string> stateful =
          find_stateful_host_object(inputs, input_names(inputs.size()))) {
    // See Note [Host objects holding tensors] in signature.cpp.
    return fall_back(module, c10::str(*stateful, " is a host object holding tensors or state "
                                      "the module updates (a key/value cache): a graph would "
                                      "neither see nor update it, so the call ran eagerly. For a "
                                      "transformers model, pass use_cache=False"),
                     inputs, caller_runs_fallbacks);
  }
  if (mode == CallMode::kTraining && !factories_.training) {
    // INTEGRATION POINT, see Note [Training entries]: until the training
    // factory (forward and backward graphs) is plugged in, training calls run
    // eagerly and are counted, so stats() shows that nothing is graphed.
    return fall_back(module, std::string(kTrainingGraphsUnavailable), inputs,
                     caller_runs_fallbacks);
  }
  // Note [Buckets graphed picks itself]: inference calls only.
  const bool may_pick = mode == CallMode::kInference && options_.pick_buckets &&
                        options_.buckets.empty() && !module.picking_refused;
  const BucketPolicy* policy =
      may_pick && module.picked_buckets ? &*module.picked_buckets : &options_.buckets;
  std::string why;
  std::optional<BucketPlan> planned = plan_call(module, *policy, inputs, tensors, why);
  if (!planned) {
    return fall_back(module, why, inputs, caller_runs_fallbacks);
  }

  Slot* slot = find_slot(module, mode, *planned, inputs);
  if (slot == nullptr && mode == CallMode::kTraining && module.training_sample) {
    capture_training_group(module);
    slot = find_slot(module, mode, *planned, inputs);
  }
  if (slot == nullptr && module.spec.steady_shapes && !module.slots.empty()) {
    // A part whose shapes held through warm-up and then changed: one graph
    // per shape is what steady_shapes refuses (ModuleSpec::steady_shapes).
    module.blocked = changing_shapes_reason(module);
    while (!module.slots.empty()) evict(module.slots.front()->id);
    return fall_back(module, *module.blocked, inputs, caller_runs_fallbacks);
  }
  if (slot == nullptr && may_pick && !module.picked_buckets && pick_buckets_for(module, inputs)) {
    policy = &*module.picked_buckets;
    planned = plan_call(module, *policy, inputs, tensors, why);
    if (!planned) {
      return fall_back(module, why, inputs, caller_runs_fallbacks);
    }
  }
  const BucketPlan plan = *planned;
  if (slot == nullptr) {
    try {
      slot = &capture_slot(module, mode, plan, inputs, *policy);
    } catch (const CaptureError& error) {
      const std::string reason =
          c10::str("capture failed: ", error.what_without_backtrace());
      module.blocked = reason;
      // Graphs of other signatures of this module were captured fine but
      // would replay next to eager calls of the same module; drop them so the
      // module behaves one way.
      while (!module.slots.empty()) evict(module.slots.front()->id);
      if (options_.fallback == FallbackPolicy::kRaise) throw;
      return fall_back(module, reason, inputs, caller_runs_fallbacks);
    }
  } else if (slot->entry) {
    lru_.touch(slot->id);
  }
  if (!slot->entry) {
    return fall_back(module, slot->failure, inputs, caller_runs_fallbacks);
  }
  if (slot->arena && slot->arena->inputs_in) order_shared_inputs(*slot->arena->inputs_in);
  c10::IValue out;
  ++depth_;
  try {
    out = slot->entry->run(inputs, plan);
    --depth_;
  } catch (const ReplayOrderError&) {
    --depth_;
    // Nothing ran: the call can run eagerly without touching the pending
    // backwards (Note [Training graphs captured together]).
    if (options_.fallback == FallbackPolicy::kRaise) throw;
    // One reason for every such call (the error's positions vary), so that
    // stats() counts them together.
    return fall_back(module, "called out of its graphs' recorded order while backward passes "
                             "of their pool were pending (e.g. a module called again before "
                             "its backward ran): replaying would overwrite what those backwards "
                             "read, so the call ran eagerly",
                     inputs, caller_runs_fallbacks);
  } catch (...) {
    --depth_;
    throw;
  }
  ++counters_.replays;
  ++module.replays;
  ++slot->replays;
  if (module.picked_buckets && !module.picked_checked && plan.pads()) {
    if (std::optional<c10::IValue> eager =
            check_picked_buckets(module, inputs, out, *slot->entry, plan)) {
      return eager;
    }
  }
  return out;
}

GraphManagerStats GraphManager::stats() const {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  GraphManagerStats out = counters_;
  out.graphs = static_cast<int64_t>(lru_.size());
  out.graph_memory_bytes = lru_.total_bytes();
  for (const auto& module : modules_) {
    ModuleStats stats;
    stats.name = module->spec.name;
    stats.state = module->blocked ? "eager"
                  : module->warmup_calls < options_.warmup ? "warmup"
                                                           : "graphed";
    stats.calls = module->calls;
    stats.replays = module->replays;
    stats.part_of = module->spec.part_of;
    if (!module->blocked && module->replays > 0) {
      for (const std::string& finding : module->unconfirmed_findings) {
        out.check_false_findings.push_back(FallbackStats{module->spec.name, finding, 1});
      }
    }
    for (const auto& slot : module->slots) {
      if (slot->entry) {
        ++stats.graphs;
        if (out.pool_reserved_bytes == 0) out.pool_reserved_bytes = slot->entry->pool_reserved_bytes();
      }
    }
    out.modules.push_back(std::move(stats));
  }
  return out;
}

void GraphManager::clear() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  for (auto& module : modules_) {
    while (!module->slots.empty()) evict(module->slots.front()->id);
    module->captured_ahead = false;
  }
}

}  // namespace graphed
