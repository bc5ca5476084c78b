#include "graphed/graph_manager.h"

#include "graphed/check.h"
#include "graphed/graphed_callable.h"
#include "graphed/safety_check.h"
#include "graphed/state_snapshot.h"
#include "graphed/static_io.h"
#include "graphed/tensor_identity.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <cctype>
#include <atomic>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <sstream>
#include <unordered_set>

namespace graphed {

// Note [Training entries]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A call in grad mode whose inputs or parameters require grad needs outputs
// with autograd history: a forward graph and a backward graph joined by an
// autograd function (as make_graphed_callables builds them). GraphManager
// treats such an entry like any other GraphEntry -- keyed by signature and
// mode, replayed through run(), evicted by the budget -- and asks
// GraphEntryFactories::training to capture it. That factory is the single
// integration point of the training path: while it is unset, training calls
// run eagerly and are counted as fallbacks with the reason
// kTrainingGraphsUnavailable (see GraphManager::call_locked), never silently.
// make_training_entry is the factory graphed.auto plugs in.
//
// A training entry made on demand (a new signature after the first capture, a
// module left out of the group below) captures its forward and its backward
// graph at once, in a pool of its own. Sharing a pool with graphs captured
// at other times would be wrong: module 2's forward captured after module 1's
// backward could reuse the activations module 1's backward frees at capture,
// which at run time are still waiting for that backward (forward 1,
// forward 2, backward 2, backward 1).
//
// Note [Training graphs captured together]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// One pool for the training graphs of all modules is safe when they are
// captured together in the order they run, as make_graphed_callables does:
// a graph captured later reuses only memory that an earlier one freed
// before it in that order. So the manager records that order during warm-up:
// each module's last warm-up call in training mode adds its forward to the
// record and hooks its outputs, whose first gradient adds the start of its
// backward (on autograd's thread, hence the recorder's own lock). The call
// also keeps a copy of its inputs as the sample to capture with. On the
// first call after warm-up that needs a training graph, every recorded
// module whose forward and backward ran once joins one make_graphed_callables
// call with the recorded order (Transformer Engine's convention, Note
// [Pipeline order]): forwards in call order and backwards as they ran,
// usually reversed, but two losses backpropagated one after the other are
// recorded as they happen. Replays are then checked against that order (Note
// [Replays follow the capture order]); a call out of order cannot replay
// without corrupting a pending backward, so it runs eagerly and is counted
// (or raises with fallback="raise").
//
// A module called several times per step, or whose outputs got no gradient,
// is left out (TrainingGroupStats::left_out) and captured on its own. If the
// group fails to capture, nothing is kept and each member is captured on its
// own, so that the module that cannot be captured falls back alone. On the
// GPT of bench/gpt_train.py (six layers) the method's memory went from 568 MB
// with a pool per module to 428 MB with one pool (H200, gpt_train
// graphed_auto in bench/results/h200.json, runs before and after this
// change; memory, unlike time, compares across runs).

namespace {

double elapsed_ms(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since)
      .count();
}

std::string lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

std::string trim(std::string_view text) {
  size_t begin = 0;
  size_t end = text.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(text[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(text[end - 1]))) --end;
  return std::string(text.substr(begin, end - begin));
}

// True when `inner` is `outer` or lies inside it ("blocks.0.mlp" in "blocks.0").
bool is_within(const std::string& inner, const std::string& outer) {
  if (outer.empty()) return true;
  return inner == outer ||
         (inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 &&
          inner[outer.size()] == '.');
}

std::string parent_of(const std::string& name) {
  const size_t dot = name.rfind('.');
  return dot == std::string::npos ? std::string() : name.substr(0, dot);
}

std::string shown(const std::string& name) { return name.empty() ? "<root>" : name; }

// What identifies the graph a call needs: the structure, tensor properties at
// bucket sizes and constants of its inputs, and its mode. Built on every call,
// so it is flat: codes for everything but constants, compared as vectors.
struct CallKey {
  std::vector<int64_t> codes;
  std::vector<c10::IValue> constants;

