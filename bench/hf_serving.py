"""Workload hf_serving (issue 27, item 4): many requests at once, side by side
with transformers' continuous batching. 64 requests, prompts of 16-512 tokens
and budgets of 32-256 new tokens (fixed seed), greedy, every request running
its whole budget (no end-of-sequence token), on two models: the Llama of
hf_decode (4 layers, d512, GQA) in fp32 with TF32 matmuls, and a Qwen3-MoE (4
layers, d512, 16 experts top-4, as in zoo_modern_models.py) in bf16.

Paths, one process per model except where said:
- ``graphed``: graphed.generate_batch (continuous batching on graphed's decode
  graphs, Note [Continuous batching on graphs]) on a serving decoder that has
  run these requests once (``graphed_first_pass``, whose ``capture_s`` is the
  decoder's build and capture): a server's steady state, where prompt lengths
  recur. The first pass pays each new prompt length's one-time costs (its
  first eager prefills, library kernels' first calls on a shape), which
  transformers' paged path, padding prefills to its token budget, mostly does
  not; both are reported.
- ``graphed_prefills_per_round_4``: the same with at most 4 prefills between two
  chunks of decode steps (decoding starts while requests still wait).
- ``hf_generate_batch``: transformers' ``model.generate_batch`` path with per-request
  budgets (its ContinuousBatchingManager, ``add_request(max_new_tokens=...)``),
  ``ContinuousBatchingConfig(use_cuda_graph=False)``, warmed up first.
- ``hf_generate_batch_cuda_graphs``: the same with ``use_cuda_graph=True``
  (forced: transformers turns them on by default only with FlashAttention), in a
  child process with a time limit, since a failed capture can hang or kill it;
  its row is the error string when it fails.
- ``hf_generate_static_batch``: one padded ``model.generate`` call (left padding,
  DynamicCache, max budget for every row): the static batch a user would write.

Per path: ``tokens_per_s`` (new tokens of all requests / wall time), and per
request ``ms_per_token`` (time per output token: from its first token to its
last, over its tokens minus one) as p50/p99. ``same_tokens``: every request's
tokens equal to transformers' continuous batching (graphs off);
``same_tokens_as_hf_alone``: equal to ``model.generate`` on the request alone
for the first ``ALONE`` requests. ``hf_generate_batch_setting`` says which
attention implementation and switches transformers ran with.

Run: ``python3 bench/hf_serving.py --json OUT.json`` (``--quick``: 16 requests,
budgets of 8-32; ``--models llama``; ``--device cpu`` for a smoke run)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch

import hf_decode_report

REQUESTS, PROMPT_RANGE, BUDGET_RANGE = 64, (16, 512), (32, 256)
QUICK_REQUESTS, QUICK_PROMPTS, QUICK_BUDGETS = 16, (16, 128), (8, 32)
ALONE = 4  # requests compared with model.generate on each alone
MAX_BATCH = 32
PREFILLS_PER_ROUND = 4  # the second graphed row: prefills interleaved with decoding
CHILD_TIMEOUT_S = 100
MODELS = ("llama", "qwen3_moe")
_CHILD = "HF_SERVING_CHILD"  # set in the child that measures transformers' graphs
_NO_TF32 = "HF_SERVING_NO_TF32"  # --no-tf32, passed on to the child


def build_model(name: str, device: str):
    import transformers

    torch.manual_seed(0)
    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
        model = transformers.LlamaForCausalLM(config)
        tf32 = device == "cuda" and torch.backends.cuda.matmul.allow_tf32
        label = (f"HF Llama 4 layers d512 GQA (8 heads, 2 kv), vocab 32000, fp32 "
                 f"({'TF32' if tf32 else 'TF32 off'})")
    elif name == "qwen3_moe":
        width = 512
        config = transformers.Qwen3MoeConfig(
            num_hidden_layers=4, hidden_size=width, intermediate_size=2 * width,
            moe_intermediate_size=width // 2, num_attention_heads=8, num_key_value_heads=2,
            head_dim=width // 8, num_experts=16, num_experts_per_tok=4, vocab_size=32000,
            max_position_embeddings=1024, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
        label = "HF Qwen3-MoE 4 layers d512, 16 experts top-4, vocab 32000, bf16"
    else:
        raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")
    model = model.to(device).eval()
    # Every request runs its whole budget on every path.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model, label


def make_requests(count: int, prompts, budgets, vocab: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompts[0], prompts[1] + 1, (count,), generator=generator).tolist()
    news = torch.randint(budgets[0], budgets[1] + 1, (count,), generator=generator).tolist()
    ids = [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths]
    return ids, news


def _percentiles(values: List[float]) -> Dict[str, Optional[float]]:
    values = sorted(v for v in values if v is not None)
    if not values:
        return {"p50_ms_per_token": None, "p99_ms_per_token": None}
    p99 = values[min(len(values) - 1, int(round(0.99 * (len(values) - 1))))]
    return {"p50_ms_per_token": round(statistics.median(values), 4),
            "p99_ms_per_token": round(p99, 4)}


def _device_allocs(device: str) -> int:
    """The caching allocator's cudaMalloc calls so far (0 without CUDA)."""
    if device != "cuda":
        return 0
    return int(torch.cuda.memory_stats().get("num_device_alloc", 0))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_graphed(model, prompts, budgets, device: str, prefills_per_round: int = 0,
                fresh: bool = True) -> Dict[str, Any]:
    """One generate_batch call over all requests. ``fresh``: a new serving
    decoder first (its capture timed as ``capture_s``); else the one the last
    call left, whose prefills have seen these prompt lengths."""
    import graphed

    capture_s = 0.0
    if fresh:
        model.__dict__.pop("_graphed_serving", None)
        started = time.perf_counter()
        graphed.generate_batch(model, prompts[:2], max_new_tokens=2, max_batch=MAX_BATCH,
                               max_len=max(len(p) + n - 1 for p, n in zip(prompts, budgets)),
                               eos_token_id=None, prefills_per_round=prefills_per_round)
        _sync(device)
        capture_s = time.perf_counter() - started
    times: Dict[int, List[float]] = {}

    def on_token(index, tokens, finished):
        now = time.perf_counter()
        times.setdefault(index, []).extend([now] * len(tokens))

    before = model.__dict__["_graphed_serving"].stats()
    _sync(device)
    allocs_before = _device_allocs(device)
    started = time.perf_counter()
    tokens = graphed.generate_batch(model, prompts, max_new_tokens=budgets,
                                    max_batch=MAX_BATCH, eos_token_id=None, on_token=on_token,
                                    prefills_per_round=prefills_per_round)
    _sync(device)
    wall = time.perf_counter() - started
    device_allocs = _device_allocs(device) - allocs_before
    serving = model.__dict__["_graphed_serving"]
    stats = {k: round(v - before[k], 3) for k, v in serving.stats().items()}  # this call's
    per_request = [(t[-1] - t[0]) * 1000 / (len(t) - 1) for t in times.values() if len(t) > 1]
    decode = [r for r in serving.memory_report() if r["kind"] == "decode"]
    return {"tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(sum(len(t) for t in tokens) / wall, 1),
            "capture_s": round(capture_s, 2),
            "graph_mb": round(sum(r["graph_bytes"] for r in decode) / 2**20, 2),
            "max_batch": MAX_BATCH, "stats": stats,
            # cudaMalloc calls of the caching allocator during the call: a first
            # pass that pays for new prompt lengths there shows it here.
            "device_allocs": device_allocs,
            "occupancy": round(stats["live_row_steps"] / max(stats["row_steps"], 1), 3),
            "ms_per_token_note": "per request, from the chunk its first token arrived in to "
                                 "the chunk of its last (chunks of 8 decode steps)",
            **_percentiles(per_request)}


