#pragma once

/// \file rms_norm_ops.h
/// transformers' RMSNorm forward in three kernels instead of six or eight
/// (issue 27): the body LlamaRMSNorm, Mamba2RMSNorm and their copies share,
/// Gemma's (1 + weight) and Mamba2's gated MambaRMSNormGated, bitwise their
/// float32, bfloat16 and float16 results (Note [RMSNorm in three kernels] in src/rms_norm_ops.cpp).
/// graphed.generate and graphed.Decoder use it in the decode steps of
/// transformers' models, whose step graphs are mostly such small
/// kernels (Note [RMSNorm in every decode step]).

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace graphed {

/// Why rms_norm does not take these arguments (a sentence naming the
/// argument and what was expected), or nullopt when it does. It takes
/// float32, bfloat16 or float16 tensors of one dtype on one CUDA device, none
/// requiring grad while grad mode is on: `hidden` with at least one element whose last dimension is contiguous
/// and whose leading dimensions collapse into one row stride (a slice along
/// the last dimension does), `gate` undefined or of `hidden`'s shape and the
/// same kind of layout, and `weight` 1-D with hidden.size(-1) elements.
std::optional<std::string> rms_norm_refusal(const at::Tensor& hidden, const at::Tensor& gate,
                                            const at::Tensor& weight);

/// weight * (h * rsqrt(mean(h^2, -1) + eps)) with h = hidden in float32, or
/// hidden * silu(gate) when `gate` is defined, as transformers' RMSNorm
/// modules compute it, to the bit: the mean is ATen's own reduction kernel on
/// the same float32 squares, the rest elementwise kernels rounding as ATen's
/// do. With `round_before_weight` (Llama's form, weight *
/// h.to(input_dtype)) the normalized value is rounded to hidden's dtype
/// before the product; without it (gpt-oss's, OLMo 2's and Gemma's, the
/// product in float32, then the cast) only the product is. With
/// `weight_plus_one`, (1 + weight) scales in place of weight, as Gemma's
/// modules (Gemma, Gemma 2, Gemma 3) compute h * (1.0 + weight). In float32
/// the two forms agree. Returns a new contiguous tensor of hidden's shape and
/// dtype. Throws graphed::Error with rms_norm_refusal's reason when it does
/// not take the arguments.
at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& gate, const at::Tensor& weight,
                    double eps, bool weight_plus_one = false, bool round_before_weight = true);

}  // namespace graphed
