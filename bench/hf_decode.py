"""Workload hf_decode (issue 14): LLM decoding of a Hugging Face Llama (4 layers,
d512, GQA, random init), 32-token prompts, 128 new tokens, greedy, at batch 1, 8
and 32. Paths, side by side in one process: HF generate with DynamicCache, HF
generate on the StaticCache (eager, auto-compile off), the StaticCache with
torch.compile(mode="reduce-overhead") as transformers documents it,
graphed.generate, and graphed.generate(compile=True) (its decode step fused by
Inductor's default mode, then captured: Note [A compiled decode step]; its row
adds compile_s, its own step's kernel_floor_ms and ratio_to_own_floor, and
new_tokens_equal_to_hf_static, the fraction of new tokens equal to HF's).
Results are ms per new token; graphed rows add capture_s,
graph_mb (decode buckets), prefill_graphs (one entry per captured prefill
shape: batch, prompt_len, padded, graph_mb, capture_ms, kernels, replays) and
same_tokens_as_hf_static (with the eager and with the graphed prefill); a path
that fails records `error`.

The torch.compile path runs in a child process (same model, same seed, same
prompts): on torch 2.11 with transformers 5.17 its cudagraph tree can kill the
process with a segmentation fault inside Inductor's kernel launcher, and a dead
process must not take the other paths' results with it. Its ms are the
child's; its tokens are compared with the child's own static-cache eager run.

HF_DECODE_WITHOUT_COMPILE=1 leaves out both compiled paths (the
reduce-overhead child and graphed.generate(compile=True)), whose compiles
take most of the workload's minutes: the eager and graphed rows alone, for a
quick no-regression run of graphed's own path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict

import torch

import graphed
from graphed import measure

PROMPT, NEW_TOKENS = 32, 128


def llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    return transformers.LlamaForCausalLM(config).cuda().eval()


def _ms_per_token(fn: Callable[[], torch.Tensor], repeats: int, new_tokens: int) -> float:
    fn()  # warm
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1000 / new_tokens)
    return round(sorted(times)[len(times) // 2], 4)


def _step_floor_ms(adapter, ids, max_cache_len: int) -> float:
    """Kernel time of one decode step of graphed's adapter, run eagerly (no graph)."""
    batch = ids.shape[0]
    mask = torch.ones(batch, max_cache_len, dtype=torch.long, device=ids.device)
    with torch.no_grad():
        adapter.reset()
        adapter.prefill((ids, mask[:, :PROMPT], graphed._C.prompt_positions(mask[:, :PROMPT])))
        token = ids[:, -1:].clone()
        position = torch.full((batch, 1), PROMPT, dtype=torch.long, device=ids.device)

        def step():
            adapter.step((token, position, mask))

        ms, _ = measure.kernel_floor_ms(step, iters=20)
        adapter.reset()
    return round(ms, 4)


def _decode_floor_ms(model, ids, max_cache_len: int) -> float:
    """Kernel time of one eager StaticCache decode step (HF's forward through
    graphed's adapter, no graph): the issue's kernel floor."""
    from graphed.generate import _StaticCacheModel

    return _step_floor_ms(_StaticCacheModel(model, ids.shape[0], max_cache_len), ids,
                          max_cache_len)


# Set in a child process that measures only the torch.compile path, at this batch.
_COMPILE_BATCH = "HF_DECODE_COMPILE_BATCH"
# Set (to 1) to leave out the compiled paths (see the module's doc).
_WITHOUT_COMPILE = "HF_DECODE_WITHOUT_COMPILE"


