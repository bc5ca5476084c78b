#pragma once

/// \file source_location.h
/// Where in the user's program an operation was called. The core has no
/// Python dependency: a host language (the Python bindings) registers a
/// SourceLocator, and the core asks it for the current stack when it needs to
/// point at a line (a capture failure, a capture blocker found by a check).

#include <memory>
#include <string>
#include <vector>

namespace graphed {

/// One frame of the host program's call stack.
struct SourceFrame {
  /// File name as the host language reports it.
  std::string file;
  /// 1-based line number.
  int line = 0;
  /// Function (or method) name.
  std::string function;
  /// True when the frame is the user's code, not torch's or graphed's.
  bool is_user_code = true;
  /// True when the file belongs to an installed package (site-packages or
  /// dist-packages: transformers, timm...) rather than the user's own
  /// sources. Such frames still count as user code for source lines (the
  /// user called into that library), but a finding there is one the user
  /// cannot edit, and one that may branch on capture (Note [Checking the
  /// path taken under capture] in safety_check.cpp).
  bool is_installed_package = false;
};

/// Reports the host program's call stack. Implementations must be callable
/// from any thread that runs ATen operators.
class SourceLocator {
 public:
  virtual ~SourceLocator() = default;
  /// The current stack, innermost frame first.
  virtual std::vector<SourceFrame> current_stack() const = 0;
};

/// True when `file` lies in an installed package: a path through a
/// site-packages or dist-packages directory.
bool is_installed_package_file(const std::string& file);

/// Installs the process-wide locator (replacing any earlier one); null removes it.
void set_source_locator(std::shared_ptr<const SourceLocator> locator);

/// The current stack from the installed locator, innermost first; empty when
/// no locator is installed.
std::vector<SourceFrame> current_source_stack();

/// Formats the innermost user frame as `file:line in function`, or "" when
/// `frames` holds no user frame.
std::string describe_user_frame(const std::vector<SourceFrame>& frames);

/// The innermost frame of `frames` that is not user code (the library call the
/// user made, e.g. torch.cuda.synchronize), formatted as `function (file:line)`,
/// or "" when there is none before the first user frame.
std::string describe_library_frame(const std::vector<SourceFrame>& frames);

/// Remembers, for the calling thread, the stack of an exception that a host
/// language raised inside a callable the core ran (its traceback). The core
/// takes it when it explains the failure.
void note_exception_stack(std::vector<SourceFrame> frames);

/// Returns and clears the stack noted by note_exception_stack on this thread.
std::vector<SourceFrame> take_exception_stack();

}  // namespace graphed