def _hf_continuous(model, prompts, budgets, use_cuda_graph: bool) -> Dict[str, Any]:
    """transformers' continuous batching with a budget per request (generate_batch
    takes one max_new_tokens for all, so its manager is driven as generate_batch
    drives it, with add_request per prompt)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation = GenerationConfig(do_sample=False, max_new_tokens=max(budgets),
                                  eos_token_id=None, pad_token_id=0)
    config = ContinuousBatchingConfig(use_cuda_graph=use_cuda_graph)
    from transformers.generation.continuous_batching.continuous_api import WorkloadHints

    hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts),
                          max_generated_length=max(budgets), num_requests=len(prompts))
    original = model.config._attn_implementation
    started_all = time.perf_counter()
    results = {}
    try:
        with model.continuous_batching_context_manager(
                generation_config=generation, continuous_batching_config=config, block=True,
                timeout=30, warmup=True, workload_hints=hints) as manager:
            warm_s = time.perf_counter() - started_all
            resolved = getattr(manager, "continuous_batching_config", config)
            setting = {"attn_implementation": model.config._attn_implementation,
                       "use_cuda_graph (varlen, decode)": _plain(resolved.use_cuda_graph),
                       "use_async_batching": _plain(getattr(resolved, "use_async_batching", None)),
                       "max_batch_tokens": _plain(getattr(resolved, "max_batch_tokens", None)),
                       "num_blocks": _plain(getattr(resolved, "num_blocks", None)),
                       "block_size": _plain(getattr(resolved, "block_size", None)),
                       "max_requests_per_batch": _plain(getattr(resolved, "max_requests_per_batch",
                                                                None))}
            started = time.perf_counter()
            ids = [manager.add_request(list(p), max_new_tokens=n, record_timestamps=True)
                   for p, n in zip(prompts, budgets)]
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' generation thread stopped with "
                                       f"{len(results)} of {len(ids)} requests done")
            wall = time.perf_counter() - started
    finally:
        if model.config._attn_implementation != original:
            model.set_attn_implementation(original)
    tokens = [list(results[i].generated_tokens) for i in ids]
    errors = [results[i].error for i in ids if results[i].error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    per_request = []
    for i in ids:
        stamps = results[i].timestamps or []
        if len(stamps) > 1:
            per_request.append((stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1))
    return {"tokens": tokens, "wall_s": round(wall, 3), "warmup_s": round(warm_s, 2),
            "tokens_per_s": round(sum(len(t) for t in tokens) / wall, 1),
            "setting": setting, **_percentiles(per_request)}


def _plain(value):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


def run_static_batch(model, prompts, budgets, device: str) -> Dict[str, Any]:
    """One padded model.generate call: left padding, every row the longest budget."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)
    new = max(budgets)
    with torch.no_grad():
        _sync(device)
        started = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
        _sync(device)
        wall = time.perf_counter() - started
    tokens = [out[row, longest:longest + budget].tolist() for row, budget in enumerate(budgets)]
    per_token = wall * 1000 / new  # every row waits for the longest
    return {"tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(sum(budgets) / wall, 1),
            "p50_ms_per_token": round(per_token, 4), "p99_ms_per_token": round(per_token, 4),
            "note": "useful tokens (each request's budget) per second; rows run max budget"}


