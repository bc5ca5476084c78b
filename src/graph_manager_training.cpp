// GraphManager's training graphs captured together: the last warm-up step
// records the order of the modules' forwards and backwards, and the first
// training call after it captures every recorded module in that order into
// one pool (Note [Training graphs captured together] in training_group.cpp).

#include "graph_manager_internal.h"

#include "graphed/check.h"
#include "graphed/static_io.h"
#include "graphed/training_group.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>

namespace graphed {
namespace {

double elapsed_ms(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since)
      .count();
}

std::string shown(const std::string& name) { return name.empty() ? "<root>" : name; }

std::string first_line(const std::string& text) {
  const size_t end = text.find('\n');
  return end == std::string::npos ? text : text.substr(0, end);
}

}  // namespace

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
        plan_call_buckets(options_.buckets, samples[module.index], tensors, &why);
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
    const AutocastCacheOff cache_off;  // Note [Autocast's cache while graphed.auto captures]
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
    slot->mode = CallMode::kTraining;
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

}  // namespace graphed
