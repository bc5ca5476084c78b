#include "graphed/source_location.h"

#include <c10/util/StringUtil.h>

#include <mutex>
#include <utility>

namespace graphed {
namespace {

std::mutex& locator_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::shared_ptr<const SourceLocator>& installed_locator() {
  static std::shared_ptr<const SourceLocator> locator;
  return locator;
}

thread_local std::vector<SourceFrame> noted_exception_stack;

}  // namespace

void set_source_locator(std::shared_ptr<const SourceLocator> locator) {
  std::lock_guard<std::mutex> lock(locator_mutex());
  installed_locator() = std::move(locator);
}

std::vector<SourceFrame> current_source_stack() {
  std::shared_ptr<const SourceLocator> locator;
  {
    std::lock_guard<std::mutex> lock(locator_mutex());
    locator = installed_locator();
  }
  return locator ? locator->current_stack() : std::vector<SourceFrame>{};
}

bool is_installed_package_file(const std::string& file) {
  return file.find("/site-packages/") != std::string::npos ||
         file.find("/dist-packages/") != std::string::npos ||
         file.find("\\site-packages\\") != std::string::npos;
}

std::string describe_user_frame(const std::vector<SourceFrame>& frames) {
  for (const SourceFrame& frame : frames) {
    if (frame.is_user_code) {
      return c10::str(frame.file, ":", frame.line, " in ", frame.function);
    }
  }
  return "";
}

std::string describe_library_frame(const std::vector<SourceFrame>& frames) {
  if (frames.empty() || frames.front().is_user_code) {
    return "";
  }
  const SourceFrame& frame = frames.front();
  return c10::str(frame.function, " (", frame.file, ":", frame.line, ")");
}

void note_exception_stack(std::vector<SourceFrame> frames) {
  noted_exception_stack = std::move(frames);
}

std::vector<SourceFrame> take_exception_stack() {
  return std::exchange(noted_exception_stack, {});
}

}  // namespace graphed