  bool operator==(const CallKey& other) const {
    if (codes != other.codes || constants.size() != other.constants.size()) {
      return false;
    }
    for (size_t i = 0; i < constants.size(); ++i) {
      if (!constants_equal(constants[i], other.constants[i])) return false;
    }
    return true;
  }
};

enum KeyCode : int64_t { kTensorCode = -1, kTupleCode = -2, kListCode = -3, kDictCode = -4,
                         kConstantCode = -5, kUndefinedCode = -6 };

void encode(const c10::IValue& value, const BucketPlan& plan, CallKey& key) {
  if (value.isTensor()) {
    const at::Tensor& tensor = value.toTensor();
    if (!tensor.defined()) {
      key.codes.push_back(kUndefinedCode);
      return;
    }
    key.codes.push_back(kTensorCode);
    key.codes.push_back(static_cast<int64_t>(tensor.scalar_type()));
    key.codes.push_back(static_cast<int64_t>(tensor.device().type()));
    key.codes.push_back(tensor.device().index());
    key.codes.push_back(tensor.requires_grad() ? 1 : 0);
    key.codes.push_back(tensor.dim());
    const c10::IntArrayRef sizes = tensor.sizes();
    const size_t first = key.codes.size();
    key.codes.insert(key.codes.end(), sizes.begin(), sizes.end());
    for (const BucketedDim& d : plan.dims()) {
      if (d.dim < tensor.dim()) {
        key.codes[first + d.dim] = d.padded;
      }
    }
  } else if (value.isTuple()) {
    const auto& elements = value.toTupleRef().elements();
    key.codes.push_back(kTupleCode);
    key.codes.push_back(static_cast<int64_t>(elements.size()));
    for (const c10::IValue& element : elements) encode(element, plan, key);
  } else if (value.isList()) {
    const auto list = value.toListRef();
    key.codes.push_back(kListCode);
    key.codes.push_back(static_cast<int64_t>(list.size()));
    for (const c10::IValue& element : list) encode(element, plan, key);
  } else if (value.isGenericDict()) {
    const auto dict = value.toGenericDict();
    key.codes.push_back(kDictCode);
    key.codes.push_back(static_cast<int64_t>(dict.size()));
    for (const auto& entry : dict) {
      key.constants.push_back(entry.key());
      encode(entry.value(), plan, key);
    }
  } else {
    key.codes.push_back(kConstantCode);
    key.constants.push_back(value);
  }
}

CallKey key_of(const std::vector<c10::IValue>& inputs, const BucketPlan& plan, CallMode mode) {
  CallKey key;
  key.codes.push_back(static_cast<int64_t>(mode));
  for (const c10::IValue& input : inputs) encode(input, plan, key);
  return key;
}

// The tensors of the inputs with their paths, for bucket planning.
void collect(const c10::IValue& value, const std::string& path, std::vector<at::Tensor>& tensors,
             std::vector<std::string>& paths) {
  if (value.isTensor()) {
    if (value.toTensor().defined()) {
      tensors.push_back(value.toTensor());
      paths.push_back(path);
    }
  } else if (value.isTuple()) {
    const auto& elements = value.toTupleRef().elements();
    for (size_t i = 0; i < elements.size(); ++i) {
      collect(elements[i], c10::str(path, "[", i, "]"), tensors, paths);
    }
  } else if (value.isList()) {
    const auto list = value.toListRef();
    for (size_t i = 0; i < list.size(); ++i) {
      collect(list[i], c10::str(path, "[", i, "]"), tensors, paths);
    }
  } else if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict()) {
      std::ostringstream key;
      if (entry.key().isString()) {
        key << "'" << entry.key().toStringRef() << "'";
      } else {
        key << entry.key();
      }
      collect(entry.value(), c10::str(path, "[", key.str(), "]"), tensors, paths);
    }
  }
}

int64_t tensor_bytes(const std::vector<at::Tensor>& tensors) {
  int64_t bytes = 0;
  for (const at::Tensor& tensor : tensors) {
    if (tensor.defined()) bytes += static_cast<int64_t>(tensor.nbytes());
  }
  return bytes;
}

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

// An entry captured with graphed::capture; see make_inference_entry.
class InferenceEntry final : public GraphEntry {
 public:
  InferenceEntry(CapturedFunction function, int64_t bytes, double capture_ms)
      : function_(std::move(function)), bytes_(bytes), capture_ms_(capture_ms) {}

  c10::IValue run(const std::vector<c10::IValue>& inputs, const BucketPlan& plan) override {
    if (!plan.pads()) {
      return function_(inputs);
    }
    // Write each short input into the front of its static buffer and pass the
    // buffer itself, so that the captured function copies nothing more.
    const std::vector<at::Tensor>& buffers = function_.static_inputs();
    std::vector<at::Tensor> originals;
    std::vector<c10::IValue> padded;
    padded.reserve(inputs.size());
    {
      c10::NoGradGuard no_grad;
      for (const c10::IValue& input : inputs) {
        padded.push_back(map_tensors(input, [&](const at::Tensor& tensor) {
          const at::Tensor& buffer = buffers.at(originals.size());
          originals.push_back(tensor);
          if (tensor.sizes().equals(buffer.sizes())) {
            return tensor;
          }
          front_of(buffer, tensor.sizes()).copy_(tensor, /*non_blocking=*/true);
          return buffer;
        }));
      }
    }
    c10::IValue outputs = function_(padded);
    if (!function_.mutated_inputs().empty()) {
      c10::NoGradGuard no_grad;
      for (size_t index : function_.mutated_inputs()) {
        const at::Tensor& original = originals[index];
        if (!original.sizes().equals(buffers[index].sizes())) {
          original.copy_(front_of(buffers[index], original.sizes()), /*non_blocking=*/true);
        }
      }
    }
    return slice_to_call(outputs, plan);
  }

  int64_t memory_bytes() const override { return bytes_; }
  const Signature& signature() const override { return function_.signature(); }
  int64_t pool_reserved_bytes() const override {
    return function_.graph().stats().pool_reserved_bytes;
  }
  double capture_ms() const override { return capture_ms_; }

 private:
  static at::Tensor front_of(const at::Tensor& buffer, c10::IntArrayRef sizes) {
    at::Tensor view = buffer;
    for (int64_t dim = 0; dim < view.dim(); ++dim) {
      if (view.size(dim) != sizes[dim]) view = view.narrow(dim, 0, sizes[dim]);
    }
    return view;
  }

  CapturedFunction function_;
  int64_t bytes_;
  double capture_ms_;
};

