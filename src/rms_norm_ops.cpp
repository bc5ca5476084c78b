// Note [RMSNorm in three kernels]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// transformers writes its RMSNorm modules as a chain of ATen calls:
//   h = hidden.to(float32)                       (a cast; nothing in float32)
//   h = h * silu(gate.to(float32))               (gated: SiLU, product)
//   variance = h.pow(2).mean(-1, keepdim=True)   (square, mean)
//   h = h * rsqrt(variance + eps)                (sum, root, product)
//   return weight * h.to(input_dtype)            (a cast, a product)
// six float32 kernels, eight gated, each a microsecond at decode sizes, and
// two casts more in bfloat16 or float16; Gemma's modules scale by
// (1.0 + weight), a kernel on the weight before the product, and gpt-oss's,
// OLMo 2's and Gemma's take the product in float32 before the cast. After
// the fused state updates (Note [Fused state-space decode steps]) they were
// 14 of the 26 kernels of a Mamba2 layer's decode step, and in a step graph
// each costs its run time and a gap before the next.
//
// Fusing the whole norm into one kernel would change its sum: ATen's mean is
// a reduction whose order (vectorized loads, a block's tree, warp shuffles)
// depends on the shape and the GPU, and a tree of our own rounds differently,
// so greedy tokens would no longer be transformers'. What can be fused
// without changing a bit is everything around the sum. rms_norm runs
//   1. the gate and the squares in one kernel (gated), ATen's pow (plain
//      float32) or the cast and the square in one kernel (plain bfloat16 or
//      float16, into the layout the reference's cast makes),
//   2. ATen's own mean on those squares (the reference's kernel, on a tensor
//      of the reference's layout: contiguous, as the reference's product
//      makes it, or what ATen's pow makes of the input),
//   3. the sum with eps, the root, both products and the casts in one kernel
//      (with Gemma's 1 + weight, rounded as ATen's add rounds it, before its
//      product; the cast before the weight's product in Llama's form, after
//      it in the others),
// three kernels either way, each expression rounded as its ATen kernel
// rounds it (rms_norm_kernels.cu). graphed's decoders swap the modules'
// forwards for it during their eager steps and check the first call against
// the module's own forward to the bit (python/graphed/_decode_norms.py),
// so a torch whose kernels round otherwise keeps transformers' forward.
// The layout of the result (contiguous) is the reference's for every input
// taken: its products are of a contiguous or non-dense operand.

#include "graphed/rms_norm_ops.h"

#include "graphed/check.h"

#include "device_float_type.h"

#include "device/rms_norm_kernels.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace graphed {
namespace {

constexpr const char* kFunction = "rms_norm";

std::string describe(const at::Tensor& t) {
  return t.defined() ? c10::str(t.scalar_type(), " ", t.sizes(), " on ", t.device()) : "none";
}

// The stride between rows when `t` is [..., cols] with contiguous columns and
// leading dimensions that collapse into one row dimension; nullopt otherwise.
std::optional<int64_t> row_stride(const at::Tensor& t) {
  if (t.dim() == 0) {
    return std::nullopt;
  }
  const int64_t last = t.dim() - 1;
  if (t.size(last) != 1 && t.stride(last) != 1) {
    return std::nullopt;
  }
  std::optional<int64_t> stride;  // of the innermost leading dimension with size > 1
  int64_t inner = 0;              // elements the rows so far span, in rows
  for (int64_t d = last - 1; d >= 0; --d) {
    if (t.size(d) == 1) {
      continue;
    }
    if (!stride) {
      stride = t.stride(d);
      inner = t.size(d);
    } else if (t.stride(d) != *stride * inner) {
      return std::nullopt;
    } else {
      inner *= t.size(d);
    }
  }
  return stride.value_or(t.size(last));
}

std::optional<std::string> tensor_refusal(const char* name, const at::Tensor& t,
                                          const at::Tensor& first) {
  if (!t.is_cuda()) {
    return c10::str("Expected ", kFunction, "'s ", name, " on a CUDA device, got ", describe(t),
                    "; the fused kernels run on the GPU, transformers' forward elsewhere.");
  }
  if (t.device() != first.device()) {
    return c10::str("Expected ", kFunction, "'s ", name, " on ", first.device(),
                    " with its other arguments, got ", describe(t), "; move them to one GPU.");
  }
  if (c10::GradMode::is_enabled() && t.requires_grad()) {
    return c10::str("Expected ", kFunction, "'s ", name, " not to require grad (a decode step ",
                    "runs under no_grad), got one that does; the fused kernels have no ",
                    "backward, so transformers' forward runs.");
  }
  return std::nullopt;
}

std::optional<std::string> layout_refusal(const char* name, const at::Tensor& t) {
  if (!row_stride(t)) {
    return c10::str("Expected ", kFunction, "'s ", name, " with a contiguous last dimension and ",
                    "leading dimensions of one row stride, got ", describe(t), " with strides ",
                    t.strides(), "; other layouts keep transformers' forward.");
  }
  return std::nullopt;
}

cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

}  // namespace

