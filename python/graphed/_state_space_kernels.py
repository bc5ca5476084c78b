"""graphed's fused decode-step kernels in place of transformers' torch
reference functions for Mamba2-family layers (Mamba2, Bamba, granite-moe-hybrid,
Zamba2, NemotronH, Falcon-H1), while a decoder's adapter runs a step eagerly:
its warm-ups and the capture, so that the decode graphs record the fused
kernels (Note [Fused state-space decode steps] in src/state_space_ops.cpp).
The RMSNorm modules of every float32 model run graphed's three-kernel RMSNorm
in the same steps (Note [RMSNorm in every decode step] in _decode_norms.py).
Arguments the kernels do not take run transformers' function."""

import contextlib
import inspect

import torch

from . import _C
from ._decode_norms import DecodeNorms
from ._decode_rotary import NAME as ROTARY, DecodeRotary

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
    telling the device), so it is neither copied nor compared."""
    if verdicts.get(name) is True:
        return fused(state)
    if state.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # unchecked: the capture records transformers' function
    reference_state = state.clone() if mutates else state
    out = fused(state)
    if out is None:
        return None
    want = reference(reference_state)
    if torch.equal(out, want) and (not mutates or torch.equal(state, reference_state)):
        verdicts[name] = True
        return out
    verdicts[name] = False
    difference = (out.double() - want.double()).abs().max().item() if \
        out.shape == want.shape else float("inf")
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

_NOTE_OF = {kind: "RMSNorm in every decode step"
            for kind in ("rms_norm", "rms_norm_cast_last", "rms_norm_gated", "rms_norm_plus_one")}
_NOTE_OF[ROTARY] = "Rotary embedding in one kernel"
# The dtypes graphed's rms_norm takes (src/rms_norm_ops.cpp).
_NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FusedDecodeKernels:
    """graphed's kernels in a decode step on a GPU, while active() is entered:
    in place of transformers' reference state update and convolution update
    for the modules whose forward calls them (float32), of the forwards of its
    RMSNorm modules (Note [RMSNorm in every decode step]) and of its
    apply_rotary_pos_emb (Note [Rotary embedding in one kernel]; both in
    float32, bfloat16 or float16), each checked against transformers' on its
    first call. `notes` (the list given, else a
    new one) says what was found, whether it applies, and any kernel whose
    check failed; `applies` whether anything runs fused."""

    def __init__(self, model, notes=None):
        self.notes = [] if notes is None else notes
        # Per function name: None unchecked, True equal to transformers' to the
        # bit on its first call, False not (transformers' function from then on).
        self.verdicts = {}
        # (id of the forward's globals, function name) -> (those globals, fused function)
        self._swaps = {}
        self.norms = DecodeNorms(model, self._check_norm)
        self.rotary = DecodeRotary(model, self._check_pair)
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
                    self._swaps.setdefault((id(namespace), name), (
                        namespace, fuse(original, self.verdicts, self._mismatch)))
                    layers.setdefault(type(module).__name__, set()).add(id(module))
        found = ", ".join(f"{len(ids)} {kind}" for kind, ids in sorted(layers.items()))
        dtype = getattr(model, "dtype", None)
        on_gpu = any(p.is_cuda for p in model.parameters())
        if not on_gpu or dtype not in _NORM_DTYPES:
            self.norms.clear()
            self.rotary.clear()
        if self._swaps and (dtype != torch.float32 or not on_gpu):
            self._swaps = {}
            self.notes.append(
                f"the decode steps of {found} keep transformers' torch reference "
                f"functions: graphed's fused state-space kernels take float32 on a GPU, "
                f"the model is {dtype} on {'the GPU' if on_gpu else 'the CPU'} (Note "
                f"[Fused state-space decode steps])")
        if self._swaps:
            self.notes.append(
                f"the decode steps of {found} run graphed's fused selective state update and "
                f"convolution update (3 and 1 kernels) in place of transformers' torch "
                f"reference functions (14 and 4), bitwise their results (Note [Fused "
                f"state-space decode steps])")
        if self.norms:
            self.notes.append(
                f"the RMSNorms of the decode steps ({self.norms.describe()}) run graphed's "
                f"rms_norm, 3 kernels in place of 6 to 10 ({dtype}), bitwise their "
                f"forwards (Note [RMSNorm in every decode step])")
        if self.rotary:
            self.notes.append(
                f"the rotary embeddings of the decode steps ({self.rotary.describe()}) run "
                f"graphed's rotary_embedding, 1 kernel per query and key tensor in place of 5, "
                f"bitwise transformers' apply_rotary_pos_emb (Note [Rotary embedding in one "
                f"kernel])")

    @property
    def applies(self):
        """Whether any kernel of the step runs graphed's."""
        return bool(self._swaps) or bool(self.norms) or bool(self.rotary)

    def _check_norm(self, name, fused, reference, hidden):
        if self.verdicts.get(name) is False:
            return None
        return _checked(name, self.verdicts, self._mismatch, fused, reference, hidden,
                        mutates=False)

    def _check_pair(self, name, fused, reference):
        """``fused()`` (a tuple of tensors, or None when the kernel does not take
        the arguments), its first run outside a capture compared with
        ``reference()`` to the bit as _checked compares one tensor; None when
        the reference is to run instead."""
        verdict = self.verdicts.get(name)
        if verdict is False:
            return None
        if verdict is None and torch.cuda.is_available() and \
                torch.cuda.is_current_stream_capturing():
            return None  # unchecked: the capture records transformers' function
        out = fused()
        if out is None or verdict is True:
            return out
        want = reference()
        if all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(out, want)):
            self.verdicts[name] = True
            return out
        self.verdicts[name] = False
        self._mismatch(name, max(
            (a.double() - b.double()).abs().max().item() if a.shape == b.shape else float("inf")
            for a, b in zip(out, want)))
        return want

    def _mismatch(self, name, difference):
        self.notes.append(
            f"graphed's fused {name} differed from transformers' on its first call (largest "
            f"difference {difference:.3g}), so the decode steps keep transformers' function for "
            f"it (Note [{_NOTE_OF.get(name, 'Fused state-space decode steps')}])")

    @contextlib.contextmanager
    def active(self):
        """transformers' functions and RMSNorm forwards replaced by graphed's
        inside the block, restored after it (whatever the block raises)."""
        saved = []
        try:
            for (_, name), (namespace, fused) in self._swaps.items():
                saved.append((namespace, name, namespace[name]))
                namespace[name] = fused
            with self.norms.active(), self.rotary.active():
                yield
        finally:
            for namespace, name, original in reversed(saved):
                namespace[name] = original
