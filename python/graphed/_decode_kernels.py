"""The kernels graphed runs in place of transformers' in a decoder's eager
decode steps (its warm-ups and the capture, so that the decode graphs record
them): Mamba2-family state updates (_state_space_kernels.py), RMSNorms
(_decode_norms.py) and rotary embeddings (_decode_rotary.py), each checked
against transformers' on its first call, to the bit. graphed.generate's,
graphed.Decoder's and the serving decoder's adapters hold one each."""

import contextlib

import torch

from ._decode_norms import DecodeNorms, written_forward
from ._decode_rotary import NAME as ROTARY, DecodeRotary
from ._state_space_kernels import _FUSED, _checked, torch_reference

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
        self.norms = DecodeNorms(model, self._check)
        self.rotary = DecodeRotary(model, self._check)
        layers = {}
        for module in model.modules():
            # transformers decorates Mamba2Mixer's forward: the one as written.
            names, namespace = written_forward(module)
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

    @classmethod
    def for_eager_steps(cls, model, notes):
        """The kernels for ``model``'s eager decode steps, or None where none
        applies (the notes say why where there is a reason to)."""
        fused = cls(model, notes)
        return fused if fused.applies else None

    @property
    def applies(self):
        """Whether any kernel of the step runs graphed's."""
        return bool(self._swaps) or bool(self.norms) or bool(self.rotary)

    def _check(self, name, fused, reference, state):
        """One call of a norm or rotary kernel through _checked (``state``: an
        input, neither written nor compared); None when transformers' function
        is to run instead."""
        if self.verdicts.get(name) is False:
            return None
        return _checked(name, self.verdicts, self._mismatch, fused, reference, state,
                        mutates=False)

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
