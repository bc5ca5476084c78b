#pragma once

/// \file training_group.h
/// Which modules graphed.auto captures together for training, and in what
/// order: plan_training_group turns the forwards and backwards recorded during
/// warm-up into one group captured into one pool (Note [Training graphs
/// captured together] in training_group.cpp). Pure host logic.

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace graphed {

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
/// training_group.cpp. A module joins when its forward ran once and its
/// backward once after it; the order keeps the recorded sequence.
TrainingGroupPlan plan_training_group(const std::vector<TrainingEvent>& events);

/// The events of a training step as they run (Note [Training graphs captured
/// together] in training_group.cpp): forward events come from calls (under
/// the manager's lock), backward events from hooks on autograd's threads.
struct TrainingRecorder {
  /// Guards `events`.
  std::mutex mutex;
  /// In the order they were recorded.
  std::vector<TrainingEvent> events;

  /// Appends an event under the lock.
  void record(size_t module, bool forward);
};

}  // namespace graphed