// A training entry: forward and backward graphs of one module for one
// signature, built by make_graphed_callables; see make_training_entry and
// make_training_group.
class TrainingEntry final : public GraphEntry {
 public:
  TrainingEntry(std::shared_ptr<GraphedCallable> callable, int64_t bytes, double capture_ms)
      : callable_(std::move(callable)), bytes_(bytes), capture_ms_(capture_ms) {}

  c10::IValue run(const std::vector<c10::IValue>& inputs, const BucketPlan& plan) override {
    GRAPHED_CHECK(!plan.pads(), "Expected a training call of ", callable_->description(),
                  " at the exact size of its graphs, but its inputs would be padded to a "
                  "bucket. Padding would change the loss (padded rows get gradients); train "
                  "at bucket sizes, or leave buckets for inference.");
    return callable_->call(inputs, std::nullopt);
  }

  int64_t memory_bytes() const override { return bytes_; }
  const Signature& signature() const override { return callable_->signature(); }
  int64_t pool_reserved_bytes() const override { return pool_bytes(*callable_); }
  double capture_ms() const override { return capture_ms_; }

  // Bytes the callable's pool holds now.
  static int64_t pool_bytes(const GraphedCallable& callable) {
    int64_t bytes = 0;
    for (const GraphedPassInfo& info : callable.graphs()) {
      bytes = std::max(bytes, info.graph.pool_reserved_bytes);
    }
    return bytes;
  }

 private:
  std::shared_ptr<GraphedCallable> callable_;
  int64_t bytes_;
  double capture_ms_;
};

// The module of a training request as make_graphed_callables takes it.
GraphableCallable graphable_request(const GraphEntryRequest& request) {
  GRAPHED_CHECK(request.module != nullptr, "A training entry needs its module.");
  for (const c10::IValue& input : request.sample) {
    for_each_tensor(input, [&](const at::Tensor& tensor) {
      GRAPHED_CHECK_AS(CaptureError, tensor.is_cuda(), "Cannot graph ",
                       request.description, " for training: an input is ",
                       describe_tensor(tensor), ", and graphs replay GPU work only. Move the "
                       "model and its inputs to the GPU.");
    });
  }
  GraphableCallable callable;
  callable.function = request.module->forward;
  callable.parameters = request.module->parameters;
  callable.state = request.module->state;
  callable.description = request.description;
  return callable;
}

// Bytes of the static input buffers of a callable (outside the pool).
int64_t static_input_bytes(const GraphedCallable& callable) {
  int64_t bytes = 0;
  for (const TensorSpec& spec : callable.signature().tensor_specs()) {
    int64_t elements = 1;
    for (int64_t size : spec.sizes) elements *= size;
    bytes += elements * static_cast<int64_t>(c10::elementSize(spec.dtype));
  }
  return bytes;
}

GraphedCallablesOptions training_options(const GraphEntryRequest& request) {
  GraphedCallablesOptions options;
  options.warmup_iters = request.warmup_iters;
  options.error_mode = request.error_mode;
  options.input_names = request.input_names;
  if (options.input_names.size() != request.sample.size()) {
    options.input_names.clear();
  }
  return options;
}

}  // namespace

std::unique_ptr<GraphEntry> make_training_entry(const GraphEntryRequest& request) {
  const auto started = std::chrono::steady_clock::now();
  GraphableCallable callable = graphable_request(request);
  // A private pool: see Note [Training entries].
  auto graphed = make_graphed_callables({std::move(callable)}, {request.sample},
                                        training_options(request));
  const GraphedCallable& only = *graphed.front();
  const int64_t bytes = static_input_bytes(only) + TrainingEntry::pool_bytes(only);
  return std::make_unique<TrainingEntry>(std::move(graphed.front()), bytes, elapsed_ms(started));
}

std::vector<std::unique_ptr<GraphEntry>> make_training_group(
    const std::vector<GraphEntryRequest>& requests, const std::vector<int64_t>& order) {
  GRAPHED_CHECK(!requests.empty(), "A training group needs at least one module.");
  const auto started = std::chrono::steady_clock::now();
  std::vector<GraphableCallable> callables;
  std::vector<std::vector<c10::IValue>> samples;
  for (const GraphEntryRequest& request : requests) {
    callables.push_back(graphable_request(request));
    samples.push_back(request.sample);
  }
  // One pool, captured in the recorded order: Note [Training graphs captured together].
  GraphedCallablesOptions options = training_options(requests.front());
  options.order = order;
  auto graphed = make_graphed_callables(std::move(callables), std::move(samples), options);
  const double ms = elapsed_ms(started);
  const auto count = static_cast<int64_t>(graphed.size());
  const int64_t pool = TrainingEntry::pool_bytes(*graphed.front());
  std::vector<std::unique_ptr<GraphEntry>> entries;
  for (int64_t i = 0; i < count; ++i) {
    // Shares of the pool that sum to it: the first entry takes the remainder.
    const int64_t share = pool / count + (i == 0 ? pool % count : 0);
    const int64_t bytes = static_input_bytes(*graphed[i]) + share;
    entries.push_back(std::make_unique<TrainingEntry>(std::move(graphed[i]), bytes,
                                                      ms / static_cast<double>(count)));
  }
  return entries;
}

