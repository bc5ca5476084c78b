#include "cublas_workspace.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <iterator>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <type_traits>
#include <utility>

namespace graphed::detail {
namespace {

// The map's value: a DataPtr (torch 2.11) or a DataPtr with the workspace's
// size (torch 2.14). Chosen from the header at compile time.
using WorkspaceMap = decltype(at::cuda::cublas_handle_stream_to_workspace().map);
using WorkspaceValue = typename WorkspaceMap::mapped_type;

template <typename Value>
at::DataPtr& data_of(Value& value) {
  if constexpr (!std::is_same_v<Value, at::DataPtr>) {
    return value.first;
  } else {
    return value;
  }
}

template <typename Value>
size_t size_of(const Value& value, size_t configured) {
  if constexpr (!std::is_same_v<Value, at::DataPtr>) {
    return value.second;
  } else {
    return configured;
  }
}

template <typename Value = WorkspaceValue>
Value borrowed(void* data, c10::Device device, size_t size) {
  // No deleter: clearing the map leaves the memory to graphed.
  if constexpr (!std::is_same_v<Value, at::DataPtr>) {
    return Value{at::DataPtr(data, device), size};
  } else {
    (void)size;
    return at::DataPtr(data, device);
  }
}

// One buffer the capture stream's workspace entries point at while graphs
// captured with it live: Note [cuBLAS workspaces of captured graphs]. Its
// memory comes from a private pool of its own, so that when the last graph
// that writes into it is gone, no other allocation can take it over while a
// replay may still be running; the pool's segment goes back to the device at
// the next empty_cache(), whose cudaFree waits for the device.
class SharedWorkspace {
 public:
  SharedWorkspace(c10::DeviceIndex device, cudaStream_t stream, size_t bytes)
      : device_(device), bytes_(bytes) {
    // Allocated on `stream`, the capture stream whose entries will point here.
    c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(stream, device));
    c10::cuda::CUDACachingAllocator::beginAllocateToPool(
        device, pool_, [stream](cudaStream_t s) { return s == stream; });
    try {
      memory_ = c10::cuda::CUDACachingAllocator::get()->allocate(bytes);
    } catch (...) {
      c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool_);
      c10::cuda::CUDACachingAllocator::releasePool(device, pool_);
      throw;
    }
    c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool_);
  }
  ~SharedWorkspace();
  SharedWorkspace(const SharedWorkspace&) = delete;
  SharedWorkspace& operator=(const SharedWorkspace&) = delete;

  void* data() const { return memory_.get(); }
  size_t bytes() const { return bytes_; }

 private:
  c10::DeviceIndex device_;
  size_t bytes_;
  at::cuda::MempoolId_t pool_ = at::cuda::graph_pool_handle();
  at::DataPtr memory_;
};

// The live shared workspaces: the newest per device serves new captures.
struct SharedWorkspaces {
  std::mutex mutex;
  std::array<std::weak_ptr<SharedWorkspace>, C10_COMPILE_TIME_MAX_GPUS> newest;
  std::set<const void*> addresses;
};

SharedWorkspaces& shared_workspaces() {
  static auto& instance = *new SharedWorkspaces;  // leaked: outlives every graph
  return instance;
}

bool is_shared_buffer(const void* data) {
  SharedWorkspaces& shared = shared_workspaces();
  std::lock_guard<std::mutex> lock(shared.mutex);
  return shared.addresses.count(data) > 0;
}

// The newest shared workspace of `device` when it holds at least `bytes`,
// else a new one on `stream`, which becomes the newest.
std::shared_ptr<SharedWorkspace> shared_buffer(c10::DeviceIndex device, cudaStream_t stream,
                                               size_t bytes) {
  SharedWorkspaces& shared = shared_workspaces();
  std::lock_guard<std::mutex> lock(shared.mutex);
  std::weak_ptr<SharedWorkspace>& newest = shared.newest.at(static_cast<size_t>(device));
  std::shared_ptr<SharedWorkspace> found = newest.lock();
  if (found && found->bytes() >= bytes) {
    return found;
  }
  found = std::make_shared<SharedWorkspace>(device, stream, bytes);
  shared.addresses.insert(found->data());
  newest = found;
  return found;
}

template <typename Visit>
void for_each_map(Visit&& visit) {
  visit(at::cuda::cublas_handle_stream_to_workspace(), at::cuda::getChosenWorkspaceSize());
  visit(at::cuda::cublaslt_handle_stream_to_workspace(), at::cuda::getCUDABlasLtWorkspaceSize());
}

void* stream_of(const std::tuple<void*, void*>& key) { return std::get<1>(key); }

