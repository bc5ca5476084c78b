#pragma once

/// \file memory_budget.h
/// Memory sizes and the least-recently-used byte budget: parsing sizes such as
/// "2GiB" (graphed.auto's and graphed.Decoder's memory_budget), formatting
/// byte counts for messages, and LruBudget, the bookkeeping GraphManager and
/// Decoder evict their graphs by. Pure host logic.

#include <cstdint>
#include <list>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
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

}  // namespace graphed
