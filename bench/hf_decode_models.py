"""Workload hf_decode_models (issue 27, "Results format": the
``hf_decode.models.<model>.b<batch>`` rows): graphed.generate on the cache
kinds beyond hf_decode's Llama, at hf_decode's scale. Six Hugging Face causal
LMs, random init from configs (nothing downloaded), 4 layers, d512, vocab
32000, GQA (8 heads, 2 key/value heads) where the family has it:

- ``mistral_sliding``: Mistral, every layer in a sliding window of 64;
- ``gpt_oss``: gpt-oss, sliding (64) and full layers alternating, attention
  sinks (attn_implementation="eager"), 8 experts top-2;
- ``gemma3``: Gemma 3 (text), local (window 64) and global layers alternating;
- ``mamba2``: Mamba2, transformers' torch path (state 64, 16 heads of 64);
- ``granite_hybrid``: GraniteMoeHybrid, Mamba2 and attention layers
  alternating, 8 experts top-2 plus a shared MLP;
- ``qwen3_moe``: Qwen3-MoE, 16 experts top-4, in bf16 (the others fp32).

32-token prompts (random ids, no padding), 128 new tokens, greedy, no
end-of-sequence token (every row runs its whole budget), at batch 1 and 8:
32 + 128 positions cross every window of 64, so the windows matter. fp32
models run with TF32 off (``tf32``: False in the record), so that tokens can
be compared exactly; the previous TF32 setting is restored afterwards.

Each (model, batch) gets a freshly built model (same seed, same weights), so
that nothing graphed switched on one row (its experts' grouped GEMM on the
GPU, Note [A grouped GEMM every dtype can capture]) reaches transformers' paths
or the next row. Row ``models.<model>.b<batch>``:

- ``ms_per_token``: graphed.generate, ms per new token, warm (its first call,
  which builds the decoder and captures the decode bucket, is
  ``first_call_s``; then hf_decode's ``_ms_per_token``: one more call, and the
  median of ``GRAPHED_REPEATS``);
- ``kernel_floor_ms``: kernel time of one decode step of the decoder's own
  adapter run eagerly (hf_decode's ``_step_floor_ms``: the profiler's GPU
  activities; None on the CPU);
- ``hf_dynamic_ms_per_token``: ``model.generate`` with its default
  DynamicCache (median of ``HF_REPEATS`` after a warm call);
- ``same_tokens``: graphed's tokens (first call, and a call after the timing,
  when the prefill has its graph) equal transformers' reference, which is
  ``compared_with``: ``hf_static`` (``model.generate(...,
  cache_implementation="static")``, eager) where transformers runs the model
  on a static cache, else ``hf_dynamic`` (``hf_static_error`` says why);
  ``new_tokens_equal_fraction`` where they differ; ``hf_static_cache_layers``:
  the layer kinds of transformers' static cache; ``hf_static_equals_dynamic``:
  transformers' two caches agree with each other;
- ``prefill_call_ms``: the same call with one new token (the prefill, its
  token and the call's own work); ``decode_ms_per_token``: the marginal time
  of one more token, ``(new_tokens * ms_per_token - prefill_call_ms) /
  (new_tokens - 1)``, the decode step alone as ``kernel_floor_ms`` is
  (``ms_per_token`` spreads the prefill over the tokens, which counts where
  the prefill runs many kernels, as the state-space models' chunked scans
  do); ``decode_ratio_to_floor``;
- ``prefill_kernel_ms``: kernel time of the prefill of the prompts (the
  adapter's, run eagerly, its cache emptied first as the decoder's prefill
  does); ``call_kernel_ms_per_token``: the kernels of the whole call per new
  token, ``(prefill_kernel_ms + (new_tokens - 1) * kernel_floor_ms) /
  new_tokens``, the floor under ``ms_per_token``; ``ratio_to_call_floor``:
  ``ms_per_token`` over it (``ratio_to_floor`` counts the prefill's kernels
  as overhead: a 32-token Mamba2 prefill runs 0.8 ms of kernels at batch 1,
  its chunked scan materialising 256x256 blocks);
- ``hf_kernel_floor_ms`` and ``ratio_to_hf_floor`` where graphed runs fused
  kernels of its own in the step (state-space models): the kernel time of the
  same eager step on transformers' own functions, the eager iteration's
  floor of DESIGN.md, which ``kernel_floor_ms`` (graphed's fused step, fewer
  kernels) is stricter than;
- ``max_speedup_vs_hf_dynamic``: ``hf_dynamic_ms_per_token`` over
  ``kernel_floor_ms``, the most any graph of this step could give against
  transformers' DynamicCache on this host (where the step's kernels are
  transformers' own, a faster host lowers it);
- ``ratio_to_floor``, ``speedup_vs_hf_dynamic``; ``graph_notes`` (the
  decoder's notes: sliding windows held whole, state-space layers, experts
  switched to graphed's grouped GEMM); ``capture_s``, ``graph_mb``, ``kernels``
  of the decode graphs; ``prefill_captured``.

A path that fails records its error under ``errors`` and the row keeps the
rest; a model that cannot be built records ``error``. The issue names these
rows ``hf_decode.models``; they are a workload of their own (opt-in in
bench/run.py, ``workloads.hf_decode_models.models``) so that hf_decode's
Llama rows and its default run stay as they were. On the CPU (a smoke run)
torch runs one thread.

Run: ``python3 bench/hf_decode_models.py --json OUT.json`` (``--models
mamba2,gemma3``; ``--quick``: tiny models, 8 new tokens; ``--device cpu``:
graphed.generate decodes eagerly there, a smoke run), or ``python3
bench/run.py --json OUT.json hf_decode_models`` (opt-in)."""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

