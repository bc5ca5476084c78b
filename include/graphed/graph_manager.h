#pragma once

/// \file graph_manager.h
/// graphed::GraphManager: automatic capture per module, the core of
/// graphed.auto. Chosen modules run eagerly for a few warm-up calls while the
/// order of their calls is recorded; then each module is captured on its next
/// call (so graphs are captured in call order, into one shared pool) and
/// replayed afterwards. Calls with a new signature get a new graph, or are
/// padded up to a bucket (bucket_policy.h); a memory budget evicts the least
/// recently used graphs; a module that cannot be captured runs eagerly while
/// the others stay graphed, and every such fallback is counted with its reason.

#include "graphed/auto_buckets.h"
#include "graphed/bucket_policy.h"
#include "graphed/call_key.h"
#include "graphed/capture.h"
#include "graphed/graph.h"
#include "graphed/graph_entry.h"
#include "graphed/memory_budget.h"
#include "graphed/training_group.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace graphed {

struct SharedInputs;
struct BucketBuffers;

/// What happens when a module or a call cannot use a graph.
enum class FallbackPolicy {
  /// Run eagerly and count the fallback with its reason.
  kEager,
  /// Raise graphed::Error with the reason and the fix.
  kRaise,
};

/// Parses "eager" or "raise".
FallbackPolicy parse_fallback_policy(std::string_view name);

/// Options of a GraphManager.
struct GraphManagerOptions {
  /// Eager calls per module before it is captured (>= 1).
  int warmup = 3;
  /// Bucketed dimensions; none by default.
  BucketPolicy buckets;
  /// Without `buckets`: pick power-of-two buckets along dimension 0 for a
  /// module whose inference calls came at pick_buckets_after sizes (checked
  /// against eager on the first padded call); see Note [Buckets graphed
  /// picks itself] in auto_buckets.h. False: one graph per signature.
  bool pick_buckets = false;
  /// See pick_buckets (>= 2).
  int64_t pick_buckets_after = 4;
  /// Limit of the summed memory of live graphs (Note [Graph memory
  /// accounting]); least recently used graphs are evicted to stay under it.
  std::optional<int64_t> memory_budget_bytes;
  /// See FallbackPolicy.
  FallbackPolicy fallback = FallbackPolicy::kEager;
  /// Run the last warm-up call of each module under check_safety: a module
  /// with an operation that breaks capture in the user's code, or one that
  /// spoils replay anywhere, falls back without a failed capture, and the
  /// reason names the operation and its source line. Findings a capture may
  /// never meet (inside installed packages) are left to the capture (Note
  /// [Capture is the verdict] in safety_check.cpp).
  bool check_blockers = true;
  /// Eager runs on the capture stream before each capture (>= 1).
  int capture_warmup_iters = 1;
  /// Capture every bucket of a module on its first capture, largest first
  /// (when there are at most this many combinations); 0 captures on demand.
  int max_capture_ahead = 64;
  /// Graphs of one module at several buckets keep their static inputs and
  /// outputs in the fronts of the largest one's (Note [Bucket graphs share
  /// their buffers] in src/graph_manager_buckets.cpp): a module's outputs
  /// are then valid until its next call at any bucket, as documented for
  /// graphed.auto. False: every graph has buffers of its own.
  bool share_bucket_buffers = true;
  /// See CaptureErrorMode.
  CaptureErrorMode error_mode = CaptureErrorMode::kGlobal;
  /// How replays bring inputs in. kAuto: an input that arrives where the
  /// previous call's did (the previous layer's graph output) is re-pointed
  /// once instead of copied on every call; see Note [Re-pointing a graph].
  InputUpdate input_update = InputUpdate::kAuto;
  /// Called after each graph of a module's first capture that captures
  /// several buckets ahead (max_capture_ahead): the module's name, the
  /// graphs done and their number; a last call reports done == total when
  /// the budget stopped the captures early. For progress bars; unset: none.
  std::function<void(const std::string& module, size_t done, size_t total)> on_capture_ahead;
};

/// Counters of one managed module.
struct ModuleStats {
  /// Qualified name.
  std::string name;
  /// "warmup", "graphed" or "eager" (fallen back for good).
  std::string state;
  /// Calls of the module.
  int64_t calls = 0;
  /// Calls that replayed a graph.
  int64_t replays = 0;
  /// Live graphs.
  int64_t graphs = 0;
  /// ModuleSpec::part_of: the module this one is graphed in place of.
  std::string part_of;
};

