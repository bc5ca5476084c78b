#include "graphed/graphed_callable.h"

#include "autograd_node.h"
#include "graph_pair.h"
#include "graphed/check.h"
#include "graphed/cuda_handles.h"
#include "graphed/nvtx.h"
#include "graphed/state_snapshot.h"
#include "graphed/static_io.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/ScopeExit.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>

namespace graphed {
namespace detail {

namespace {

// Note [Returned gradients are never aliases]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The backward graph writes its gradients into static tensors that the next
// replay overwrites. torch.cuda.make_graphed_callables returns detached views
// of them; a detached view has its own TensorImpl with one reference, so
// AccumulateGrad steals it as `.grad` when `.grad` is None, and the next
// replay then rewrites that `.grad` in place: accumulation over microbatches
// silently doubles the last one (pytorch#181723). Here the node returns the
// static tensors themselves. graphed keeps a reference, so every consumer
// sees a shared tensor: AccumulateGrad clones it (when `.grad` is None) or
// adds it in place into `.grad`, and autograd's input buffers add out of
// place; nothing keeps the static memory. The one consumer that would hand
// the tensor itself to the user is torch.autograd.grad (a graph task that
// captures gradients); then the node returns clones.
bool graph_task_captures_gradients() {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  return exec_info != nullptr && !exec_info->empty();
}

// Note [Fresh gradients in one allocation]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// After zero_grad(set_to_none=True), the usual loop, every parameter's
// `.grad` is None when its gradient arrives, and AccumulateGrad clones the
// static tensor (Note [Returned gradients are never aliases]): an allocation
// and a copy kernel per parameter, about 20 us of host time each on a slow
// host, which is most of what a graphed backward costs beyond its replay.
// Instead, those gradients are copied into one fresh allocation per dtype
// with one multi-tensor copy, and the node returns views of it shaped and
// strided like the parameters: AccumulateGrad steals such a view as `.grad`
// (it has one reference and obeys the layout contract), so the user's
// gradients never alias graph memory, and the step costs one allocation and
// a kernel or two. Parameters whose `.grad` exists (accumulation over
// microbatches, zero_grad(set_to_none=False)) get the static tensor, which
// AccumulateGrad adds in place; non-contiguous parameters too.
torch::autograd::variable_list fresh_gradients(const GraphPair& pair) {
  torch::autograd::variable_list results(pair.grad_results.begin(), pair.grad_results.end());
  const size_t first_parameter = pair.grad_input_positions.size();
  std::map<c10::ScalarType, std::vector<size_t>> by_dtype;
  for (size_t i = first_parameter; i < results.size(); ++i) {
    const at::Tensor& grad = results[i];
    const at::Tensor& parameter = pair.grad_parameters[i - first_parameter];
    if (grad.defined() && !parameter.grad().defined() && grad.layout() == at::kStrided &&
        parameter.is_contiguous() && grad.sizes() == parameter.sizes() &&
        grad.scalar_type() == parameter.scalar_type()) {
      by_dtype[grad.scalar_type()].push_back(i);
    }
  }
  constexpr int64_t kAlignmentBytes = 64;  // keeps vectorized kernels on their fast path
  for (const auto& [dtype, indices] : by_dtype) {
    const int64_t per_alignment = std::max<int64_t>(1, kAlignmentBytes / c10::elementSize(dtype));
    std::vector<int64_t> offsets;
    int64_t total = 0;
    for (size_t i : indices) {
      offsets.push_back(total);
      total += (results[i].numel() + per_alignment - 1) / per_alignment * per_alignment;
    }
    const at::Tensor flat = at::empty({total}, results[indices.front()].options());
    std::vector<at::Tensor> views;
    std::vector<at::Tensor> sources;
    for (size_t k = 0; k < indices.size(); ++k) {
      const at::Tensor& grad = results[indices[k]];
      views.push_back(flat.narrow(0, offsets[k], grad.numel()).view(grad.sizes()));
      sources.push_back(grad);
    }
    at::_foreach_copy_(views, sources);
    for (size_t k = 0; k < indices.size(); ++k) {
      results[indices[k]] = std::move(views[k]);
    }
  }
  return results;
}

class GraphedBackward final : public torch::autograd::Node {
 public:
  GraphedBackward(std::shared_ptr<GraphPair> pair, uint64_t generation)
      : pair_(std::move(pair)), generation_(generation) {}

