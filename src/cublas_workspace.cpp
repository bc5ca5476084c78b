#include "cublas_workspace.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <array>
#include <mutex>
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

// graphed's workspace buffers, per device, never freed (graphs captured with
// an older, smaller one may live until the process exits); the newest serves
// new captures.
struct SharedBuffers {
  std::mutex mutex;
  std::array<std::vector<std::pair<at::DataPtr, size_t>>, C10_COMPILE_TIME_MAX_GPUS> buffers;
  std::set<const void*> addresses;
};

SharedBuffers& shared_buffers() {
  static auto& instance = *new SharedBuffers;  // leaked: outlives every graph
  return instance;
}

bool is_shared_buffer(const void* data) {
  SharedBuffers& shared = shared_buffers();
  std::lock_guard<std::mutex> lock(shared.mutex);
  return shared.addresses.count(data) > 0;
}

// The newest shared buffer of `device`, at least `bytes` long; nullptr when
// that needs an allocation and `may_allocate` is false.
void* shared_buffer(c10::DeviceIndex device, size_t bytes, bool may_allocate = true) {
  SharedBuffers& shared = shared_buffers();
  std::lock_guard<std::mutex> lock(shared.mutex);
  auto& buffers = shared.buffers.at(static_cast<size_t>(device));
  if (buffers.empty() || buffers.back().second < bytes) {
    if (!may_allocate) {
      return nullptr;
    }
    c10::cuda::CUDAGuard guard(device);
    at::DataPtr memory = c10::cuda::CUDACachingAllocator::get()->allocate(bytes);
    shared.addresses.insert(memory.get());
    buffers.emplace_back(std::move(memory), bytes);
  }
  return buffers.back().first.get();
}

template <typename Visit>
void for_each_map(Visit&& visit) {
  visit(at::cuda::cublas_handle_stream_to_workspace(), at::cuda::getChosenWorkspaceSize());
  visit(at::cuda::cublaslt_handle_stream_to_workspace(), at::cuda::getCUDABlasLtWorkspaceSize());
}

void* stream_of(const std::tuple<void*, void*>& key) { return std::get<1>(key); }

}  // namespace

void share_stream_workspaces(c10::DeviceIndex device, cudaStream_t stream) {
  const c10::Device cuda(c10::kCUDA, device);
  for_each_map([&](at::cuda::WorkspaceMapWithMutex& workspaces, size_t configured) {
    std::unique_lock<std::shared_mutex> lock(workspaces.mutex);
    for (auto& [key, value] : workspaces.map) {
      if (stream_of(key) != static_cast<void*>(stream) || is_shared_buffer(data_of(value).get())) {
        continue;
      }
      const size_t bytes = size_of(value, configured);
      // Replacing the value frees PyTorch's workspace on `stream`; the work
      // that used it is ordered before anything `stream` runs next.
      value = borrowed(shared_buffer(device, bytes), cuda, bytes);
    }
  });
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
                                                 bool may_allocate) noexcept {
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
      if (stream_of(it->first) == static_cast<void*>(stream)) {
        try {
          if (void* buffer = shared_buffer(device, bytes, may_allocate)) {
            it->second = borrowed(buffer, cuda, bytes);
            ++it;
            continue;
          }
        } catch (const std::exception&) {
          // Out of memory for a bigger shared buffer: drop the entry instead;
          // share_stream_workspaces() tries again before the next capture.
        }
      }
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