TrainingGroupPlan plan_training_group(const std::vector<TrainingEvent>& events) {
  // Per module, in order of first forward: forwards, backwards, and whether a
  // backward came before any forward.
  struct Seen {
    size_t module;
    int forwards = 0;
    int backwards = 0;
    bool backward_first = false;
  };
  std::vector<Seen> seen;
  const auto find = [&](size_t module) -> Seen& {
    for (Seen& s : seen) {
      if (s.module == module) return s;
    }
    seen.push_back(Seen{module});
    return seen.back();
  };
  for (const TrainingEvent& event : events) {
    Seen& s = find(event.module);
    if (event.forward) {
      ++s.forwards;
    } else {
      if (s.forwards == 0) s.backward_first = true;
      ++s.backwards;
    }
  }
  TrainingGroupPlan plan;
  std::unordered_map<size_t, int64_t> position;  // module -> 1-based id in the order
  for (const Seen& s : seen) {
    if (s.backward_first || s.forwards == 0) {
      plan.left_out.emplace_back(s.module, "its backward was recorded without its forward");
    } else if (s.forwards > 1) {
      plan.left_out.emplace_back(
          s.module, c10::str("it ran ", s.forwards, " times in the recorded step (a module "
                             "called several times per step); one graph pair serves one call "
                             "at a time"));
    } else if (s.backwards == 0) {
      plan.left_out.emplace_back(s.module, "no gradient reached its outputs after its last "
                                           "warm-up call (no backward ran before the next "
                                           "call)");
    } else if (s.backwards > 1) {
      plan.left_out.emplace_back(s.module, c10::str("its backward was recorded ", s.backwards,
                                                    " times after one forward"));
    } else {
      plan.modules.push_back(s.module);
      position[s.module] = static_cast<int64_t>(plan.modules.size());
    }
  }
  for (const TrainingEvent& event : events) {
    const auto found = position.find(event.module);
    if (found != position.end()) {
      plan.order.push_back(event.forward ? found->second : -found->second);
    }
  }
  return plan;
}

int64_t parse_memory_size(std::string_view text) {
  const std::string cleaned = trim(text);
  size_t split = 0;
  while (split < cleaned.size() &&
         (std::isdigit(static_cast<unsigned char>(cleaned[split])) || cleaned[split] == '.')) {
    ++split;
  }
  const std::string number = cleaned.substr(0, split);
  const std::string unit = lower(trim(cleaned.substr(split)));
  static const std::vector<std::pair<std::string, double>> kUnits = {
      {"", 1.0},      {"b", 1.0},       {"kb", 1e3},          {"mb", 1e6},
      {"gb", 1e9},    {"tb", 1e12},     {"kib", 1024.0},      {"mib", 1048576.0},
      {"gib", 1073741824.0},            {"tib", 1099511627776.0}};
  double scale = -1.0;
  for (const auto& [name, factor] : kUnits) {
    if (unit == name) scale = factor;
  }
  bool valid_number = !number.empty() && std::count(number.begin(), number.end(), '.') <= 1 &&
                      number != ".";
  GRAPHED_CHECK(valid_number && scale > 0, "Expected a memory size such as \"512MB\", \"2GiB\" "
                "or a number of bytes, got \"", text, "\". Units: B, KB, MB, GB, TB (powers of "
                "1000) and KiB, MiB, GiB, TiB (powers of 1024).");
  const double bytes = std::stod(number) * scale;
  GRAPHED_CHECK(bytes >= 1.0 && bytes < 9.2e18, "Expected a memory size of at least one byte, "
                "got \"", text, "\". Pass a positive size such as \"2GiB\", or None for no budget.");
  return static_cast<int64_t>(std::llround(bytes));
}

std::string format_bytes(int64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  while (std::abs(value) >= 1024.0 && unit + 1 < sizeof(kUnits) / sizeof(kUnits[0])) {
    value /= 1024.0;
    ++unit;
  }
  std::ostringstream out;
  if (unit == 0) {
    out << bytes << " B";
  } else {
    out << std::fixed << std::setprecision(1) << value << " " << kUnits[unit];
  }
  return out.str();
}

LruBudget::LruBudget(std::optional<int64_t> budget_bytes) : budget_(budget_bytes) {
  GRAPHED_CHECK(!budget_ || *budget_ >= 1, "Expected a memory budget of at least one byte, got ",
                budget_ ? *budget_ : 0, ". Pass a positive size such as \"2GiB\", or None for "
                "no budget.");
}

void LruBudget::add(uint64_t id, int64_t bytes) {
  GRAPHED_INTERNAL_ASSERT(items_.count(id) == 0, "item ", id, " added twice");
  lru_.emplace_back(id, bytes);
  items_[id] = std::prev(lru_.end());
  total_ += bytes;
}

void LruBudget::touch(uint64_t id) {
  const auto found = items_.find(id);
  GRAPHED_INTERNAL_ASSERT(found != items_.end(), "touch of unknown item ", id);
  lru_.splice(lru_.end(), lru_, found->second);
}

void LruBudget::remove(uint64_t id) {
  const auto found = items_.find(id);
  if (found == items_.end()) return;
  total_ -= found->second->second;
  lru_.erase(found->second);
  items_.erase(found);
}

std::vector<uint64_t> LruBudget::over_budget(std::optional<uint64_t> keep) const {
  std::vector<uint64_t> evict;
  if (!budget_) return evict;
  int64_t total = total_;
  for (const auto& [id, bytes] : lru_) {
    if (total <= *budget_) break;
    if (keep && id == *keep) continue;
    evict.push_back(id);
    total -= bytes;
  }
  return evict;
}

