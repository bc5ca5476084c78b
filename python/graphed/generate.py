"""graphed.generate and graphed.Decoder: Hugging Face causal LMs decoded on
captured CUDA graphs.

An adapter only. It turns a transformers model into the two functions the
core's decoder calls -- the prefill and the one-token decode step, both on a
StaticCache it sizes and empties -- and maps ``generate``'s arguments onto the
core's options. The token loop, sampling, finished rows, buckets, graphs and
memory budget live in C++ (include/graphed/decoder.h). transformers is imported
only here, and only when a model is adapted.
"""

import copy
import logging
import weakref

import torch

from ._autocast_cache import convert_states_to_cache_dtype
from . import _C
from ._compiled import torch_compile_options
from ._experts import capturable_experts
from ._progress import Progress
from ._state_space_decoding import is_state_layer, mark_previous_state, state_view
from ._decode_kernels import FusedDecodeKernels

logger = logging.getLogger(__name__)

#: Arguments of ``model.generate`` that graphed.generate takes.
SUPPORTED_ARGUMENTS = (
    "attention_mask", "max_new_tokens", "min_new_tokens", "max_length", "min_length",
    "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id",
    "streamer", "callback", "max_cache_len", "generation_config", "use_cache",
)

#: Arguments graphed.generate takes beyond model.generate's.
GRAPHED_ARGUMENTS = ("compile",)

# Generation settings that change what generate() computes and that the decoder
# does not implement, with the values that leave them off.
_NEUTRAL_SETTINGS = {
    "num_beams": (None, 1), "num_return_sequences": (None, 1), "repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "min_p": (None,),
    "typical_p": (None, 1.0), "top_h": (None,), "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
    "suppress_tokens": (None,), "begin_suppress_tokens": (None,), "sequence_bias": (None,),
    "renormalize_logits": (None, False), "remove_invalid_values": (None, False),
    "exponential_decay_length_penalty": (None,), "guidance_scale": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0), "max_time": (None,), "stop_strings": (None,),
    "watermarking_config": (None,), "output_scores": (None, False), "output_logits": (None, False),
    "return_dict_in_generate": (None, False), "prefill_chunk_size": (None,),
    "assistant_model": (None,), "prompt_lookup_num_tokens": (None,),
}

_DEFAULTS = {"max_length": 20, "min_length": 0, "do_sample": False, "temperature": 1.0,
             "top_k": 50, "top_p": 1.0}


def _error(message):
    return _C.GraphedError(message)


def _static_cache_shape(model):
    """(key/value heads, head size) of the model's StaticCache, or None when it
    has none (a config without attention heads raises inside transformers)."""
    try:
        return model._get_static_cache_init_shape()
    except AttributeError:
        return None


def _is_state_space(model):
    """A model that keeps recurrent states and no key/value cache at all (Mamba);
    a hybrid with attention layers decodes on the StaticCache adapter."""
    return bool(getattr(model, "_is_stateful", False)) and _static_cache_shape(model) is None


def _check_model(model):
    """Refuses, with the reason, models the decoder cannot drive."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "prepare_inputs_for_generation"):
        raise _error(
            f"Expected a Hugging Face causal language model (a transformers PreTrainedModel with "
            f"generate()), got {type(model).__name__}. For a model of your own, use "
            f"graphed._C.Decoder with your own step and prefill functions.")
    if getattr(config, "is_encoder_decoder", False):
        raise _error(f"{type(model).__name__} is an encoder-decoder model; graphed.generate "
                     f"decodes causal (decoder-only) language models. Use model.generate.")
    attention = getattr(config, "_attn_implementation", None)
    if attention not in ("sdpa", "eager"):
        raise _error(f"Expected attn_implementation 'sdpa' or 'eager', got {attention!r}. Load "
                     f"the model with attn_implementation='sdpa'.")
    if _is_state_space(model):
        return  # its own adapter: Note [Decoding a state-space model on graphs]
    if not model._supports_default_dynamic_cache() or _static_cache_shape(model) is None:
        raise _error(f"{type(model).__name__} cannot use a StaticCache of one head count and "
                     f"head size per layer, which the decode graphs need. Use model.generate.")


# Compiled decode steps per code object before Dynamo falls back to eager; a
# bucket or decoder each needs one (Note [A compiled decode step]).
_RECOMPILE_LIMIT = 64


def _call_step(compiled, eager, args, fused=None):
    """One decode step, compiled when the decoder was asked to; every bucket and
    decoder recompiles (Note [A compiled decode step]). An eager step runs
    ``fused``'s kernels (a FusedDecodeKernels, or None)."""
    if fused is not None:
        with fused.active():
            return eager(*args)
    if compiled is None:
        return eager(*args)
    with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
        return compiled(*args)


