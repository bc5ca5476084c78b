// Note [Fused state-space decode steps]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Without the mamba-ssm and causal-conv1d packages, transformers decodes a
// Mamba2 layer's step on its torch reference path: the selective state
// update is fourteen float32 kernels (the bias add, softplus, the product
// with A and its exp, B and C made contiguous, three products, the sum, the
// state's copy, cuBLAS's product with C, the skip connection's product and
// sum) and the convolution's update four (a cat, the state's copy, the
// convolution, SiLU). In a decode graph every kernel costs its run time and
// a gap before the next one (0.4 us on the H200): at batch 1 these kernels
// run for about a microsecond each, so a Mamba2 step graph was 1.29x its
// kernels' time, more than the attention models' 1.2x. These functions do
// the same arithmetic in three kernels and one (Note [The reference's
// roundings] in src/device/state_space_kernels.cu), bitwise transformers'
// results, so that greedy tokens stay transformers'. On the H200 (bench
// hf_decode_models, Mamba2 4 layers d512, batch 1) a decode step went from
// 156 kernels to 104 and from 0.319 to 0.237 ms per token.
//
// graphed.generate and graphed.Decoder put them in place of transformers'
// two reference functions while their adapter runs a decode step eagerly
// (warm-ups, captures, python/graphed/_state_space_kernels.py); a replay
// runs what the capture recorded. Each fused function's first call outside
// a capture also runs transformers' function on a copy of the state and
// compares both results and both states with torch.equal: a difference (a
// transformers or torch whose reference rounds otherwise) drops the fused
// kernel for that function, with a note, and a capture before that check
// records transformers' function. Arguments these kernels do not take
// (another dtype, a gate z, a package kernel already in place) keep
// transformers' function: the refusal functions say why, and graphed's
// notes say which layers were fused.

#include "graphed/state_space_ops.h"

#include "graphed/check.h"

#include "device/state_space_kernels.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <initializer_list>
#include <utility>