def run(quick: bool = False) -> Dict[str, Any]:
    compile_batch = int(os.environ.get(_COMPILE_BATCH, "0"))
    without_compile = os.environ.get(_WITHOUT_COMPILE, "") == "1"
    torch.backends.cuda.matmul.allow_tf32 = True
    model = llama()
    batches = (1, 8) if quick else (1, 8, 32)
    repeats = 2 if quick else 5
    new_tokens = 32 if quick else NEW_TOKENS
    max_cache_len = PROMPT + new_tokens - 1
    record: Dict[str, Any] = {"model": "HF Llama 4 layers d512 GQA (8 heads, 2 kv), vocab 32000",
                              "prompt": PROMPT, "new_tokens": new_tokens,
                              "kernel_floor_ms": {}, "methods": {}}
    methods = record["methods"]
    if without_compile:
        record["without_compile"] = True
    common = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def attempt(name: str, body: Callable[[], Dict[str, Any]]) -> None:
        try:
            methods[name] = body()
        except Exception as error:  # a failed path is a result
            methods[name] = {"error": f"{type(error).__name__}: {error}"[-2000:],
                             "traceback": traceback.format_exc()[-2000:]}
        torch.cuda.synchronize()

    for batch in batches:
        if compile_batch and batch != compile_batch:
            continue
        ids = torch.randint(0, 32000, (batch, PROMPT), device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(batch))
        hf_static: Dict[str, torch.Tensor] = {}
        if compile_batch:
            attempt(f"hf_eager_static_b{batch}", lambda: _static_tokens(model, ids, common,
                                                                        max_cache_len, hf_static))
            attempt(f"hf_compile_static_b{batch}", lambda: _compiled(model, ids, common,
                                                                     max_cache_len, repeats,
                                                                     new_tokens, hf_static))
            continue
        try:
            record["kernel_floor_ms"][str(batch)] = _decode_floor_ms(model, ids, max_cache_len)
        except Exception as error:
            record["kernel_floor_ms"][str(batch)] = None
            record.setdefault("errors", {})[f"kernel_floor_b{batch}"] = repr(error)[-2000:]

        def dynamic():
            with torch.no_grad():
                fn = lambda: model.generate(ids, **common)  # noqa: E731
                return {"ms": _ms_per_token(fn, repeats, new_tokens)}

        def static():
            with torch.no_grad():
                fn = lambda: model.generate(ids, cache_implementation="static",  # noqa: E731
                                            max_cache_len=max_cache_len, disable_compile=True,
                                            **common)
                hf_static["tokens"] = fn()
                return {"ms": _ms_per_token(fn, repeats, new_tokens)}

        def ours():
            model.__dict__.pop("_graphed_decoder", None)
            with torch.no_grad():
                fn = lambda: graphed.generate(model, ids, max_cache_len=max_cache_len,  # noqa: E731
                                              **common)
                tokens = fn()  # builds the decoder and captures this batch's bucket
                decoder = model.__dict__["_graphed_decoder"]
                # Timing runs the prefill eagerly until the shape was seen `warmup`
                # (2) times, then captures it: the median is of graphed prefills.
                ms = _ms_per_token(fn, repeats, new_tokens)
                replayed = fn()  # a request with the prefill graph
                report = decoder.memory_report()
                decode = [r for r in report if r["kind"] == "decode" and r["captured"]]
                prefill = [r for r in report if r["kind"] == "prefill"]
                out = {"ms": ms,
                       "capture_s": round(sum(r["capture_ms"] for r in decode) / 1000, 3),
                       "graph_mb": round(sum(r["graph_bytes"] for r in decode) / 2**20, 2),
                       "kernels": sum(r["kernels"] for r in decode),
                       "prefill_graphs": [
                           {"batch": r["batch"], "prompt_len": r["prompt_len"],
                            "padded": r["padded"], "captured": r["captured"],
                            "graph_mb": round(r["graph_bytes"] / 2**20, 2),
                            "capture_ms": round(r["capture_ms"], 2), "kernels": r["kernels"],
                            "replays": r["replays"]} for r in prefill]}
                if "tokens" in hf_static:
                    out["same_tokens_as_hf_static"] = bool(
                        torch.equal(tokens, hf_static["tokens"])
                        and torch.equal(replayed, hf_static["tokens"]))
                # Every bucket of a serving decoder for this batch, captured at once.
                serving = graphed.Decoder(model, max_batch=max(batch, 1), max_len=max_cache_len,
                                          do_sample=False, capture=False)
                started = time.perf_counter()
                serving.capture()
                torch.cuda.synchronize()
                out["capture_all_buckets_s"] = round(time.perf_counter() - started, 3)
                out["buckets"] = serving.memory_report()
                del serving
                return out

        def ours_compiled():
            # Note [A compiled decode step]: Inductor's default mode fuses HF's
            # small kernels; graphed captures the compiled step.
            model.__dict__.pop("_graphed_decoder", None)
            with torch.no_grad():
                fn = lambda: graphed.generate(model, ids, max_cache_len=max_cache_len,  # noqa: E731
                                              compile=True, **common)
                started = time.perf_counter()
                tokens = fn()  # compiles in the bucket's warm-up, then captures it
                torch.cuda.synchronize()
                first_s = time.perf_counter() - started
                decoder = model.__dict__["_graphed_decoder"]
                ms = _ms_per_token(fn, repeats, new_tokens)
                decode = [r for r in decoder.memory_report()
                          if r["kind"] == "decode" and r["captured"]]
                own_floor = _step_floor_ms(decoder._adapter[0], ids, max_cache_len)
                out = {"ms": ms, "first_request_s": round(first_s, 2),
                       "compile_s": round(sum(r["warmup_ms"] for r in decode) / 1000, 3),
                       "capture_s": round(sum(r["capture_ms"] - r["warmup_ms"]
                                              for r in decode) / 1000, 3),
                       "graph_mb": round(sum(r["graph_bytes"] for r in decode) / 2**20, 2),
                       "kernels": sum(r["kernels"] for r in decode),
                       "kernel_floor_ms": own_floor,
                       "ratio_to_own_floor": round(ms / own_floor, 3)}
                if "tokens" in hf_static:
                    want = hf_static["tokens"]
                    out["same_tokens_as_hf_static"] = bool(torch.equal(tokens, want))
                    out["new_tokens_equal_to_hf_static"] = round(
                        (tokens[:, PROMPT:] == want[:, PROMPT:]).float().mean().item(), 4)
                return out

        attempt(f"hf_eager_dynamic_b{batch}", dynamic)
        attempt(f"hf_eager_static_b{batch}", static)
        if (not quick or batch == 1) and not without_compile:
            methods[f"hf_compile_static_b{batch}"] = _compiled_in_own_process(quick, batch)
        attempt(f"graphed_generate_b{batch}", ours)
        if not without_compile:
            attempt(f"graphed_generate_compiled_b{batch}", ours_compiled)
        floor = record["kernel_floor_ms"].get(str(batch))
        for path in ("graphed_generate", "graphed_generate_compiled"):
            row = methods.get(f"{path}_b{batch}", {})
            if floor and row.get("ms"):
                row["ratio_to_floor"] = round(row["ms"] / floor, 3)
                dyn = methods[f"hf_eager_dynamic_b{batch}"].get("ms")
                if dyn:
                    row["speedup_vs_hf_dynamic"] = round(dyn / row["ms"], 2)
        model.__dict__.pop("_graphed_decoder", None)
        torch.cuda.empty_cache()
    return record


