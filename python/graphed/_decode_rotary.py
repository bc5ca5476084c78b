"""graphed's one-kernel rotary embedding (Note [Rotary embedding in one
kernel] in src/rotary_ops.cpp) in place of transformers'
apply_rotary_pos_emb while a decoder's adapter runs a decode step eagerly
(its warm-ups and the capture): the decode graphs record one kernel per
query and key tensor instead of five, the same bits.

A modeling module's function is taken when it and its rotate_half compute
transformers' form (their source parses to it, docstrings aside): Llama's
and its copies (Mistral, Qwen2/3, Qwen3-MoE, Gemma 2/3, Granite,
granite-moe-hybrid). gpt-oss, Phi-3 (a partial rotation) and OLMo 2 rotate
with forms of their own and keep them. The swap
replaces the name in the modeling module's globals, where the attention
layers' forwards look it up, and puts it back after the step. The first call
is checked against transformers' function to the bit, both tensors; a call
the kernel does not take (another unsqueeze_dim, mixed dtypes, a layout)
runs transformers' function."""

from __future__ import annotations

import collections
import contextlib
import inspect
from typing import Callable, Dict, List, Tuple

import torch

from . import _C
from ._decode_norms import _function_shape, describe_counts, written_forward

NAME = "apply_rotary_pos_emb"

_APPLY = """
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
"""

# Older modeling files keep an unused position_ids argument.
_APPLY_WITH_POSITIONS = """
def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
"""

_ROTATE_HALF = """
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
"""

_APPLY_SHAPES = {_function_shape(_APPLY), _function_shape(_APPLY_WITH_POSITIONS)}
_ROTATE_HALF_SHAPE = _function_shape(_ROTATE_HALF)


def _shape(function):
    try:
        return _function_shape(inspect.getsource(inspect.unwrap(function)))
    except (OSError, TypeError):
        return None


def is_transformers_rotary(namespace) -> bool:
    """Whether ``namespace`` (a modeling module's globals) holds transformers'
    apply_rotary_pos_emb and rotate_half in the form graphed's kernel computes."""
    apply, rotate = namespace.get(NAME), namespace.get("rotate_half")
    return (callable(apply) and callable(rotate) and _shape(apply) in _APPLY_SHAPES
            and _shape(rotate) == _ROTATE_HALF_SHAPE)


def _fused_apply(original: Callable, check: Callable) -> Callable:
    """apply_rotary_pos_emb computing each tensor with graphed's kernel, through
    ``check(name, fused, reference, q)`` (the first call compared with
    ``original`` to the bit)."""
    signature = inspect.signature(inspect.unwrap(original))

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        def reference(_=None):
            return original(q, k, cos, sin, *args, **kwargs)

        try:
            unsqueeze_dim = signature.bind(q, k, cos, sin, *args, **kwargs).arguments.get(
                "unsqueeze_dim", 1)
        except TypeError:
            return reference()
        if unsqueeze_dim != 1 or not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
            return reference()

        def fused(_):
            rotated_q = _C.try_rotary_embedding(q, cos, sin)
            rotated_k = _C.try_rotary_embedding(k, cos, sin) if rotated_q is not None else None
            return None if rotated_k is None else (rotated_q, rotated_k)

        out = check(NAME, fused, reference, q)
        return reference() if out is None else out

    return apply_rotary_pos_emb


class DecodeRotary:
    """The modeling modules of ``model``'s attention layers whose
    apply_rotary_pos_emb graphed's kernel reproduces; while active() is
    entered, their globals hold graphed's. ``check(name, fused, reference,
    state)`` runs one call (FusedDecodeKernels._check)."""

    def __init__(self, model, check: Callable):
        # (id of the globals) -> (those globals, the fused function)
        self._swaps: Dict[int, Tuple[dict, Callable]] = {}
        self.counts: Dict[str, int] = collections.Counter()
        # A model configured without rotary positions (granite-moe-hybrid's
        # position_embedding_type=None) has attention layers that would call it
        # but no rotary module to feed them: nothing to swap.
        if not any(type(m).__name__.endswith("RotaryEmbedding") for m in model.modules()):
            return
        for module in model.modules():
            names, namespace = written_forward(module)
            if NAME not in names or not is_transformers_rotary(namespace):
                continue
            self._swaps.setdefault(id(namespace), (namespace, _fused_apply(namespace[NAME],
                                                                           check)))
            self.counts[type(module).__name__] += 1

    def __bool__(self):
        return bool(self._swaps)

    def describe(self) -> str:
        """'4 LlamaAttention': the layers whose rotation runs graphed's kernel."""
        return describe_counts(self.counts)

    def clear(self):
        self._swaps, self.counts = {}, collections.Counter()

    @contextlib.contextmanager
    def active(self):
        """transformers' function replaced by graphed's inside the block, put
        back after it (whatever the block raises)."""
        saved: List[Tuple[dict, Callable]] = []
        try:
            for namespace, fused in self._swaps.values():
                saved.append((namespace, namespace[NAME]))
                namespace[NAME] = fused
            yield
        finally:
            for namespace, original in reversed(saved):
                namespace[NAME] = original