import hf_decode_report
from hf_decode import NEW_TOKENS, PROMPT, _ms_per_token, _step_floor_ms

MODELS = ("mistral_sliding", "gpt_oss", "gemma3", "mamba2", "granite_hybrid", "qwen3_moe")
BATCHES = (1, 8)
HF_REPEATS, GRAPHED_REPEATS = 2, 5
QUICK_NEW_TOKENS, QUICK_HF_REPEATS, QUICK_GRAPHED_REPEATS = 8, 1, 2
PAD = 0  # pad token of every model; prompts hold ids from 1


class Size(NamedTuple):
    layers: int
    width: int
    vocab: int
    window: int
    heads: int
    experts: int  # gpt-oss's and granite's (qwen3_moe has 16 at every size)
    ssm_head: int  # Mamba2's head size and state size
    chunk: int  # Mamba2's scan chunk: the 32-token prompt spans several


#: hf_decode's scale; the windows of 64 are crossed by 32 + 128 positions.
BENCH = Size(layers=4, width=512, vocab=32000, window=64, heads=8, experts=8, ssm_head=64,
             chunk=16)
#: --quick: tiny models; windows of 8 are crossed by the 32-token prompt.
TINY = Size(layers=2, width=64, vocab=512, window=8, heads=4, experts=4, ssm_head=16, chunk=8)

#: The models whose attention layers (some or all) see a sliding window.
SLIDING = ("mistral_sliding", "gpt_oss", "gemma3")


def _alternating(first: str, second: str, layers: int) -> List[str]:
    return [first if i % 2 == 0 else second for i in range(layers)]