  ~GraphedBackward() override {
    // Outputs dropped before their backward ran: the pair is free again.
    GraphPair& pair = *pair_;
    std::lock_guard<std::mutex> lock(pair.shared->mutex);
    if (pair.backward_pending && pair.generation == generation_) {
      pair.backward_pending = false;
      --pair.shared->pending_backwards;
    }
  }

  std::string name() const override { return "GraphedBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    GraphPair& pair = *pair_;
    GRAPHED_CHECK(!c10::GradMode::is_enabled(), "Expected a first-order backward through ",
                  pair.description, ", but autograd asked for a graph of the backward itself "
                  "(create_graph=True or double backward). Its backward is a replayed CUDA graph "
                  "without autograd history; compute higher-order gradients eagerly.");
    {
      std::lock_guard<std::mutex> lock(pair.shared->mutex);
      GraphedCallablesShared& shared = *pair.shared;
      GRAPHED_CHECK(pair.backward_pending && pair.generation == generation_,
                    "The backward of ", pair.description, " cannot run: ",
                    pair.generation != generation_
                        ? "its forward graph was replayed again since these outputs were made, "
                          "which overwrote the activations this backward reads"
                        : "it already ran once for these outputs (retain_graph=True), and later "
                          "graphs of the same pool may have reused the activations it reads",
                    ". Run each call's backward before calling the callable again, or graph "
                    "several microbatches in flight with order=.");
      const auto position = static_cast<int64_t>(shared.schedule.backward_position(pair.index));
      GRAPHED_CHECK(position > shared.last_position, "The backward of ", pair.description,
                    " ran out of the order its graphs were captured in: it comes at position ",
                    position, " of the schedule, but position ", shared.last_position,
                    " already ran. Graphs of one pool must replay in capture order (forwards "
                    "in order, backwards reversed, or as given by order=).");
      shared.last_position = position;
      pair.backward_pending = false;
      --shared.pending_backwards;
    }
    {
      c10::NoGradGuard no_grad;
      const NvtxRange range(pair.backward_range);
      for (size_t i = 0; i < pair.grad_outputs.size(); ++i) {
        at::Tensor& destination = pair.grad_outputs[i];
        const at::Tensor& grad = i < grads.size() ? grads[i] : at::Tensor();
        if (!grad.defined()) {
          destination.zero_();
        } else if (grad.data_ptr() != destination.data_ptr()) {
          destination.copy_(grad);
          pair.grad_copies.fetch_add(1, std::memory_order_relaxed);
        }
      }
      pair.backward.replay();
    }
    pair.backward_replays.fetch_add(1, std::memory_order_relaxed);
    if (!graph_task_captures_gradients()) {
      c10::NoGradGuard no_grad;
      return fresh_gradients(pair);  // Note [Fresh gradients in one allocation]
    }
    torch::autograd::variable_list results;
    results.reserve(pair.grad_results.size());
    for (const at::Tensor& grad : pair.grad_results) {
      results.push_back(grad.defined() ? grad.clone() : grad);
    }
    return results;
  }