namespace graphed {
namespace {

std::string describe(const at::Tensor& t) {
  return t.defined() ? c10::str(t.scalar_type(), " ", t.sizes(), " on ", t.device()) : "none";
}

// The checks every tensor argument shares: float32, the first one's CUDA
// device, and no autograd in a step that fuses away the graph of its ops.
std::optional<std::string> common_refusal(
    const char* function, std::initializer_list<std::pair<const char*, at::Tensor>> tensors) {
  const at::Tensor& first = tensors.begin()->second;
  for (const auto& [name, t] : tensors) {
    if (!t.defined()) {
      continue;
    }
    if (!t.is_cuda()) {
      return c10::str("Expected ", function, "'s ", name, " on a CUDA device, got ", describe(t),
                      "; the fused kernel runs on the GPU, transformers' function elsewhere.");
    }
    if (t.device() != first.device()) {
      return c10::str("Expected ", function, "'s ", name, " on ", first.device(), " with its ",
                      "other arguments, got ", describe(t), "; move them to one GPU.");
    }
    if (t.scalar_type() != at::kFloat) {
      return c10::str("Expected ", function, "'s ", name, " in float32, got ", describe(t),
                      "; other dtypes keep transformers' function, whose roundings the fused ",
                      "kernel reproduces in float32 only.");
    }
    if (c10::GradMode::is_enabled() && t.requires_grad()) {
      return c10::str("Expected ", function, "'s ", name, " not to require grad (a decode ",
                      "step runs under no_grad), got one that does; the fused kernel has no ",
                      "backward, so transformers' function runs.");
    }
  }
  return std::nullopt;
}

std::optional<std::string> shape_refusal(const char* function, const char* name,
                                         const at::Tensor& t, at::IntArrayRef expected) {
  if (t.sizes() != expected) {
    return c10::str("Expected ", function, "'s ", name, " of shape ", expected, ", got ",
                    describe(t), ".");
  }
  return std::nullopt;
}

cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

}  // namespace

std::optional<std::string> selective_state_update_refusal(
    const at::Tensor& state, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
    const at::Tensor& B, const at::Tensor& C, const at::Tensor& D, const at::Tensor& dt_bias) {
  constexpr const char* kFunction = "selective_state_update";
  if (!state.defined() || !x.defined() || !dt.defined() || !A.defined() || !B.defined() ||
      !C.defined()) {
    return c10::str("Expected ", kFunction, "'s state, x, dt, A, B and C to be tensors, got ",
                    describe(state), ", ", describe(x), ", ", describe(dt), ", ", describe(A),
                    ", ", describe(B), ", ", describe(C), ".");
  }
  if (auto why = common_refusal(kFunction, {{"state", state}, {"x", x}, {"dt", dt}, {"A", A},
                                            {"B", B}, {"C", C}, {"D", D},
                                            {"dt_bias", dt_bias}})) {
    return why;
  }
  if (state.dim() != 4 || !state.is_contiguous()) {
    return c10::str("Expected ", kFunction, "'s state to be a contiguous 4-D [batch, heads, ",
                    "head_dim, state_size] tensor, got ", describe(state),
                    state.dim() == 4 ? " (not contiguous)" : "", ".");
  }
  const int64_t batch = state.size(0), heads = state.size(1), head_dim = state.size(2),
                state_size = state.size(3);
  if (B.dim() != 3 || B.size(0) != batch || B.size(2) != state_size || B.size(1) < 1 ||
      heads % B.size(1) != 0) {
    return c10::str("Expected ", kFunction, "'s B to be [batch, groups, state_size] = [", batch,
                    ", a divisor of ", heads, ", ", state_size, "], got ", describe(B), ".");
  }
  const int64_t groups = B.size(1);
  for (auto why : {shape_refusal(kFunction, "x", x, {batch, heads, head_dim}),
                   shape_refusal(kFunction, "dt", dt, {batch, heads, head_dim}),
                   shape_refusal(kFunction, "A", A, {heads, head_dim, state_size}),
                   shape_refusal(kFunction, "C", C, {batch, groups, state_size})}) {
    if (why) {
      return why;
    }
  }
  if (D.defined()) {
    if (auto why = shape_refusal(kFunction, "D", D, {heads, head_dim})) {
      return why;
    }
  }
  if (dt_bias.defined()) {
    if (auto why = shape_refusal(kFunction, "dt_bias", dt_bias, {heads, head_dim})) {
      return why;
    }
  }
  return std::nullopt;
}

at::Tensor selective_state_update(const at::Tensor& state, const at::Tensor& x,
                                  const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                                  const at::Tensor& C, const at::Tensor& D,
                                  const at::Tensor& dt_bias, bool dt_softplus) {
  const auto why = selective_state_update_refusal(state, x, dt, A, B, C, D, dt_bias);
  GRAPHED_CHECK(!why, *why);
  const c10::cuda::CUDAGuard guard(state.device());
  const int64_t batch = state.size(0), heads = state.size(1), head_dim = state.size(2),
                state_size = state.size(3), groups = B.size(1);
  device::SelectiveStateUpdate update;
  update.state = state.data_ptr<float>();
  update.x = x.data_ptr<float>();
  update.dt = dt.data_ptr<float>();
  update.a = A.data_ptr<float>();
  update.b = B.data_ptr<float>();
  for (int d = 0; d < 4; ++d) {
    update.state_stride[d] = state.stride(d);
  }
  for (int d = 0; d < 3; ++d) {
    update.x_stride[d] = x.stride(d);
    update.dt_stride[d] = dt.stride(d);
    update.a_stride[d] = A.stride(d);
    update.b_stride[d] = B.stride(d);
  }
  if (dt_bias.defined()) {
    update.dt_bias = dt_bias.data_ptr<float>();
    update.dt_bias_stride[0] = dt_bias.stride(0);
    update.dt_bias_stride[1] = dt_bias.stride(1);
  }
  update.batch = batch;
  update.heads = heads;
  update.head_dim = head_dim;
  update.state_size = state_size;
  update.groups = groups;
  update.dt_softplus = dt_softplus;
  // C repeated per head, as the reference's expand(...).contiguous() lays it
  // out; the update kernel fills it.
  const at::Tensor c = at::empty({batch, heads, state_size}, C.options());
  update.c = C.data_ptr<float>();
  for (int d = 0; d < 3; ++d) {
    update.c_stride[d] = C.stride(d);
  }
  update.c_heads = c.data_ptr<float>();
  GRAPHED_CHECK_CUDA(device::launch_selective_state_update(update, stream_of(state)));

  // The product with C on the reference's shapes: one [head_dim, state_size]
  // @ [state_size, 1] per row and head.
  at::Tensor y = at::bmm(state.view({batch * heads, head_dim, state_size}),
                         c.view({batch * heads, state_size, 1}))
                     .view({batch, heads, head_dim});
  if (!D.defined()) {
    return y;
  }
  at::Tensor out = at::empty_like(y);
  device::SkipConnection skip;
  skip.y = y.data_ptr<float>();
  skip.x = x.data_ptr<float>();
  skip.d = D.data_ptr<float>();
  skip.out = out.data_ptr<float>();
  for (int d = 0; d < 3; ++d) {
    skip.x_stride[d] = x.stride(d);
  }
  skip.d_stride[0] = D.stride(0);
  skip.d_stride[1] = D.stride(1);
  skip.batch = batch;
  skip.heads = heads;
  skip.head_dim = head_dim;
  GRAPHED_CHECK_CUDA(device::launch_skip_connection(skip, stream_of(state)));
  return out;
}

std::optional<std::string> causal_conv1d_update_refusal(const at::Tensor& x,
                                                        const at::Tensor& conv_state,
                                                        const at::Tensor& weight,
                                                        const at::Tensor& bias) {
  constexpr const char* kFunction = "causal_conv1d_update";
  if (!x.defined() || !conv_state.defined() || !weight.defined()) {
    return c10::str("Expected ", kFunction, "'s x, conv_state and weight to be tensors, got ",
                    describe(x), ", ", describe(conv_state), ", ", describe(weight), ".");
  }
  if (auto why = common_refusal(kFunction, {{"x", x}, {"conv_state", conv_state},
                                            {"weight", weight}, {"bias", bias}})) {
    return why;
  }
  if (x.dim() != 3 || x.size(2) != 1) {
    return c10::str("Expected ", kFunction, "'s x to be [batch, channels, 1] (one new ",
                    "position), got ", describe(x), "; longer inputs keep transformers' ",
                    "function.");
  }
  const int64_t batch = x.size(0), channels = x.size(1);
  if (conv_state.dim() != 3 || conv_state.size(0) != batch || conv_state.size(1) != channels ||
      conv_state.size(2) < 1 || conv_state.size(2) > device::kMaxConvWidth) {
    return c10::str("Expected ", kFunction, "'s conv_state to be [batch, channels, width] = [",
                    batch, ", ", channels, ", 1 to ", device::kMaxConvWidth, "], got ",
                    describe(conv_state), ".");
  }
  if (auto why = shape_refusal(kFunction, "weight", weight, {channels, conv_state.size(2)})) {
    return why;
  }
  if (bias.defined()) {
    if (auto why = shape_refusal(kFunction, "bias", bias, {channels})) {
      return why;
    }
  }
  return std::nullopt;
}

at::Tensor causal_conv1d_update(const at::Tensor& x, const at::Tensor& conv_state,
                                const at::Tensor& weight, const at::Tensor& bias, bool silu) {
  const auto why = causal_conv1d_update_refusal(x, conv_state, weight, bias);
  GRAPHED_CHECK(!why, *why);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({x.size(0), x.size(1), 1}, x.options());
  device::ConvStateUpdate conv;
  conv.x = x.data_ptr<float>();
  conv.x_stride[0] = x.stride(0);
  conv.x_stride[1] = x.stride(1);
  conv.state = conv_state.data_ptr<float>();
  for (int d = 0; d < 3; ++d) {
    conv.state_stride[d] = conv_state.stride(d);
  }
  conv.weight = weight.data_ptr<float>();
  conv.weight_stride[0] = weight.stride(0);
  conv.weight_stride[1] = weight.stride(1);
  if (bias.defined()) {
    conv.bias = bias.data_ptr<float>();
    conv.bias_stride = bias.stride(0);
  }
  conv.out = out.data_ptr<float>();
  conv.batch = x.size(0);
  conv.channels = x.size(1);
  conv.width = conv_state.size(2);
  conv.silu = silu;
  GRAPHED_CHECK_CUDA(device::launch_conv_state_update(conv, stream_of(x)));
  return out;
}

}  // namespace graphed
