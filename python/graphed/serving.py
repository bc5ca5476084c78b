"""graphed.generate_batch and graphed.Decoder.submit/run: many requests of
different lengths and budgets on one set of decode graphs (continuous batching).

An adapter only. The scheduler -- slots, prefills between decode steps,
per-request budgets and end-of-sequence tokens, streaming -- is the core's
(include/graphed/request_scheduler.h, Note [Continuous batching on graphs]);
the decode graphs are a graphed::Decoder's. This module turns a transformers
model into the two functions they call: a prefill of one prompt into one row
(slot) of a static cache, and a decode step in which every row writes its key
and value at its own position and attends to its own positions only.
"""

import copy
import weakref

import torch

from ._attention_backends import attention_without_cudnn, served_attention_note
from ._autocast_cache import convert_states_to_cache_dtype
from . import _C
from ._experts import capturable_experts
from ._state_space_decoding import StateSpaceModel, is_state_layer, mark_previous_state
from ._decode_kernels import FusedDecodeKernels
from .generate import (_call_step, _check_model, _compile_options, _input_vocabulary,
                       _install_prefill_mask_rule, _is_state_space, _sampling_key, _settings,
                       _unroll_sliding_windows)

_SLOT_LAYER = None


def _error(message):
    return _C.GraphedError(message)


def _slot_layer_class():
    """transformers' StaticLayer with one request per row (defined on first use,
    so that transformers is imported only when a model is adapted)."""
    global _SLOT_LAYER
    if _SLOT_LAYER is None:
        from transformers.cache_utils import StaticLayer

        class SlotLayer(StaticLayer):
            """A view of a StaticLayer whose rows are slots (Note [Continuous batching on
            graphs]). With ``write_index`` (a decode step: [rows] int64 on the device) each
            row writes its one new key and value at its own position; without it (a slot's
            prefill, one row) the prompt's keys go to positions [0, prompt_len).
            ``cumulative_length`` is a constant the masks read as the query offset: 0 for a
            prefill (the causal triangle from position 0), max_len - 1 for a decode step
            (causal hides nothing; the step's per-row attention mask does the work)."""

            write_index = None

            def update(self, key_states, value_states, *args, **kwargs):
                if self.write_index is None:
                    length = key_states.shape[-2]
                    self.keys[:, :, :length].copy_(key_states)
                    self.values[:, :, :length].copy_(value_states)
                else:
                    at = self.write_index.view(-1, 1, 1, 1)
                    self.keys.scatter_(2, at.expand(key_states.shape), key_states)
                    self.values.scatter_(2, at.expand(value_states.shape), value_states)
                return self.keys, self.values

        _SLOT_LAYER = SlotLayer
    return _SLOT_LAYER


def _state_rows(layer, rows):
    """A state-space layer's states restricted to `rows` (a slice); shares the
    layer's host flags, as _state_space_decoding.state_view does. A layer not
    sized yet is its own view."""
    if not (any(layer.is_conv_states_initialized.values())
            or any(layer.is_recurrent_states_initialized.values())):
        return layer
    part = copy.copy(layer)
    part.conv_states = {i: s[rows] if s is not None else None
                        for i, s in layer.conv_states.items()}
    part.recurrent_states = {i: s[rows] if s is not None else None
                             for i, s in layer.recurrent_states.items()}
    return part