 private:
  std::shared_ptr<GraphPair> pair_;
  uint64_t generation_;
};

// Note [Readers of a shared cast replay after its caster]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A forward graph that reads the FP8 weight cast of an earlier forward graph
// (Note [Weight casts shared by the graphs of a scope] in fp8_linear.cpp)
// computes with whatever that graph wrote at its last replay. Replayed in
// order every step, that is this step's cast. Replayed without it after the
// optimizer step (one call per step of a callable graphed with several
// microbatches, whose calls cycle through them; a no-grad call that replays
// the next microbatch's graph after the step), it would be last step's: the
// silent staleness of Transformer Engine's is_first_microbatch=False. The
// optimizer bumps the weight's version (weight._version()) on the host, so
// each casting forward notes the versions of the weights whose casts later
// graphs read when it replays, and a reading forward compares them with the
// versions now and refuses to replay (ReplayOrderError, before anything ran)
// when one changed. That costs one integer compare per shared cast and call,
// and nothing without FP8 layers. Updates that bypass the version counter
// (writes through `.data`) are not seen, as by the cache itself.
void link_float8_casts(const std::vector<std::shared_ptr<GraphPair>>& pairs,
                       const std::shared_ptr<const Float8ScopeCasts>& casts,
                       const std::vector<std::pair<size_t, size_t>>& cast_ranges,
                       const std::vector<std::pair<size_t, size_t>>& read_ranges,
                       GraphedCallablesShared& shared) {
  constexpr size_t kNone = static_cast<size_t>(-1);
  std::vector<size_t> caster(casts->casts.size(), kNone);
  for (size_t p = 0; p < pairs.size(); ++p) {
    pairs[p]->float8_weight_casts =
        static_cast<int64_t>(cast_ranges[p].second - cast_ranges[p].first);
    for (size_t c = cast_ranges[p].first; c < cast_ranges[p].second; ++c) {
      caster[c] = p;
    }
  }
  std::vector<size_t> slot_of(casts->casts.size(), kNone);
  for (size_t p = 0; p < pairs.size(); ++p) {
    GraphPair& reader = *pairs[p];
    for (size_t r = read_ranges[p].first; r < read_ranges[p].second; ++r) {
      const size_t c = casts->reads.at(r);
      const size_t maker = caster.at(c);
      if (maker == p || maker == kNone) {
        continue;  // read within the graph that cast it (or a cast of no forward graph)
      }
      ++reader.float8_weight_cast_reads;
      const Float8ScopeCasts::Cast& cast = casts->casts[c];
      if (slot_of[c] == kNone) {
        slot_of[c] = shared.float8_cast_versions.size();
        shared.float8_cast_versions.push_back(cast.weight_version);
        pairs[maker]->float8_casts_made.push_back(
            {slot_of[c], cast.weight, pairs[maker]->description});
      }
      reader.float8_casts_read.push_back({slot_of[c], cast.weight, pairs[maker]->description});
    }
  }
  shared.float8_casts = casts;
}

std::string spec_key(const Signature& signature) {
  std::ostringstream key;
  key << signature.describe();
  for (const TensorSpec& spec : signature.tensor_specs()) {
    key << '|' << spec.requires_grad;
  }
  return key.str();
}

}  // namespace
}  // namespace detail

using detail::GraphedCallablesShared;
using detail::GraphPair;

GraphableCallable graphable_module(std::shared_ptr<torch::nn::Module> module,
                                   CapturableFunction forward, std::string description) {
  GRAPHED_CHECK(module != nullptr, "Expected a module to graph, got a null pointer.");
  GraphableCallable callable;
  callable.function = std::move(forward);
  callable.parameters = module->parameters();
  callable.state = module->buffers();
  callable.training = module->is_training();
  callable.read_training = [weak = std::weak_ptr<torch::nn::Module>(module)] {
    const auto alive = weak.lock();
    return alive ? alive->is_training() : false;
  };
  callable.read_parameters = [weak = std::weak_ptr<torch::nn::Module>(module)] {
    const auto alive = weak.lock();
    return alive ? alive->parameters() : std::vector<at::Tensor>{};
  };
  callable.description =
      description.empty() ? c10::str("module `", module->name(), "`") : std::move(description);
  return callable;
}

GraphedCallable::GraphedCallable(GraphableCallable callable,
                                 std::vector<std::shared_ptr<GraphPair>> pairs,
                                 std::shared_ptr<GraphedCallablesShared> shared)
    : callable_(std::move(callable)), pairs_(std::move(pairs)), shared_(std::move(shared)) {
  if (callable_.read_parameters) {
    parameter_identity_ = TensorIdentities(callable_.read_parameters());
  }
  state_identity_ = TensorIdentities(callable_.state);
}

GraphedCallable::~GraphedCallable() = default;

void GraphedCallable::check_parameters() const {
  // See Note [Tensors a graph reads in place].
  static constexpr const char* kFix =
      ". The graphs read and write the original parameters' memory. Graph the module again "
      "after changing its parameters (update values in place with param.data.copy_(...) to "
      "keep the graphs).";
  if (callable_.read_parameters) {
    const std::vector<at::Tensor> now = callable_.read_parameters();
    GRAPHED_CHECK(now.size() == parameter_identity_.size(), "Expected the parameters of ",
                  callable_.description, " to be those it was graphed with (",
                  parameter_identity_.size(), " tensors), but they were changed to ", now.size(),
                  " tensors", kFix);
    const std::string difference = parameter_identity_.first_difference(now, "parameter");
    GRAPHED_CHECK(difference.empty(), "Expected the parameters of ", callable_.description,
                  " to be those it was graphed with (", parameter_identity_.size(),
                  " tensors), but ", difference, kFix);
  }
  const std::string moved = state_identity_.first_difference(callable_.state, "buffer");
  GRAPHED_CHECK(moved.empty(), "Expected the buffers of ", callable_.description,
                " to keep the memory they had when it was graphed, but ", moved,
                ". Changing a module's dtype or device (.double(), .to()) or assigning `.data` "
                "after graphing leaves the graphs on freed memory. Graph the module again after "
                "such a change.");
}

c10::IValue GraphedCallable::operator()(const std::vector<c10::IValue>& inputs) {
  return call(inputs, callable_.read_training ? std::optional<bool>(callable_.read_training())
                                              : callable_.training);
}

c10::IValue GraphedCallable::call(const std::vector<c10::IValue>& inputs,
                                  std::optional<bool> training) {
  if (training && callable_.training && *training != *callable_.training) {
    ++stats_.eager_calls[c10::str("training is ", *training ? "True" : "False",
                                  " but the graphs were captured with ",
                                  *callable_.training ? "True" : "False")];
    return callable_.function(inputs);
  }
  check_parameters();
  const std::shared_ptr<GraphPair>& pair_ptr = pairs_[next_microbatch_];
  GraphPair& pair = *pair_ptr;
  // The call's inputs are not kept past it: they would pin their memory and,
  // through their autograd history, the caller's last autograd graph, whose
  // AccumulateGrad nodes a later capture must not find alive (Note [Gradient
  // accumulators on the capture stream]).
  const auto release_inputs = c10::make_scope_exit([this] { scratch_.clear(); });
  if (!pair.signature.collect_tensors(inputs, scratch_)) {
    std::ostringstream message;
    message << "The inputs do not match those " << pair.description << " was graphed with:";
    for (const std::string& difference : pair.signature.differences(inputs)) {
      message << "\n  " << difference;
    }
    message << "\nIts graphs replay fixed shapes, dtypes, devices and requires_grad flags: call "
               "it with inputs like its sample, or graph it again with a sample of the new shape.";
    GRAPHED_THROW(InputMismatchError, message.str());
  }
  const bool with_autograd = c10::GradMode::is_enabled() && pair.has_backward;
  GraphedCallablesShared& shared = *shared_;
  uint64_t generation = 0;
  {
    // See Note [Replays follow the capture order].
    std::lock_guard<std::mutex> lock(shared.mutex);
    if (shared.pending_backwards == 0) {
      shared.last_position = -1;
    }
    const auto position = static_cast<int64_t>(shared.schedule.forward_position(pair.index));
    if (position <= shared.last_position) {
      if (!with_autograd) {
        ++stats_.eager_calls["called without autograd, out of the capture order, while backward "
                             "passes of its graph pool were pending"];
        c10::NoGradGuard no_grad;
        return callable_.function(inputs);
      }
      GRAPHED_THROW(ReplayOrderError, "The forward of ", pair.description, " was called out of the order "
                    "its graphs were captured in: it comes at position ", position, " of the "
                    "schedule, but position ", shared.last_position, " already ran and ",
                    shared.pending_backwards, " backward pass(es) are still pending. Replaying "
                    "it now would overwrite activations those backwards read. Run backward "
                    "before the next forward (or drop outputs you will not differentiate), "
                    "call in the order given by order=, or graph more microbatches.");
    }
    // See Note [Readers of a shared cast replay after its caster].
    for (const detail::Float8SharedCast& cast : pair.float8_casts_read) {
      if (cast.weight._version() != shared.float8_cast_versions[cast.slot]) {
        GRAPHED_THROW(ReplayOrderError, "Expected a fresh FP8 weight cast for the forward of ",
                      pair.description, ", but the weight whose cast it reads (",
                      describe_tensor(cast.weight), ") changed since the forward of ",
                      cast.caster, ", which casts it once per step, last replayed (an optimizer "
                      "step or another in-place update came in between), so this replay would "
                      "compute with the cast of the old weight. Call every microbatch in order "
                      "each step, starting with the first (the contract of order=), or graph "
                      "with graphed.fp8.Recipe(cache_weights=False) so that every graph casts "
                      "its weights itself; see docs/troubleshooting.md#fp8-shared-weight-cast. "
                      "Nothing ran.");
      }
    }
    shared.last_position = position;
    for (const detail::Float8SharedCast& cast : pair.float8_casts_made) {
      shared.float8_cast_versions[cast.slot] = cast.weight._version();
    }
    generation = ++pair.generation;
    if (pair.backward_pending) {
      // A forward without autograd overwrote what this pair's backward reads;
      // that backward now fails with the reason (generation mismatch).
      pair.backward_pending = false;
      --shared.pending_backwards;
    }
    if (with_autograd) {
      pair.backward_pending = true;
      ++shared.pending_backwards;
    }
  }
  if (with_autograd) {
    next_microbatch_ = (next_microbatch_ + 1) % pairs_.size();
  }

  c10::cuda::CUDAGuard device_guard(shared.device);
  {
    c10::NoGradGuard no_grad;
    // The input copies belong to the replay's cost.
    const NvtxRange range(pair.forward_range);
    // See Note [Inputs that alias other static buffers]; scratch_ keeps the
    // caller's tensors, whose autograd history the backward edges need.
    std::vector<at::Tensor> unaliased;
    if (any_cross_alias(scratch_, pair.inputs->tensors)) {
      unaliased = scratch_;
      clone_cross_aliases(unaliased, pair.inputs->tensors);
    }
    const std::vector<at::Tensor>& sources = unaliased.empty() ? scratch_ : unaliased;
    for (size_t i = 0; i < sources.size(); ++i) {
      at::Tensor& buffer = pair.inputs->tensors[i];
      if (sources[i].data_ptr() != buffer.data_ptr()) {
        buffer.copy_(sources[i]);
        ++stats_.input_copies;
      }
    }
    pair.forward.replay();
  }
  ++stats_.forward_replays;

  std::vector<at::Tensor> outputs;
  outputs.reserve(pair.outputs.size());
  for (const at::Tensor& output : pair.outputs) {
    outputs.push_back(output.defined() ? output.detach() : output);
  }
  if (with_autograd) {
    auto node = detail::make_node<detail::GraphedBackward>(pair_ptr, generation);
    torch::autograd::edge_list edges;
    edges.reserve(pair.grad_input_positions.size() + pair.grad_parameters.size());
    for (size_t position : pair.grad_input_positions) {
      edges.push_back(torch::autograd::impl::gradient_edge(scratch_[position]));
    }
    for (const at::Tensor& parameter : pair.grad_parameters) {
      edges.push_back(torch::autograd::impl::gradient_edge(parameter));
    }
    node->set_next_edges(std::move(edges));
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (pair.output_differentiable[i]) {
        torch::autograd::set_history(outputs[i], node);
      }
    }
  }
  size_t next = 0;
  return map_tensors(pair.output_tree, [&](const at::Tensor&) { return outputs.at(next++); });
}