def _install_prefill_mask_rule():
    """Makes transformers' prefill mask rule capturable during graphed's prefills.

    Note [A capturable prefill]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~
    transformers (5.17) decides in masking_utils._ignore_causal_mask_sdpa
    whether the prefill can skip its attention mask and use SDPA's is_causal:
    yes when the (empty) cache's offset is 0 and no prompt has left padding.
    It decides by reading device values on the host (``q_offset == 0`` on the
    StaticCache's length tensor, ``padding_mask.sum() == numel``), which no
    graph can hold, and while a CUDA stream captures it answers "no" without
    looking -- a different attention path than the eager prefill, whose
    tokens could differ in the last bits. The decoder knows both answers on
    the host: the cache was just emptied, and the core passes the mask only
    when some row has left padding (PrefillStep in decoder.h). So during
    graphed's prefills this rule answers as transformers would for those
    values (padding, or a local attention window it reaches, keeps the mask);
    everywhere else it calls transformers' own rule, or the one of Note
    [transformers' mask rules under capture] (integrations/transformers_masks.py,
    which holds both)."""
    from .integrations import transformers_masks

    transformers_masks.install()


def _compile_options(compile):
    """torch.compile's keyword arguments for the decode step, or None for an
    eager step. See Note [A compiled decode step].

    Note [A compiled decode step]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A captured graph removes the host's launch cost, not the GPU's: each
    kernel node still costs about 0.5 us of launch latency on the device
    between kernels, which no host work can hide. transformers' decode step
    is mostly tiny kernels (RMSNorm, rotary embeddings, SiLU-and-multiply,
    residual adds: about 205 per token for a 4-layer Llama), so that latency
    is ~0.1 ms per token on the H200 whatever the host does, ~25% above the
    kernels' own time. Inductor's default mode fuses them (74 kernels for the
    same step) and records no graphs of its own, so graphed captures the
    compiled step as it captures an eager one. This is vLLM's arrangement too:
    its model is compiled for fusion and captured per batch size.
    - Compilation happens in the bucket's warm-up steps, before the capture
      (memory_report's ``warmup_ms``); a capture never compiles, because the
      warm-up just ran the same shapes and guards.
    - Each bucket and each decoder is a new set of guards for the same code,
      so the calls run with Dynamo's recompile limit raised: past the default
      (8) Dynamo would fall back to eager without an error, silently undoing
      what the user asked for.
    - Only decode steps compile. A prefill runs once per request and would
      recompile for every prompt length.
    - Numerics: fused kernels round differently from eager ones, so greedy
      tokens can differ from the eager model's where two logits nearly tie.
    Modes that record Inductor's own CUDA graphs (reduce-overhead,
    max-autotune) are refused: those graphs cannot be captured inside
    graphed's."""
    return torch_compile_options(compile, "decode step")[1]


