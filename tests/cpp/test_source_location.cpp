// SourceLocator registry and frame formatting.

#include "graphed/source_location.h"
#include "test_support.h"

namespace graphed {
namespace {

class FixedLocator final : public SourceLocator {
 public:
  std::vector<SourceFrame> current_stack() const override {
    return {SourceFrame{"/lib/torch/x.py", 3, "inner", false},
            SourceFrame{"user.py", 12, "fn", true}};
  }
};

TEST(SourceLocation, NoLocatorMeansNoFrames) {
  set_source_locator(nullptr);
  EXPECT_TRUE(current_source_stack().empty());
}

TEST(SourceLocation, InstalledLocatorIsAsked) {
  set_source_locator(std::make_shared<FixedLocator>());
  const auto frames = current_source_stack();
  ASSERT_EQ(frames.size(), 2u);
  EXPECT_EQ(describe_user_frame(frames), "user.py:12 in fn");
  EXPECT_EQ(describe_library_frame(frames), "inner (/lib/torch/x.py:3)");
  set_source_locator(nullptr);
}

TEST(SourceLocation, NoUserFrameDescribesAsEmpty) {
  EXPECT_EQ(describe_user_frame({SourceFrame{"/lib/a.py", 1, "f", false}}), "");
  EXPECT_EQ(describe_library_frame({SourceFrame{"u.py", 1, "f", true}}), "");
}

TEST(SourceLocation, ExceptionStackIsTakenOnce) {
  note_exception_stack({SourceFrame{"u.py", 5, "g", true}});
  EXPECT_EQ(take_exception_stack().size(), 1u);
  EXPECT_TRUE(take_exception_stack().empty());
}

}  // namespace
}  // namespace graphed