GraphedCallableStats GraphedCallable::stats() const {
  GraphedCallableStats stats = stats_;
  for (const auto& pair : pairs_) {
    stats.backward_replays += pair->backward_replays.load(std::memory_order_relaxed);
    stats.grad_copies += pair->grad_copies.load(std::memory_order_relaxed);
  }
  return stats;
}

std::vector<GraphedPassInfo> GraphedCallable::graphs() const {
  std::vector<GraphedPassInfo> infos;
  for (const auto& pair : pairs_) {
    GraphedPassInfo forward{pair->microbatch, true, pair->forward.stats()};
    forward.float8_weight_casts = pair->float8_weight_casts;
    forward.float8_weight_cast_reads = pair->float8_weight_cast_reads;
    infos.push_back(forward);
    if (pair->has_backward) {
      infos.push_back({pair->microbatch, false, pair->backward.stats()});
    }
  }
  return infos;
}

const Signature& GraphedCallable::signature() const { return pairs_.front()->signature; }

const std::string& GraphedCallable::description() const { return callable_.description; }

PoolId GraphedCallable::pool() const { return shared_->pool; }

std::vector<std::shared_ptr<GraphedCallable>> make_graphed_callables(
    std::vector<GraphableCallable> callables, std::vector<std::vector<c10::IValue>> samples,
    GraphedCallablesOptions options) {
  GRAPHED_CHECK(options.warmup_iters >= 1, "Expected num_warmup_iters >= 1, got ",
                options.warmup_iters, ". Warm-up runs create what capture cannot (cuBLAS "
                "handles and workspaces, autotuning); use at least 1, and 11 under "
                "DistributedDataParallel.");
  for (size_t i = 0; i < callables.size(); ++i) {
    GRAPHED_CHECK(static_cast<bool>(callables[i].function), "Callable ", i,
                  " has no function to run.");
  }
  detail::check_no_autocast_cache();
  auto shared = std::make_shared<GraphedCallablesShared>();
  shared->schedule = GraphSchedule::plan(callables.size(), samples.size(), options.order);
  const GraphSchedule& schedule = shared->schedule;

  // Signatures and the device, before anything is allocated.
  std::vector<std::shared_ptr<GraphPair>> pairs(schedule.num_pairs());
  std::optional<c10::Device> device;
  std::vector<std::string> keys;
  for (size_t p = 0; p < pairs.size(); ++p) {
    auto pair = std::make_shared<GraphPair>();
    pair->index = p;
    pair->microbatch = schedule.microbatch_of(p);
    const GraphableCallable& callable = callables[schedule.callable_of(p)];
    pair->description = schedule.num_microbatches() > 1
                            ? c10::str(callable.description, " (microbatch ",
                                       pair->microbatch, ")")
                            : callable.description;
    pair->nvtx_subject = nvtx_subject(pair->description);
    pair->forward_range = nvtx_range_name(NvtxPhase::kReplay, pair->nvtx_subject + " forward");
    pair->backward_range = nvtx_range_name(NvtxPhase::kReplay, pair->nvtx_subject + " backward");
    std::vector<std::string> names = options.input_names;
    if (names.empty()) {
      for (size_t i = 0; i < samples[p].size(); ++i) {
        names.push_back(c10::str("args[", i, "]"));
      }
    }
    GRAPHED_CHECK(names.size() == samples[p].size(), "Expected one input name per sample "
                  "input, got ", names.size(), " names for ", samples[p].size(), " inputs.");
    SignatureOptions signature_options;
    signature_options.match_requires_grad = true;
    pair->signature = Signature(samples[p], names, signature_options);
    for (size_t i = 0; i < pair->signature.num_tensors(); ++i) {
      const TensorSpec& spec = pair->signature.tensor_specs()[i];
      GRAPHED_CHECK(spec.device.is_cuda(), "Expected every sample tensor of ", pair->description,
                    " on a CUDA device, but ", pair->signature.tensor_path(i), " is ",
                    spec.describe(), ". Graphs replay GPU work only; move the sample (and later "
                    "inputs) to the GPU with .cuda().");
      GRAPHED_CHECK(!device || *device == spec.device, "Expected every sample tensor on one "
                    "device, but ", pair->description, "'s ", pair->signature.tensor_path(i),
                    " is on ", spec.device.str(), " and an earlier one on ", device->str(),
                    ". Graph callables of different GPUs in separate calls.");
      device = spec.device;
      if (spec.requires_grad) {
        pair->grad_input_positions.push_back(i);
      }
    }
    for (const at::Tensor& parameter : callable.parameters) {
      GRAPHED_CHECK(parameter.defined(), "A parameter of ", callable.description,
                    " is undefined; pass defined tensors.");
      GRAPHED_CHECK(!device || parameter.device() == *device || !parameter.requires_grad(),
                    "Expected the parameters of ", callable.description, " on ", device->str(),
                    " with its inputs, but one is ", describe_tensor(parameter),
                    ". Move the module to the inputs' GPU (module.cuda()).");
      if (parameter.requires_grad()) {
        pair->grad_parameters.push_back(parameter);
      }
    }
    keys.push_back(detail::spec_key(pair->signature));
    pairs[p] = std::move(pair);
  }
  GRAPHED_CHECK(c10::cuda::device_count() > 0, "Graphing ", callables.front().description,
                " needs an NVIDIA GPU, but CUDA reports no device "
                "(torch.cuda.is_available() is False).");
  shared->device = device.value_or(c10::Device(c10::kCUDA, c10::cuda::current_device()));
  c10::cuda::CUDAGuard device_guard(shared->device);
  shared->pool = options.pool.value_or(new_pool());
  detail::check_gradient_accumulators(pairs, capture_stream(shared->device.index()));

  // Static input buffers, shared where lifetimes allow (Note [Pipeline order]).
  const std::vector<std::optional<size_t>> donors = schedule.shared_inputs(keys);
  // Owners first: a donor is always a pair that allocated its own set.
  for (size_t p = 0; p < pairs.size(); ++p) {
    if (!donors[p]) {
      pairs[p]->inputs = std::make_shared<detail::InputBuffers>();
      pairs[p]->inputs->tensors = StaticInputs(samples[p]).buffers();
    }
  }
  for (size_t p = 0; p < pairs.size(); ++p) {
    GraphPair& pair = *pairs[p];
    if (donors[p]) {
      pair.inputs = pairs[*donors[p]]->inputs;
      GRAPHED_INTERNAL_ASSERT(pair.inputs != nullptr, "a donor owns its buffers");
    }
    size_t next = 0;
    for (const c10::IValue& input : samples[p]) {
      pair.input_tree.push_back(map_tensors(input, [&](const at::Tensor& tensor) {
        at::Tensor& buffer = pair.inputs->tensors.at(next++);
        if (tensor.requires_grad() && !buffer.requires_grad()) {
          buffer.requires_grad_(true);
        }
        return buffer;
      }));
    }
  }

  std::vector<at::Tensor> state;
  for (const GraphableCallable& callable : callables) {
    state.insert(state.end(), callable.state.begin(), callable.state.end());
  }
  const StateSnapshot snapshot = StateSnapshot::take(state, shared->device);
  GraphCaptureOptions graph_options;
  graph_options.pool = shared->pool;
  graph_options.error_mode = options.error_mode;
  // What each forward capture cast and read: [first, last) in the scope's
  // record (Note [Weight casts shared by the graphs of a scope]).
  std::vector<std::pair<size_t, size_t>> float8_cast_ranges(pairs.size());
  std::vector<std::pair<size_t, size_t>> float8_read_ranges(pairs.size());
  std::shared_ptr<const Float8ScopeCasts> float8_casts;
  try {
    c10::AutoGradMode grad_mode(true);
    const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(shared->device.index());
    const c10::cuda::CUDAStream stream = capture_stream(shared->device.index());
    {
      // Warm up on the capture stream (Note [One capture stream per device]),
      // in the order of the forwards.
      stream_wait(stream.stream(), caller.stream());
      c10::cuda::CUDAStreamGuard on_capture_stream(stream);
      for (const GraphPass& pass : schedule.passes()) {
        if (!pass.forward) {
          continue;
        }
        GraphPair& pair = *pairs[pass.pair];
        const GraphableCallable& callable = callables[schedule.callable_of(pass.pair)];
        const NvtxRange range(NvtxPhase::kWarmup, pair.nvtx_subject);
        for (int i = 0; i < options.warmup_iters; ++i) {
          detail::run_eagerly_once(callable, pair, options.allow_unused_input);
        }
      }
      stream_wait(caller.stream(), stream.stream());
    }
    std::unordered_map<std::string, at::Tensor> grad_output_buffers;
    // The graphs share one pool and replay in capture order, so a forward
    // graph may read the FP8 weight casts an earlier one made (Note [Weight
    // casts shared by the graphs of a scope]). Without FP8 layers the scope
    // records nothing.
    const Float8CastScope float8_scope;
    for (const GraphPass& pass : schedule.passes()) {
      GraphPair& pair = *pairs[pass.pair];
      const GraphableCallable& callable = callables[schedule.callable_of(pass.pair)];
      graph_options.description = c10::str(pass.forward ? "the forward of " : "the backward of ",
                                           pair.description);
      const NvtxRange range(NvtxPhase::kCapture,
                            pair.nvtx_subject + (pass.forward ? " forward" : " backward"));
      if (pass.forward) {
        const size_t casts = float8_scope.num_casts();
        const size_t reads = float8_scope.num_reads();
        detail::capture_forward(callable, pair, graph_options);
        float8_cast_ranges[pass.pair] = {casts, float8_scope.num_casts()};
        float8_read_ranges[pass.pair] = {reads, float8_scope.num_reads()};
      } else {
        detail::capture_backward(pair, graph_options, grad_output_buffers);
      }
    }
    float8_casts = float8_scope.casts();
  } catch (c10::Error& error) {
    snapshot.restore();
    error.add_context("Graphing changed nothing: the callables' buffers, their gradients and "
                      "the random generators are as they were, and the graphs' memory is "
                      "released.");
    throw;
  } catch (...) {
    snapshot.restore();
    throw;
  }
  snapshot.restore();
  if (float8_casts) {
    detail::link_float8_casts(pairs, float8_casts, float8_cast_ranges, float8_read_ranges,
                              *shared);
  }

  for (const auto& pair : pairs) {
    pair->shared = shared;
  }
  std::vector<std::shared_ptr<GraphedCallable>> graphed;
  for (size_t c = 0; c < callables.size(); ++c) {
    std::vector<std::shared_ptr<GraphPair>> own;
    for (size_t m = 0; m < schedule.num_microbatches(); ++m) {
      own.push_back(pairs[schedule.pair_index(c, m)]);
    }
    graphed.push_back(
        std::make_shared<GraphedCallable>(std::move(callables[c]), std::move(own), shared));
  }
  return graphed;
}

}  // namespace graphed
