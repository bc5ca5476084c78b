#include "graphed/training_group.h"

#include <c10/util/StringUtil.h>

#include <unordered_map>

namespace graphed {

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

void TrainingRecorder::record(size_t module, bool forward) {
  std::lock_guard<std::mutex> lock(mutex);
  events.push_back(TrainingEvent{module, forward});
}

}  // namespace graphed
