"""transformers' rules for skipping the attention mask, made to decide during
graphed's captures as they decide eagerly. Imported only for transformers
models (graphed._experts.capturable_experts, graphed.generate).

Note [transformers' mask rules under capture]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers (5.17) hands SDPA no mask at all (``is_causal=True``, or no bias
for a bidirectional encoder) when it can tell the mask is plain: no padding,
and the query and key lengths line up (masking_utils._ignore_causal_mask_sdpa,
_ignore_bidirectional_mask_sdpa). Both rules first ask ``is_tracing()``, which
is true while a CUDA stream captures, and then answer "materialize the mask"
without looking: the guard is there for torch.export, whose graph would
hard-code ``is_causal`` for other shapes. So a captured step ran another
attention than the eager one: an explicit mask, which also turns off SDPA's
grouped-query path (``use_gqa_in_sdpa`` wants no mask), so keys and values
are repeated per head and their gradients summed back. The losses were right
but not eager's: under bf16 autocast with fp32 weights the rotary keys are
fp32, their repeat-and-sum rounds differently from SDPA's own reduction, and
mixture-of-experts routing turned that last-bit difference into 1.8e-2
(Mixtral) over 20 steps; a plain ``torch.cuda.graph`` of the step shows the
same (bench/zoo_modern.py, ``loss_rel_diffs_torch_graph``).

A CUDA graph is specialized to its shapes, so the export concern does not
apply: when no padding mask is given (``padding_mask is None``) and the
offsets are host ints, the answer depends on the shapes alone, and the rules
here give eager's answer during capture too. With a padding mask the eager
rule reads its values on the host (``padding_mask.sum() == numel``), which a
graph cannot hold for later batches; that case keeps transformers' answer
(materialize), which is right for every batch. graphed.generate's prefill
has its own answer (Note [A capturable prefill] in generate.py), taken first.

A training forward meets one more such guard before those rules: with no
cache and no attention mask, transformers looks for packed sequences in the
position ids (masking_utils.find_packed_sequence_indices) and, finding none
on the host, lets the mask be skipped; under capture its ``is_tracing()``
guard returns the device tensor instead, which forbids the skip, so every
captured training step of a transformers LM ran the explicit mask, and the
rules above never came into play (Mixtral's amp_bf16 losses in
bench/zoo_modern.py drifted from eager's by this: the first step's gradients
already differed, in the backward of the repeated keys). When the position
ids are the model's own (the outermost transformers forward on the stack was
called without them, so the model made ``arange(length) + past``, never
packed), the answer depends on the shape alone and the rule here gives
eager's, None. Position ids the caller passed may differ from one replay to
the next (packed batches), so they keep transformers' answer: the mask the
graph holds is right for every batch, and the attention is not eager's
kernel.

Note [An eager-attention mask a graph can hold]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
For eager attention (gpt-oss's attention sinks need it) transformers turns
the boolean mask into 0 and the dtype's minimum with
``torch.where(mask, torch.tensor(0.0, device=...), min)``: the zero is copied
from pageable host memory, which no capture may do, so gpt-oss's whole step
could not be captured (masking_utils.py:604). While a stream captures,
graphed's eager mask builds the same boolean mask with transformers' own
sdpa_mask and the same where() with a zero made on the device: the same
values, and no copy. Outside captures transformers' function runs unchanged.

Note [The mask rules under torch.compile]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
While Dynamo traces, the rules here step aside (``_capturing()`` is False):
the traced code is transformers' own, whose ``is_tracing()`` is true under
Dynamo, so the compiled graph materializes the mask, for warm-up and capture
alike. Asking the stream instead (``torch.cuda.is_current_stream_capturing``
is no function Dynamo can fold) broke the graph there and made the code after
the break depend on the answer: a mask computed eagerly came back as a tensor
during warm-up and as None during the capture, Dynamo's guard on its type
failed, and it recompiled inside the capture, which no capture survives (T5
under ``optimize(..., compile=True)`` on the H200: Inductor's compile failed
at a host read). Stepping aside also removes the graph breaks themselves:
T5's compiled forward became one graph instead of a dozen.
"""

from __future__ import annotations

import inspect
import sys
import threading
from typing import Any, Optional

import torch

#: Whether the prefill under way in graphed.generate has left padding
#: (True/False), or None outside its prefills. Per thread: the decoder calls
#: the prefill on the thread that called generate().
prefill_padding = threading.local()


def _capturing() -> bool:
    """Whether a stream captures, as the rules here ask it; False while Dynamo
    traces (Note [The mask rules under torch.compile])."""
    if torch.compiler.is_compiling():
        return False
    return _stream_capturing()


def _stream_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _causal_skip_from_shapes(q_length: int, kv_length: int, q_offset: Any,
                             local_attention_size: Optional[int]) -> bool:
    """_ignore_causal_mask_sdpa's answer for no padding mask, past its tracing guard."""
    if local_attention_size is not None and kv_length >= local_attention_size:
        return False
    if q_length == 1 or kv_length == q_length:
        return True
    return q_offset == 0