/// Calls of one module that fell back to eager for one reason.
struct FallbackStats {
  /// The module's qualified name.
  std::string module;
  /// Why it could not use a graph, with the fix.
  std::string reason;
  /// Calls that ran eagerly for this reason.
  int64_t count = 0;
};

/// Training graphs of several modules captured together into one pool.
struct TrainingGroupStats {
  /// The modules, in the order of their forwards.
  std::vector<std::string> modules;
  /// The recorded order (TrainingGroupPlan::order) the graphs were captured
  /// in and replays follow.
  std::vector<int64_t> order;
  /// Recorded modules that did not join, each with why ("blocks.3: ...");
  /// they are captured on their own.
  std::vector<std::string> left_out;
  /// Empty when captured; else why the capture failed (each member is then
  /// captured on its own, so that a module that cannot be captured is found
  /// and falls back alone).
  std::string failure;
  /// Wall time of the capture, warm-up included, in milliseconds.
  double capture_ms = 0.0;
  /// Bytes the group's pool held right after capture.
  int64_t pool_reserved_bytes = 0;
};

/// What a GraphManager did.
struct GraphManagerStats {
  /// Calls of managed modules.
  int64_t calls = 0;
  /// Calls that replayed a graph.
  int64_t replays = 0;
  /// Eager warm-up calls.
  int64_t warmup_calls = 0;
  /// Graphs captured (capture-ahead included).
  int64_t captures = 0;
  /// Graphs evicted to stay under the memory budget.
  int64_t evictions = 0;
  /// Times a module's parameters or buffers were found moved or replaced
  /// (`.double()`, `.to()`, `param.data = ...`, a new nn.Parameter) after
  /// its warm-up: its graphs were released and it was warmed up and captured
  /// again. See Note [Modules whose tensors moved] in graph_manager.cpp.
  int64_t tensor_changes = 0;
  /// Calls that fell back to eager execution.
  int64_t fallback_calls = 0;
  /// Wall time of all captures, warm-up on the capture stream included.
  double capture_ms = 0.0;
  /// Live graphs.
  int64_t graphs = 0;
  /// Their memory; see Note [Graph memory accounting].
  int64_t graph_memory_bytes = 0;
  /// Bytes the shared pool holds now.
  int64_t pool_reserved_bytes = 0;
  /// The memory budget, or -1 for none.
  int64_t memory_budget_bytes = -1;
  /// Modules in the order of their first call.
  std::vector<std::string> order;
  /// Per module, in registration order.
  std::vector<ModuleStats> modules;
  /// Every (module, reason) that fell back, in order of first occurrence.
  std::vector<FallbackStats> fallbacks;
  /// Training graphs captured together, in order of capture.
  std::vector<TrainingGroupStats> training_groups;
  /// What the manager decided by itself, one line each: buckets it picked
  /// for a module (Note [Buckets graphed picks itself]), or refused to keep.
  std::vector<std::string> notes;
  /// Findings of the warm-up check inside installed packages that a capture
  /// never met: the module captured and replays
  /// (Note [Capture is the verdict] in safety_check.cpp). `reason` holds the
  /// finding; `count` is 1.
  std::vector<FallbackStats> check_false_findings;
};

/// Automatic capture of modules; see the file comment.
class GraphManager {
 public:
  /// A manager with `options` (validated; throws graphed::Error with the fix)
  /// capturing through `factories`.
  explicit GraphManager(GraphManagerOptions options, GraphEntryFactories factories = {});
  ~GraphManager();
  GraphManager(const GraphManager&) = delete;
  GraphManager& operator=(const GraphManager&) = delete;

  /// Registers a module; returns its index for call().
  size_t add_module(ModuleSpec spec);

  /// Runs module `index` on `inputs`: eagerly during warm-up and for
  /// fallbacks, else by replaying (capturing first when no graph serves the
  /// call). A call made while another managed call is running (a module
  /// reached from inside a captured one) runs eagerly and is not counted.
  c10::IValue call(size_t index, const std::vector<c10::IValue>& inputs);