def run_alone(model, prompts, budgets, count: int, device: str) -> List[List[int]]:
    """model.generate on each of the first `count` requests alone (DynamicCache)."""
    out = []
    with torch.no_grad():
        for prompt, budget in zip(prompts[:count], budgets[:count]):
            ids = torch.tensor([prompt], device=device)
            row = model.generate(ids, max_new_tokens=budget, min_new_tokens=budget,
                                 do_sample=False, pad_token_id=0)
            out.append(row[0, len(prompt):].tolist())
    return out


def _attempt(body: Callable[[], Dict[str, Any]], device: str) -> Dict[str, Any]:
    try:
        return body()
    except Exception as error:  # a failed path is a result
        return {"error": f"{type(error).__name__}: {error}"[-2000:],
                "traceback": traceback.format_exc()[-2000:]}
    finally:
        _sync(device)


def _hf_graphs_in_child(name: str, quick: bool, device: str) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "child.json")
        command = [sys.executable, "-X", "faulthandler", os.path.abspath(__file__), "--json", out,
                   "--models", name, "--device", device] + (["--quick"] if quick else [])
        env = dict(os.environ, **{_CHILD: "1"})
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {CHILD_TIMEOUT_S} s in its own process"}
        if os.path.exists(out):
            with open(out) as file:
                row = json.load(file)["models"][name].get("hf_generate_batch_cuda_graphs")
            if row is not None:
                return dict(row, measured_in="its own process")
        return {"error": f"the child process exited with {done.returncode}",
                "stderr_tail": done.stderr[-1500:]}


