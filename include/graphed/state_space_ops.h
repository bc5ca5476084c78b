#pragma once

/// \file state_space_ops.h
/// One decode step of a Mamba2-family layer in fewer kernels (issue 27): the
/// selective state update and the convolution state's update that
/// transformers' torch path runs as a dozen and four float32 kernels per
/// layer, with its results to the bit (Note [Fused state-space decode steps]
/// in src/state_space_ops.cpp). graphed.generate and graphed.Decoder use
/// them in the decode steps of transformers' Mamba2-family models.

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace graphed {

/// Why selective_state_update does not take these arguments (a sentence
/// naming the argument and what was expected), or nullopt when it does. It
/// takes float32 tensors on one CUDA device, none requiring grad while grad
/// mode is on: `state` [batch, heads, head_dim, state_size] contiguous, `x`
/// and `dt` [batch, heads, head_dim], `A` [heads, head_dim, state_size], `B`
/// and `C` [batch, groups, state_size] with groups dividing heads, `D` and
/// `dt_bias` [heads, head_dim] or undefined; any strides except the state's.
std::optional<std::string> selective_state_update_refusal(
    const at::Tensor& state, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
    const at::Tensor& B, const at::Tensor& C, const at::Tensor& D, const at::Tensor& dt_bias);

/// One step of the selective scan, as transformers'
/// mamba2_selective_state_update computes it (z undefined): with
/// dt' = softplus(dt + dt_bias) (softplus when dt_softplus), updates `state`
/// in place to state * exp(dt' * A) + dt' * B * x and returns
/// [batch, heads, head_dim] = state . C + x * D, bitwise transformers'
/// result. At most two kernels and cuBLAS's product. Throws graphed::Error with
/// selective_state_update_refusal's reason when it does not take the
/// arguments.
at::Tensor selective_state_update(const at::Tensor& state, const at::Tensor& x,
                                  const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                                  const at::Tensor& C, const at::Tensor& D,
                                  const at::Tensor& dt_bias, bool dt_softplus);

/// Why causal_conv1d_update does not take these arguments, or nullopt when it
/// does. It takes float32 tensors on one CUDA device, none requiring grad
/// while grad mode is on: `x` [batch, channels, 1] (the newest position),
/// `conv_state` [batch, channels, width], `weight` [channels, width] with
/// width at most 16, `bias` [channels] or undefined; any strides.
std::optional<std::string> causal_conv1d_update_refusal(const at::Tensor& x,
                                                        const at::Tensor& conv_state,
                                                        const at::Tensor& weight,
                                                        const at::Tensor& bias);

/// One position of a depthwise causal convolution on its state, as
/// transformers' causal_conv1d_update computes it: the state shifts left by
/// one with `x` appended (in place), and the result [batch, channels, 1] is
/// bias + the weighted sum of the new state, through SiLU when `silu`;
/// bitwise transformers' result, in one kernel. Throws graphed::Error with
/// causal_conv1d_update_refusal's reason when it does not take the arguments.
at::Tensor causal_conv1d_update(const at::Tensor& x, const at::Tensor& conv_state,
                                const at::Tensor& weight, const at::Tensor& bias, bool silu);

}  // namespace graphed
