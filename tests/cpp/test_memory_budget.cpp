// Memory sizes and the LRU budget (memory_budget.h): parsing and formatting
// sizes, eviction order. Host logic only.

#include "graphed/check.h"
#include "graphed/memory_budget.h"
#include "test_support.h"

namespace graphed {
namespace {

TEST(MemorySize, ParsesUnitsOfBothKinds) {
  EXPECT_EQ(parse_memory_size("1048576"), 1048576);
  EXPECT_EQ(parse_memory_size("512MB"), 512000000);
  EXPECT_EQ(parse_memory_size("2GiB"), 2LL << 30);
  EXPECT_EQ(parse_memory_size(" 1.5 gb "), 1500000000);
  EXPECT_EQ(parse_memory_size("64KiB"), 65536);
  EXPECT_EQ(parse_memory_size("3B"), 3);
}

TEST(MemorySize, RefusesWhatItCannotRead) {
  EXPECT_THROW_WITH(parse_memory_size("2 parsecs"), Error,
                    "Expected a memory size such as \"512MB\", \"2GiB\"");
  EXPECT_THROW_WITH(parse_memory_size("GiB"), Error, "got \"GiB\"");
  EXPECT_THROW_WITH(parse_memory_size("1.2.3MB"), Error, "got \"1.2.3MB\"");
  EXPECT_THROW_WITH(parse_memory_size("0MB"), Error, "at least one byte");
}

TEST(MemorySize, FormatsBinaryUnits) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(3 * 1024 * 1024 + 200 * 1024), "3.2 MiB");
  EXPECT_EQ(format_bytes(2LL << 30), "2.0 GiB");
}

TEST(LruBudget, EvictsLeastRecentlyUsedFirstUntilItFits) {
  LruBudget lru(250);
  lru.add(1, 100);
  lru.add(2, 100);
  EXPECT_TRUE(lru.over_budget().empty());
  lru.touch(1);  // 2 is now the least recently used
  lru.add(3, 100);
  EXPECT_EQ(lru.order(), (std::vector<uint64_t>{2, 1, 3}));
  EXPECT_EQ(lru.over_budget(), (std::vector<uint64_t>{2}));
  EXPECT_EQ(lru.over_budget(/*keep=*/2), (std::vector<uint64_t>{1}));
  lru.remove(2);
  EXPECT_EQ(lru.total_bytes(), 200);
  EXPECT_TRUE(lru.over_budget().empty());
  lru.remove(42);  // absent: nothing
  EXPECT_EQ(lru.size(), 2u);
}

TEST(LruBudget, NoBudgetNeverEvicts) {
  LruBudget lru;
  lru.add(1, int64_t{1} << 50);
  EXPECT_TRUE(lru.over_budget().empty());
  EXPECT_THROW_WITH(LruBudget(0), Error, "at least one byte");
}

}  // namespace
}  // namespace graphed
