// Captures a small LibTorch MLP with graphed::capture and compares it with
// eager execution: outputs and time per call. Exits 0 without a GPU, saying so.

#include <graphed/graphed.h>

#include <torch/torch.h>

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdio>
#include <vector>

namespace {

struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(int64_t width, int depth) {
    for (int i = 0; i < depth; ++i) {
      layers.push_back(register_module("linear" + std::to_string(i), torch::nn::Linear(width, width)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : layers) {
      x = x + torch::gelu(layer->forward(x));
    }
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(MLP);

template <typename Fn>
double milliseconds_per_call(Fn&& fn, int iters = 200) {
  for (int i = 0; i < 10; ++i) fn();
  at::cuda::CUDAEvent start(cudaEventDefault);
  at::cuda::CUDAEvent end(cudaEventDefault);
  std::vector<double> samples;
  for (int repeat = 0; repeat < 5; ++repeat) {
    start.record();
    for (int i = 0; i < iters; ++i) fn();
    end.record();
    end.synchronize();
    samples.push_back(start.elapsed_time(end) / iters);
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

}  // namespace

int main() {
  if (!torch::cuda::is_available()) {
    std::printf("capture_mlp: graphed %s needs an NVIDIA GPU to capture; none found.\n",
                GRAPHED_VERSION_STRING);
    return 0;
  }
  torch::manual_seed(0);
  torch::NoGradGuard no_grad;
  MLP model(512, 12);
  model->to(torch::kCUDA);
  model->eval();
  const torch::Tensor x = torch::randn({16, 512}, torch::kCUDA);

  graphed::CapturedFunction fast = graphed::capture(
      [&](const std::vector<c10::IValue>& inputs) -> c10::IValue {
        return model->forward(inputs[0].toTensor());
      },
      {x});

  const torch::Tensor expected = model->forward(x);
  const torch::Tensor got = fast({x}).toTensor();
  const bool match = torch::allclose(expected, got, 1e-5, 1e-5);
  const double eager_ms = milliseconds_per_call([&] { (void)model->forward(x); });
  const double graph_ms = milliseconds_per_call([&] { (void)fast({x}); });
  const graphed::GraphStats stats = fast.graph().stats();
  std::printf("capture_mlp: outputs %s; eager %.4f ms, graphed %.4f ms (%.2fx), %lld kernels\n",
              match ? "match" : "DIFFER", eager_ms, graph_ms, eager_ms / graph_ms,
              static_cast<long long>(stats.kernels));
  return match ? 0 : 1;
}