class SlotCacheModel:
    """The model's slot prefill and decode step on one StaticCache of max_batch
    rows, each row a request at its own position; state-space layers of a
    hybrid keep one state per row next to it. Holds the model weakly, as
    generate.py's adapters do."""

    def __init__(self, model, max_batch, max_len, compile_options=None):
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        self._model = weakref.ref(model)
        text_config = model.config.get_text_config(decoder=True)
        self.cache = StaticCache(config=text_config, max_cache_len=max_len)
        self.notes = []
        window = getattr(text_config, "sliding_window", None)
        if window and max_len <= window:
            # Within the window a sliding layer is a full one, and transformers'
            # window mask, built from the step's query offset (max_len - 1 here),
            # hides nothing (Note [Sliding windows on a full static cache]).
            self.notes += _unroll_sliding_windows(self.cache, max_len, model)
        kinds = sorted({type(layer).__name__ for layer in self.cache.layers
                        if type(layer) is not StaticLayer and not is_state_layer(layer)})
        if kinds:
            raise _error(
                f"Expected a model whose cache layers are all full-attention StaticLayers for "
                f"continuous batching, got {type(model).__name__} with {kinds}: sliding windows "
                f"are served per slot only while max_len ({max_len}) <= the window ({window}), "
                f"since transformers builds their masks from one position shared by all rows. "
                f"Lower max_len, or use graphed.generate (one static batch) for it.")
        heads, head_dim = model._get_static_cache_init_shape()
        self.cache.early_initialization(batch_size=max_batch, num_heads=heads, head_dim=head_dim,
                                        dtype=model.dtype, device=model.device)
        convert_states_to_cache_dtype(self.cache)  # Note [A static cache under autocast]
        self.max_len = max_len
        self.extra = {"logits_to_keep": 1} if model._supports_logits_to_keep() else {}
        device = model.device
        self.columns = torch.arange(max_len, device=device)
        self.ones = torch.ones(1, max_len, dtype=torch.long, device=device)
        self.positions = self.columns.view(1, -1)
        self.decode_offset = torch.tensor(max_len - 1, device=device)
        self.prefill_offset = torch.tensor(0, device=device)
        self.views = {}
        self.slot_views = {}
        self._compiled_step = None
        if compile_options is not None:
            self._compiled_step = torch.compile(self._eager_step, **compile_options)
        _install_prefill_mask_rule()
        states = sum(1 for layer in self.cache.layers if is_state_layer(layer))
        if states:
            # A one-token forward over every row sizes the state layers (Note
            # [Decoding a state-space model on graphs]).
            zeros = torch.zeros(max_batch, 1, dtype=torch.long, device=device)
            with torch.no_grad():
                mark_previous_state(self.cache, False)
                self._run(zeros, self._view(slice(0, max_batch), self.prefill_offset),
                          torch.ones_like(zeros), zeros, is_first_iteration=True)
            self.reset()
            self.notes.append(
                f"{states} of {len(self.cache.layers)} layers of {type(model).__name__} are "
                f"state-space layers: one state per slot, overwritten by the slot's prefill")
        self.fused = None
        if compile_options is None:
            # As in graphed.generate's steps: Note [RMSNorm in every decode step],
            # Note [Fused state-space decode steps]. A compiled step has Inductor's.
            self.fused = FusedDecodeKernels.for_eager_steps(model, self.notes)
        self.notes += served_attention_note(model)

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise _error("The model this decoder was built for was freed; build a new decoder.")
        return model

    def _view(self, rows, offset):
        layer_class = _slot_layer_class()
        view = copy.copy(self.cache)
        view.layers = []
        for layer in self.cache.layers:
            if is_state_layer(layer):
                view.layers.append(_state_rows(layer, rows))
                continue
            part = layer_class.__new__(layer_class)
            part.__dict__.update(layer.__dict__)
            part.keys, part.values = layer.keys[rows], layer.values[rows]
            part.batch_size = part.keys.shape[0]
            part.cumulative_length = offset
            view.layers.append(part)
        return view

    def decode_view(self, rows):
        if rows not in self.views:
            self.views[rows] = self._view(slice(0, rows), self.decode_offset)
        return self.views[rows]

    def slot_view(self, slot):
        if slot not in self.slot_views:
            self.slot_views[slot] = self._view(slice(slot, slot + 1), self.prefill_offset)
        return self.slot_views[slot]

    def reset(self):
        self.cache.reset()

    def prefill(self, args):
        """One prompt ([1, prompt_len]) into row `slot`, eagerly, at its exact length."""
        input_ids, slot = args
        length = input_ids.shape[1]
        from .integrations.transformers_masks import prefill_padding

        prefill_padding.padded = False  # Note [A capturable prefill]: no left padding
        mark_previous_state(self.cache, False)
        try:
            # Note [Served attention without cuDNN's plans]: a new length each request.
            with attention_without_cudnn():
                return self._run(input_ids, self.slot_view(int(slot)), self.ones[:, :length],
                                 self.positions[:, :length], is_first_iteration=True)
        finally:
            prefill_padding.padded = None

    def _run(self, input_ids, view, attention_mask, position_ids, **flags):
        inputs = self.model.prepare_inputs_for_generation(
            input_ids, past_key_values=view, attention_mask=attention_mask,
            position_ids=position_ids, use_cache=True, **flags, **self.extra)
        return self.model(**inputs, return_dict=True).logits

    def _eager_step(self, input_ids, position_ids, attention_mask):
        rows = input_ids.shape[0]
        view = self.decode_view(rows)
        # Each row writes at its own position (bounded: Note [Token ids are checked on
        # the host]) and attends to positions up to it.
        write = position_ids.view(-1).clamp(max=self.max_len - 1)
        for layer in view.layers:
            layer.write_index = write
        torch.le(self.columns, position_ids, out=attention_mask)
        return self._run(input_ids, view, attention_mask, position_ids, next_sequence_length=1)

    def step(self, args):
        mark_previous_state(self.cache, True)
        # The prefills' attention kernels (Note [Served attention without cuDNN's plans]).
        with attention_without_cudnn():
            return _call_step(self._compiled_step, self._eager_step, args, self.fused)


