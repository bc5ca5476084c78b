#pragma once

// Private to libgraphed: what Graph::find_references found, for Graph::repoint
// (src/graph_update.cpp, Note [Re-pointing a graph]).

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace graphed::detail {

struct PointerSites {
  struct Ref {
    size_t site = 0;
    size_t param = 0;
    size_t offset = 0;  // within the parameter
    uint64_t delta = 0;  // from the site's base
  };
  struct KernelNode {
    CUgraphNode node = nullptr;
    CUDA_KERNEL_NODE_PARAMS params{};
    std::vector<std::vector<char>> values;  // every parameter as captured
    std::vector<Ref> refs;
  };
  struct Site {
    uint64_t base = 0;
    uint64_t bytes = 0;
    uint64_t current = 0;
    size_t kernels = 0;
  };
  std::vector<KernelNode> nodes;
  std::vector<Site> sites;
};

}  // namespace graphed::detail
