#pragma once

// Private to libgraphed: who owns the cuBLAS workspaces that captured graphs
// write into. See Note [cuBLAS workspaces of captured graphs].

#include <ATen/core/TensorBody.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <set>
#include <tuple>
#include <vector>

namespace graphed::detail {

// Note [cuBLAS workspaces of captured graphs]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// PyTorch gives every (cuBLAS handle, stream) pair a workspace on first use
// and keeps it in a process-wide map (cublas_handle_stream_to_workspace(), and
// one for cuBLASLt). A GEMM captured into a graph records the workspace's
// address, so the graph writes there on every replay; but the map, not the
// graph, owns that memory, and PyTorch frees it behind the graph's back:
// torch.compile's cudagraph trees call torch._C._cuda_clearCublasWorkspaces()
// before and after every recording, and newer torch's CUDAGraph::reset()
// clears the workspaces of its capture stream (2.14's does, 2.11's not).
// Measured on the H200 (torch 2.11, scripts/repro_torch_cublas_workspace.py):
// a hand-written torch.cuda.graph of the mlp_inference model, captured after
// another graph on the same capture stream had been destroyed, used the
// workspace left in the dead graph's pool; after clearCublasWorkspaces() and
// empty_cache() its replay overwrote 98,304 floats of tensors allocated since,
// and in the benchmark (gpt_train then mlp_inference in one process, where
// compile_reduce_overhead does the clearing) the same replay hit an illegal
// memory access once the segment was returned to the driver. That is PyTorch's
// bug (bench/run.py's forget_cublas_workspaces() keeps the benchmark's hand-
// written graphs clear of it); graphed's own graphs would suffer the same
// through the shared capture stream's workspace (Note [One capture stream per
// device]), so graphed owns what its graphs write into:
// - Before capture begins, every map entry for the capture stream is pointed
//   at a buffer graphed allocates (the map gets a non-owning pointer, so
//   clearing the map frees nothing). Every graph captured with it holds it
//   (a lease), and all graphs captured on that stream share it, which is
//   safe for the reason the stream itself is shared: they never replay
//   concurrently, and a workspace holds nothing from one GEMM to the next.
//   When the last graph holding it is destroyed, the map entries pointing at
//   it are removed and it is freed: its memory sits in a private pool of its
//   own, so nothing can reuse it while a replay may still run, and the
//   segment goes back to the device at the next empty_cache() (issue 29:
//   dropping every graph gives back all of graphed's memory).
// - A workspace created during the capture (a handle that did not run during
//   warm-up, or a side stream the captured code forks onto) comes from the
//   graph's private pool; the graph takes ownership of it and the map entry
//   goes back to the shared buffer (capture stream) or away (side streams),
//   so no later capture can inherit memory that dies with this graph. A
//   failed capture does the same before its pool is released.
// A replay therefore never writes into memory it does not own, whatever
// clears PyTorch's maps. tests/python/test_cublas_workspace_gpu.py checks it;
// its TrainStep cases failed on the H200 before graphed owned the workspaces
// (sentinel tensors overwritten after clearCublasWorkspaces() and after a
// torch.compile(mode="reduce-overhead") recording).

// The keys ((handle, stream)) of PyTorch's cuBLAS and cuBLASLt workspace maps.
struct WorkspaceKeys {
  std::set<std::tuple<void*, void*>> blas;
  std::set<std::tuple<void*, void*>> lt;
};

// Points every workspace entry of `stream` (on `device`) at graphed's shared
// buffer, growing it when an entry asks for more, and returns the buffer (a
// lease: hold it for as long as a graph captured next may replay; null when
// `stream` has no entry yet). Call outside any capture.
std::shared_ptr<void> share_stream_workspaces(c10::DeviceIndex device, cudaStream_t stream);

// The map keys now.
WorkspaceKeys workspace_keys();

// The workspaces created since `before` (during a capture on `stream`):
// returns their memory for the graph to own, re-points `stream`'s entries at
// `lease` (what share_stream_workspaces returned before the capture) and
// removes the other new entries, and those `lease` is too small for.
// Allocates nothing; never throws.
std::vector<at::DataPtr> take_capture_workspaces(const WorkspaceKeys& before,
                                                 c10::DeviceIndex device, cudaStream_t stream,
                                                 const std::shared_ptr<void>& lease) noexcept;

}  // namespace graphed::detail
