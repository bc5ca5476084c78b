"""PyTorch alone (no graphed): a hand-written torch.cuda.graph writes into
memory it does not own once PyTorch frees the cuBLAS workspace it captured.
Note [cuBLAS workspaces of captured graphs] in src/cublas_workspace.h.

    python scripts/repro_torch_cublas_workspace.py   # exit 1: the replay wrote into other tensors

The same steps on graphed's mlp_inference model (session 12, the H200, torch
2.11) overwrote 98,304 floats of unrelated tensors; in the benchmark the
replay hit an illegal memory access once the memory had gone back to the
driver. This script's own output on the H200 is not recorded yet."""

import gc
import sys

import torch


def capture(fn):
    """The documented recipe: warm up on a side stream, capture on torch's default capture stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    layers = [torch.nn.Linear(512, 512).cuda() for _ in range(16)]
    x = torch.randn(32, 512, device="cuda")

    def model():
        y = x
        for layer in layers:
            y = torch.nn.functional.gelu(layer(y))
        return y

    with torch.no_grad():
        # 1. A graph captured and destroyed: the capture stream's cuBLAS
        #    workspace was created during its capture, in its private pool,
        #    and outlives it in PyTorch's workspace map.
        first, _ = capture(model)
        del first, _
        gc.collect()
        # 2. A second graph on the same capture stream reuses that workspace.
        graph, out = capture(model)
        expected = model().clone()
        # 3. What torch.compile(mode="reduce-overhead") does around every recording.
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        sentinels = [torch.full((8 << 20,), 7.0, device="cuda") for _ in range(8)]
        graph.replay()
        torch.cuda.synchronize()
        damaged = sum(int((s != 7).sum().item()) for s in sentinels)
    print(f"replay matches eager: {torch.allclose(out, expected)}; "
          f"elements of unrelated tensors overwritten by the replay: {damaged}")
    return 1 if damaged else 0


if __name__ == "__main__":
    sys.exit(main())