std::optional<std::string> rms_norm_refusal(const at::Tensor& hidden, const at::Tensor& gate,
                                            const at::Tensor& weight) {
  if (!hidden.defined() || !weight.defined()) {
    return c10::str("Expected ", kFunction, "'s hidden states and weight to be tensors, got ",
                    describe(hidden), " and ", describe(weight), ".");
  }
  if (hidden.dim() == 0 || hidden.numel() == 0) {
    return c10::str("Expected ", kFunction, "'s hidden states with at least one dimension and ",
                    "one element, got ", describe(hidden), "; transformers' forward runs.");
  }
  if (!float_type_of(hidden.scalar_type())) {
    return c10::str("Expected ", kFunction, "'s hidden states in float32, bfloat16 or float16, ",
                    "got ", describe(hidden), "; other dtypes keep transformers' forward.");
  }
  for (const auto& [name, t] : {std::pair<const char*, at::Tensor>{"gate", gate},
                                {"weight", weight}}) {
    if (t.defined() && t.scalar_type() != hidden.scalar_type()) {
      return c10::str("Expected ", kFunction, "'s ", name, " in the hidden states' dtype (",
                      hidden.scalar_type(), "), got ", describe(t), "; transformers' forward ",
                      "promotes mixed dtypes, which the fused kernels do not reproduce.");
    }
  }
  for (const auto& [name, t] : {std::pair<const char*, at::Tensor>{"hidden states", hidden},
                                {"gate", gate},
                                {"weight", weight}}) {
    if (t.defined()) {
      if (auto why = tensor_refusal(name, t, hidden)) {
        return why;
      }
    }
  }
  const int64_t cols = hidden.size(-1);
  if (weight.dim() != 1 || weight.size(0) != cols) {
    return c10::str("Expected ", kFunction, "'s weight of shape [", cols, "] (the hidden ",
                    "states' last dimension), got ", describe(weight), ".");
  }
  if (gate.defined() && gate.sizes() != hidden.sizes()) {
    return c10::str("Expected ", kFunction, "'s gate of the hidden states' shape ",
                    hidden.sizes(), ", got ", describe(gate), "; transformers' forward ",
                    "broadcasts it, the fused kernels do not.");
  }
  if (auto why = layout_refusal("hidden states", hidden)) {
    return why;
  }
  if (gate.defined()) {
    if (auto why = layout_refusal("gate", gate)) {
      return why;
    }
  }
  return std::nullopt;
}

at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& gate, const at::Tensor& weight,
                    double eps, bool weight_plus_one, bool round_before_weight) {
  const auto why = rms_norm_refusal(hidden, gate, weight);
  GRAPHED_CHECK(!why, *why);
  const c10::cuda::CUDAGuard guard(hidden.device());
  const cudaStream_t stream = stream_of(hidden);
  const device::FloatType type = *float_type_of(hidden.scalar_type());
  const int64_t cols = hidden.size(-1);
  const int64_t rows = hidden.numel() / cols;

  // What the root scales: the input, or the gated product in float32.
  const void* normed = hidden.data_ptr();
  int64_t normed_row_stride = *row_stride(hidden);
  bool normed_is_float32 = type == device::FloatType::kFloat32;
  at::Tensor gated;
  at::Tensor squares;
  if (gate.defined()) {
    const auto as_float = hidden.options().dtype(at::kFloat);
    gated = at::empty(hidden.sizes(), as_float);
    squares = at::empty(hidden.sizes(), as_float);
    device::RmsNormGate g;
    g.hidden = hidden.data_ptr();
    g.hidden_row_stride = normed_row_stride;
    g.gate = gate.data_ptr();
    g.gate_row_stride = *row_stride(gate);
    g.type = type;
    g.gated = gated.data_ptr<float>();
    g.squares = squares.data_ptr<float>();
    g.rows = rows;
    g.cols = cols;
    GRAPHED_CHECK_CUDA(device::launch_rms_norm_gate(g, stream));
    normed = gated.data_ptr();
    normed_row_stride = cols;
    normed_is_float32 = true;
  } else if (type == device::FloatType::kFloat32) {
    squares = at::pow(hidden, 2);
  } else {
    // The reference squares hidden.to(float32), whose layout empty_like
    // gives (both keep a dense input's strides): the mean then reduces the
    // same tensor in the same order.
    squares = at::empty_like(hidden, hidden.options().dtype(at::kFloat));
    const auto squares_row_stride = row_stride(squares);
    // empty_like keeps a dense input's strides and makes others contiguous.
    GRAPHED_INTERNAL_ASSERT(squares_row_stride, "the float32 squares of ", describe(hidden),
                            " have one row stride (strides ", squares.strides(), ")");
    device::RmsNormSquares q;
    q.hidden = hidden.data_ptr();
    q.hidden_row_stride = normed_row_stride;
    q.type = type;
    q.squares = squares.data_ptr<float>();
    q.squares_row_stride = *squares_row_stride;
    q.rows = rows;
    q.cols = cols;
    GRAPHED_CHECK_CUDA(device::launch_rms_norm_squares(q, stream));
  }
  const at::Tensor variance = at::mean(squares, {-1}, /*keepdim=*/true).contiguous();

  at::Tensor out = at::empty(hidden.sizes(), hidden.options());
  device::RmsNormScale s;
  s.hidden = normed;
  s.hidden_row_stride = normed_row_stride;
  s.hidden_is_float32 = normed_is_float32;
  s.variance = variance.data_ptr<float>();
  s.weight = weight.data_ptr();
  s.weight_stride = weight.stride(0);
  s.type = type;
  s.eps = static_cast<float>(eps);
  s.weight_plus_one = weight_plus_one;
  s.round_before_weight = round_before_weight;
  s.out = out.data_ptr();
  s.rows = rows;
  s.cols = cols;
  GRAPHED_CHECK_CUDA(device::launch_rms_norm_scale(s, stream));
  return out;
}

}  // namespace graphed