def _same(a: Optional[List[List[int]]], b: Optional[List[List[int]]]) -> Optional[bool]:
    if a is None or b is None:
        return None
    return all(x == y for x, y in zip(a, b)) and len(a) == len(b)


def _fraction(a, b) -> Optional[float]:
    if a is None or b is None:
        return None
    equal = sum(x == y for x, y in zip(a, b))
    return round(equal / max(len(a), 1), 4)


def run_model(name: str, quick: bool, device: str) -> Dict[str, Any]:
    child = os.environ.get(_CHILD) == "1"
    model, label = build_model(name, device)
    count, prompt_range, budget_range = ((QUICK_REQUESTS, QUICK_PROMPTS, QUICK_BUDGETS) if quick
                                         else (REQUESTS, PROMPT_RANGE, BUDGET_RANGE))
    prompts, budgets = make_requests(count, prompt_range, budget_range, model.config.vocab_size)
    record: Dict[str, Any] = {"model": label, "requests": count, "prompt_range": prompt_range,
                              "budget_range": budget_range, "new_tokens": sum(budgets),
                              "prompt_tokens": sum(len(p) for p in prompts)}
    if child:
        record["hf_generate_batch_cuda_graphs"] = _strip(_attempt(
            lambda: _hf_continuous(model, prompts, budgets, use_cuda_graph=True), device))
        return record
    first_row = _attempt(lambda: run_graphed(model, prompts, budgets, device), device)
    graphed_row = _attempt(lambda: run_graphed(model, prompts, budgets, device, fresh=False),
                           device)
    limited_row = _attempt(lambda: run_graphed(model, prompts, budgets, device,
                                               prefills_per_round=PREFILLS_PER_ROUND), device)
    model.__dict__.pop("_graphed_serving", None)
    hf_row = _attempt(lambda: _hf_continuous(model, prompts, budgets, use_cuda_graph=False),
                      device)
    static_row = _attempt(lambda: run_static_batch(model, prompts, budgets, device), device)
    alone = _attempt(lambda: {"tokens": run_alone(model, prompts, budgets, ALONE, device)},
                     device)
    graphs_row = (_hf_graphs_in_child(name, quick, device) if device == "cuda"
                  else {"error": "transformers turns CUDA graphs off without CUDA"})
    ours, theirs = graphed_row.get("tokens"), hf_row.get("tokens")
    record.update({
        "graphed_tokens_per_s": graphed_row.get("tokens_per_s"),
        "graphed_first_pass_tokens_per_s": first_row.get("tokens_per_s"),
        "same_tokens_first_pass": _same(ours, first_row.get("tokens")),
        f"graphed_prefills_per_round_{PREFILLS_PER_ROUND}_tokens_per_s":
            limited_row.get("tokens_per_s"),
        "same_tokens_with_prefills_per_round": _same(ours, limited_row.get("tokens")),
        "hf_generate_batch_tokens_per_s": hf_row.get("tokens_per_s"),
        "hf_generate_batch_cuda_graphs_tokens_per_s": graphs_row.get(
            "tokens_per_s", graphs_row.get("error")),
        "hf_generate_static_batch_tokens_per_s": static_row.get("tokens_per_s"),
        "same_tokens": _same(ours, theirs),
        "same_tokens_fraction": _fraction(ours, theirs),
        "same_tokens_as_hf_graphs": _same(ours, graphs_row.get("tokens")),
        "same_tokens_as_static_batch_fraction": _fraction(ours, static_row.get("tokens")),
        # transformers against itself: where two of its paths already disagree
        # (near-tied logits under TF32 or bf16), equal tokens cannot be asked.
        "hf_generate_batch_vs_static_batch_fraction": _fraction(theirs, static_row.get("tokens")),
        "hf_generate_batch_vs_alone_fraction": _fraction(theirs[:ALONE] if theirs else None,
                                                         alone.get("tokens")),
        "same_tokens_as_hf_alone": _same(ours[:ALONE] if ours else None, alone.get("tokens")),
        "hf_generate_batch_setting": {"graphs_off": hf_row.get("setting"),
                                      "graphs_on": graphs_row.get("setting")},
        "p50_ms_per_token": graphed_row.get("p50_ms_per_token"),
        "p99_ms_per_token": graphed_row.get("p99_ms_per_token"),
        "paths": {"graphed": _strip(graphed_row), "graphed_first_pass": _strip(first_row),
                  f"graphed_prefills_per_round_{PREFILLS_PER_ROUND}": _strip(limited_row),
                  "hf_generate_batch": _strip(hf_row),
                  "hf_generate_batch_cuda_graphs": _strip(graphs_row),
                  "hf_generate_static_batch": _strip(static_row)},
    })
    fastest_hf = max([v for v in (record["hf_generate_batch_tokens_per_s"],
                                  graphs_row.get("tokens_per_s")) if isinstance(v, float)],
                     default=None)
    if fastest_hf and record["graphed_tokens_per_s"]:
        record["speedup_vs_fastest_hf_generate_batch"] = round(
            record["graphed_tokens_per_s"] / fastest_hf, 2)
    return record


