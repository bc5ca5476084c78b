"""graphed's fused decode-step kernels in place of transformers' torch
reference functions for Mamba2-family layers (Mamba2, Bamba, granite-moe-hybrid,
Zamba2, NemotronH, Falcon-H1), while a decoder's adapter runs a step eagerly:
its warm-ups and the capture, so that the decode graphs record the fused
kernels (Note [Fused state-space decode steps] in src/state_space_ops.cpp).
Arguments the kernels do not take run transformers' function."""

import contextlib
import inspect

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


def _fused_selective_state_update(transformers_function):
    def mamba2_selective_state_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None,
                                      dt_softplus=False, z=None, **kwargs):
        if z is None:
            out = _C.try_selective_state_update(state, hidden_states, dt, A, B, C, D, dt_bias,
                                                dt_softplus)
            if out is not None:
                return out
        return transformers_function(state, hidden_states, dt, A, B, C, D=D, dt_bias=dt_bias,
                                     dt_softplus=dt_softplus, z=z, **kwargs)

    return mamba2_selective_state_update


def _fused_conv1d_update(transformers_function):
    def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
        if activation in (None, "silu", "swish"):
            out = _C.try_causal_conv1d_update(hidden_states, conv_state, weight, bias,
                                              activation is not None)
            if out is not None:
                return out
        return transformers_function(hidden_states, conv_state, weight, bias, activation)

    return causal_conv1d_update


_FUSED = {_SELECTIVE: _fused_selective_state_update, _CONV: _fused_conv1d_update}


class FusedDecodeKernels:
    """The modules of `model` whose forward calls transformers' reference
    state update or convolution update, and graphed's kernels for them while
    active() is entered. `notes` says what was found and whether it applies."""

    def __init__(self, model):
        # (id of the forward's globals, function name) -> (those globals, fused function)
        self._swaps = {}
        layers = {}
        for module in model.modules():
            # The forward as written (transformers decorates Mamba2Mixer's), whose
            # globals are the modeling module's, where it looks the functions up.
            forward = inspect.unwrap(getattr(type(module), "forward", None) or (lambda: None))
            names = getattr(getattr(forward, "__code__", None), "co_names", ())
            namespace = getattr(forward, "__globals__", {})
            for name, fuse in _FUSED.items():
                original = namespace.get(name)
                if name in names and torch_reference(original) is not None:
                    self._swaps.setdefault((id(namespace), name), (namespace, fuse(original)))
                    layers.setdefault(type(module).__name__, set()).add(id(module))
        self.notes = []
        if not self._swaps:
            return
        found = ", ".join(f"{len(ids)} {kind}" for kind, ids in sorted(layers.items()))
        dtype = getattr(model, "dtype", None)
        on_gpu = any(p.is_cuda for p in model.parameters())
        if dtype != torch.float32 or not on_gpu:
            self._swaps = {}
            self.notes.append(
                f"the decode steps of {found} keep transformers' torch reference functions: "
                f"graphed's fused state-space kernels take float32 on a GPU, the model is "
                f"{dtype} on {'the GPU' if on_gpu else 'the CPU'} (Note [Fused state-space "
                f"decode steps])")
            return
        self.notes.append(
            f"the decode steps of {found} run graphed's fused selective state update and "
            f"convolution update (3 and 1 kernels) in place of transformers' torch reference "
            f"functions (14 and 4), bitwise their results (Note [Fused state-space decode "
            f"steps])")

    @contextlib.contextmanager
    def active(self):
        """transformers' two functions replaced by graphed's inside the block,
        restored after it (whatever the block raises)."""
        saved = []
        try:
            for (_, name), (namespace, fused) in self._swaps.items():
                saved.append((namespace, name, namespace[name]))
                namespace[name] = fused
            yield
        finally:
            for namespace, name, original in reversed(saved):
                namespace[name] = original
