#pragma once

// Private to libgraphed: GraphManager's per-module and per-graph records,
// shared by its rooms (graph_manager.cpp: calls, capture and stats;
// graph_manager_buckets.cpp: buckets picked for a module and their check;
// graph_manager_training.cpp: the training graphs captured together).

#include "graphed/auto_buckets.h"
#include "graphed/graph_manager.h"
#include "graphed/tensor_identity.h"

#include <ATen/autocast_mode.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace graphed {

// Note [Autocast's cache while graphed.auto captures]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under torch.autocast with its weight cache on (the default), a cast of a
// weight made inside a capture would be kept in the cache, in the graph's
// pool, and a cast made before it (by an eager module of the same autocast
// region: tied embeddings) would be read by every replay after the region
// freed it; make_graphed_callables refuses such captures (Note in
// graphed_callable.cpp). graphed.auto captures inside the user's forward,
// under the user's autocast, so it turns the cache off for its warm-up
// runs and captures alone: the graphs cast the weights themselves on every
// replay (what they must do anyway, as the weights change every step), and
// the eager code around them keeps its cache.
class AutocastCacheOff {
 public:
  AutocastCacheOff() : was_enabled_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~AutocastCacheOff() { at::autocast::set_autocast_cache_enabled(was_enabled_); }
  AutocastCacheOff(const AutocastCacheOff&) = delete;
  AutocastCacheOff& operator=(const AutocastCacheOff&) = delete;

 private:
  bool was_enabled_;
};

// The input buffers of the largest bucket graph of any module, in whose
// fronts every module's largest bucket graph keeps its input buffers (Note
// [Bucket graphs share their buffers] in graph_manager_buckets.cpp).
struct SharedInputs {
  std::vector<at::Tensor> buffers;
};

// The static inputs and outputs of a module's largest bucket graph, in whose
// fronts its other bucket graphs keep theirs (same Note), and the shared
// inputs its input buffers live in (null: their own memory).
struct BucketArena {
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> outputs;
  std::shared_ptr<const SharedInputs> inputs_in;
};

// Where a bucket graph keeps its buffers: in its module's arena (when it fits
// there), and in the shared inputs (directly, or through the module's arena).
struct BucketBuffers {
  std::shared_ptr<const BucketArena> module_arena;
  std::shared_ptr<const SharedInputs> shared;
};

// Whether every tensor of `sample` fits in its counterpart of `arena` (none
// has more elements): false when a graph at these sizes must have buffers of
// its own, and becomes the module's arena.
bool fits_bucket_arena(const std::vector<c10::IValue>& sample,
                       const std::vector<at::Tensor>& arena);

// Whether one of `outputs` shares storage with one of `inputs`.
bool outputs_alias_inputs(const std::vector<at::Tensor>& outputs,
                          const std::vector<at::Tensor>& inputs);

struct GraphManager::Slot {
  uint64_t id = 0;
  CallKey key;
  CallMode mode = CallMode::kInference;
  BucketPlan plan;  // at bucket sizes
  std::unique_ptr<GraphEntry> entry;
  // Set instead of `entry` when these inputs cannot be captured (not the
  // module: e.g. CPU tensors); calls with this key fall back at once.
  std::string failure;
  int64_t replays = 0;
  // The buffers it keeps its own in (its own when it is the module's largest
  // bucket graph); null when they are private.
  std::shared_ptr<const BucketArena> arena;
};

struct GraphManager::Module {
  explicit Module(int64_t pick_buckets_after) : auto_buckets(pick_buckets_after) {}

  ModuleSpec spec;
  size_t index = 0;
  int64_t calls = 0;
  int64_t warmup_calls = 0;
  int64_t replays = 0;
  bool seen = false;
  // Set once the module falls back for good (a blocker or a capture error).
  std::optional<std::string> blocked;
  std::vector<std::unique_ptr<Slot>> slots;  // most recently used first
  std::string description;
  // The subject of its NVTX warm-up ranges, "layers.0 (Block)".
  std::string nvtx_subject;
  // The inputs of its last warm-up call in training mode, until a training
  // group is planned (Note [Training graphs captured together]).
  std::optional<std::vector<c10::IValue>> training_sample;
  // Findings of the warm-up check that a capture decides (CaptureVerdict::
  // kTryCapture): false findings once a graph of the module replays.
  std::vector<std::string> unconfirmed_findings;
  // Its parameters and buffers at the end of warm-up, which its graphs read
  // (Note [Modules whose tensors moved]).
  TensorIdentities tensors;
  // Whether its graphs of every bucket were captured ahead (Note [Bucket
  // padding]: not from a call whose broadcast tensors cannot be told).
  bool captured_ahead = false;
  // Note [Buckets graphed picks itself]: the sizes its inference calls came
  // at, the buckets picked from them, whether the first padded call agreed
  // with eager, and whether picking was refused for good.
  AutoBuckets auto_buckets;
  std::optional<BucketPolicy> picked_buckets;
  // The buffers of its largest bucket graph, while one of its graphs uses them.
  std::weak_ptr<const BucketArena> arena;
  bool picked_checked = false;
  bool picking_refused = false;
  // The last call that could not be bucketed and its reason, so that calls
  // repeating it build no message (Note [A fallback costs nothing]).
  std::optional<BucketMiss> last_miss;
  std::string last_miss_reason;
  // The key of its first warm-up call (ModuleSpec::steady_shapes).
  std::optional<CallKey> warmup_key;
  // Where its last fallback reason is counted in GraphManagerStats::fallbacks.
  std::optional<size_t> last_fallback;
};

}  // namespace graphed