class SlotStateSpaceModel(StateSpaceModel):
    """A state-space model (Mamba, Mamba2) served per slot: its recurrent states,
    sized for max_batch rows, hold one request per row; a slot's prefill
    overwrites its row's states in place, and nothing depends on positions."""

    def __init__(self, model, max_batch, max_len, compile_options=None):
        super().__init__(model, max_batch, max_len, compile_options)
        # The first note (one static batch) becomes the served one; the fused
        # kernels' notes stay.
        self.notes[0] = (f"{type(model).__name__} serves one request per row of its recurrent "
                         f"states ({max_batch} slots)")
        self.slot_views = {}

    def slot_view(self, slot):
        if slot not in self.slot_views:
            view = copy.copy(self.cache)
            view.layers = [_state_rows(layer, slice(slot, slot + 1)) for layer in self.cache.layers]
            self.slot_views[slot] = view
        return self.slot_views[slot]

    def prefill(self, args):
        input_ids, slot = args
        mark_previous_state(self.cache, False)
        return self.model(input_ids=input_ids, cache_params=self.slot_view(int(slot)),
                          attention_mask=None, use_cache=True, return_dict=True,
                          **self.extra).logits


def _no_prefill(args):
    raise _error("This decoder serves requests through its scheduler (submit/run); its own "
                 "prefill is not used.")


class Serving:
    """The serving half of a graphed.Decoder: its own slot cache and decode graphs
    (built without end-of-sequence tokens: the scheduler ends requests on them on
    the host) and the core's scheduler."""

    def __init__(self, model, settings, max_batch, max_len, *, buckets=None, chunk_steps=8,
                 warmup=2, use_graphs=None, capture_error_mode="global", compile=False,
                 prefills_per_round=0):
        compile_options = _compile_options(compile)
        device = model.device
        if use_graphs is None:
            use_graphs = device.type == "cuda"
        self.settings = settings
        self.key = (_sampling_key(settings) + (repr(compile_options),)
                    + (int(chunk_steps), int(prefills_per_round)))
        adapter_class = SlotStateSpaceModel if _is_state_space(model) else SlotCacheModel
        adapter = adapter_class(model, max_batch, max_len, compile_options)
        self._adapter = adapter
        self._expert_notes = capturable_experts(model) if device.type == "cuda" else []
        held = weakref.ref(adapter)
        self._core = _C.Decoder(
            step=lambda args: held().step(args), prefill=_no_prefill,
            reset=lambda: held().reset(),
            max_batch=max_batch, max_len=max_len, buckets=list(buckets or []),
            do_sample=settings["do_sample"], temperature=settings["temperature"],
            top_k=settings["top_k"], top_p=settings["top_p"], min_tokens_to_keep=1,
            eos_token_ids=[], pad_token_id=None, check_every=chunk_steps, memory_budget=None,
            warmup=warmup, use_graphs=use_graphs, capture_error_mode=capture_error_mode,
            device=device, prefill_graphs=0, vocab_size=_input_vocabulary(model))
        with torch.no_grad():
            self._scheduler = _C.RequestScheduler(
                self._core, lambda args: held().prefill(args), chunk_steps=chunk_steps,
                eos_token_ids=settings["eos_token_ids"], prefills_per_round=prefills_per_round)
        self.results = {}

    @property
    def notes(self):
        """What the adapter and the experts' switch found, read when asked: a
        fused kernel's first-call check adds its note during the first steps."""
        return list(self._adapter.notes) + list(self._expert_notes)

    @property
    def max_batch(self):
        return self._core.max_batch

    @property
    def max_len(self):
        return self._core.max_len

    def submit(self, prompt, max_new_tokens):
        return self._scheduler.submit(_prompt_tensor(prompt), int(max_new_tokens))

    def _collect(self, finished):
        for request_id, tokens, _ in finished:
            self.results[request_id] = tokens

    def step(self, on_token=None):
        with torch.no_grad():
            finished = self._scheduler.step(on_token)
        self._collect(finished)
        return {request_id: tokens for request_id, tokens, _ in finished}

    def run(self, on_token=None):
        with torch.no_grad():
            finished = self._scheduler.run(on_token)
        self._collect(finished)
        return {request_id: tokens for request_id, tokens, _ in finished}

    @property
    def idle(self):
        return self._scheduler.idle

    def stats(self):
        return self._scheduler.stats()

    def memory_report(self):
        return self._core.memory_report()


def _prompt_tensor(prompt):
    if isinstance(prompt, torch.Tensor):
        tensor = prompt
        if tensor.dim() == 2 and tensor.shape[0] == 1:
            tensor = tensor[0]
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        tensor = torch.tensor(list(prompt), dtype=torch.long)
    else:
        raise _error(f"Expected a prompt as a list of token ids or a 1-D tensor, got "
                     f"{type(prompt).__name__}. Pass one request's ids, e.g. "
                     f"tokenizer(text).input_ids.")
    return tensor


