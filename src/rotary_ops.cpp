// Note [Rotary embedding in one kernel]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// transformers' attention layers (Llama and its copies: Mistral, Qwen2/3,
// Qwen3-MoE, Gemma 2/3, Granite, ...) rotate queries and keys with
//   q_embed = (q * cos) + (rotate_half(q) * sin)
//   rotate_half(x) = cat(-x[..., half:], x[..., :half])
// five kernels a tensor (negation, concatenation, two products, a sum), ten a
// layer, each a microsecond or two at decode sizes and a gap before the next
// in a step graph: 40 of the ~200 kernels of a 4-layer Mistral decode step.
// Each element's result is three roundings of exact operands (the negation
// and the concatenation are exact): x*cos, rotated*sin and their sum, each
// rounded to the tensor's dtype. One kernel computing those three roundings
// in that order, without contracting a product and the sum into an FMA,
// gives the same bits in float32, bfloat16 and float16 (rotary_kernels.cu).
// The result keeps x's strides, as ATen's elementwise kernels keep a dense
// operand's. graphed's decoders swap the modeling module's
// apply_rotary_pos_emb for it during their eager steps and check its first
// call against transformers' function to the bit
// (python/graphed/_decode_rotary.py); a torch whose kernels round otherwise
// keeps transformers' function.

#include "graphed/rotary_ops.h"

#include "graphed/check.h"

#include "device_float_type.h"

#include "device/rotary_kernels.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace graphed {
namespace {

constexpr const char* kFunction = "rotary_embedding";

std::string describe(const at::Tensor& t) {
  return t.defined() ? c10::str(t.scalar_type(), " ", t.sizes(), " on ", t.device()) : "none";
}

bool last_dim_contiguous(const at::Tensor& t) {
  return t.size(-1) == 1 || t.stride(-1) == 1;
}

// The stride of dimension `d`, 0 where its size is 1 (a broadcast row).
int64_t stride_or_broadcast(const at::Tensor& t, int64_t d) {
  return t.size(d) == 1 ? 0 : t.stride(d);
}

}  // namespace

std::optional<std::string> rotary_embedding_refusal(const at::Tensor& x, const at::Tensor& cos,
                                                    const at::Tensor& sin) {
  if (!x.defined() || !cos.defined() || !sin.defined()) {
    return c10::str("Expected ", kFunction, "'s states, cosines and sines to be tensors, got ",
                    describe(x), ", ", describe(cos), " and ", describe(sin), ".");
  }
  if (!float_type_of(x.scalar_type())) {
    return c10::str("Expected ", kFunction, "'s states in float32, bfloat16 or float16, got ",
                    describe(x), "; other dtypes keep transformers' function.");
  }
  for (const auto& [name, t] : {std::pair<const char*, at::Tensor>{"cosines", cos},
                                {"sines", sin}}) {
    if (t.scalar_type() != x.scalar_type()) {
      return c10::str("Expected ", kFunction, "'s ", name, " in the states' dtype (",
                      x.scalar_type(), "), got ", describe(t), "; transformers' products ",
                      "promote mixed dtypes, which the kernel does not reproduce.");
    }
  }
  if (x.dim() != 4 || cos.dim() != 3 || sin.dim() != 3) {
    return c10::str("Expected ", kFunction, "'s states of [batch, heads, seq, dim] and cosines ",
                    "and sines of [batch, seq, dim], got ", describe(x), ", ", describe(cos),
                    " and ", describe(sin), "; other shapes keep transformers' function.");
  }
  for (const auto& [name, t] : {std::pair<const char*, at::Tensor>{"states", x},
                                {"cosines", cos},
                                {"sines", sin}}) {
    if (!t.is_cuda() || t.device() != x.device()) {
      return c10::str("Expected ", kFunction, "'s ", name, " on the states' CUDA device, got ",
                      describe(t), "; the kernel runs on the GPU, transformers' function ",
                      "elsewhere.");
    }
    if (c10::GradMode::is_enabled() && t.requires_grad()) {
      return c10::str("Expected ", kFunction, "'s ", name, " not to require grad (a decode ",
                      "step runs under no_grad), got one that does; the kernel has no ",
                      "backward, so transformers' function runs.");
    }
    if (!last_dim_contiguous(t)) {
      return c10::str("Expected ", kFunction, "'s ", name, " with a contiguous last ",
                      "dimension, got ", describe(t), " with strides ", t.strides(), ".");
    }
  }
  const int64_t batch = x.size(0), seq = x.size(2), dim = x.size(3);
  if (x.numel() == 0 || dim % 2 != 0) {
    return c10::str("Expected ", kFunction, "'s states with elements and an even last ",
                    "dimension, got ", describe(x), "; transformers' function runs.");
  }
  for (const auto& [name, t] : {std::pair<const char*, at::Tensor>{"cosines", cos},
                                {"sines", sin}}) {
    if ((t.size(0) != batch && t.size(0) != 1) || t.size(1) != seq || t.size(2) != dim) {
      return c10::str("Expected ", kFunction, "'s ", name, " of [", batch, " or 1, ", seq, ", ",
                      dim, "] for states of ", x.sizes(), ", got ", describe(t), ".");
    }
  }
  if (!x.is_non_overlapping_and_dense()) {
    return c10::str("Expected ", kFunction, "'s states non-overlapping and dense, got ",
                    describe(x), " with strides ", x.strides(), "; other layouts keep ",
                    "transformers' function.");
  }
  return std::nullopt;
}

at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto why = rotary_embedding_refusal(x, cos, sin);
  GRAPHED_CHECK(!why, *why);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);  // x's strides: it is dense
  device::RotaryApply a;
  a.x = x.data_ptr();
  a.cos = cos.data_ptr();
  a.sin = sin.data_ptr();
  a.out = out.data_ptr();
  for (int64_t d = 0; d < 3; ++d) {
    a.x_strides[d] = stride_or_broadcast(x, d);
    a.out_strides[d] = stride_or_broadcast(out, d);
  }
  for (int64_t d = 0; d < 2; ++d) {
    a.cos_strides[d] = stride_or_broadcast(cos, d);
    a.sin_strides[d] = stride_or_broadcast(sin, d);
  }
  a.type = *float_type_of(x.scalar_type());
  a.batch = x.size(0);
  a.heads = x.size(1);
  a.seq = x.size(2);
  a.dim = x.size(3);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  GRAPHED_CHECK_CUDA(device::launch_rotary_apply(a, stream));
  return out;
}

}  // namespace graphed
