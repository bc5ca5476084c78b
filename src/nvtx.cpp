#include "graphed/nvtx.h"

#if GRAPHED_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace graphed {

// Note [NVTX ranges cost nothing without a profiler]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// graphed marks its warm-ups, captures and replays with NVTX ranges, because
// a user reading an Nsight Systems timeline wants to see which replay is
// which graph next to the ranges of their own code. NVTX v3 is header-only:
// nothing is linked, and the first call looks for a tool (the library named by
// NVTX_INJECTION64_PATH, which `nsys profile` sets, or one linked statically).
// Without a tool that first call sets every NVTX entry point to "no tool",
// and each later push or pop is a load of a function pointer and a branch
// that always goes the same way; with our switch (an atomic load) and the
// call into this file, a range costs a few nanoseconds on a replay that costs
// microseconds. So ranges are on by default, replays included. What would
// cost is building the range's name: replays therefore use names built once,
// at capture (warm-up and capture ranges build theirs when they open, only
// while ranges are enabled). Under a profiler a range costs what the tool
// charges to record it; GRAPHED_NVTX=0 or graphed.set_nvtx(False) switches
// graphed's ranges off where even that matters.
// graphed compiles without ranges where the CUDA toolkit lacks the nvtx3
// headers (GRAPHED_HAVE_NVTX=0); the API stays, nvtx_available() says so.

namespace {

bool initially_enabled() {
  const char* value = std::getenv("GRAPHED_NVTX");
  if (value == nullptr || *value == '\0') {
    return true;
  }
  for (const char* off : {"0", "false", "False", "FALSE", "off", "OFF", "no"}) {
    if (std::strcmp(value, off) == 0) {
      return false;
    }
  }
  return true;
}

std::atomic<bool> enabled{initially_enabled()};

}  // namespace

std::string_view nvtx_phase_name(NvtxPhase phase) noexcept {
  switch (phase) {
    case NvtxPhase::kWarmup:
      return "warmup";
    case NvtxPhase::kCapture:
      return "capture";
    case NvtxPhase::kReplay:
      return "replay";
  }
  return "unknown";
}

std::string nvtx_range_name(NvtxPhase phase, std::string_view subject) {
  const std::string_view phase_name = nvtx_phase_name(phase);
  std::string name;
  name.reserve(8 + phase_name.size() + 1 + subject.size());
  name.append("graphed/").append(phase_name).append(":").append(subject);
  return name;
}

std::string nvtx_subject(std::string_view description) {
  const size_t tick = description.find('`');
  if (tick == std::string_view::npos) {
    return std::string(description);
  }
  std::string subject;
  subject.reserve(description.size() - tick);
  for (const char c : description.substr(tick)) {
    if (c != '`') {
      subject.push_back(c);
    }
  }
  return subject;
}

bool nvtx_available() noexcept { return GRAPHED_HAVE_NVTX != 0; }

bool nvtx_enabled() noexcept {
  return nvtx_available() && enabled.load(std::memory_order_relaxed);
}

bool set_nvtx_enabled(bool on) noexcept {
  return enabled.exchange(on, std::memory_order_relaxed);
}

NvtxRange::NvtxRange(const char* name) noexcept {
#if GRAPHED_HAVE_NVTX
  if (enabled.load(std::memory_order_relaxed)) {
    nvtxRangePushA(name);
    open_ = true;
  }
#else
  (void)name;
#endif
}

NvtxRange::NvtxRange(NvtxPhase phase, std::string_view subject) {
  if (nvtx_enabled()) {
    *this = NvtxRange(nvtx_range_name(phase, subject));
  }
}

NvtxRange& NvtxRange::operator=(NvtxRange&& other) noexcept {
  if (this != &other) {
    end();
    open_ = other.open_;
    other.open_ = false;
  }
  return *this;
}

void NvtxRange::end() noexcept {
  if (open_) {
#if GRAPHED_HAVE_NVTX
    nvtxRangePop();
#endif
    open_ = false;
  }
}

}  // namespace graphed