def _static_tokens(model, ids, common, max_cache_len, hf_static) -> Dict[str, Any]:
    with torch.no_grad():
        hf_static["tokens"] = model.generate(ids, cache_implementation="static",
                                             max_cache_len=max_cache_len, disable_compile=True,
                                             **common)
    return {"tokens_only": True}


def _compiled(model, ids, common, max_cache_len, repeats, new_tokens, hf_static) -> Dict[str, Any]:
    """transformers' documented recipe: compile the forward, static cache."""
    forward = model.forward
    try:
        model.forward = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
        with torch.no_grad():
            fn = lambda: model.generate(ids, cache_implementation="static",  # noqa: E731
                                        max_cache_len=max_cache_len, disable_compile=True,
                                        **common)
            started = time.perf_counter()
            tokens = fn()
            fn()
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - started
            out = {"ms": _ms_per_token(fn, repeats, new_tokens), "compile_s": round(compile_s, 2)}
            if "tokens" in hf_static:
                out["same_tokens_as_hf_static"] = bool(torch.equal(tokens, hf_static["tokens"]))
            return out
    finally:
        model.forward = forward
        torch._dynamo.reset()


def _compiled_in_own_process(quick: bool, batch: int) -> Dict[str, Any]:
    """The hf_compile_static row of `batch`, measured in a child process; a
    child that dies gives the row its cause (the signal, the last frames)."""
    name = f"hf_compile_static_b{batch}"
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "hf_decode_compile.json")
        env = dict(os.environ, **{_COMPILE_BATCH: str(batch)})
        run_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.py")
        command = [sys.executable, "-X", "faulthandler", run_py, "--json", out, "hf_decode"]
        if quick:
            command.append("--quick")
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return {"error": "timed out after 300 s in its own process"}
        child = {}
        if os.path.exists(out):
            with open(out) as file:
                child = json.load(file).get("workloads", {}).get("hf_decode", {}).get("methods", {})
    if name in child:
        return dict(child[name], measured_in="its own process")
    code = done.returncode
    cause = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    # faulthandler prints the crashing thread after "Current thread", innermost first.
    crashing = done.stderr.split("Current thread", 1)[-1]
    frames = [line.strip() for line in crashing.splitlines() if line.strip().startswith("File ")]
    return {"error": f"the process measuring torch.compile died ({cause}); innermost frames: "
                     f"{frames[:3]}",
            "stderr_tail": done.stderr[-1500:]}
