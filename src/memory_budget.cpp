#include "graphed/memory_budget.h"

#include "graphed/check.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <iomanip>
#include <iterator>
#include <sstream>

namespace graphed {

namespace {

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

}  // namespace

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

}  // namespace graphed
