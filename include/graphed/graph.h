#pragma once

/// \file graph.h
/// graphed::Graph owns one captured CUDA graph: it captures a callable on
/// graphed's capture stream, replays on the caller's current stream, shares
/// memory pools, and reports what it holds. When capture fails it names the
/// operation that broke it and leaves the process as it found it.

#include <c10/core/Device.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace graphed {

namespace detail {
class TorchGraph;
struct PointerSites;
}  // namespace detail

/// Identifies a memory pool that graphs allocate from (torch's MempoolId_t).
using PoolId = c10::cuda::MempoolId_t;

/// A fresh pool handle that several captures can share
/// (at::cuda::graph_pool_handle). Share a pool only between graphs that
/// always replay in the order they were captured (Invariant 6).
PoolId new_pool();

/// How strictly CUDA polices other CUDA calls while a capture is under way
/// (cudaStreamCaptureMode).
enum class CaptureErrorMode {
  /// Unsafe calls from any thread invalidate the capture (torch's default).
  kGlobal,
  /// Unsafe calls from the capturing thread invalidate the capture.
  kThreadLocal,
  /// Nothing is policed; unsafe calls are the caller's responsibility.
  kRelaxed,
};

/// Parses "global", "thread_local" or "relaxed".
CaptureErrorMode parse_capture_error_mode(std::string_view name);
/// The name parse_capture_error_mode accepts for `mode`.
std::string_view capture_error_mode_name(CaptureErrorMode mode);

/// Options of Graph::capture.
struct GraphCaptureOptions {
  /// Pool to allocate from; a private pool when unset.
  std::optional<PoolId> pool;
  /// See CaptureErrorMode.
  CaptureErrorMode error_mode = CaptureErrorMode::kGlobal;
  /// What is being captured, for messages (e.g. "function `forward`").
  std::string description = "the function";
};

/// What a captured graph holds.
struct GraphStats {
  /// All nodes, including those inside child graphs.
  int64_t nodes = 0;
  /// Kernel nodes.
  int64_t kernels = 0;
  /// Memory copy nodes.
  int64_t memcpys = 0;
  /// Memory set nodes.
  int64_t memsets = 0;
  /// Nodes of any other type (events, host nodes, conditionals...).
  int64_t other_nodes = 0;
  /// Bytes of device memory the graph's pool holds (cudaMalloc'd segments).
  /// Shared pools report the whole pool.
  int64_t pool_reserved_bytes = 0;
  /// Bytes of the pool in live allocations.
  int64_t pool_allocated_bytes = 0;
  /// Wall time of the capture itself (begin to instantiated), in milliseconds.
  double capture_ms = 0.0;
};

/// Device memory a pool holds on one device.
struct PoolMemory {
  /// Bytes of the pool's segments (cudaMalloc'd).
  int64_t reserved_bytes = 0;
  /// Bytes of those segments in live allocations.
  int64_t allocated_bytes = 0;
};

/// What `pool` holds on `device` now (read from the caching allocator's
/// snapshot, so not for hot paths). Zeros for a pool nothing allocated from.
PoolMemory pool_memory(PoolId pool, c10::DeviceIndex device);

/// The stream graphed warms up and captures on for `device`.
///
/// Note [One capture stream per device]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// cuBLAS keeps one workspace per (handle, stream) and allocates it on first
/// use. Warming up on the stream that will capture allocates the workspace
/// before capture, outside the graph's pool, and every later capture on that
/// stream reuses it; a fresh stream per capture would put a new workspace
/// (32 MiB by default on Hopper) into every graph's pool. The price is that
/// graphs captured on this stream share that workspace, so two of them must
/// not replay concurrently on different streams: the same rule as sharing a
/// pool, and the way eager cuBLAS calls on one stream already behave. The
/// stream is created once per device and lives as long as the process.
c10::cuda::CUDAStream capture_stream(c10::DeviceIndex device);

/// One captured CUDA graph.
class Graph {
 public:
  /// An empty graph; capture() fills it.
  Graph() noexcept;
  /// Releases the graph and its pool reference. Never throws.
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  /// Transfers the captured graph; `other` becomes empty.
  Graph(Graph&& other) noexcept;
  /// Releases this graph, then takes `other`'s.
  Graph& operator=(Graph&& other) noexcept;

  /// Captures the CUDA work `body` enqueues on the current device. `body` runs
  /// with graphed's capture stream (see capture_stream) as the current stream,
  /// which first waits for the caller's current stream; afterwards the
  /// caller's stream waits for the capture stream. On failure throws
  /// CaptureError naming the operation that broke capture and how to fix it;
  /// the pool is then released and the stream usable again.
  void capture(const std::function<void()>& body, const GraphCaptureOptions& options = {});

  /// Launches the graph on the current stream of the capture device.
  void replay();

  /// Finds every reference the graph's kernels make into the device memory
  /// [base, base + bytes) (a static input buffer), so that repoint() can move
  /// them. Returns the id of that site, or nullopt when the graph could reach
  /// the memory where the scan cannot see (see Note [Re-pointing a graph] in
  /// src/graph_update.cpp); the graph is unchanged either way.
  std::optional<size_t> find_references(const void* base, size_t bytes);
  /// Makes the references of `site` point at the same offsets from `base`
  /// (memory of the same layout and size) from the next replay on, by
  /// updating the instantiated graph's kernel parameters in place
  /// (cudaGraphExecKernelNodeSetParams). Cheap when few kernels read the
  /// site; no device work.
  void repoint(size_t site, const void* base);
  /// Kernel nodes that reference `site`.
  size_t reference_count(size_t site) const;

  /// True once capture() succeeded.
  bool is_captured() const noexcept { return torch_graph_ != nullptr; }
  /// The pool the graph allocated from; pass it to another capture to share.
  PoolId pool() const;
  /// The device the graph runs on.
  c10::Device device() const;
  /// Node counts, pool memory and capture time. Pool figures are read now.
  GraphStats stats() const;
  /// The graph in Graphviz DOT form (cudaGraphDebugDotPrint, verbose).
  std::string dot() const;
  /// Writes dot() to `path`.
  void write_dot(const std::string& path) const;

 private:
  std::unique_ptr<detail::TorchGraph> torch_graph_;
  std::unique_ptr<detail::PointerSites> pointer_sites_;
  PoolId pool_{0, 0};
  c10::DeviceIndex device_ = -1;
  GraphStats node_stats_;
};

}  // namespace graphed