std::vector<uint64_t> LruBudget::order() const {
  std::vector<uint64_t> ids;
  for (const auto& item : lru_) ids.push_back(item.first);
  return ids;
}

std::vector<std::string> select_repeated_blocks(const std::vector<ModuleInfo>& modules) {
  struct Group {
    std::vector<std::string> names;
    int64_t parameters = 0;
    size_t first_index = 0;
  };
  std::unordered_map<std::string, size_t> index_of;
  for (size_t i = 0; i < modules.size(); ++i) index_of[modules[i].name] = i;

  const auto in_container = [&](const ModuleInfo& module) {
    if (module.name.empty()) return false;
    const auto parent = index_of.find(parent_of(module.name));
    return parent != index_of.end() && modules[parent->second].is_container;
  };
  // How many children of each container have each class, as their own class
  // or as a base.
  std::unordered_map<std::string, int64_t> children_with;  // "container\0class" -> count
  for (const ModuleInfo& module : modules) {
    if (!in_container(module)) continue;
    const std::string container = parent_of(module.name) + '\0';
    ++children_with[container + module.type];
    for (const std::string& base : module.bases) ++children_with[container + base];
  }

  // Children of each container, grouped by their own class if a sibling
  // shares it, else by their nearest base a sibling shares.
  std::vector<Group> groups;
  std::unordered_map<std::string, size_t> group_of;  // "container\0class" -> group
  for (size_t i = 0; i < modules.size(); ++i) {
    const ModuleInfo& module = modules[i];
    if (!in_container(module)) continue;
    const std::string container = parent_of(module.name) + '\0';
    std::string group_key = container + module.type;
    if (children_with[group_key] < 2) {
      for (const std::string& base : module.bases) {
        if (children_with[container + base] >= 2) {
          group_key = container + base;
          break;
        }
      }
    }
    auto [found, inserted] = group_of.emplace(group_key, groups.size());
    if (inserted) {
      groups.push_back(Group{{}, 0, i});
    }
    Group& group = groups[found->second];
    group.names.push_back(module.name);
    group.parameters += module.parameters;
  }
  groups.erase(std::remove_if(groups.begin(), groups.end(),
                              [](const Group& g) { return g.names.size() < 2; }),
               groups.end());
  std::stable_sort(groups.begin(), groups.end(), [](const Group& a, const Group& b) {
    return a.parameters > b.parameters;
  });
  std::vector<std::string> chosen;
  std::vector<size_t> chosen_groups;
  for (size_t g = 0; g < groups.size(); ++g) {
    bool overlaps = false;
    for (const std::string& name : groups[g].names) {
      for (const std::string& taken : chosen) {
        overlaps = overlaps || is_within(name, taken) || is_within(taken, name);
      }
    }
    if (overlaps) continue;
    chosen.insert(chosen.end(), groups[g].names.begin(), groups[g].names.end());
    chosen_groups.push_back(g);
  }
  if (chosen.empty()) {
    return {std::string()};
  }
  // Back to the model's order, so that stats list modules as the model does.
  std::sort(chosen.begin(), chosen.end(), [&](const std::string& a, const std::string& b) {
    return index_of[a] < index_of[b];
  });
  return chosen;
}

void validate_module_selection(const std::vector<std::string>& chosen,
                               const std::vector<ModuleInfo>& modules) {
  GRAPHED_CHECK(!chosen.empty(), "Expected at least one module to capture, got none. Pass "
                "modules=None to capture the largest repeated blocks, or name the modules "
                "(e.g. modules=[\"blocks.0\"] or modules=[MyBlock]).");
  std::unordered_map<std::string, bool> known;
  for (const ModuleInfo& module : modules) known[module.name] = true;
  for (size_t i = 0; i < chosen.size(); ++i) {
    if (known.count(chosen[i]) == 0) {
      std::ostringstream names;
      size_t listed = 0;
      for (const ModuleInfo& module : modules) {
        if (listed == 12) {
          names << ", ...";
          break;
        }
        names << (listed == 0 ? "" : ", ") << "'" << module.name << "'";
        ++listed;
      }
      GRAPHED_THROW(Error, "Expected the name of a submodule of the model, got '", chosen[i],
                    "'. Names are those of model.named_modules(): ", names.str(), ".");
    }
    for (size_t j = 0; j < chosen.size(); ++j) {
      if (i == j) continue;
      GRAPHED_CHECK(chosen[i] != chosen[j], "Module '", shown(chosen[i]),
                    "' is chosen twice; list each module once.");
      GRAPHED_CHECK(!is_within(chosen[j], chosen[i]), "Module '", shown(chosen[i]),
                    "' contains module '", shown(chosen[j]), "', and both are chosen. A graph "
                    "of the outer module already records the inner one; choose one of them.");
    }
  }
}

std::string_view call_mode_name(CallMode mode) {
  return mode == CallMode::kTraining ? "training" : "inference";
}

FallbackPolicy parse_fallback_policy(std::string_view name) {
  if (name == "eager") return FallbackPolicy::kEager;
  if (name == "raise") return FallbackPolicy::kRaise;
  GRAPHED_THROW(Error, "Expected fallback to be \"eager\" (run what cannot be graphed eagerly "
                "and count it in stats()) or \"raise\", got \"", name, "\".");
}

