#include "graphed/graph_schedule.h"

#include "graphed/check.h"

#include <algorithm>
#include <deque>
#include <sstream>

namespace graphed {
namespace {

std::string format_order(const std::vector<int64_t>& order) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < order.size(); ++i) {
    out << (i ? ", " : "") << order[i];
  }
  out << "]";
  return out.str();
}

}  // namespace

GraphSchedule GraphSchedule::plan(size_t num_callables, size_t num_samples,
                                  const std::vector<int64_t>& order) {
  GRAPHED_CHECK(num_callables > 0, "Expected at least one callable to graph, got none.");
  GraphSchedule schedule;
  if (order.empty()) {
    GRAPHED_CHECK(num_samples == num_callables, "Expected one sample input per callable, got ",
                  num_samples, " samples for ", num_callables,
                  " callables. Pass sample_args as a tuple with one entry (a tuple of arguments) "
                  "per callable.");
    schedule.num_chunks_ = 1;
    schedule.num_microbatches_ = 1;
    schedule.layers_per_chunk_ = num_callables;
    for (size_t i = 0; i < num_callables; ++i) {
      schedule.passes_.push_back({true, i});
    }
    for (size_t i = num_callables; i-- > 0;) {
      schedule.passes_.push_back({false, i});
    }
  } else {
    int64_t max_chunk = 0;
    for (int64_t entry : order) {
      GRAPHED_CHECK(entry != 0, "Expected order entries to be chunk ids, +c for a forward and -c "
                    "for a backward with c >= 1, but ", format_order(order),
                    " contains 0. Chunk ids are 1-based.");
      max_chunk = std::max(max_chunk, entry < 0 ? -entry : entry);
    }
    const auto chunks = static_cast<size_t>(max_chunk);
    GRAPHED_CHECK(order.size() % (2 * chunks) == 0, "Expected the order to hold every chunk's "
                  "forward and backward once per microbatch (a length divisible by 2 x ", chunks,
                  " chunks), but ", format_order(order), " has ", order.size(), " entries.");
    const size_t microbatches = order.size() / (2 * chunks);
    std::vector<size_t> forwards(chunks, 0);
    std::vector<size_t> backwards(chunks, 0);
    for (int64_t entry : order) {
      const size_t chunk = static_cast<size_t>(entry < 0 ? -entry : entry) - 1;
      if (entry > 0) {
        ++forwards[chunk];
      } else {
        ++backwards[chunk];
        GRAPHED_CHECK(backwards[chunk] <= forwards[chunk], "Expected every backward of a chunk "
                      "to follow its forward, but in ", format_order(order), " backward number ",
                      backwards[chunk], " of chunk ", chunk + 1, " comes before forward number ",
                      backwards[chunk], ". Reorder the schedule.");
      }
    }
    for (size_t chunk = 0; chunk < chunks; ++chunk) {
      GRAPHED_CHECK(forwards[chunk] == microbatches && backwards[chunk] == microbatches,
                    "Expected each of the ", chunks, " chunks to appear ", microbatches,
                    " times as +c and as -c in ", format_order(order), ", but chunk ", chunk + 1,
                    " has ", forwards[chunk], " forwards and ", backwards[chunk], " backwards.");
    }
    GRAPHED_CHECK(num_callables % chunks == 0, "Expected the ", num_callables,
                  " callables to split evenly into the order's ", chunks,
                  " chunks (layers of chunk 1 first, then chunk 2, ...). Pass a multiple of ",
                  chunks, " callables.");
    schedule.num_chunks_ = chunks;
    schedule.num_microbatches_ = microbatches;
    schedule.layers_per_chunk_ = num_callables / chunks;
    GRAPHED_CHECK(num_samples == schedule.num_pairs(), "Expected ", schedule.num_pairs(),
                  " sample inputs with this order (", num_callables, " callables x ",
                  microbatches, " microbatches), got ", num_samples,
                  ". Lay samples out chunk by chunk, then microbatch, then layer within the chunk.");
    std::fill(forwards.begin(), forwards.end(), 0);
    std::fill(backwards.begin(), backwards.end(), 0);
    const size_t layers = schedule.layers_per_chunk_;
    for (int64_t entry : order) {
      const size_t chunk = static_cast<size_t>(entry < 0 ? -entry : entry) - 1;
      if (entry > 0) {
        const size_t microbatch = forwards[chunk]++;
        for (size_t layer = 0; layer < layers; ++layer) {
          schedule.passes_.push_back(
              {true, schedule.pair_index(chunk * layers + layer, microbatch)});
        }
      } else {
        const size_t microbatch = backwards[chunk]++;
        for (size_t layer = layers; layer-- > 0;) {
          schedule.passes_.push_back(
              {false, schedule.pair_index(chunk * layers + layer, microbatch)});
        }
      }
    }
  }
  schedule.forward_position_.assign(schedule.num_pairs(), 0);
  schedule.backward_position_.assign(schedule.num_pairs(), 0);
  for (size_t position = 0; position < schedule.passes_.size(); ++position) {
    const GraphPass& pass = schedule.passes_[position];
    (pass.forward ? schedule.forward_position_ : schedule.backward_position_)[pass.pair] = position;
  }
  return schedule;
}

size_t GraphSchedule::pair_index(size_t callable, size_t microbatch) const {
  const size_t chunk = callable / layers_per_chunk_;
  const size_t layer = callable % layers_per_chunk_;
  return (chunk * num_microbatches_ + microbatch) * layers_per_chunk_ + layer;
}

size_t GraphSchedule::callable_of(size_t pair) const {
  const size_t chunk = pair / (num_microbatches_ * layers_per_chunk_);
  return chunk * layers_per_chunk_ + pair % layers_per_chunk_;
}

size_t GraphSchedule::microbatch_of(size_t pair) const {
  return (pair / layers_per_chunk_) % num_microbatches_;
}

std::vector<std::optional<size_t>> GraphSchedule::shared_inputs(
    const std::vector<std::string>& keys) const {
  GRAPHED_INTERNAL_ASSERT(keys.size() == num_pairs(), "one key per pair");
  std::vector<std::optional<size_t>> donors(num_pairs());
  // Buffer sets whose owner's backward has passed, oldest first; each entry is
  // the pair that allocated the set.
  std::deque<size_t> free_sets;
  // The set each pair uses: its own index, or the index of its donor's set.
  std::vector<size_t> set_of(num_pairs());
  for (const GraphPass& pass : passes_) {
    if (pass.forward) {
      set_of[pass.pair] = pass.pair;
      for (auto it = free_sets.begin(); it != free_sets.end(); ++it) {
        if (keys[*it] == keys[pass.pair]) {
          donors[pass.pair] = *it;
          set_of[pass.pair] = *it;
          free_sets.erase(it);
          break;
        }
      }
    } else {
      free_sets.push_back(set_of[pass.pair]);
    }
  }
  return donors;
}

}  // namespace graphed