def _strip(row: Dict[str, Any]) -> Dict[str, Any]:
    """The row without its token lists (kept for comparisons only); the child keeps them."""
    if os.environ.get(_CHILD) == "1":
        return row
    return {k: v for k, v in row.items() if k != "tokens"}


def run(quick: bool = False, models=MODELS, device: str = "cuda", tf32: bool = True
        ) -> Dict[str, Any]:
    tf32 = tf32 and os.environ.get(_NO_TF32) != "1"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
    out: Dict[str, Any] = {"models": {}, "tf32": tf32 and device == "cuda",
                           "max_batch": MAX_BATCH}
    for name in models:
        out["models"][name] = _attempt(lambda: run_model(name, quick, device), device)
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def markdown(workload: Dict[str, Any]) -> List[str]:
    """The workload's table (bench/hf_decode_report.py, which imports neither
    graphed nor torch, for scripts/gpu_check_summary.py)."""
    return hf_decode_report.serving_markdown(workload)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="16 requests, short budgets")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--no-tf32", action="store_true",
                        help="fp32 matmuls without TF32 (hf_decode's setting is TF32 on): "
                             "fewer near-ties that a batch's shape can flip")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; expected {', '.join(MODELS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU; pass --device cpu for a smoke run")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.no_tf32:
        os.environ[_NO_TF32] = "1"  # the child measuring transformers' graphs follows
    result = run(args.quick, args.models, args.device, tf32=not args.no_tf32)
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as file:
            file.write(text)
    if os.environ.get(_CHILD) != "1":
        print(text if not args.json else f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
