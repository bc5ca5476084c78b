#include "graphed/profile.h"

#include "graphed/check.h"
#include "graphed/cuda_handles.h"
#include "graphed/graph.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <kineto/ActivityType.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <string_view>

namespace graphed {

// Note [Kineto from C++]
// ~~~~~~~~~~~~~~~~~~~~~~
// torch.profiler is a thin Python layer over these calls of
// torch/csrc/autograd/profiler_kineto.h: prepareProfiler (initializes CUPTI
// and Kineto's buffers), enableProfiler (installs the RecordFunction
// callbacks on this thread and starts CUPTI activity tracing), and
// disableProfiler, whose ProfilerResult lists KinetoEvents. Their signatures
// common to torch 2.11 and 2.14 are the ones used here (2.14 adds an optional
// activity filter to prepareProfiler). GPU activities are the events whose
// deviceType() is CUDA; activityType() is libkineto's ActivityType, whose
// values for kernels, copies, sets and runtime calls are the same in both
// versions (2.14 pins them explicitly). CUPTI records every GPU activity of
// the process, including those launched by autograd's worker threads during
// backward and the nodes of replayed graphs.

namespace {

using libkineto::ActivityType;
namespace kineto_api = torch::autograd::profiler;
namespace profiler_impl = torch::profiler::impl;

bool is(uint8_t type, ActivityType expected) { return type == static_cast<uint8_t>(expected); }

bool is_launch_call(std::string_view name) {
  return name.find("Launch") != std::string_view::npos ||
         name.find("Memcpy") != std::string_view::npos ||
         name.find("Memset") != std::string_view::npos;
}

bool has_cuda_device() { return c10::cuda::device_count() > 0; }

using TimingEvent = UniqueCudaHandle<cudaEvent_t, &cudaEventDestroy>;

TimingEvent timing_event() {
  TimingEvent event;
  GRAPHED_CHECK_CUDA(cudaEventCreate(event.out()));
  return event;
}

}  // namespace

Trace record_trace(const std::function<void()>& iteration, int iterations) {
  GRAPHED_CHECK(iterations >= 1, "Expected at least one iteration to trace, got ", iterations,
                ".");
  GRAPHED_CHECK(!profiler_impl::profilerEnabled(),
                "Expected no profiler to be running on this thread, but one is (torch.profiler or "
                "torch.autograd.profiler). graphed traces with its own profiler session: call it "
                "outside the `with torch.profiler.profile(...)` block.");
  const bool cuda = has_cuda_device();
  std::set<profiler_impl::ActivityType> activities{profiler_impl::ActivityType::CPU};
  if (cuda) {
    activities.insert(profiler_impl::ActivityType::CUDA);
    c10::cuda::device_synchronize();
  }
  const profiler_impl::ProfilerConfig config(profiler_impl::ProfilerState::KINETO);
  kineto_api::prepareProfiler(config, activities);
  kineto_api::enableProfiler(config, activities);
  std::unique_ptr<kineto_api::ProfilerResult> result;
  try {
    for (int i = 0; i < iterations; ++i) {
      RECORD_USER_SCOPE(kIterationMarker);
      iteration();
    }
    if (cuda) {
      c10::cuda::device_synchronize();
    }
  } catch (...) {
    try {
      kineto_api::disableProfiler();
    } catch (const std::exception& error) {
      TORCH_WARN("graphed: stopping the profiler after a failed iteration failed too: ",
                 error.what());
    }
    throw;
  }
  result = kineto_api::disableProfiler();

  Trace trace;
  for (const kineto_api::KinetoEvent& event : result->events()) {
    const uint8_t type = event.activityType();
    const auto start = static_cast<int64_t>(event.startNs());
    const auto duration = static_cast<int64_t>(event.durationNs());
    if (event.deviceType() == c10::DeviceType::CUDA) {
      ActivityKind kind;
      if (is(type, ActivityType::CONCURRENT_KERNEL)) {
        kind = ActivityKind::kKernel;
      } else if (is(type, ActivityType::GPU_MEMCPY)) {
        kind = ActivityKind::kMemcpy;
      } else if (is(type, ActivityType::GPU_MEMSET)) {
        kind = ActivityKind::kMemset;
      } else {
        continue;  // GPU-side annotations and the like: not work.
      }
      trace.gpu.push_back(GpuActivity{event.name(), kind, start, duration});
      continue;
    }
    const std::string name = event.name();
    if (name == kIterationMarker) {
      trace.iterations.push_back(HostSpan{name, start, duration});
    } else if ((is(type, ActivityType::CUDA_RUNTIME) || is(type, ActivityType::CUDA_DRIVER)) &&
               is_launch_call(name)) {
      trace.launches.push_back(HostSpan{name, start, duration});
    }
  }
  GRAPHED_CHECK(static_cast<int>(trace.iterations.size()) == iterations,
                "Expected the profiler to record ", iterations, " iteration spans named \"",
                kIterationMarker, "\", found ", trace.iterations.size(),
                ". Is another profiler or RecordFunction observer interfering?");
  const auto by_start = [](const auto& a, const auto& b) { return a.start_ns < b.start_ns; };
  std::sort(trace.gpu.begin(), trace.gpu.end(), by_start);
  std::sort(trace.launches.begin(), trace.launches.end(), by_start);
  std::sort(trace.iterations.begin(), trace.iterations.end(), by_start);
  return trace;
}

double time_ms(const std::function<void()>& fn, int iters, int repeats, int warmup) {
  GRAPHED_CHECK(has_cuda_device(), "Timing with CUDA events needs a CUDA device; CUDA reports "
                "none on this machine.");
  GRAPHED_CHECK(iters >= 1 && repeats >= 1 && warmup >= 0, "Expected iters >= 1, repeats >= 1 "
                "and warmup >= 0, got ", iters, ", ", repeats, " and ", warmup, ".");
  for (int i = 0; i < warmup; ++i) {
    fn();
  }
  TimingEvent start = timing_event();
  TimingEvent end = timing_event();
  std::vector<double> samples;
  for (int r = 0; r < repeats; ++r) {
    // The current stream is read each round: `fn` may not change it, but a
    // caller's stream guard applies to every round alike.
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    GRAPHED_CHECK_CUDA(cudaEventRecord(start.get(), stream));
    for (int i = 0; i < iters; ++i) {
      fn();
    }
    GRAPHED_CHECK_CUDA(cudaEventRecord(end.get(), stream));
    GRAPHED_CHECK_CUDA(cudaEventSynchronize(end.get()));
    float elapsed = 0.0F;
    GRAPHED_CHECK_CUDA(cudaEventElapsedTime(&elapsed, start.get(), end.get()));
    samples.push_back(static_cast<double>(elapsed) / iters);
  }
  std::sort(samples.begin(), samples.end());
  const size_t middle = samples.size() / 2;
  return samples.size() % 2 == 1 ? samples[middle] : 0.5 * (samples[middle - 1] + samples[middle]);
}

Profile profile(const std::function<void()>& iteration, const ProfileOptions& options) {
  GRAPHED_CHECK(has_cuda_device(), "Profiling for graphed's advice needs a CUDA device; CUDA "
                "reports none on this machine. graphed.check works without one.");
  GRAPHED_CHECK(options.warmup >= 1, "Expected at least one warm-up iteration, got ",
                options.warmup, ": the first call of a function pays one-time costs that a "
                "graph never replays.");
  for (int i = 0; i < options.warmup; ++i) {
    iteration();
  }
  Profile result;
  result.eager_ms = time_ms(iteration, options.timed_iters, options.timed_repeats, 0);
  result.trace = record_trace(iteration, options.profiled_iters);
  return result;
}

// Note [The replay-cost probe]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The probe's kernels must behave like a launch-bound model's. A chain of
// one-element additions does not: the profiler reports such a kernel as
// longer than it takes inside a graph, so the fitted per-node cost came out
// below zero on an H200 (clamped to 0), while graphs of matmuls and
// elementwise kernels replay about 0.35 us per node slower than the sum of
// their profiled durations. The probe therefore chains small layers, a
// 32x512 by 512x512 matmul with bias and a GELU, and counts its kernels from
// the profiler rather than assuming them.
ReplayCost measure_replay_cost(c10::DeviceIndex device, int64_t small_layers,
                               int64_t large_layers) {
  GRAPHED_CHECK(has_cuda_device() && device >= 0 && device < c10::cuda::device_count(),
                "Expected a CUDA device index below ", c10::cuda::device_count(),
                " to measure the replay cost on, got ", static_cast<int>(device), ".");
  GRAPHED_CHECK(small_layers >= 1 && large_layers > small_layers, "Expected 1 <= small_layers < "
                "large_layers, got ", small_layers, " and ", large_layers, ".");
  const c10::cuda::CUDAGuard device_guard(device);
  const auto options = at::TensorOptions().device(c10::kCUDA, device);
  const at::Tensor input = at::randn({32, 512}, options);
  const at::Tensor weight = at::randn({512, 512}, options).div_(32.0);
  const at::Tensor bias = at::zeros({512}, options);
  const auto chain = [&](int64_t layers) {
    return std::function<void()>([input, weight, bias, layers] {
      at::Tensor y = input;
      for (int64_t i = 0; i < layers; ++i) {
        y = at::gelu(at::addmm(bias, y, weight));
      }
    });
  };
  const auto kernels_of = [](const Trace& trace, double& total_ns) {
    int64_t kernels = 0;
    for (const GpuActivity& activity : trace.gpu) {
      if (activity.kind == ActivityKind::kKernel) {
        total_ns += static_cast<double>(activity.duration_ns);
        ++kernels;
      }
    }
    return kernels;
  };
  // Eager runs first, on the stream that captures: cuBLAS creates its handle
  // and workspace on first use, which capture cannot record.
  {
    const c10::cuda::CUDAStreamGuard on_capture_stream(capture_stream(device));
    chain(large_layers)();
  }
  double small_ns = 0.0;
  double large_ns = 0.0;
  const int64_t small_kernels = kernels_of(record_trace(chain(small_layers), 1), small_ns);
  const int64_t large_kernels = kernels_of(record_trace(chain(large_layers), 1), large_ns);
  GRAPHED_CHECK(small_kernels > 0 && large_kernels > small_kernels,
                "The profiler recorded too few kernels of the replay-cost probe (", small_kernels,
                " and ", large_kernels, " for ", small_layers, " and ", large_layers,
                " layers on cuda:", static_cast<int>(device),
                "); is CUPTI available to this torch build?");
  GraphCaptureOptions graph_options;
  graph_options.description = "graphed's replay-cost probe";
  Graph small;
  Graph large;
  small.capture(chain(small_layers), graph_options);
  large.capture(chain(large_layers), graph_options);
  const double small_us = 1e3 * time_ms([&] { small.replay(); }, 20, 5, 3);
  const double large_us = 1e3 * time_ms([&] { large.replay(); }, 20, 5, 3);
  return ReplayCost::fit(small_kernels, small_us, large_kernels, large_us,
                         large_ns / static_cast<double>(large_kernels) / 1e3);
}

ReplayCost replay_cost(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, ReplayCost> costs;
  const std::lock_guard<std::mutex> lock(mutex);
  auto found = costs.find(device);
  if (found == costs.end()) {
    found = costs.emplace(device, measure_replay_cost(device)).first;
  }
  return found->second;
}

}  // namespace graphed
