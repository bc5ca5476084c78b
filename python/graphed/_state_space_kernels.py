"""graphed's fused decode-step kernels in place of transformers' torch
reference functions for Mamba2-family layers (Mamba2, Bamba, granite-moe-hybrid,
Zamba2, NemotronH, Falcon-H1), while a decoder's adapter runs a step eagerly:
its warm-ups and the capture, so that the decode graphs record the fused
kernels (Note [Fused state-space decode steps] in src/state_space_ops.cpp);
_decode_kernels.FusedDecodeKernels swaps them in. Arguments the kernels do
not take run transformers' function."""

import torch

from . import _C

_SELECTIVE = "mamba2_selective_state_update"
_CONV = "causal_conv1d_update"


def torch_reference(function):
    """The torch function behind transformers' kernel-or-fallback wrapper
    (use_kernel_func_from_hub_with_fallback) when no package kernel took its
    place, else None (a package kernel, or not that wrapper)."""
    for _ in range(4):  # the wrapper, under at most a few more decorators
        code = getattr(function, "__code__", None)
        closure = getattr(function, "__closure__", None)
        if code is not None and closure:
            cells = dict(zip(code.co_freevars, closure))
            if "implementation" in cells and "torch_function" in cells:
                try:
                    implementation = cells["implementation"].cell_contents
                    reference = cells["torch_function"].cell_contents
                except ValueError:  # an empty cell
                    return None
                return reference if implementation is reference else None
        function = getattr(function, "__wrapped__", None)
        if function is None:
            return None
    return None


def _checked(name, verdicts, on_mismatch, fused, reference, state, mutates=True):
    """``fused(state)``, whose first run outside a capture is checked against
    ``reference`` on a copy of ``state`` (Note [Fused state-space decode steps]):
    equal to the bit, the fused kernel is trusted from then on; otherwise the
    state gets the reference's values, the reference's result is returned and
    ``verdicts[name]`` is False. None when the fused kernel does not take the
    arguments (nothing ran), or when it is unchecked and a capture is running.
    With ``mutates`` False neither function writes ``state`` (an input only
    telling the device), so it is neither copied nor compared. The results
    are tensors or tuples of tensors (the rotary embedding's q and k)."""
    if verdicts.get(name) is True:
        return fused(state)
    if state.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # unchecked: the capture records transformers' function
    reference_state = state.clone() if mutates else state
    out = fused(state)
    if out is None:
        return None
    want = reference(reference_state)
    pairs = list(zip(out, want)) if isinstance(out, tuple) else [(out, want)]
    if all(a.shape == b.shape and torch.equal(a, b) for a, b in pairs) and \
            (not mutates or torch.equal(state, reference_state)):
        verdicts[name] = True
        return out
    verdicts[name] = False
    difference = max((a.double() - b.double()).abs().max().item() if a.shape == b.shape
                     else float("inf") for a, b in pairs)
    if mutates:
        difference = max(difference,
                         (state.double() - reference_state.double()).abs().max().item())
        state.copy_(reference_state)
    on_mismatch(name, difference)
    return want


def _fused_selective_state_update(transformers_function, verdicts, on_mismatch):
    def mamba2_selective_state_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None,
                                      dt_softplus=False, z=None, **kwargs):
        def reference(target):
            return transformers_function(target, hidden_states, dt, A, B, C, D=D,
                                         dt_bias=dt_bias, dt_softplus=dt_softplus, z=z, **kwargs)

        def fused(target):
            return _C.try_selective_state_update(target, hidden_states, dt, A, B, C, D, dt_bias,
                                                 dt_softplus)

        if z is None and verdicts.get(_SELECTIVE) is not False:
            out = _checked(_SELECTIVE, verdicts, on_mismatch, fused, reference, state)
            if out is not None:
                return out
        return reference(state)

    return mamba2_selective_state_update


def _fused_conv1d_update(transformers_function, verdicts, on_mismatch):
    def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
        def reference(target):
            return transformers_function(hidden_states, target, weight, bias, activation)

        def fused(target):
            return _C.try_causal_conv1d_update(hidden_states, target, weight, bias,
                                               activation is not None)

        if activation in (None, "silu", "swish") and verdicts.get(_CONV) is not False:
            out = _checked(_CONV, verdicts, on_mismatch, fused, reference, conv_state)
            if out is not None:
                return out
        return reference(conv_state)

    return causal_conv1d_update


_FUSED = {_SELECTIVE: _fused_selective_state_update, _CONV: _fused_conv1d_update}