std::unique_ptr<GraphEntry> make_inference_entry(const GraphEntryRequest& request) {
  GRAPHED_INTERNAL_ASSERT(request.module != nullptr, "request without a module");
  CaptureOptions options;
  options.warmup_iters = request.warmup_iters;
  options.pool = request.pool();
  options.error_mode = request.error_mode;
  options.input_names = request.input_names;
  options.state = request.module->state;
  options.description = request.description;
  options.input_update = request.input_update;
  std::optional<c10::Device> device;
  for (const c10::IValue& input : request.sample) {
    for_each_tensor(input, [&](const at::Tensor& tensor) {
      if (!device && tensor.defined() && tensor.is_cuda()) device = tensor.device();
    });
  }
  const c10::DeviceIndex index = device ? device->index() : c10::cuda::current_device();
  const PoolMemory before = pool_memory(*options.pool, index);
  const auto started = std::chrono::steady_clock::now();
  CapturedFunction function = capture(request.module->forward, request.sample, options);
  const double ms = elapsed_ms(started);
  const PoolMemory after = pool_memory(*options.pool, index);
  const int64_t outputs = tensor_bytes(flatten_tensors(function.static_outputs()));
  const int64_t bytes = tensor_bytes(function.static_inputs()) +
                        std::max(outputs, after.reserved_bytes - before.reserved_bytes);
  return std::make_unique<InferenceEntry>(std::move(function), bytes, ms);
}

struct GraphManager::Slot {
  uint64_t id = 0;
  CallKey key;
  BucketPlan plan;  // at bucket sizes
  std::unique_ptr<GraphEntry> entry;
  // Set instead of `entry` when these inputs cannot be captured (not the
  // module: e.g. CPU tensors); calls with this key fall back at once.
  std::string failure;
  int64_t replays = 0;
};

// Note [Training graphs captured together]: forward events come from calls
// (under the manager's lock), backward events from hooks on autograd's threads.
struct GraphManager::TrainingRecorder {
  std::mutex mutex;
  std::vector<TrainingEvent> events;

  void record(size_t module, bool forward) {
    std::lock_guard<std::mutex> lock(mutex);
    events.push_back(TrainingEvent{module, forward});
  }
};

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

struct GraphManager::Module {
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
  // The inputs of its last warm-up call in training mode, until a training
  // group is planned (Note [Training graphs captured together]).
  std::optional<std::vector<c10::IValue>> training_sample;
  // Findings of the warm-up check that a capture decides (CaptureVerdict::
  // kTryCapture): false findings once a graph of the module replays.
  std::vector<std::string> unconfirmed_findings;
  // Its parameters and buffers at the end of warm-up, which its graphs read
  // (Note [Modules whose tensors moved]).
  TensorIdentities tensors;
};

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
  auto module = std::make_unique<Module>();
  module->index = modules_.size();
  module->description = c10::str("module `", shown(spec.name), "` (", spec.type, ")");
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

c10::IValue GraphManager::fall_back(Module& module, const std::string& reason,
                                    const std::vector<c10::IValue>& inputs) {
  if (options_.fallback == FallbackPolicy::kRaise) {
    GRAPHED_THROW(Error, module.description, " cannot run as a graph: ", reason,
                  "\n(fallback=\"raise\"; pass fallback=\"eager\" to run it eagerly and count "
                  "the fallback in stats() instead.)");
  }
  const std::string key = module.spec.name + '\0' + reason;
  auto [found, inserted] = fallback_index_.emplace(key, counters_.fallbacks.size());
  if (inserted) {
    counters_.fallbacks.push_back(FallbackStats{module.spec.name, reason, 0});
  }
  ++counters_.fallbacks[found->second].count;
  ++counters_.fallback_calls;
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
}

void GraphManager::enforce_budget(const Slot& keep) {
  for (uint64_t id : lru_.over_budget(keep.id)) {
    evict(id);
    ++counters_.evictions;
  }
}