def _budgets(max_new_tokens, count):
    if isinstance(max_new_tokens, (list, tuple)):
        if len(max_new_tokens) != count:
            raise _error(f"Expected one max_new_tokens per prompt ({count}), got "
                         f"{len(max_new_tokens)}. Pass an int for all of them or a list as long "
                         f"as prompts.")
        return [int(n) for n in max_new_tokens]
    return [int(max_new_tokens)] * count


def generate_batch(model, prompts, max_new_tokens=20, *, max_batch=None, max_len=None,
                   on_token=None, chunk_steps=8, prefills_per_round=0, compile=False,
                   **arguments):
    """Many requests on captured graphs, each at its own length, with continuous
    batching: ``prompts`` is a list of token id lists or 1-D tensors (different
    lengths), ``max_new_tokens`` an int or one per prompt. Returns each request's
    new tokens (a list of ints, ending at its first end-of-sequence token) in
    the order of ``prompts``. Greedy tokens are those of ``model.generate`` run
    on each prompt alone; ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
    ``eos_token_id``, ``pad_token_id`` and ``generation_config`` are taken as by
    graphed.generate. ``on_token(index, tokens, finished)`` streams each
    request's new tokens (index into ``prompts``) once per chunk of
    ``chunk_steps`` decode steps. ``prefills_per_round`` (0: no limit) bounds the
    prefills between two chunks, so that decoding starts while many requests
    still wait (the tokens are the same).

    ``max_batch`` rows decode at once (default: the number of prompts, at most
    32); ``max_len`` cache positions per row (default: the longest prompt plus
    its budget). The serving decoder (cache and graphs) is kept on the model and
    reused while it fits and the settings are unchanged. Note [Continuous
    batching on graphs] says how it works.
    """
    _check_model(model)
    for name in ("min_new_tokens", "min_length"):
        if arguments.get(name):
            raise _error(f"graphed.generate_batch does not implement {name} yet (got "
                         f"{arguments[name]!r}): an end-of-sequence token would have to be "
                         f"suppressed per request. Use graphed.generate for it.")
    for name in ("input_ids", "attention_mask", "streamer", "callback", "max_length"):
        if name in arguments:
            raise _error(f"graphed.generate_batch does not take {name}: pass the prompts as a "
                         f"list (no padding, no mask), max_new_tokens per prompt, and "
                         f"on_token(index, tokens, finished) for streaming.")
    settings = _settings(model, arguments)
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)):
        raise _error(f"Expected prompts as a list of token id lists or 1-D tensors, got "
                     f"{type(prompts).__name__}. For one padded batch use graphed.generate.")
    prompts = [_prompt_tensor(p) for p in prompts]
    if not prompts:
        return []
    budgets = _budgets(max_new_tokens, len(prompts))
    for index, (prompt, budget) in enumerate(zip(prompts, budgets)):
        # Before any decoder is built: the core checks the same at submit.
        if prompt.numel() < 1:
            raise _error(f"Expected a prompt of at least one token, got 0 (prompt {index}).")
        if budget < 1:
            raise _error(f"Expected max_new_tokens >= 1, got {budget} (prompt {index}).")
    needed = max(p.numel() + n - 1 for p, n in zip(prompts, budgets))
    max_len = max(int(max_len or needed), needed, 3)  # 3: above the decode warm-up steps
    max_batch = int(max_batch or min(len(prompts), 32))
    serving = model.__dict__.get("_graphed_serving")
    key = (_sampling_key(settings) + (repr(_compile_options(compile)),)
           + (int(chunk_steps), int(prefills_per_round)))
    if (serving is None or serving.key != key or serving.max_len < max_len
            or serving.max_batch != max_batch):
        model.__dict__.pop("_graphed_serving", None)
        serving = Serving(model, settings, max_batch, max_len, chunk_steps=chunk_steps,
                          compile=compile, prefills_per_round=prefills_per_round)
        model.__dict__["_graphed_serving"] = serving
    index_of = {}
    for index, (prompt, budget) in enumerate(zip(prompts, budgets)):
        index_of[serving.submit(prompt, budget)] = index
    callback = None
    if on_token is not None:
        def callback(request_id, tokens, finished):
            if request_id in index_of:
                on_token(index_of[request_id], tokens, finished)
    done = serving.run(callback)
    out = [None] * len(prompts)
    for request_id, index in index_of.items():
        out[index] = done.get(request_id, serving.results.get(request_id))
        serving.results.pop(request_id, None)
    return out


__all__ = ["generate_batch", "Serving", "SlotCacheModel"]