def _unroll_sliding_windows(cache, max_len, model):
    """Replaces the cache's sliding-window layers by full static layers;
    returns the notes saying so (none when there were none).

    Note [Sliding windows on a full static cache]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    transformers' StaticSlidingWindowLayer (5.17) keeps the last `window`
    keys and decides on the host, from a Python int counting the tokens it
    has seen, whether the window is full: then it rolls the whole window by
    one position and writes the new key last, else it writes at the next
    position. A graph captured before the window fills would replay the
    not-full branch for ever (and one captured after, the roll), so the
    decode graphs refused those layers. Here every sliding layer of
    Mistral, Qwen2/3 with a window, gpt-oss (sliding and full layers
    alternate) and Gemma 2/3 (local and global layers) becomes a full static
    layer: keys stay at their absolute positions, and transformers' own
    sliding-window mask, which the model builds on the device from the cache
    positions, hides those outside the window. Every step is then the same
    graph, and the attention sees exactly the keys transformers' static
    cache keeps (greedy tokens equal to model.generate(...,
    cache_implementation="static"): tests/python/test_generate.py, windows
    of 8 over 17 tokens). The cost is memory and attention work: a sliding
    layer holds max_len positions instead of `window` and attends over them
    (masked). Nothing changes while max_len <= window (Mistral's 4096 and
    most requests); past it the sliding layers grow with max_len / window. A
    ring buffer with a position map on the device would remove that."""
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    unrolled = []
    for index, layer in enumerate(cache.layers):
        if type(layer) is StaticSlidingWindowLayer:
            cache.layers[index] = StaticLayer(max_cache_len=max_len)
            unrolled.append(index)
    if not unrolled:
        return []
    window = getattr(model.config.get_text_config(decoder=True), "sliding_window", None)
    layers = ", ".join(str(index) for index in unrolled)
    return [f"{len(unrolled)} of {len(cache.layers)} layers of {type(model).__name__} (layers "
            f"{layers}) attend within a sliding window of {window}: their cache holds all "
            f"{max_len} positions and transformers' sliding-window mask keeps the window "
            f"(Note [Sliding windows on a full static cache])"]


class _StaticCacheModel:
    """The model's prefill and decode step on one StaticCache of max_batch rows;
    a batch of n rows works on views of the first n rows of every layer.

    It holds the model weakly: the core's decoder holds this object, and a
    decoder kept on the model (graphed.generate) would otherwise be a cycle
    through C++ that Python's collector cannot see, and never be freed."""

    def __init__(self, model, max_batch, max_len, compile_options=None):
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        self._model = weakref.ref(model)
        self.cache = StaticCache(config=model.config.get_text_config(decoder=True),
                                 max_cache_len=max_len)
        self.notes = _unroll_sliding_windows(self.cache, max_len, model)
        kinds = {type(layer).__name__ for layer in self.cache.layers
                 if type(layer) is not StaticLayer and not is_state_layer(layer)}
        if kinds:
            raise _error(f"{type(model).__name__} needs cache layers of kind {sorted(kinds)}, "
                         f"which the decode graphs do not support yet. Use model.generate, or "
                         f"a config without them.")
        heads, head_dim = model._get_static_cache_init_shape()
        self.cache.early_initialization(batch_size=max_batch, num_heads=heads, head_dim=head_dim,
                                        dtype=model.dtype, device=model.device)
        convert_states_to_cache_dtype(self.cache)  # Note [A static cache under autocast]
        self.extra = {"logits_to_keep": 1} if model._supports_logits_to_keep() else {}
        self.views = {}
        self._compiled_step = None
        self.fused = None  # graphed's kernels in eager steps, below
        if compile_options is not None:
            self._compiled_step = torch.compile(self._eager_step, **compile_options)
        _install_prefill_mask_rule()
        states = sum(1 for layer in self.cache.layers if is_state_layer(layer))
        if states:
            # Note [Decoding a state-space model on graphs]: a prefill of one
            # token sizes the state layers for max_batch rows.
            zeros = torch.zeros(max_batch, 1, dtype=torch.long, device=model.device)
            with torch.no_grad():
                self.prefill((zeros, None, zeros))
            self.views = {}  # built before the states existed
            self.reset()
            self.notes.append(
                f"{states} of {len(self.cache.layers)} layers of {type(model).__name__} are "
                f"state-space layers: their recurrent states are sized for {max_batch} rows "
                f"(Note [Decoding a state-space model on graphs])")
        if compile_options is None:
            # Note [RMSNorm in every decode step]; Note [Fused state-space
            # decode steps] for hybrids' Mamba layers. A compiled step has
            # Inductor's kernels.
            self.fused = FusedDecodeKernels.for_eager_steps(model, self.notes)

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise _error("The model this decoder was built for was freed; build a new decoder.")
        return model

    def view(self, rows):
        """The cache restricted to its first `rows` rows (same memory, same lengths)."""
        if rows not in self.views:
            view = copy.copy(self.cache)
            view.layers = []
            for layer in self.cache.layers:
                if is_state_layer(layer):
                    view.layers.append(state_view(layer, rows))
                    continue
                part = copy.copy(layer)
                part.keys, part.values = layer.keys[:rows], layer.values[:rows]
                part.batch_size = rows
                view.layers.append(part)
            self.views[rows] = view
        return self.views[rows]

    def reset(self):
        self.cache.reset()

    def _forward(self, input_ids, attention_mask, position_ids, **flags):
        inputs = self.model.prepare_inputs_for_generation(
            input_ids, past_key_values=self.view(input_ids.shape[0]),
            attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
            **flags, **self.extra)
        return self.model(**inputs, return_dict=True).logits

    def prefill(self, args):
        """The prompts through the model, capturable (Note [A capturable prefill]).
        attention_mask is None when no row has left padding."""
        input_ids, attention_mask, position_ids = args
        padded = attention_mask is not None
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        from .integrations.transformers_masks import prefill_padding

        prefill_padding.padded = padded
        mark_previous_state(self.cache, False)
        try:
            return self._forward(input_ids, attention_mask, position_ids, is_first_iteration=True)
        finally:
            prefill_padding.padded = None

    def _eager_step(self, input_ids, position_ids, attention_mask):
        return self._forward(input_ids, attention_mask, position_ids, next_sequence_length=1)

    def step(self, args):
        mark_previous_state(self.cache, True)
        return _call_step(self._compiled_step, self._eager_step, args, self.fused)


