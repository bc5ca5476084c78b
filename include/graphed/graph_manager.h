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

#include "graphed/bucket_policy.h"
#include "graphed/capture.h"
#include "graphed/graph.h"
#include "graphed/signature.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace graphed {

/// Parses a memory size: a number of bytes ("1048576") or a number with a unit
/// ("512MB", "2GiB", "1.5 GB"; B, KB, MB, GB, TB are powers of 1000, KiB, MiB,
/// GiB, TiB powers of 1024; case-insensitive). Throws graphed::Error naming
/// the accepted forms for anything else, or for a size below one byte.
int64_t parse_memory_size(std::string_view text);

/// E.g. "3.2 MiB".
std::string format_bytes(int64_t bytes);

/// Least-recently-used bookkeeping of items with sizes under a byte budget.
/// Pure host logic; GraphManager keys its graphs into it.
class LruBudget {
 public:
  /// No budget: nothing is ever over it.
  LruBudget() = default;
  /// A budget of `budget_bytes` (>= 1); nullopt for none.
  explicit LruBudget(std::optional<int64_t> budget_bytes);

  /// Adds `id` (not present yet) as the most recently used item.
  void add(uint64_t id, int64_t bytes);
  /// Marks `id` the most recently used item.
  void touch(uint64_t id);
  /// Forgets `id`; nothing when absent.
  void remove(uint64_t id);
  /// Items to evict, least recently used first, until the total fits the
  /// budget, never naming `keep`. Does not remove them.
  std::vector<uint64_t> over_budget(std::optional<uint64_t> keep = std::nullopt) const;
  /// Sum of the items' sizes.
  int64_t total_bytes() const { return total_; }
  /// Number of items.
  size_t size() const { return items_.size(); }
  /// The budget, if any.
  std::optional<int64_t> budget() const { return budget_; }
  /// Ids from least to most recently used.
  std::vector<uint64_t> order() const;

 private:
  std::optional<int64_t> budget_;
  std::list<std::pair<uint64_t, int64_t>> lru_;  // front: least recently used
  std::unordered_map<uint64_t, std::list<std::pair<uint64_t, int64_t>>::iterator> items_;
  int64_t total_ = 0;
};

/// A module of the model, as module selection sees it.
struct ModuleInfo {
  /// Qualified name ("" for the root, "blocks.0", "blocks.0.mlp").
  std::string name;
  /// Class name, e.g. "GPTBlock".
  std::string type;
  /// Parameters of the module and its descendants (elements).
  int64_t parameters = 0;
  /// True for containers of repeated children (ModuleList, Sequential).
  bool is_container = false;
  /// Names of the classes `type` derives from, nearest first (Module itself
  /// left out): a layer subclassed to change one block still repeats its
  /// siblings (Note [Choosing repeated blocks]).
  std::vector<std::string> bases;
};

/// The modules graphed.auto captures by default: the largest repeated blocks.
///
/// Note [Choosing repeated blocks]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// Repeated blocks are the children of one container (ModuleList, Sequential)
/// that share a class with at least one sibling: a transformer's layers, a
/// residual MLP's blocks. A child whose own class has no sibling joins the
/// siblings of its nearest base class, so that one layer replaced by a
/// subclass (a block with logging, say) is still managed with the others,
/// and if it cannot be captured it is counted as a fallback rather than
/// silently left out. Each such group is a candidate; candidates are
/// taken by the parameters they cover, largest first, skipping any that
/// nests within or contains one already taken, so that a model's layers win
/// over the Linear layers inside each of them and an encoder and a decoder
/// are both taken. Graphing at this level keeps graphs few and large (one
/// launch per layer), leaves code between layers (embeddings, losses, host
/// logic) eager, and gives the graphs of a layer one signature per call
/// size. Without any repeated block the whole model ("") is captured.
/// `modules` lists every module in named_modules() order.
std::vector<std::string> select_repeated_blocks(const std::vector<ModuleInfo>& modules);

/// Checks a user's choice of modules: every name exists in `modules` and no
/// chosen module contains another. Throws graphed::Error naming the problem
/// and the fix.
void validate_module_selection(const std::vector<std::string>& chosen,
                               const std::vector<ModuleInfo>& modules);

/// What a call needs from a graph.
enum class CallMode {
  /// No autograd history: grad mode off, or nothing requires grad.
  kInference,
  /// Grad mode on and an input or parameter requires grad: outputs must
  /// carry autograd history (forward and backward graphs).
  kTraining,
};