SharedWorkspace::~SharedWorkspace() {
  {
    SharedWorkspaces& shared = shared_workspaces();
    std::lock_guard<std::mutex> lock(shared.mutex);
    shared.addresses.erase(memory_.get());
  }
  try {
    // Entries still pointing here would hand PyTorch freed memory: drop them
    // (PyTorch makes a workspace of its own on the stream's next GEMM).
    for_each_map([&](at::cuda::WorkspaceMapWithMutex& workspaces, size_t /*configured*/) {
      std::unique_lock<std::shared_mutex> lock(workspaces.mutex);
      for (auto it = workspaces.map.begin(); it != workspaces.map.end();) {
        it = data_of(it->second).get() == memory_.get() ? workspaces.map.erase(it)
                                                           : std::next(it);
      }
    });
    memory_.clear();
    c10::cuda::CUDACachingAllocator::releasePool(device_, pool_);
  } catch (const std::exception& error) {
    TORCH_WARN("graphed: releasing a shared cuBLAS workspace failed: ", error.what());
  } catch (...) {
    TORCH_WARN("graphed: releasing a shared cuBLAS workspace failed.");
  }
}

}  // namespace

std::shared_ptr<void> share_stream_workspaces(c10::DeviceIndex device, cudaStream_t stream) {
  // The largest workspace `stream`'s entries ask for, then one buffer that
  // large (taken with no map locked: dropping an old lease may release a
  // buffer, which edits the maps), then every entry pointed at it.
  size_t largest = 0;
  for_each_map([&](at::cuda::WorkspaceMapWithMutex& workspaces, size_t configured) {
    std::shared_lock<std::shared_mutex> lock(workspaces.mutex);
    for (const auto& [key, value] : workspaces.map) {
      if (stream_of(key) == static_cast<void*>(stream)) {
        largest = std::max(largest, size_of(value, configured));
      }
    }
  });
  if (largest == 0) {
    return nullptr;  // No GEMM ran on `stream` yet.
  }
  std::shared_ptr<SharedWorkspace> lease = shared_buffer(device, stream, largest);
  const c10::Device cuda(c10::kCUDA, device);
  for_each_map([&](at::cuda::WorkspaceMapWithMutex& workspaces, size_t configured) {
    std::unique_lock<std::shared_mutex> lock(workspaces.mutex);
    for (auto& [key, value] : workspaces.map) {
      if (stream_of(key) != static_cast<void*>(stream) || data_of(value).get() == lease->data()) {
        continue;
      }
      // Replacing the value frees PyTorch's workspace on `stream` (or drops
      // a pointer to an older shared one); the work that used it is ordered
      // before anything `stream` runs next.
      value = borrowed(lease->data(), cuda, size_of(value, configured));
    }
  });
  return lease;
}

WorkspaceKeys workspace_keys() {
  WorkspaceKeys keys;
  auto collect = [](at::cuda::WorkspaceMapWithMutex& workspaces,
                    std::set<std::tuple<void*, void*>>& into) {
    std::shared_lock<std::shared_mutex> lock(workspaces.mutex);
    for (const auto& entry : workspaces.map) {
      into.insert(entry.first);
    }
  };
  collect(at::cuda::cublas_handle_stream_to_workspace(), keys.blas);
  collect(at::cuda::cublaslt_handle_stream_to_workspace(), keys.lt);
  return keys;
}

std::vector<at::DataPtr> take_capture_workspaces(const WorkspaceKeys& before,
                                                 c10::DeviceIndex device, cudaStream_t stream,
                                                 const std::shared_ptr<void>& lease) noexcept {
  const auto* shared = static_cast<const SharedWorkspace*>(lease.get());
  std::vector<at::DataPtr> taken;
  const c10::Device cuda(c10::kCUDA, device);
  auto take = [&](at::cuda::WorkspaceMapWithMutex& workspaces,
                  const std::set<std::tuple<void*, void*>>& known, size_t configured) {
    std::unique_lock<std::shared_mutex> lock(workspaces.mutex);
    for (auto it = workspaces.map.begin(); it != workspaces.map.end();) {
      at::DataPtr& data = data_of(it->second);
      if (known.count(it->first) > 0 || is_shared_buffer(data.get())) {
        ++it;
        continue;
      }
      const size_t bytes = size_of(it->second, configured);
      taken.push_back(std::move(data));
      if (stream_of(it->first) == static_cast<void*>(stream) && shared != nullptr &&
          shared->bytes() >= bytes) {
        it->second = borrowed(shared->data(), cuda, bytes);
        ++it;
        continue;
      }
      // Too small (or no lease): PyTorch makes a new one on the next GEMM,
      // and share_stream_workspaces() re-points it before the next capture.
      it = workspaces.map.erase(it);
    }
  };
  take(at::cuda::cublas_handle_stream_to_workspace(), before.blas,
       at::cuda::getChosenWorkspaceSize());
  take(at::cuda::cublaslt_handle_stream_to_workspace(), before.lt,
       at::cuda::getCUDABlasLtWorkspaceSize());
  return taken;
}

}  // namespace graphed::detail
