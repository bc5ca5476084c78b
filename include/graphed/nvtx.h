#pragma once

/// \file nvtx.h
/// NVTX ranges around graphed's phases, so that a profile taken with
/// `nsys profile --cuda-graph-trace=graph` shows graphed's warm-ups, captures
/// and replays next to the user's own ranges: `graphed/warmup:<name>`,
/// `graphed/capture:<name>` and `graphed/replay:<name>`, where `<name>` is the
/// short name of what runs (a module's name, a function's). See Note [NVTX
/// ranges cost nothing without a profiler] in src/nvtx.cpp.

#include <string>
#include <string_view>

namespace graphed {

/// The phases of graphed's work that NVTX ranges mark.
enum class NvtxPhase {
  /// Eager runs before a capture (and graphed.auto's eager warm-up calls).
  kWarmup,
  /// Recording a CUDA graph.
  kCapture,
  /// Launching a captured graph (and copying the call's inputs in).
  kReplay,
};

/// "warmup", "capture" or "replay".
std::string_view nvtx_phase_name(NvtxPhase phase) noexcept;

/// The name of a range: "graphed/<phase>:<subject>", e.g.
/// "graphed/replay:layers.0".
std::string nvtx_range_name(NvtxPhase phase, std::string_view subject);

/// The short name of what a description in graphed's messages names: the
/// text from its first backtick on, without backticks ("module `layers.0`
/// (Block)" gives "layers.0 (Block)", "function `step`" gives "step"); the
/// whole description when it has no backtick.
std::string nvtx_subject(std::string_view description);

/// True when graphed was built with the NVTX headers (nvtx3, from the CUDA
/// toolkit); otherwise ranges are never emitted and NvtxRange does nothing.
bool nvtx_available() noexcept;

/// True when graphed emits NVTX ranges: NVTX is available and ranges are
/// switched on (the default; GRAPHED_NVTX=0 in the environment at load time,
/// or set_nvtx_enabled(false), switches them off).
bool nvtx_enabled() noexcept;

/// Switches graphed's NVTX ranges on or off for the whole process and
/// returns the previous setting. Ranges already open still end. Python:
/// `graphed.set_nvtx(enabled)`.
bool set_nvtx_enabled(bool enabled) noexcept;

/// One NVTX range (push on construction, pop on destruction) on the calling
/// thread, emitted only while nvtx_enabled(). Ranges nest: one must end on
/// the thread that started it, after the ranges started inside it. Moving
/// transfers the duty to end it; the moved-from range ends nothing.
class NvtxRange {
 public:
  /// A range that is not open (ends nothing).
  NvtxRange() noexcept = default;
  /// Opens a range named `name` (copied by the profiler, if one listens).
  explicit NvtxRange(const char* name) noexcept;
  /// Opens a range named `name`.
  explicit NvtxRange(const std::string& name) noexcept : NvtxRange(name.c_str()) {}
  /// Opens the range nvtx_range_name(phase, subject); builds the name only
  /// when ranges are enabled. For phases that run once (warm-up, capture);
  /// replays pass a name built once, at capture.
  NvtxRange(NvtxPhase phase, std::string_view subject);
  /// Takes over `other`'s open range.
  NvtxRange(NvtxRange&& other) noexcept : open_(other.open_) { other.open_ = false; }
  /// Ends this range if open, then takes over `other`'s.
  NvtxRange& operator=(NvtxRange&& other) noexcept;
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
  /// Ends the range if it is open; never throws.
  ~NvtxRange() { end(); }

  /// True while this object has a range to end.
  bool open() const noexcept { return open_; }
  /// Ends the range now (no-op when not open).
  void end() noexcept;

 private:
  bool open_ = false;
};

}  // namespace graphed