/// "inference" or "training".
std::string_view call_mode_name(CallMode mode);

/// One captured graph (or graph pair) of one module for one signature.
/// GraphManager only replays through this interface: the inference entry
/// (make_inference_entry) captures with graphed::capture; a training entry
/// (forward and backward graphs) plugs in through GraphEntryFactories::training.
class GraphEntry {
 public:
  virtual ~GraphEntry() = default;
  /// Replays on `inputs`, which match signature() except along the padded
  /// dimensions of `plan` (each input tensor then holds the call's size;
  /// the entry pads it up and slices its outputs back, see Note [Bucket
  /// padding]). Returns the outputs.
  virtual c10::IValue run(const std::vector<c10::IValue>& inputs, const BucketPlan& plan) = 0;
  /// Device memory this graph holds: see Note [Graph memory accounting].
  virtual int64_t memory_bytes() const = 0;
  /// The inputs it was captured with (at bucket sizes).
  virtual const Signature& signature() const = 0;
  /// Bytes the shared pool holds now (segments), or 0 when unknown.
  virtual int64_t pool_reserved_bytes() const = 0;
  /// Wall time of its capture, warm-up included, in milliseconds.
  virtual double capture_ms() const = 0;
};

/// A module GraphManager manages.
struct ModuleSpec {
  /// Qualified name, for stats and messages.
  std::string name;
  /// Class name, for messages.
  std::string type;
  /// Runs the module's own forward (never the managed one) on the inputs of
  /// a call.
  CapturableFunction forward;
  /// Tensors the forward may modify (buffers): restored after warm-up and
  /// capture (Invariant 1).
  std::vector<at::Tensor> state;
  /// The module's parameters: a call in grad mode needs training graphs when
  /// any of them requires grad.
  std::vector<at::Tensor> parameters;
  /// Read the module's parameters and its buffers as they are now (from the
  /// module, so that replaced tensors are seen too). When both are set, every
  /// call after warm-up compares them with what its graphs were captured on
  /// and, on a difference, releases the module's graphs, takes the new
  /// tensors as `parameters` and `state`, and warms the module up again
  /// (Note [Modules whose tensors moved] in graph_manager.cpp). Unset to skip.
  std::function<std::vector<at::Tensor>()> read_parameters;
  /// See read_parameters.
  std::function<std::vector<at::Tensor>()> read_buffers;
};

/// What a GraphEntryFactory is asked to capture.
struct GraphEntryRequest {
  /// The module.
  const ModuleSpec* module = nullptr;
  /// Sample inputs at the bucket sizes of `plan`.
  std::vector<c10::IValue> sample;
  /// The buckets this graph serves (all sizes at their buckets).
  BucketPlan plan;
  /// Names of the inputs in messages.
  std::vector<std::string> input_names;
  /// The pool every graph of the manager shares; created on first use.
  std::function<PoolId()> pool;
  /// Eager runs on the capture stream before capture.
  int warmup_iters = 1;
  /// See CaptureErrorMode.
  CaptureErrorMode error_mode = CaptureErrorMode::kGlobal;
  /// E.g. "module `blocks.0` (GPTBlock)".
  std::string description;
  /// How replays bring inputs in; see InputUpdate.
  InputUpdate input_update = InputUpdate::kAuto;
};

/// Captures one entry; throws CaptureError when the module cannot be captured.
using GraphEntryFactory = std::function<std::unique_ptr<GraphEntry>(const GraphEntryRequest&)>;

/// Captures the training entries of several modules together: one pool,
/// forward and backward graphs captured in `order` (TrainingGroupPlan::order
/// over the requests). Returns one entry per request, in request order;
/// throws like GraphEntryFactory, having captured none.
using GraphGroupFactory = std::function<std::vector<std::unique_ptr<GraphEntry>>(
    const std::vector<GraphEntryRequest>& requests, const std::vector<int64_t>& order)>;

/// The factories GraphManager captures with, per call mode.
struct GraphEntryFactories {
  /// Inference graphs; make_inference_entry when unset.
  GraphEntryFactory inference;
  /// Training graphs (forward and backward). Unset until the training path
  /// lands: calls that need it fall back to eager execution with the reason
  /// kTrainingGraphsUnavailable. See Note [Training entries] in
  /// graph_manager.cpp.
  GraphEntryFactory training;
  /// Training graphs of the modules recorded in one warm-up step, captured
  /// together (Note [Training graphs captured together] in
  /// graph_manager.cpp); unset: every training entry comes from `training`.
  GraphGroupFactory training_group;
};