def install() -> None:
    """Installs the rules (idempotent): Note [transformers' mask rules under
    capture], graphed.generate's prefill rules (Note [A capturable prefill]:
    the causal mask and the state-space layers' padding mask) and Note [An
    eager-attention mask a graph can hold]."""
    from transformers import masking_utils

    _install_eager_mask(masking_utils)
    _install_recurrent_mask(masking_utils)
    _install_packed_sequence_rule(masking_utils)

    causal = masking_utils._ignore_causal_mask_sdpa
    if not getattr(causal, "_graphed_rule", False):
        def ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, kv_offset,
                                    local_attention_size=None):
            padded = getattr(prefill_padding, "padded", None)
            if padded is not None:  # graphed.generate's prefill
                if local_attention_size is not None and kv_length >= local_attention_size:
                    return False
                return not padded
            if padding_mask is None and isinstance(q_offset, int) and _capturing():
                return _causal_skip_from_shapes(q_length, kv_length, q_offset,
                                                local_attention_size)
            return causal(padding_mask, q_length, kv_length, q_offset, kv_offset,
                          local_attention_size)

        ignore_causal_mask_sdpa._graphed_rule = True
        ignore_causal_mask_sdpa.__wrapped__ = causal
        masking_utils._ignore_causal_mask_sdpa = ignore_causal_mask_sdpa

    bidirectional = getattr(masking_utils, "_ignore_bidirectional_mask_sdpa", None)
    if bidirectional is not None and not getattr(bidirectional, "_graphed_rule", False):
        def ignore_bidirectional_mask_sdpa(padding_mask, kv_length, local_attention_size=None):
            if (padding_mask is None and _capturing()
                    and not getattr(masking_utils, "_is_torch_xpu_available", False)):
                return local_attention_size is None or kv_length < local_attention_size
            return bidirectional(padding_mask, kv_length, local_attention_size)

        ignore_bidirectional_mask_sdpa._graphed_rule = True
        ignore_bidirectional_mask_sdpa.__wrapped__ = bidirectional
        masking_utils._ignore_bidirectional_mask_sdpa = ignore_bidirectional_mask_sdpa


def _positions_made_by_the_model(frame: Any) -> bool:
    """Whether the outermost transformers model forward on the stack above
    ``frame`` was called without position ids, so that the model made its
    own (Note [transformers' mask rules under capture]). False when none is
    found."""
    outermost = None
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward" and "position_ids" in code.co_varnames:
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module) and hasattr(owner, "config") and \
                    type(owner).__module__.startswith("transformers."):
                outermost = frame
        frame = frame.f_back
    return outermost is not None and outermost.f_locals.get("position_ids") is None


def _install_packed_sequence_rule(masking_utils: Any) -> None:
    """Note [transformers' mask rules under capture], its last paragraph."""
    packed = getattr(masking_utils, "find_packed_sequence_indices", None)
    if packed is None or getattr(packed, "_graphed_rule", False):
        return

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
        if _capturing() and _positions_made_by_the_model(sys._getframe(1)):
            return None  # eager's answer for arange positions: nothing packed
        return packed(position_ids)

    find_packed_sequence_indices._graphed_rule = True  # type: ignore[attr-defined]
    find_packed_sequence_indices.__wrapped__ = packed  # type: ignore[attr-defined]
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices


def _install_eager_mask(masking_utils: Any) -> None:
    """Note [An eager-attention mask a graph can hold]."""
    eager = masking_utils.eager_mask
    if getattr(eager, "_graphed_rule", False):
        return
    signature = inspect.signature(eager)
    variadic = [p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD]
    if "dtype" not in signature.parameters or len(variadic) != 1:
        return  # another transformers than this was written for: leave it alone

    def eager_mask(*args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
        if not _capturing():
            return eager(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        extra = dict(arguments.pop(variadic[0]))
        extra.pop("allow_is_causal_skip", None)
        dtype = arguments.pop("dtype")
        mask = masking_utils.sdpa_mask(**arguments, allow_is_causal_skip=False, **extra)
        if mask is None:
            return None
        zero = torch.zeros((), device=mask.device, dtype=dtype)
        return torch.where(mask, zero, torch.finfo(dtype).min)

    eager_mask._graphed_rule = True
    eager_mask.__wrapped__ = eager
    masking_utils.eager_mask = eager_mask
    masking_utils.AttentionMaskInterface.register("eager", eager_mask)


def _install_recurrent_mask(masking_utils: Any) -> None:
    """The padding mask of state-space layers during graphed.generate's
    prefills: transformers drops it when every token counts, deciding with
    ``torch.all(attention_mask == 1)`` on the host; the decoder knows the answer
    (no left padding) and gives it without the read, as Note [A capturable
    prefill] does for the causal mask. Models import the function by name and
    masking_utils maps layer kinds to it, so those references are replaced too."""
    recurrent = getattr(masking_utils, "create_recurrent_attention_mask", None)
    if recurrent is None or getattr(recurrent, "_graphed_rule", False):
        return

    def create_recurrent_attention_mask(config, inputs_embeds, attention_mask, *args, **kwargs):
        padded = getattr(prefill_padding, "padded", None)
        if padded is not None and attention_mask is not None and attention_mask.ndim == 2:
            if not padded:
                return None
            if inputs_embeds.shape[1] > 1:  # transformers' answer for a mask with padding
                return attention_mask[:, -inputs_embeds.shape[1]:].contiguous()
        return recurrent(config, inputs_embeds, attention_mask, *args, **kwargs)

    create_recurrent_attention_mask._graphed_rule = True
    create_recurrent_attention_mask.__wrapped__ = recurrent
    masking_utils.create_recurrent_attention_mask = create_recurrent_attention_mask
    mapping = getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {})
    for table in [mapping] + [v for v in mapping.values() if isinstance(v, dict)]:
        for key, value in table.items():
            if value is recurrent:
                table[key] = create_recurrent_attention_mask
    for name, module in list(sys.modules.items()):
        if (name.startswith("transformers.models.")
                and getattr(module, "create_recurrent_attention_mask", None) is recurrent):
            module.create_recurrent_attention_mask = create_recurrent_attention_mask