class _FromConfig:
    """The Decoder's default eos_token_id: the generation config's (None there
    means no end-of-sequence token, as in a generate call)."""

    def __repr__(self):
        return "<from generation_config>"


_FROM_CONFIG = _FromConfig()


def _token_list(value):
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _settings(model, arguments):
    """generate()'s arguments merged over the model's generation config, as
    model.generate merges them; refuses what the decoder does not implement."""
    unknown = sorted(set(arguments) - set(SUPPORTED_ARGUMENTS) - set(_NEUTRAL_SETTINGS))
    if unknown:
        raise _error(f"graphed.generate does not take {', '.join(unknown)}. It takes "
                     f"{', '.join(SUPPORTED_ARGUMENTS)}; use model.generate for the rest.")
    config = arguments.get("generation_config") or getattr(model, "generation_config", None)
    try:
        from transformers import GenerationConfig
        defaults = {**_DEFAULTS, **GenerationConfig._get_default_generation_params()}
    except (ImportError, AttributeError):
        defaults = dict(_DEFAULTS)

    def get(name):
        if arguments.get(name) is not None:
            return arguments[name]
        value = getattr(config, name, None)
        return defaults.get(name) if value is None else value

    for name, neutral in _NEUTRAL_SETTINGS.items():
        value = get(name)
        if value not in neutral:
            raise _error(f"graphed.generate does not implement {name}={value!r} (set in the "
                         f"call or the model's generation_config); it needs {neutral[-1]!r}. "
                         f"Use model.generate for it.")
    if get("use_cache") is False:
        raise _error("graphed.generate decodes with a KV cache; use_cache=False is not supported.")
    # An explicit eos_token_id=None means no end-of-sequence token, as in
    # model.generate, whose call arguments replace the generation config's
    # even when None; every other None means "the config's value".
    if "eos_token_id" in arguments and arguments["eos_token_id"] is None:
        eos = []
    else:
        eos = _token_list(get("eos_token_id"))
    pad = get("pad_token_id")
    if pad is None and eos:
        pad = eos[0]  # as model.generate does, with its warning
    do_sample = bool(get("do_sample"))
    return {
        "max_new_tokens": get("max_new_tokens"), "max_length": get("max_length"),
        "min_new_tokens": get("min_new_tokens") or 0, "min_length": get("min_length") or 0,
        "do_sample": do_sample,
        "temperature": float(get("temperature")) if do_sample else 1.0,
        "top_k": int(get("top_k") or 0) if do_sample else 0,
        "top_p": float(get("top_p")) if do_sample else 1.0,
        "eos_token_ids": eos, "pad_token_id": None if pad is None else int(_token_list(pad)[0]),
        "max_cache_len": get("max_cache_len"),
    }