/// The fallback reason of a training call while GraphEntryFactories::training is unset.
inline constexpr std::string_view kTrainingGraphsUnavailable = "training graphs not available yet";

/// Captures an inference entry with graphed::capture (no autograd; buffers in
/// ModuleSpec::state restored after warm-up and capture).
///
/// Note [Graph memory accounting]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// Graphs of one manager share one pool, so a graph's memory is not a pool
/// of its own. An entry counts its static input buffers (outside the pool)
/// plus the larger of its static outputs and the growth of the shared pool
/// during its capture: a graph that reused memory freed by earlier captures
/// still pins its outputs; one that needed more made the pool grow by that
/// much. The sum over live entries is what the memory budget limits; the
/// pool itself is reported as pool_reserved_bytes.
std::unique_ptr<GraphEntry> make_inference_entry(const GraphEntryRequest& request);

/// Captures a training entry: the module's forward and backward graphs for
/// the request's signature, through make_graphed_callables (an autograd node
/// per call), in a pool of its own (Note [Training entries]). Calls must come
/// at the exact sizes of the sample: bucket padding is refused for training.
std::unique_ptr<GraphEntry> make_training_entry(const GraphEntryRequest& request);

/// Captures the training entries of several modules with one
/// make_graphed_callables call: one pool, graphs captured in `order`, and
/// replays checked against it. Each entry's memory is its static inputs plus
/// its share of the pool (split evenly, so that the entries sum to the pool).
std::vector<std::unique_ptr<GraphEntry>> make_training_group(
    const std::vector<GraphEntryRequest>& requests, const std::vector<int64_t>& order);

/// One event of a recorded training step: the forward or the backward of a
/// managed module.
struct TrainingEvent {
  /// Index of the module in the manager.
  size_t module = 0;
  /// The forward call when true; the start of its backward otherwise.
  bool forward = true;
};

/// Which modules are captured together for training, and in what order.
struct TrainingGroupPlan {
  /// Modules captured together into one pool, in the order of their forwards.
  std::vector<size_t> modules;
  /// The recorded order over `modules` in Transformer Engine's convention
  /// (Note [Pipeline order]): +k for the forward of modules[k - 1], -k for
  /// its backward.
  std::vector<int64_t> order;
  /// Recorded modules that cannot join, with why; each is captured on its
  /// own (a pool of its own) when it needs a training graph.
  std::vector<std::pair<size_t, std::string>> left_out;
};

/// Plans the capture of the training graphs of the modules in `events` (each
/// module's last warm-up forward and the start of its backward, in the order
/// they ran); see Note [Training graphs captured together] in
/// graph_manager.cpp. A module joins when its forward ran once and its
/// backward once after it; the order keeps the recorded sequence.
TrainingGroupPlan plan_training_group(const std::vector<TrainingEvent>& events);

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
  /// See CaptureErrorMode.
  CaptureErrorMode error_mode = CaptureErrorMode::kGlobal;
  /// How replays bring inputs in. kAuto: an input that arrives where the
  /// previous call's did (the previous layer's graph output) is re-pointed
  /// once instead of copied on every call; see Note [Re-pointing a graph].
  InputUpdate input_update = InputUpdate::kAuto;
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
  struct TrainingRecorder;

  c10::IValue call_locked(Module& module, const std::vector<c10::IValue>& inputs);
  c10::IValue run_warmup(Module& module, const std::vector<c10::IValue>& inputs, bool last);
  void record_training_call(Module& module, const std::vector<c10::IValue>& inputs,
                            const c10::IValue& output);
  void capture_training_group(Module& trigger);
  std::optional<BucketPlan> plan_buckets(const std::vector<c10::IValue>& inputs,
                                         std::vector<at::Tensor>& tensors,
                                         std::string* why) const;
  c10::IValue fall_back(Module& module, const std::string& reason,
                        const std::vector<c10::IValue>& inputs);
  c10::IValue run_eager(Module& module, const std::vector<c10::IValue>& inputs);
  Slot* find_slot(Module& module, CallMode mode, const BucketPlan& plan,
                  const std::vector<c10::IValue>& inputs);
  Slot& capture_slot(Module& module, CallMode mode, const BucketPlan& plan,
                     const std::vector<c10::IValue>& inputs);
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
