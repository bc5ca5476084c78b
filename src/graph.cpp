#include "graphed/graph.h"

#include "graphed/capture_watcher.h"
#include "graphed/check.h"
#include "graphed/cuda_handles.h"
#include "graphed/source_location.h"
#include "pointer_sites.h"
#include "torch_graph.h"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <sstream>
#include <unistd.h>

namespace graphed {
namespace {

cudaStreamCaptureMode to_cuda(CaptureErrorMode mode) {
  switch (mode) {
    case CaptureErrorMode::kGlobal: return cudaStreamCaptureModeGlobal;
    case CaptureErrorMode::kThreadLocal: return cudaStreamCaptureModeThreadLocal;
    case CaptureErrorMode::kRelaxed: return cudaStreamCaptureModeRelaxed;
  }
  return cudaStreamCaptureModeGlobal;
}

// The message of the exception being handled, without C++ backtraces.
std::string current_exception_message() {
  try {
    throw;
  } catch (const c10::Error& error) {
    return error.what_without_backtrace();
  } catch (const std::exception& error) {
    return error.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

void count_nodes(cudaGraph_t graph, GraphStats& stats) {
  size_t count = 0;
  GRAPHED_CHECK_CUDA(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  if (count > 0) {
    GRAPHED_CHECK_CUDA(cudaGraphGetNodes(graph, nodes.data(), &count));
  }
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    GRAPHED_CHECK_CUDA(cudaGraphNodeGetType(node, &type));
    switch (type) {
      case cudaGraphNodeTypeKernel: ++stats.kernels; ++stats.nodes; break;
      case cudaGraphNodeTypeMemcpy: ++stats.memcpys; ++stats.nodes; break;
      case cudaGraphNodeTypeMemset: ++stats.memsets; ++stats.nodes; break;
      case cudaGraphNodeTypeGraph: {
        cudaGraph_t child = nullptr;
        GRAPHED_CHECK_CUDA(cudaGraphChildGraphNodeGetGraph(node, &child));
        count_nodes(child, stats);
        break;
      }
      default: ++stats.other_nodes; ++stats.nodes; break;
    }
  }
}

void wait_for(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& producer) {
  stream_wait(waiter.stream(), producer.stream());
}

}  // namespace

PoolId new_pool() { return at::cuda::graph_pool_handle(); }

PoolMemory pool_memory(PoolId pool, c10::DeviceIndex device) {
  PoolMemory memory;
  if (c10::cuda::device_count() == 0) {
    return memory;
  }
  const auto snapshot = c10::cuda::CUDACachingAllocator::snapshot(pool, /*include_traces=*/false);
  for (const auto& segment : snapshot.segments) {
    if (segment.device == device && segment.owner_private_pool_id == pool) {
      memory.reserved_bytes += static_cast<int64_t>(segment.total_size);
      memory.allocated_bytes += static_cast<int64_t>(segment.allocated_size);
    }
  }
  return memory;
}

CaptureErrorMode parse_capture_error_mode(std::string_view name) {
  if (name == "global") return CaptureErrorMode::kGlobal;
  if (name == "thread_local") return CaptureErrorMode::kThreadLocal;
  if (name == "relaxed") return CaptureErrorMode::kRelaxed;
  GRAPHED_THROW(Error, "Expected capture_error_mode to be one of \"global\", \"thread_local\" "
                "or \"relaxed\", got \"", name, "\".");
}

std::string_view capture_error_mode_name(CaptureErrorMode mode) {
  switch (mode) {
    case CaptureErrorMode::kGlobal: return "global";
    case CaptureErrorMode::kThreadLocal: return "thread_local";
    case CaptureErrorMode::kRelaxed: return "relaxed";
  }
  return "global";
}

c10::cuda::CUDAStream capture_stream(c10::DeviceIndex device) {
  // See Note [One capture stream per device]. Created once and never
  // destroyed: graphs captured on it may live until the process exits.
  static std::mutex mutex;
  static std::array<cudaStream_t, C10_COMPILE_TIME_MAX_GPUS> streams{};
  GRAPHED_CHECK(device >= 0 && device < c10::cuda::device_count(),
                "Expected a CUDA device index in [0, ", static_cast<int>(c10::cuda::device_count()),
                "), got ", static_cast<int>(device), ".");
  std::lock_guard<std::mutex> lock(mutex);
  if (streams[device] == nullptr) {
    c10::cuda::CUDAGuard guard(device);
    GRAPHED_CHECK_CUDA(cudaStreamCreateWithFlags(&streams[device], cudaStreamNonBlocking));
  }
  return c10::cuda::getStreamFromExternal(streams[device], device);
}

Graph::Graph() noexcept = default;
Graph::~Graph() = default;
Graph::Graph(Graph&& other) noexcept = default;
Graph& Graph::operator=(Graph&& other) noexcept = default;

void Graph::capture(const std::function<void()>& body, const GraphCaptureOptions& options) {
  GRAPHED_CHECK(!is_captured(), "This Graph already holds a captured graph; create a new "
                "Graph to capture ", options.description, " again.");
  GRAPHED_CHECK(c10::cuda::device_count() > 0,
                "Capturing a CUDA graph needs an NVIDIA GPU, but CUDA reports no device. "
                "Run on a machine with a GPU (torch.cuda.is_available() must be True).");
  const c10::DeviceIndex device = c10::cuda::current_device();
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device);
  const c10::cuda::CUDAStream stream = capture_stream(device);

  // Work the body depends on must finish before capture: a capture may not
  // wait on events recorded outside it.
  wait_for(stream, caller);
  GRAPHED_CHECK_CUDA(cudaStreamSynchronize(stream.stream()));

  auto torch_graph = std::make_unique<detail::TorchGraph>(/*keep_graph=*/true);
  const auto started = std::chrono::steady_clock::now();
  {
    c10::cuda::CUDAStreamGuard on_capture_stream(stream);
    CaptureWatcher watcher(stream.stream());
    try {
      (void)take_exception_stack();
      torch_graph->begin_capture(options.pool.value_or(PoolId{0, 0}), to_cuda(options.error_mode));
      body();
      torch_graph->end_capture();
    } catch (...) {
      const std::string underlying = current_exception_message();
      const std::vector<SourceFrame> exception_stack = take_exception_stack();
      const std::optional<CaptureCulprit> culprit = watcher.culprit();
      const std::string last_good = watcher.last_good_operator();
      torch_graph->abandon_capture();
      torch_graph.reset();
      wait_for(caller, stream);
      GRAPHED_THROW(CaptureError, explain_capture_failure(options.description, culprit, last_good,
                                                          underlying, exception_stack));
    }
  }
  wait_for(caller, stream);
  torch_graph->instantiate();

  GraphStats stats;
  count_nodes(torch_graph->raw_cuda_graph(), stats);
  stats.capture_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
  node_stats_ = stats;
  pool_ = torch_graph->pool();
  device_ = device;
  torch_graph_ = std::move(torch_graph);
}

void Graph::replay() {
  GRAPHED_CHECK(is_captured(), "Expected a captured graph, but this Graph is empty: call "
                "capture() first (or it was moved from).");
  torch_graph_->replay();
}

PoolId Graph::pool() const {
  GRAPHED_CHECK(is_captured(), "This Graph is empty, so it has no pool: call capture() first.");
  return pool_;
}

c10::Device Graph::device() const {
  GRAPHED_CHECK(is_captured(), "This Graph is empty, so it has no device: call capture() first.");
  return c10::Device(c10::kCUDA, device_);
}

GraphStats Graph::stats() const {
  GRAPHED_CHECK(is_captured(), "This Graph is empty: call capture() first.");
  GraphStats stats = node_stats_;
  const PoolMemory memory = pool_memory(pool_, device_);
  stats.pool_reserved_bytes = memory.reserved_bytes;
  stats.pool_allocated_bytes = memory.allocated_bytes;
  return stats;
}

void Graph::write_dot(const std::string& path) const {
  GRAPHED_CHECK(is_captured(), "This Graph is empty: call capture() first.");
  GRAPHED_CHECK_CUDA(cudaGraphDebugDotPrint(torch_graph_->raw_cuda_graph(), path.c_str(),
                                            cudaGraphDebugDotFlagsVerbose));
}

std::string Graph::dot() const {
  std::string path = "/tmp/graphed-dot-XXXXXX";
  const int fd = mkstemp(path.data());
  GRAPHED_CHECK(fd >= 0, "Could not create a temporary file for the DOT dump in /tmp.");
  close(fd);
  try {
    write_dot(path);
  } catch (...) {
    std::remove(path.c_str());
    throw;
  }
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  std::remove(path.c_str());
  return text.str();
}

}  // namespace graphed