  /// call(), except that a call that falls back (counted, with its reason)
  /// is not run: nullopt tells the caller to run the module's own forward
  /// itself, which spares a fallback the conversions into and out of the
  /// core (Note [A fallback costs nothing]).
  std::optional<c10::IValue> try_call(size_t index, const std::vector<c10::IValue>& inputs);

  /// True once module `index` falls back for good (a capture blocker or a
  /// failed capture): no later call can use a graph, so the caller may route
  /// them straight to the module's own forward (Note [A fallback costs
  /// nothing]).
  bool blocked(size_t index) const;

  /// Counters, memory and fallbacks.
  GraphManagerStats stats() const;
  /// The options.
  const GraphManagerOptions& options() const { return options_; }
  /// Drops every graph (the pool is released once nothing uses it); modules
  /// are captured again on their next call. Fallen-back modules stay eager.
  void clear();

 private:
  struct Slot;
  struct Module;

  std::optional<c10::IValue> call_locked(Module& module, const std::vector<c10::IValue>& inputs,
                                         bool caller_runs_fallbacks);
  std::optional<BucketPlan> plan_call(Module& module, const BucketPolicy& policy,
                                      const std::vector<c10::IValue>& inputs,
                                      const std::vector<at::Tensor>& tensors, std::string& why);
  bool pick_buckets_for(Module& module, const std::vector<c10::IValue>& inputs);
  std::optional<c10::IValue> check_picked_buckets(Module& module,
                                                  const std::vector<c10::IValue>& inputs,
                                                  const c10::IValue& replayed, GraphEntry& entry,
                                                  const BucketPlan& plan);
  void evict_inference_slots(Module& module);
  void rehome_bucket_graphs(Module& module, const Slot& keep);
  void rehome_shared_inputs(const SharedInputs* old, const Slot& keep);
  BucketBuffers choose_bucket_buffers(Module& module, GraphEntryRequest& request);
  std::unique_ptr<GraphEntry> capture_in_buckets(const GraphEntryFactory& factory,
                                                 GraphEntryRequest& request,
                                                 BucketBuffers& buffers);
  const SharedInputs* adopt_bucket_buffers(Slot& slot, const BucketBuffers& buffers,
                                           bool& new_arena);
  void order_shared_inputs(const SharedInputs& inputs);
  c10::IValue run_warmup(Module& module, const std::vector<c10::IValue>& inputs, bool last);
  bool shapes_changed(Module& module, const std::vector<c10::IValue>& inputs, CallMode mode);
  std::string changing_shapes_reason(const Module& module) const;
  void record_training_call(Module& module, const std::vector<c10::IValue>& inputs,
                            const c10::IValue& output);
  void capture_training_group(Module& trigger);
  std::optional<c10::IValue> fall_back(Module& module, const std::string& reason,
                                       const std::vector<c10::IValue>& inputs,
                                       bool caller_runs_fallbacks);
  c10::IValue run_eager(Module& module, const std::vector<c10::IValue>& inputs);
  Slot* find_slot(Module& module, CallMode mode, const BucketPlan& plan,
                  const std::vector<c10::IValue>& inputs);
  Slot& capture_slot(Module& module, CallMode mode, const BucketPlan& plan,
                     const std::vector<c10::IValue>& inputs, const BucketPolicy& policy);
  void enforce_budget(const Slot& keep);
  void evict(uint64_t id);
  void restart_warmup(Module& module);
  PoolId shared_pool();
  const std::vector<std::string>& input_names(size_t count) const;

  GraphManagerOptions options_;
  GraphEntryFactories factories_;
  std::vector<std::unique_ptr<Module>> modules_;
  std::unordered_map<uint64_t, Slot*> slots_by_id_;
  LruBudget lru_;
  std::optional<PoolId> pool_;
  // Note [Bucket graphs share their buffers]: the input buffers every
  // module's largest bucket graph keeps its own in, and the stream of the
  // last replay that read them.
  std::weak_ptr<const SharedInputs> shared_inputs_;
  std::optional<c10::Stream> shared_inputs_stream_;
  std::shared_ptr<TrainingRecorder> recorder_;
  uint64_t next_slot_id_ = 1;
  int depth_ = 0;
  GraphManagerStats counters_;
  std::unordered_map<std::string, size_t> fallback_index_;
  // input_names() per input count: built once, read on every call.
  mutable std::unordered_map<size_t, std::vector<std::string>> input_names_;
  mutable std::recursive_mutex mutex_;
};

}  // namespace graphed