def build_model(name: str, size: Size, device: str) -> Tuple[torch.nn.Module, str]:
    """The model ``name`` at ``size`` in eval mode on ``device``, and its label."""
    import transformers

    torch.manual_seed(0)
    d, heads, layers, vocab, window = size.width, size.heads, size.layers, size.vocab, size.window
    head_dim = d // heads
    tokens = dict(bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD)
    gqa = f"GQA ({heads} heads, 2 kv)"
    if name == "mistral_sliding":
        config = transformers.MistralConfig(
            vocab_size=vocab, hidden_size=d, intermediate_size=d * 43 // 16,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
            sliding_window=window, max_position_embeddings=1024, **tokens)
        model = transformers.MistralForCausalLM(config)
        label = f"Mistral {layers} layers d{d} {gqa}, sliding window {window} on every layer"
    elif name == "gpt_oss":
        # Attention sinks need eager attention; max_position_embeddings stays
        # the config's, which its YaRN rotary scaling is defined against.
        config = transformers.GptOssConfig(
            vocab_size=vocab, hidden_size=d, intermediate_size=d, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=2, head_dim=head_dim,
            num_local_experts=size.experts, num_experts_per_tok=2, sliding_window=window,
            layer_types=_alternating("sliding_attention", "full_attention", layers),
            attn_implementation="eager", **tokens)
        model = transformers.GptOssForCausalLM(config)
        label = (f"gpt-oss {layers} layers d{d} {gqa}, sliding window {window} and full layers "
                 f"alternating, sinks (eager attention), {size.experts} experts top-2")
    elif name == "gemma3":
        config = transformers.Gemma3TextConfig(
            vocab_size=vocab, hidden_size=d, intermediate_size=d * 43 // 16,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
            head_dim=head_dim, sliding_window=window,
            layer_types=_alternating("sliding_attention", "full_attention", layers),
            max_position_embeddings=1024, **tokens)
        model = transformers.Gemma3ForCausalLM(config)
        label = (f"Gemma 3 (text) {layers} layers d{d} {gqa}, local (window {window}) and "
                 f"global layers alternating")
    elif name == "mamba2":
        ssm_head = state = size.ssm_head
        config = transformers.Mamba2Config(
            vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, state_size=state,
            expand=2, head_dim=ssm_head, num_heads=2 * d // ssm_head, n_groups=1,
            chunk_size=size.chunk, **tokens)
        model = transformers.Mamba2ForCausalLM(config)
        kernels = [k for k in ("mamba_ssm", "causal_conv1d") if importlib.util.find_spec(k)]
        label = (f"Mamba2 {layers} layers d{d}, state {state}, {2 * d // ssm_head} heads of "
                 f"{ssm_head}, torch path (" +
                 (f"{' and '.join(kernels)} installed" if kernels
                  else "no mamba-ssm or causal-conv1d kernels") + ")")
    elif name == "granite_hybrid":
        ssm_heads, state = 2 * d // size.ssm_head, size.ssm_head
        config = transformers.GraniteMoeHybridConfig(
            vocab_size=vocab, hidden_size=d, intermediate_size=2 * d,
            shared_intermediate_size=2 * d, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=2,
            num_local_experts=size.experts, num_experts_per_tok=2,
            layer_types=_alternating("mamba", "attention", layers),
            mamba_n_heads=ssm_heads, mamba_d_head=2 * d // ssm_heads, mamba_d_state=state,
            mamba_n_groups=1, mamba_chunk_size=size.chunk,
            max_position_embeddings=1024, **tokens)
        model = transformers.GraniteMoeHybridForCausalLM(config)
        label = (f"granite-moe-hybrid {layers} layers d{d}: Mamba2 (state {state}) and "
                 f"attention {gqa} layers alternating, {size.experts} experts top-2 plus a "
                 f"shared MLP")
    elif name == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            vocab_size=vocab, hidden_size=d, intermediate_size=2 * d,
            moe_intermediate_size=d // 2, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=2, head_dim=head_dim, num_experts=16, num_experts_per_tok=4,
            max_position_embeddings=1024, **tokens)
        model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
        label = f"Qwen3-MoE {layers} layers d{d} {gqa}, 16 experts top-4"
    else:
        raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    dtype = str(model.dtype).replace("torch.", "")
    return model, f"{label}, vocab {vocab}, {dtype}"