GraphManager::Slot& GraphManager::capture_slot(Module& module, CallMode mode,
                                               const BucketPlan& plan,
                                               const std::vector<c10::IValue>& inputs) {
  const GraphEntryFactory& factory =
      mode == CallMode::kTraining ? factories_.training : factories_.inference;
  GRAPHED_INTERNAL_ASSERT(static_cast<bool>(factory), "no factory for ", call_mode_name(mode));

  // Which bucket combinations to capture now: the call's, or on a module's
  // first capture every combination, largest first, so that the smaller
  // graphs reuse the pool memory of the largest (Note [Bucket padding]).
  std::vector<BucketPlan> targets;
  const bool first_capture = module.slots.empty();
  if (first_capture && !plan.dims().empty() && options_.max_capture_ahead > 0) {
    targets = options_.buckets.combinations_largest_first(plan);
    if (targets.size() > static_cast<size_t>(options_.max_capture_ahead)) targets.clear();
  }
  const BucketPlan wanted = plan.at_buckets();
  if (targets.empty()) targets.push_back(wanted);

  Slot* result = nullptr;
  for (const BucketPlan& target : targets) {
    // `key_plan` keys the call's inputs as if they came at `target`'s sizes.
    std::vector<BucketedDim> key_dims = plan.dims();
    for (size_t i = 0; i < key_dims.size(); ++i) key_dims[i].padded = target.dims()[i].padded;
    const BucketPlan key_plan(std::move(key_dims));
    const bool is_wanted = target.dims() == wanted.dims();

    auto slot = std::make_unique<Slot>();
    slot->id = next_slot_id_++;
    slot->key = key_of(inputs, key_plan, mode);
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
    request.description = target.dims().empty()
                              ? module.description
                              : c10::str(module.description, " at ", target.describe());
    try {
      ++depth_;
      slot->entry = factory(request);
      --depth_;
    } catch (const CaptureError&) {
      --depth_;
      throw;  // The module cannot be captured: call_locked blocks it.
    } catch (const Error& error) {
      --depth_;
      if (!is_wanted) continue;  // Capture-ahead is best effort.
      slot->failure = first_line(error.what_without_backtrace());
    } catch (...) {
      --depth_;
      throw;
    }
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
    if (is_wanted) {
      module.slots.insert(module.slots.begin(), std::move(slot));
      result = raw;
    } else {
      module.slots.push_back(std::move(slot));
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
  return call_locked(module, inputs);
}

std::optional<BucketPlan> GraphManager::plan_buckets(const std::vector<c10::IValue>& inputs,
                                                     std::vector<at::Tensor>& tensors,
                                                     std::string* why) const {
  if (options_.buckets.empty()) {
    // The replay path: no input paths to build, they only name uncovered sizes.
    for (const c10::IValue& input : inputs) {
      for_each_tensor(input, [&](const at::Tensor& tensor) { tensors.push_back(tensor); });
    }
    return BucketPlan();
  }
  std::vector<std::string> paths;
  for (size_t i = 0; i < inputs.size(); ++i) {
    collect(inputs[i], i < 2 ? (i == 0 ? "args" : "kwargs") : c10::str("inputs[", i, "]"),
            tensors, paths);
  }
  std::vector<c10::IntArrayRef> sizes;
  sizes.reserve(tensors.size());
  for (const at::Tensor& tensor : tensors) sizes.push_back(tensor.sizes());
  return options_.buckets.plan(sizes, paths, why);
}

void GraphManager::record_training_call(Module& module, const std::vector<c10::IValue>& inputs,
                                        const c10::IValue& output) {
  // See Note [Training graphs captured together].
  std::vector<c10::IValue> sample;
  {
    c10::NoGradGuard no_grad;
    for (const c10::IValue& input : inputs) {
      sample.push_back(map_tensors(input, [](const at::Tensor& tensor) {
        at::Tensor copy = tensor.detach().clone(at::MemoryFormat::Preserve);
        if (tensor.requires_grad()) copy.requires_grad_(true);
        return copy;
      }));
    }
  }
  recorder_->record(module.index, /*forward=*/true);
  const auto fired = std::make_shared<std::atomic<bool>>(false);
  const std::weak_ptr<TrainingRecorder> recorder = recorder_;
  const size_t index = module.index;
  for_each_tensor(output, [&](const at::Tensor& tensor) {
    if (!tensor.defined() || !tensor.requires_grad()) return;
    tensor.register_hook([recorder, fired, index](const at::Tensor&) {
      if (fired->exchange(true)) return;  // the first gradient starts the backward
      if (const auto alive = recorder.lock()) alive->record(index, /*forward=*/false);
    });
  });
  module.training_sample = std::move(sample);
}

void GraphManager::capture_training_group(Module& trigger) {
  // Every module with a recorded sample is planned now, once: those that do
  // not join are captured on their own later.
  // Events of modules planned before (a late gradient) are dropped.
  std::vector<TrainingEvent> events;
  {
    std::lock_guard<std::mutex> lock(recorder_->mutex);
    for (const TrainingEvent& event : recorder_->events) {
      if (modules_.at(event.module)->training_sample) events.push_back(event);
    }
    recorder_->events.clear();
  }
  std::vector<std::vector<c10::IValue>> samples(modules_.size());
  for (auto& module : modules_) {
    if (module->training_sample) {
      samples[module->index] = std::move(*module->training_sample);
      module->training_sample.reset();
    }
  }
  TrainingGroupPlan plan = plan_training_group(events);
  TrainingGroupStats group;
  for (const auto& [index, why] : plan.left_out) {
    group.left_out.push_back(c10::str(shown(modules_[index]->spec.name), ": ", why));
  }

  // Members must be graphable now and take their samples unpadded.
  std::vector<size_t> members;
  std::vector<BucketPlan> plans;
  std::vector<int64_t> renumbered(plan.modules.size() + 1, 0);
  for (size_t i = 0; i < plan.modules.size(); ++i) {
    Module& module = *modules_[plan.modules[i]];
    if (module.blocked || !module.slots.empty()) {
      continue;  // fell back or captured since its warm-up
    }
    std::vector<at::Tensor> tensors;
    std::string why;
    const std::optional<BucketPlan> buckets =
        plan_buckets(samples[module.index], tensors, &why);
    if (!buckets || buckets->pads()) {
      group.left_out.push_back(c10::str(shown(module.spec.name), ": ",
                                        buckets ? "its inputs would be padded to a bucket, "
                                                  "which training graphs refuse"
                                                : why));
      continue;
    }
    members.push_back(module.index);
    plans.push_back(*buckets);
    renumbered[i + 1] = static_cast<int64_t>(members.size());
  }
  if (members.empty()) {
    if (!group.left_out.empty()) counters_.training_groups.push_back(std::move(group));
    return;
  }
  for (int64_t step : plan.order) {
    const int64_t id = renumbered[static_cast<size_t>(std::abs(step))];
    if (id != 0) group.order.push_back(step > 0 ? id : -id);
  }

  std::vector<GraphEntryRequest> requests;
  for (size_t i = 0; i < members.size(); ++i) {
    Module& module = *modules_[members[i]];
    group.modules.push_back(shown(module.spec.name));
    GraphEntryRequest request;
    request.module = &module.spec;
    request.sample = samples[module.index];
    request.plan = plans[i];
    request.input_names = input_names(request.sample.size());
    request.warmup_iters = options_.capture_warmup_iters;
    request.error_mode = options_.error_mode;
    request.input_update = options_.input_update;
    request.description = module.description;
    requests.push_back(std::move(request));
  }
  std::vector<std::unique_ptr<GraphEntry>> entries;
  const auto started = std::chrono::steady_clock::now();
  ++depth_;
  try {
    entries = factories_.training_group(requests, group.order);
    --depth_;
  } catch (const Error& error) {
    --depth_;
    group.failure = first_line(error.what_without_backtrace());
    group.capture_ms = elapsed_ms(started);
    counters_.training_groups.push_back(std::move(group));
    return;  // each member is captured on its own when next called
  } catch (...) {
    --depth_;
    throw;
  }
  GRAPHED_INTERNAL_ASSERT(entries.size() == members.size(), "one entry per group member");
  Slot* kept = nullptr;
  for (size_t i = 0; i < members.size(); ++i) {
    Module& module = *modules_[members[i]];
    auto slot = std::make_unique<Slot>();
    slot->id = next_slot_id_++;
    slot->key = key_of(requests[i].sample, plans[i], CallMode::kTraining);
    slot->plan = plans[i];
    slot->entry = std::move(entries[i]);
    ++counters_.captures;
    counters_.capture_ms += slot->entry->capture_ms();
    group.pool_reserved_bytes = std::max(group.pool_reserved_bytes,
                                         slot->entry->pool_reserved_bytes());
    const int64_t bytes = slot->entry->memory_bytes();
    if (lru_.budget() && bytes > *lru_.budget()) {
      GRAPHED_THROW(Error, "memory_budget=", format_bytes(*lru_.budget()), " is smaller than "
                    "one graph: the training graphs of ", module.description, " hold ",
                    format_bytes(bytes), ". Raise memory_budget to at least ",
                    format_bytes(bytes), " (a few graphs' worth), or pass memory_budget=None "
                    "for no limit.");
    }
    lru_.add(slot->id, bytes);
    slots_by_id_[slot->id] = slot.get();
    if (&module == &trigger) kept = slot.get();
    module.slots.insert(module.slots.begin(), std::move(slot));
  }
  group.capture_ms = elapsed_ms(started);
  counters_.training_groups.push_back(std::move(group));
  if (kept != nullptr) enforce_budget(*kept);
}

c10::IValue GraphManager::call_locked(Module& module, const std::vector<c10::IValue>& inputs) {
  ++counters_.calls;
  ++module.calls;
  if (!module.seen) {
    module.seen = true;
    counters_.order.push_back(module.spec.name);
  }
  if (module.blocked) {
    return fall_back(module, *module.blocked, inputs);
  }

  std::vector<at::Tensor> tensors;
  std::string why;
  const std::optional<BucketPlan> planned = plan_buckets(inputs, tensors, &why);
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
    ++module.warmup_calls;
    const bool last = module.warmup_calls == options_.warmup;
    if (last && follows_tensors) {
      module.tensors = TensorIdentities(read_module_tensors(module.spec));
    }
    c10::IValue output = run_warmup(module, inputs, last);
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
                     inputs);
  }
  if (mode == CallMode::kTraining && !factories_.training) {
    // INTEGRATION POINT, see Note [Training entries]: until the training
    // factory (forward and backward graphs) is plugged in, training calls run
    // eagerly and are counted, so stats() shows that nothing is graphed.
    return fall_back(module, std::string(kTrainingGraphsUnavailable), inputs);
  }
  if (!planned) {
    return fall_back(module, why, inputs);
  }
  const BucketPlan& plan = *planned;

  Slot* slot = find_slot(module, mode, plan, inputs);
  if (slot == nullptr && mode == CallMode::kTraining && module.training_sample) {
    capture_training_group(module);
    slot = find_slot(module, mode, plan, inputs);
  }
  if (slot == nullptr) {
    try {
      slot = &capture_slot(module, mode, plan, inputs);
    } catch (const CaptureError& error) {
      const std::string reason =
          c10::str("capture failed: ", error.what_without_backtrace());
      module.blocked = reason;
      // Graphs of other signatures of this module were captured fine but
      // would replay next to eager calls of the same module; drop them so the
      // module behaves one way.
      while (!module.slots.empty()) evict(module.slots.front()->id);
      if (options_.fallback == FallbackPolicy::kRaise) throw;
      return fall_back(module, reason, inputs);
    }
  } else if (slot->entry) {
    lru_.touch(slot->id);
  }
  if (!slot->entry) {
    return fall_back(module, slot->failure, inputs);
  }
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
                     inputs);
  } catch (...) {
    --depth_;
    throw;
  }
  ++counters_.replays;
  ++module.replays;
  ++slot->replays;
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
  }
}

}  // namespace graphed
