// Graph::find_references and Graph::repoint: moving a captured graph's input
// pointers instead of copying inputs into its static buffers.

#include "graphed/check.h"
#include "graphed/graph.h"
#include "pointer_sites.h"
#include "torch_graph.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace graphed {

// Note [Re-pointing a graph]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A replay reads its inputs from the addresses captured into its kernels'
// parameters. When the next input lives elsewhere, graphed either copies it
// into the static buffer (one copy kernel; device time grows with the size)
// or re-points the graph: every kernel parameter word holding an address
// inside the buffer is rewritten to the same offset in the new tensor and
// set on the instantiated graph with cudaGraphExecKernelNodeSetParams (host
// time per kernel that reads the input; no device work). Which is cheaper
// depends on the size of the input and on how many kernels read it: a copy
// costs a launch plus bytes / bandwidth, an update a driver call per
// referencing kernel, so small inputs copy and large ones re-point
// (bench/graph_update.py measures both; CaptureOptions::input_update picks).
// An input that keeps arriving at the same address (the output of the
// previous layer's graph) is re-pointed once and costs nothing afterwards.
//
// The scan must see every reference, or a re-pointed graph would read the old
// buffer. It reads each kernel's parameters with their sizes from the driver
// (cuFuncGetParamInfo, CUDA >= 12.4) and matches 8-byte aligned words, which
// covers pointers passed by value, also inside structs (TensorIterator's
// data pointer arrays). It gives up -- find_references returns nullopt and
// the caller keeps copying -- when a kernel packs its parameters into
// `extra`, when the driver cannot name a kernel's parameters, when a memcpy
// or memset node touches the buffer, and on child-graph or conditional nodes.
// Pointers stored in device memory (pointer arrays of batched GEMMs) are
// invisible to any host-side scan; no ATen operator on a single input tensor
// uses one, but this is why copying stays the default (Invariant 2 first).
// An input that an output is (or views), e.g. `return x * 2, x`, is never
// re-pointed (capture.cpp): the output is its static buffer, which only a
// copy refreshes.

namespace detail {
namespace {

struct DriverCalls {
  CUresult (*get_params)(CUgraphNode, CUDA_KERNEL_NODE_PARAMS*) = nullptr;
  CUresult (*exec_set_params)(CUgraphExec, CUgraphNode, const CUDA_KERNEL_NODE_PARAMS*) = nullptr;
  CUresult (*func_param_info)(CUfunction, size_t, size_t*, size_t*) = nullptr;
  CUresult (*kernel_param_info)(CUkernel, size_t, size_t*, size_t*) = nullptr;
};

template <typename Function>
void load(const char* symbol, Function& function) {
  void* pointer = nullptr;
  cudaDriverEntryPointQueryResult status{};
  if (cudaGetDriverEntryPointByVersion(symbol, &pointer, 12040, cudaEnableDefault, &status) ==
          cudaSuccess &&
      status == cudaDriverEntryPointSuccess) {
    function = reinterpret_cast<Function>(pointer);
  } else {
    (void)cudaGetLastError();
  }
}

// The driver calls, or nullptr when the driver lacks one (older than 12.4).
const DriverCalls* driver_calls() {
  static const DriverCalls calls = [] {
    DriverCalls loaded;
    load("cuGraphKernelNodeGetParams", loaded.get_params);
    load("cuGraphExecKernelNodeSetParams", loaded.exec_set_params);
    load("cuFuncGetParamInfo", loaded.func_param_info);
    load("cuKernelGetParamInfo", loaded.kernel_param_info);
    return loaded;
  }();
  const bool complete = calls.get_params && calls.exec_set_params && calls.func_param_info &&
                        calls.kernel_param_info;
  return complete ? &calls : nullptr;
}

}  // namespace

}  // namespace detail

namespace {

bool in_range(uint64_t value, uint64_t base, uint64_t bytes) {
  return value >= base && value < base + bytes;
}

// The parameters of a kernel node as captured, or false when they cannot be
// read completely.
bool read_kernel(const detail::DriverCalls& driver, cudaGraphNode_t node,
                 detail::PointerSites::KernelNode& out) {
  CUDA_KERNEL_NODE_PARAMS params{};
  if (driver.get_params(reinterpret_cast<CUgraphNode>(node), &params) != CUDA_SUCCESS) {
    return false;
  }
  if (params.kernelParams == nullptr) {
    return params.extra == nullptr;  // a kernel without parameters, or packed ones
  }
  if (params.func == nullptr && params.kern == nullptr) {
    return false;  // nothing to ask for the parameters' layout
  }
  for (size_t index = 0;; ++index) {
    size_t offset = 0;
    size_t size = 0;
    const CUresult status =
        params.func != nullptr ? driver.func_param_info(params.func, index, &offset, &size)
                               : driver.kernel_param_info(params.kern, index, &offset, &size);
    if (status == CUDA_ERROR_INVALID_VALUE) {
      break;  // past the last parameter
    }
    if (status != CUDA_SUCCESS) {
      return false;
    }
    const char* value = static_cast<const char*>(params.kernelParams[index]);
    out.values.emplace_back(value, value + size);
  }
  out.node = reinterpret_cast<CUgraphNode>(node);
  out.params = params;
  return true;
}

}  // namespace