def _input_vocabulary(model):
    """How many token ids the model's input embedding takes, or None when it
    has none graphed can see (the core then checks against the logits' width):
    Note [Token ids are checked on the host] in src/decoder.cpp."""
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    rows = getattr(embedding, "num_embeddings", None)
    return int(rows) if isinstance(rows, int) else None


def _sampling_key(settings):
    return tuple(settings[k] for k in ("do_sample", "temperature", "top_k", "top_p",
                                       "pad_token_id")) + (tuple(settings["eos_token_ids"]),)


class Decoder:
    """Decodes a Hugging Face causal LM on captured graphs, one per batch bucket,
    for many requests of different batch sizes and prompt lengths.

    ``max_batch`` rows and ``max_len`` cache positions (prompt + new tokens - 1)
    are allocated once; sampling settings are fixed at construction (they are
    part of the graphs). ``capture=True`` captures every bucket's decode step
    now. The prefill of a (bucket, prompt length) shape runs eagerly for its
    first ``warmup`` requests, then as a graph; at most ``prefill_graphs`` of
    them are held (least recently used evicted; 0 keeps prefills eager).
    ``memory_budget`` ("2GiB" or bytes) evicts least recently used graphs of
    either kind. Sampling settings left None come from ``generation_config``
    (default: the model's); ``eos_token_id`` left out does too, while
    ``eos_token_id=None`` decodes with no end-of-sequence token, as
    ``model.generate(..., eos_token_id=None)`` does.

    ``compile=True`` (or a dict of torch.compile arguments: fullgraph,
    dynamic, backend, mode, options) compiles the decode step with Inductor,
    without its CUDA graphs, before capturing it: fewer, fused kernels per
    token (Note [A compiled decode step]). Compilation takes seconds per bucket,
    during its warm-up; greedy tokens can differ from the eager model's where
    logits nearly tie.
    """

    def __init__(self, model, max_batch, max_len, *, buckets=None, do_sample=None,
                 temperature=None, top_k=None, top_p=None, eos_token_id=_FROM_CONFIG,
                 pad_token_id=None, check_every=8, memory_budget=None, warmup=2, capture=True, use_graphs=None,
                 capture_error_mode="global", generation_config=None, prefill_graphs=16,
                 compile=False):
        _check_model(model)
        compile_options = _compile_options(compile)
        arguments = {"do_sample": do_sample, "temperature": temperature, "top_k": top_k,
                     "top_p": top_p, "pad_token_id": pad_token_id,
                     "generation_config": generation_config}
        if eos_token_id is not _FROM_CONFIG:
            arguments["eos_token_id"] = eos_token_id
        settings = _settings(model, arguments)
        self._settings = settings
        self._check_every = check_every
        self._compile = compile
        self.key = _sampling_key(settings) + (repr(compile_options),)
        device = model.device
        if use_graphs is None:
            use_graphs = device.type == "cuda"
        # The core validates the options before the cache is allocated; it calls
        # the adapter only from generate() and capture_all().
        adapter = []  # filled below; the core must not hold `self` (see _StaticCacheModel)
        self._core = _C.Decoder(
            step=lambda args: adapter[0].step(args),
            prefill=lambda args: adapter[0].prefill(args),
            reset=lambda: adapter[0].reset(),
            max_batch=max_batch, max_len=max_len, buckets=list(buckets or []),
            do_sample=settings["do_sample"], temperature=settings["temperature"],
            top_k=settings["top_k"], top_p=settings["top_p"], min_tokens_to_keep=1,
            eos_token_ids=settings["eos_token_ids"], pad_token_id=settings["pad_token_id"],
            check_every=check_every, memory_budget=memory_budget, warmup=warmup,
            use_graphs=use_graphs, capture_error_mode=capture_error_mode, device=device,
            prefill_graphs=prefill_graphs, vocab_size=_input_vocabulary(model))
        # fp32 experts would read their offsets on the host in transformers'
        # grouped GEMM (Note [A grouped GEMM every dtype can capture]); graphed's
        # kernels need the GPU, where the graphs are.
        self._expert_notes = capturable_experts(model) if device.type == "cuda" else []
        if _is_state_space(model):
            from ._state_space_decoding import StateSpaceModel

            adapter.append(StateSpaceModel(model, max_batch, max_len, compile_options))
        else:
            adapter.append(_StaticCacheModel(model, max_batch, max_len, compile_options))
        self._adapter = adapter
        for note in self.notes:
            logger.info("Decoder: %s", note)
        if capture and use_graphs:
            self.capture()

    @property
    def cache(self):
        """The transformers cache the decoder owns: a StaticCache (max_batch rows, max_len
        positions), or a state-space model's recurrent states (max_batch rows)."""
        return self._adapter[0].cache

    @property
    def notes(self):
        """What the decoder changed about the model's cache to decode on graphs:
        sliding-window layers held whole and masked to their window (Note
        [Sliding windows on a full static cache]), a state-space model's states
        sized for max_batch (Note [Decoding a state-space model on graphs]);
        graphed's grouped GEMM for fp32 experts on the GPU; empty when nothing."""
        return list(self._adapter[0].notes) + list(self._expert_notes)

    def capture(self):
        """Captures every bucket's graph now (generate() captures a bucket on first use,
        and prefill graphs after their shape's warm-up requests).
        A progress bar shows on stderr while it takes (see graphed._progress)."""
        with Progress(len(self._core.buckets), "graphed.Decoder: capturing", unit="bucket",
                      delay=0.5) as bar:

            def captured(batch, done, total):
                bar.update(1, status=f"batch {batch}")
                logger.debug("Decoder: captured the decode step for batch bucket %d (%d of %d)",
                             batch, done, total)

            with torch.no_grad():
                self._core.capture_all(captured)

    @property
    def max_batch(self):
        """The largest batch a request may have (rows of the static KV cache)."""
        return self._core.max_batch

    @property
    def max_len(self):
        """Positions in the KV cache: a request needs prompt length + max_new_tokens - 1."""
        return self._core.max_len

    @property
    def buckets(self):
        """The batch sizes decode graphs are captured for; a batch runs in the smallest
        bucket that holds it, its extra rows ignored."""
        return list(self._core.buckets)

    def generate(self, input_ids, attention_mask=None, max_new_tokens=20, min_new_tokens=0,
                 streamer=None, callback=None):
        """Decodes one request; returns ``[batch, prompt_len + n]`` like model.generate."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise _error(f"Expected input_ids as a [batch, prompt_len] tensor of token ids, got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}.")
        self._core.check_request(input_ids.shape[0], input_ids.shape[1], max_new_tokens,
                                 min_new_tokens)
        on_token = callback
        if streamer is not None:
            streamer.put(input_ids.cpu())
            on_token = _both(streamer.put, callback)
        with torch.no_grad():
            tokens, _, _ = self._core.generate(input_ids, attention_mask, max_new_tokens,
                                               min_new_tokens, on_token)
        if streamer is not None:
            streamer.end()
        return torch.cat([input_ids, tokens], dim=1)

    def submit(self, prompt, max_new_tokens=20):
        """Queues one request for continuous batching (Note [Continuous batching on
        graphs]): ``prompt`` a list of token ids or a 1-D tensor, at most
        ``max_new_tokens`` new tokens. Returns its id. May be called while
        ``run()`` runs (from its ``on_token``). The first call builds the serving
        half: a cache of ``max_batch`` slots of ``max_len`` positions and its own
        decode graphs, next to the ones ``generate()`` uses."""
        return self._serving_half().submit(prompt, max_new_tokens)

    def step(self, on_token=None):
        """One round of the scheduler: prefills waiting requests into free slots,
        runs one chunk of decode steps; returns ``{id: tokens}`` of the requests that
        finished in it. ``on_token(id, tokens, finished)`` streams new tokens."""
        return self._serving_half().step(on_token)

    def run(self, on_token=None):
        """Runs submitted requests (and those submitted from ``on_token``) until all
        finished; returns ``{id: new tokens}`` (lists of ints)."""
        return self._serving_half().run(on_token)

    def serving_stats(self):
        """The scheduler's counters (prefills, prefill_ms, decode_steps, chunks,
        live_row_steps, row_steps, host_waits, ...); empty before the first submit."""
        serving = self.__dict__.get("_serving")
        return serving.stats() if serving is not None else {}

    def _serving_half(self):
        serving = self.__dict__.get("_serving")
        if serving is None:
            from .serving import Serving

            model = self._adapter[0].model
            serving = Serving(model, self._settings, self.max_batch, self.max_len,
                              buckets=self.buckets, chunk_steps=self._check_every,
                              compile=self._compile)
            self._serving = serving
        return serving

    def memory_report(self):
        """One dict per graph: ``kind`` ("decode": one per bucket; "prefill": one per
        prefill shape captured so far, with ``prompt_len`` and ``padded``), batch,
        captured, graph_bytes, capture_ms (warm-up and capture), warmup_ms (its warm-up
        part, where a compiled step compiles), kernels, replays, evictions."""
        return self._core.memory_report()

    def pool_bytes(self):
        """Bytes the graphs' shared pool reserves now."""
        return self._core.pool_bytes()


