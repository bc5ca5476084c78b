#pragma once

/// \file profile.h
/// Traces through libtorch's Kineto profiler API (no Nsight needed) and the
/// timing behind graphed::advise: record_trace() turns a few iterations of a
/// function into an advice.h Trace (GPU activities, the runtime calls that
/// launched them, one span per iteration); profile() adds the iteration's
/// time measured with CUDA events without the profiler; replay_cost()
/// measures, once per device, what a graph replay costs beyond its kernels
/// (Note [Predicting the graphed time] in src/advice.cpp).

#include "graphed/advice.h"

#include <c10/core/Device.h>

#include <functional>

namespace graphed {

/// The name of the host span record_trace() puts around each iteration.
inline constexpr const char* kIterationMarker = "graphed::iteration";

/// Runs `iteration` `iterations` times back to back under the Kineto
/// profiler (host operators, and GPU activities when CUDA has a device) and
/// returns what it recorded. The GPU is synchronized before and after, so
/// every activity of the iterations is in the trace. Throws graphed::Error
/// when a profiler is already running on this thread or `iterations` < 1;
/// an exception of `iteration` propagates after the profiler is stopped.
Trace record_trace(const std::function<void()>& iteration, int iterations);

/// Milliseconds per call of `fn` on the current CUDA device: `warmup` calls,
/// then the median over `repeats` of `iters` back-to-back calls timed with
/// CUDA events on the current stream. Throws graphed::Error without a device.
double time_ms(const std::function<void()>& fn, int iters, int repeats, int warmup);

/// Options of profile().
struct ProfileOptions {
  /// Eager calls before anything is measured (caches, cuBLAS handles, autotuning).
  int warmup = 3;
  /// Calls per timed round, and timed rounds (the median is kept).
  int timed_iters = 10;
  /// Timed rounds.
  int timed_repeats = 5;
  /// Iterations recorded by the profiler.
  int profiled_iters = 5;
};

/// A function's trace and its time per iteration.
struct Profile {
  /// The profiled iterations.
  Trace trace;
  /// Time per iteration measured with CUDA events, without the profiler.
  double eager_ms = 0.0;
};

/// Warms `iteration` up, times it, and records a trace of it. Needs a CUDA
/// device: throws graphed::Error without one.
Profile profile(const std::function<void()>& iteration, const ProfileOptions& options = {});

/// Measures what replaying a graph costs on `device` beyond its kernels'
/// durations: replays graphs of `small_layers` and `large_layers` small
/// dependent layers (a 32x512 by 512x512 matmul with bias, then GELU: the
/// kernels of launch-bound models) back to back and fits ReplayCost::fit to
/// their kernel counts and the kernels' profiled durations (Note [The
/// replay-cost probe]). Takes well under a second.
ReplayCost measure_replay_cost(c10::DeviceIndex device, int64_t small_layers = 8,
                               int64_t large_layers = 64);

/// measure_replay_cost(device), measured on first use and kept for the
/// process (thread-safe).
ReplayCost replay_cost(c10::DeviceIndex device);

}  // namespace graphed
