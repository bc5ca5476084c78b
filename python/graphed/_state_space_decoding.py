"""The decoder's adapter for state-space language models (transformers' Mamba2,
torch path): prefill and one-token step on the model's own recurrent cache,
sized once for the decoder's largest batch. graphed.generate picks it for a
model that keeps states instead of a key/value cache (``_is_stateful``).

Note [Decoding a state-space model on graphs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A Mamba layer's cache is two fixed-size tensors per layer (the last
``conv_kernel`` inputs of its convolution and the SSM state), which
transformers (5.17) updates in place (``copy_``): every decode step reads and
writes the same memory whatever the position, which is what a graph needs,
and there is no mask or position to carry. Three things are the adapter's:
- Size. The layers allocate their states lazily, at the batch of the first
  forward; a prefill of one token at ``max_batch`` sizes them once, and every
  batch bucket works on views of their first rows, as the StaticCache
  adapter does with keys and values.
- The host flag. Each layer decides on the host whether it holds a previous
  state (``has_previous_state``): the prefill path pads the convolution input,
  the decode path concatenates the state. Replays run no Python, so after a
  replayed prefill the flag would still say "empty" to an eager step that
  follows (a bucket's warm-up). The adapter sets it before each call: empty
  for a prefill, full for a step, which is what each always means here.
- The mask. The decoder passes an attention mask only when some prompt has
  left padding; the step passes none, as transformers' generate does.
Hybrids (granite-moe-hybrid: Mamba and attention layers) decode on the
StaticCache adapter in generate.py, whose StaticCache holds the state-space
layers beside the key/value ones; it sizes, views and flags them with the
helpers here.
"""

import copy
import weakref

import torch

from . import _C
from ._decode_kernels import FusedDecodeKernels


def is_state_layer(layer):
    """A cache layer of recurrent states only (LinearAttentionLayer)."""
    from transformers.cache_utils import LinearAttentionLayer

    return type(layer) is LinearAttentionLayer


def state_view(layer, rows):
    """The layer's states restricted to their first `rows` rows; the view shares
    the layer's host flags (has_previous_state). A layer not sized yet is its
    own view, so that the sizing prefill allocates its states in it."""
    if not (any(layer.is_conv_states_initialized.values())
            or any(layer.is_recurrent_states_initialized.values())):
        return layer
    part = copy.copy(layer)
    part.conv_states = {i: s[:rows] if s is not None else None
                        for i, s in layer.conv_states.items()}
    part.recurrent_states = {i: s[:rows] if s is not None else None
                             for i, s in layer.recurrent_states.items()}
    return part


def mark_previous_state(cache, previous):
    """Sets every state layer's host flag: Note [Decoding a state-space model on
    graphs]."""
    for layer in cache.layers:
        if is_state_layer(layer):
            for index in layer.has_previous_state:
                layer.has_previous_state[index] = previous


class StateSpaceModel:
    """A state-space model's prefill and decode step on one recurrent cache of
    ``max_batch`` rows; a batch of n rows works on views of the first n."""

    def __init__(self, model, max_batch, max_len, compile_options=None):
        from transformers import DynamicCache

        self._model = weakref.ref(model)
        self.cache = DynamicCache(config=model.config)
        kinds = {type(layer).__name__ for layer in self.cache.layers if not is_state_layer(layer)}
        if kinds or not self.cache.layers:
            raise _C.GraphedError(
                f"Expected every cache layer of {type(model).__name__} to be a state-space "
                f"(LinearAttentionLayer) one, got {sorted(kinds) or 'none'}. Use "
                f"model.generate.")
        self.notes = [f"{type(model).__name__} decodes on its recurrent states, sized for "
                      f"{max_batch} rows (Note [Decoding a state-space model on graphs])"]
        self.extra = {"logits_to_keep": 1} if model._supports_logits_to_keep() else {}
        self.views = {}
        with torch.no_grad():
            model(input_ids=torch.zeros(max_batch, 1, dtype=torch.long, device=model.device),
                  cache_params=self.cache, use_cache=True, **self.extra)
        self.reset()
        self._compiled_step = None
        # Note [Fused state-space decode steps]: eager steps (warm-ups, captures)
        # run graphed's kernels; a compiled step has Inductor's.
        self.fused = (FusedDecodeKernels.for_eager_steps(model, self.notes)
                      if compile_options is None else None)
        if compile_options is not None:
            self._compiled_step = torch.compile(self._eager_step, **compile_options)

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise _C.GraphedError("The model this decoder was built for was freed; build a new "
                                  "decoder.")
        return model

    def view(self, rows):
        """The cache restricted to its first `rows` rows (same memory, same flags)."""
        if rows not in self.views:
            view = copy.copy(self.cache)
            view.layers = [state_view(layer, rows) for layer in self.cache.layers]
            self.views[rows] = view
        return self.views[rows]

    def reset(self):
        self.cache.reset()

    def _forward(self, input_ids, attention_mask, **flags):
        return self.model(input_ids=input_ids, cache_params=self.view(input_ids.shape[0]),
                          attention_mask=attention_mask, use_cache=True, return_dict=True,
                          **flags, **self.extra).logits

    def prefill(self, args):
        """The prompts through the model; attention_mask is None without left padding."""
        input_ids, attention_mask, _ = args
        mark_previous_state(self.cache, False)
        return self._forward(input_ids, attention_mask)

    def _eager_step(self, input_ids, position_ids, attention_mask):
        return self._forward(input_ids, None)

    def step(self, args):
        from .generate import _call_step

        mark_previous_state(self.cache, True)
        return _call_step(self._compiled_step, self._eager_step, args, self.fused)