def _both(first, second):
    if second is None:
        return first
    return lambda tokens: (first(tokens), second(tokens))


def _attention_mask(input_ids, settings):
    """model.generate's mask for prompts given without one: pad tokens are
    padding when the pad token is not also an eos token."""
    pad, eos = settings["pad_token_id"], settings["eos_token_ids"]
    if pad is None or pad in eos or not bool((input_ids == pad).any()):
        return None
    return input_ids.ne(pad).long()


def generate(model, input_ids, **arguments):
    """``model.generate(input_ids, **arguments)`` on captured graphs, returning the
    same tensor. Greedy decoding gives the tokens of
    ``model.generate(..., cache_implementation="static")``. The decoder (its
    cache and graphs) is kept on the model and reused while the batch fits
    and the cache length and sampling settings are unchanged.

    Takes the arguments in SUPPORTED_ARGUMENTS, and ``compile`` (Decoder's:
    a decode step fused by Inductor); ``callback(tokens)`` is called
    with each step's tokens, as a streamer's ``put``. Anything else, and
    settings it does not implement, raise graphed.GraphedError before any work.
    """
    _check_model(model)
    compile = arguments.pop("compile", False)
    compile_options = _compile_options(compile)
    settings = _settings(model, arguments)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise _error(f"Expected input_ids as a [batch, prompt_len] tensor of token ids, got "
                     f"{getattr(input_ids, 'shape', type(input_ids).__name__)}.")
    batch, prompt_len = input_ids.shape
    new_tokens = settings["max_new_tokens"]
    if new_tokens is None:
        new_tokens = settings["max_length"] - prompt_len
    if new_tokens < 1:
        raise _error(f"Nothing to generate: max_length {settings['max_length']} is not above the "
                     f"prompt length {prompt_len}. Pass max_new_tokens.")
    min_new = max(settings["min_new_tokens"], settings["min_length"] - prompt_len, 0)
    max_len = max(prompt_len + new_tokens - 1, settings["max_cache_len"] or 0, 2)
    mask = arguments.get("attention_mask")
    if mask is None:
        mask = _attention_mask(input_ids, settings)
    decoder = model.__dict__.get("_graphed_decoder")
    key = _sampling_key(settings) + (repr(compile_options),)
    if decoder is None or decoder.key != key or decoder.max_len != max_len or decoder.max_batch < batch:
        model.__dict__.pop("_graphed_decoder", None)
        max_batch = 1 << (batch - 1).bit_length()
        decoder = Decoder(model, max_batch, max_len, capture=False, compile=compile,
                          **{k: arguments[k] for k in ("do_sample", "temperature", "top_k",
                                                       "top_p", "eos_token_id", "pad_token_id",
                                                       "generation_config") if k in arguments})
        model.__dict__["_graphed_decoder"] = decoder
    return decoder.generate(input_ids, mask, new_tokens, min_new,
                            streamer=arguments.get("streamer"), callback=arguments.get("callback"))