def _prefill_floor_ms(adapter, ids: torch.Tensor) -> float:
    """Kernel time of the prompts' prefill through graphed's adapter, run
    eagerly (no left padding: no mask, as the decoder passes it), the cache
    emptied first as the decoder's prefill empties it."""
    import graphed
    from graphed import measure

    mask = torch.ones_like(ids)

    def prefill() -> None:
        adapter.reset()
        adapter.prefill((ids, None, graphed._C.prompt_positions(mask)))

    with torch.no_grad():
        ms, _ = measure.kernel_floor_ms(prefill, iters=10)
        adapter.reset()
    return round(ms, 4)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], repeats: int, new_tokens: int, device: str) -> float:
    """ms per new token: hf_decode's _ms_per_token on the GPU (one warm call,
    then the median of `repeats`); on the CPU the same without CUDA syncs."""
    if device == "cuda":
        return _ms_per_token(fn, repeats, new_tokens)
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000 / new_tokens)
    return round(sorted(times)[len(times) // 2], 4)


def _error(error: BaseException) -> Dict[str, str]:
    return {"error": f"{type(error).__name__}: {error}"[-2000:],
            "traceback": traceback.format_exc()[-2000:]}


def _prompts(batch: int, vocab: int, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(1, vocab, (batch, PROMPT), generator=generator).to(device)


def run_row(name: str, batch: int, size: Size, new_tokens: int, hf_repeats: int,
            graphed_repeats: int, device: str,
            about: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One ``b<batch>`` row of ``name`` (see the module docstring) on a model
    built for it; ``about`` gets the model's label and dtype."""
    import graphed

    model, label = build_model(name, size, device)
    if about is not None:
        about.update(model=label, dtype=str(model.dtype).replace("torch.", ""))
    ids = _prompts(batch, size.vocab, device)
    max_cache_len = PROMPT + new_tokens - 1
    common = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                  pad_token_id=PAD)
    row: Dict[str, Any] = {"ms_per_token": None, "kernel_floor_ms": None,
                           "hf_dynamic_ms_per_token": None, "same_tokens": None,
                           "compared_with": None}
    errors: Dict[str, Any] = {}
    out: Dict[str, Any] = {}  # tokens of each path, and graphed's decoder

    def attempt(path: str, body: Callable[[], None]) -> None:
        try:
            with torch.no_grad():
                body()
        except Exception as error:  # a failed path is a result; the row keeps the rest
            errors[path] = _error(error)
        _sync(device)

    # transformers first, on a model graphed has not touched.
    def hf_dynamic() -> None:
        def call() -> None:
            out["hf_dynamic"] = model.generate(ids, **common)

        row["hf_dynamic_ms_per_token"] = _timed(call, hf_repeats, new_tokens, device)

    def hf_static() -> None:
        result = model.generate(ids, cache_implementation="static", max_cache_len=max_cache_len,
                                disable_compile=True, return_dict_in_generate=True, **common)
        out["hf_static"] = result.sequences
        row["hf_static_cache_layers"] = sorted(
            {type(layer).__name__ for layer in getattr(result.past_key_values, "layers", [])})

    attempt("hf_dynamic", hf_dynamic)
    attempt("hf_static", hf_static)
    if "hf_static" in out:
        reference, row["compared_with"] = out["hf_static"], "hf_static"
        if "hf_dynamic" in out:
            row["hf_static_equals_dynamic"] = bool(torch.equal(out["hf_static"],
                                                               out["hf_dynamic"]))
    else:
        reference = out.get("hf_dynamic")
        row["compared_with"] = "hf_dynamic" if reference is not None else None
        if "hf_static" in errors:
            row["hf_static_error"] = errors.pop("hf_static")["error"]

    def ours() -> None:
        model.__dict__.pop("_graphed_decoder", None)

        def call() -> torch.Tensor:
            return graphed.generate(model, ids, max_cache_len=max_cache_len, **common)

        started = time.perf_counter()
        first = call()  # builds the decoder and captures this batch's decode bucket
        _sync(device)
        row["first_call_s"] = round(time.perf_counter() - started, 3)
        decoder = model.__dict__["_graphed_decoder"]
        row["graph_notes"] = list(decoder.notes)
        # Timing runs the prefill eagerly until its shape was seen `warmup` (2)
        # times, then captures it: the median is of graphed prefills.
        row["ms_per_token"] = _timed(call, graphed_repeats, new_tokens, device)
        if new_tokens > 1:
            one_token = dict(common, max_new_tokens=1)
            row["prefill_call_ms"] = _timed(
                lambda: graphed.generate(model, ids, max_cache_len=max_cache_len, **one_token),
                graphed_repeats, 1, device)
            row["decode_ms_per_token"] = round(
                (new_tokens * row["ms_per_token"] - row["prefill_call_ms"]) / (new_tokens - 1), 4)
        last = call()
        report = decoder.memory_report()
        decode = [r for r in report if r["kind"] == "decode" and r["captured"]]
        row.update({"capture_s": round(sum(r["capture_ms"] for r in decode) / 1000, 3),
                    "graph_mb": round(sum(r["graph_bytes"] for r in decode) / 2**20, 2),
                    "kernels": sum(r["kernels"] for r in decode),
                    "prefill_captured": any(r["captured"] for r in report
                                            if r["kind"] == "prefill")})
        if reference is not None:
            row["same_tokens"] = bool(torch.equal(first, reference)
                                      and torch.equal(last, reference))
            row["same_tokens_after_timing"] = bool(torch.equal(last, reference))
            row["new_tokens_equal_fraction"] = round(
                (first[:, PROMPT:] == reference[:, PROMPT:]).float().mean().item(), 4)
        out["decoder"] = decoder

    def floor() -> None:
        if device != "cuda":
            row["kernel_floor_note"] = "needs CUDA (the profiler's GPU kernel times)"
            return
        # The step the graphs hold (the decoder's own adapter, experts as the
        # decoder set them), run eagerly; it empties the cache afterwards.
        adapter = out["decoder"]._adapter[0]
        row["kernel_floor_ms"] = _step_floor_ms(adapter, ids, max_cache_len)
        row["prefill_kernel_ms"] = _prefill_floor_ms(adapter, ids)
        if adapter.fused is not None:
            # The same step on transformers' own functions (graphed's fused
            # state-space kernels and norms left out): the eager step a user
            # of transformers runs, the floor DESIGN.md defines.
            fused, adapter.fused = adapter.fused, None
            try:
                row["hf_kernel_floor_ms"] = _step_floor_ms(adapter, ids, max_cache_len)
            finally:
                adapter.fused = fused

    attempt("graphed_generate", ours)
    if "decoder" in out:
        attempt("kernel_floor", floor)
    ms, floor_ms, dynamic = (row["ms_per_token"], row["kernel_floor_ms"],
                             row["hf_dynamic_ms_per_token"])
    row["ratio_to_floor"] = round(ms / floor_ms, 3) if ms and floor_ms else None
    if ms and row.get("hf_kernel_floor_ms"):
        row["ratio_to_hf_floor"] = round(ms / row["hf_kernel_floor_ms"], 3)
    prefill_floor = row.get("prefill_kernel_ms")
    if floor_ms and prefill_floor is not None:
        row["call_kernel_ms_per_token"] = round(
            (prefill_floor + (new_tokens - 1) * floor_ms) / new_tokens, 4)
        row["ratio_to_call_floor"] = (round(ms / row["call_kernel_ms_per_token"], 3)
                                      if ms else None)
    decode_ms = row.get("decode_ms_per_token")
    row["decode_ratio_to_floor"] = (round(decode_ms / floor_ms, 3)
                                    if decode_ms and floor_ms else None)
    row["speedup_vs_hf_dynamic"] = round(dynamic / ms, 2) if ms and dynamic else None
    row["max_speedup_vs_hf_dynamic"] = (round(dynamic / floor_ms, 2)
                                        if floor_ms and dynamic else None)
    if errors:
        row["errors"] = errors
    out.clear()
    model.__dict__.pop("_graphed_decoder", None)
    return row


def run_model(name: str, quick: bool, device: str,
              batches: Sequence[int] = BATCHES) -> Dict[str, Any]:
    size = TINY if quick else BENCH
    new_tokens = QUICK_NEW_TOKENS if quick else NEW_TOKENS
    hf_repeats, graphed_repeats = ((QUICK_HF_REPEATS, QUICK_GRAPHED_REPEATS) if quick
                                   else (HF_REPEATS, GRAPHED_REPEATS))
    about: Dict[str, Any] = {}
    rows: Dict[str, Any] = {}
    for batch in batches:
        started = time.perf_counter()
        try:
            rows[f"b{batch}"] = run_row(name, batch, size, new_tokens, hf_repeats,
                                        graphed_repeats, device, about)
        except Exception as error:  # one failure must not take the other rows
            rows[f"b{batch}"] = _error(error)
        rows[f"b{batch}"]["wall_s"] = round(time.perf_counter() - started, 2)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    if name in SLIDING:
        about["sliding_window"] = size.window
    if "model" not in about and rows:  # not even built: the model failed
        about["error"] = next(iter(rows.values()))["error"]
    return {**about, **rows}


def run(quick: bool = False, models: Sequence[str] = MODELS, device: str = "cuda",
        batches: Sequence[int] = BATCHES) -> Dict[str, Any]:
    """Every model's rows; fp32 with TF32 off (restored afterwards)."""
    new_tokens = QUICK_NEW_TOKENS if quick else NEW_TOKENS
    size = TINY if quick else BENCH
    record: Dict[str, Any] = {
        "prompt": PROMPT, "new_tokens": new_tokens, "batches": list(batches),
        "size": {"layers": size.layers, "width": size.width, "vocab": size.vocab,
                 "sliding_window": size.window},
        "tf32": False, "greedy": True, "eos_token_id": None,
        "repeats": {"graphed": QUICK_GRAPHED_REPEATS if quick else GRAPHED_REPEATS,
                    "hf_dynamic": QUICK_HF_REPEATS if quick else HF_REPEATS},
        "note": "fp32 models with TF32 matmuls and convolutions off, so that tokens compare "
                "exactly; qwen3_moe in bf16. ms are per new token.",
        "models": {}}
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    threads = torch.get_num_threads()
    if device == "cpu":
        # A smoke run: one thread, since tiny models on a shared machine's
        # cores spend their time in OpenMP's waits (tens of times slower).
        torch.set_num_threads(1)
        record["cpu_threads"] = 1
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        for name in models:
            started = time.perf_counter()
            try:
                record["models"][name] = run_model(name, quick, device, batches)
            except Exception as error:  # a failed model is a result
                record["models"][name] = _error(error)
            record["models"][name]["wall_s"] = round(time.perf_counter() - started, 2)
            print(f"hf_decode_models: {name} done in {record['models'][name]['wall_s']} s",
                  flush=True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        torch.set_num_threads(threads)
    return record


def markdown(workload: Dict[str, Any]) -> List[str]:
    """The workload's table (bench/hf_decode_report.py, which imports neither
    torch nor graphed)."""
    return hf_decode_report.models_markdown(workload)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny models, {QUICK_NEW_TOKENS} new tokens, fewer repeats")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--batches", default=",".join(str(b) for b in BATCHES),
                        help="comma-separated batch sizes (default 1,8)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; expected {', '.join(MODELS)}")
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        parser.error(f"--batches takes comma-separated integers, got {args.batches!r}")
    if not args.batches or min(args.batches) < 1:
        parser.error("--batches needs batch sizes of at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU; pass --device cpu for a smoke run")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    result = run(args.quick, args.models, args.device, args.batches)
    if args.device == "cuda":
        result["device"] = torch.cuda.get_device_name()
    result["torch"] = torch.__version__
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result, file, indent=2)
        print(f"wrote {args.json}")
    else:
        print(json.dumps(result, indent=2))
    print("\n".join(markdown(result)))
    failed = any("error" in m or any("error" in m.get(f"b{b}", {}) or "errors" in
                                     m.get(f"b{b}", {}) for b in args.batches)
                 for m in result["models"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
