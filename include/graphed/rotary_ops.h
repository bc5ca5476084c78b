#pragma once

/// \file rotary_ops.h
/// transformers' rotary position embedding, apply_rotary_pos_emb's
/// (x * cos) + (rotate_half(x) * sin), in one kernel instead of five per
/// tensor, bitwise its float32, bfloat16 and float16 results (Note [Rotary
/// embedding in one kernel] in src/rotary_ops.cpp). graphed.generate and
/// graphed.Decoder use it in the decode steps of transformers' models.

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace graphed {

/// Why rotary_embedding does not take these arguments (a sentence naming the
/// argument and what was expected), or nullopt when it does. It takes `x` of
/// [batch, heads, seq, dim] with an even dim, non-overlapping and dense (a
/// transposed projection is), and `cos` and `sin` of [batch or 1, seq, dim]
/// as transformers' rotary modules return them; all float32, bfloat16 or
/// float16 of one dtype on one CUDA device, with contiguous last dimensions,
/// none requiring grad while grad mode is on. Dtypes are checked first, so a
/// refusal for them needs no device.
std::optional<std::string> rotary_embedding_refusal(const at::Tensor& x, const at::Tensor& cos,
                                                    const at::Tensor& sin);

/// (x * cos.unsqueeze(1)) + (cat(-x2, x1) * sin.unsqueeze(1)) with x1 and x2
/// the halves of x's last dimension, each product and the sum rounded to x's
/// dtype as ATen's kernels round them: to the bit transformers'
/// apply_rotary_pos_emb for one of q and k. Returns a new tensor of x's
/// shape, dtype and strides. Throws graphed::Error with
/// rotary_embedding_refusal's reason when it does not take the arguments.
at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace graphed