std::optional<size_t> Graph::find_references(const void* base_pointer, size_t bytes) {
  GRAPHED_CHECK(is_captured(), "This Graph is empty: call capture() first.");
  const detail::DriverCalls* driver = detail::driver_calls();
  if (driver == nullptr) {
    return std::nullopt;
  }
  const uint64_t base = reinterpret_cast<uint64_t>(base_pointer);
  cudaGraph_t graph = torch_graph_->raw_cuda_graph();
  size_t count = 0;
  GRAPHED_CHECK_CUDA(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  if (count > 0) {
    GRAPHED_CHECK_CUDA(cudaGraphGetNodes(graph, nodes.data(), &count));
  }
  if (!pointer_sites_) {
    pointer_sites_ = std::make_unique<detail::PointerSites>();
  }
  const size_t site = pointer_sites_->sites.size();
  std::vector<detail::PointerSites::KernelNode> found;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    GRAPHED_CHECK_CUDA(cudaGraphNodeGetType(node, &type));
    switch (type) {
      case cudaGraphNodeTypeKernel: {
        detail::PointerSites::KernelNode kernel;
        if (!read_kernel(*driver, node, kernel)) {
          return std::nullopt;
        }
        for (size_t param = 0; param < kernel.values.size(); ++param) {
          const std::vector<char>& value = kernel.values[param];
          for (size_t offset = 0; offset + sizeof(uint64_t) <= value.size();
               offset += sizeof(uint64_t)) {
            uint64_t word = 0;
            std::memcpy(&word, value.data() + offset, sizeof(word));
            if (in_range(word, base, bytes)) {
              kernel.refs.push_back({site, param, offset, word - base});
            }
          }
        }
        if (!kernel.refs.empty()) {
          found.push_back(std::move(kernel));
        }
        break;
      }
      case cudaGraphNodeTypeMemcpy: {
        cudaMemcpy3DParms copy{};
        GRAPHED_CHECK_CUDA(cudaGraphMemcpyNodeGetParams(node, &copy));
        if (in_range(reinterpret_cast<uint64_t>(copy.srcPtr.ptr), base, bytes) ||
            in_range(reinterpret_cast<uint64_t>(copy.dstPtr.ptr), base, bytes)) {
          return std::nullopt;
        }
        break;
      }
      case cudaGraphNodeTypeMemset: {
        cudaMemsetParams set{};
        GRAPHED_CHECK_CUDA(cudaGraphMemsetNodeGetParams(node, &set));
        if (in_range(reinterpret_cast<uint64_t>(set.dst), base, bytes)) {
          return std::nullopt;
        }
        break;
      }
      case cudaGraphNodeTypeEmpty:
      case cudaGraphNodeTypeEventRecord:
      case cudaGraphNodeTypeWaitEvent:
      case cudaGraphNodeTypeHost:
        break;
      default:
        return std::nullopt;  // child graphs, conditionals, allocations: not scanned
    }
  }
  detail::PointerSites& sites = *pointer_sites_;
  sites.sites.push_back({base, bytes, base, found.size()});
  for (auto& kernel : found) {
    auto existing = std::find_if(sites.nodes.begin(), sites.nodes.end(),
                                 [&](const auto& known) { return known.node == kernel.node; });
    if (existing != sites.nodes.end()) {
      existing->refs.insert(existing->refs.end(), kernel.refs.begin(), kernel.refs.end());
    } else {
      sites.nodes.push_back(std::move(kernel));
    }
  }
  return site;
}

void Graph::repoint(size_t site, const void* base_pointer) {
  GRAPHED_CHECK(pointer_sites_ && site < pointer_sites_->sites.size(), "Expected a site from "
                "find_references(), got ", site, ".");
  const detail::DriverCalls* driver = detail::driver_calls();
  GRAPHED_INTERNAL_ASSERT(driver != nullptr, "a site exists without the driver calls");
  detail::PointerSites& sites = *pointer_sites_;
  const uint64_t base = reinterpret_cast<uint64_t>(base_pointer);
  if (sites.sites[site].current == base) {
    return;
  }
  sites.sites[site].current = base;
  CUgraphExec exec = reinterpret_cast<CUgraphExec>(torch_graph_->raw_cuda_graph_exec());
  std::vector<std::vector<char>> values;
  std::vector<void*> pointers;
  for (auto& kernel : sites.nodes) {
    const bool affected = std::any_of(kernel.refs.begin(), kernel.refs.end(),
                                      [&](const auto& ref) { return ref.site == site; });
    if (!affected) continue;
    // Every site's current address, so that one input's move keeps another's.
    values = kernel.values;
    for (const auto& ref : kernel.refs) {
      const uint64_t address = sites.sites[ref.site].current + ref.delta;
      std::memcpy(values[ref.param].data() + ref.offset, &address, sizeof(address));
    }
    pointers.clear();
    for (auto& value : values) pointers.push_back(value.data());
    CUDA_KERNEL_NODE_PARAMS params = kernel.params;
    params.kernelParams = pointers.data();
    params.extra = nullptr;
    const CUresult status = driver->exec_set_params(exec, kernel.node, &params);
    GRAPHED_CHECK_AS(CudaError, status == CUDA_SUCCESS, "cuGraphExecKernelNodeSetParams failed "
                     "with CUresult ", static_cast<int>(status), " while re-pointing a graph "
                     "input; capture with input_update=\"copy\" to avoid re-pointing.");
  }
}

size_t Graph::reference_count(size_t site) const {
  GRAPHED_CHECK(pointer_sites_ && site < pointer_sites_->sites.size(), "Expected a site from "
                "find_references(), got ", site, ".");
  return pointer_sites_->sites[site].kernels;
}

}  // namespace graphed
