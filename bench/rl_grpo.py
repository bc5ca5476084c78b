"""Workload rl_grpo (issue 30): TRL's GRPOTrainer end to end, nothing
downloaded. A random-init Llama-style policy (4 layers, d512, GQA, as
bench/hf_decode.py, on a word-level vocabulary of 68 tokens built here),
synthetic prompts of 2 to 6 words, a programmatic reward (the fraction of
completion words that are "fig"), 8 completions per prompt, 4 prompts per
step, 64 new tokens at most, gradient checkpointing off (TRL's configs turn it
on; graphed's update refuses it), TRL's defaults otherwise (loss dapo, beta 0,
AdamW fused, bf16 autocast).

Methods, side by side in one process, each from the same initial weights:
- ``trl_default``: TRL's model.generate (DynamicCache) and its eager update,
  at two seeds (the second gives the run-to-run spread of the reward);
- ``trl_continuous_batching``: use_transformers_continuous_batching=True
  (its error string when it fails);
- ``graphed``: GraphedGRPOTrainer, rollouts on graphed.generate and the
  update on graphs.
Each has ``ms_per_step`` (median wall time of an optimizer step, CUDA
synchronized, after the first two steps: captures excluded),
``generation_ms_per_step`` (median time in _generate_single_turn),
``update_ms_per_step`` (median time of training_step outside
_prepare_inputs: forward, backward, optimizer), ``mean_reward_after_n_steps``
(the mean reward of the last ``REWARD_STEPS`` steps) and ``n_steps``.
``policy_loss_rel_diff_first_step``: a TRL trainer and a graphed one, from the
same weights, train one step on the same completions (trl_default's first
rollout); the relative difference of their losses, with
``grad_norm_rel_diff_first_step`` beside it. On TRL's own batch (no old
log-probabilities with num_iterations=1) the ratio is exactly 1 and the loss
does not depend on the policy's numerics, only the gradient does; the
``_off_policy`` pair repeats the comparison with old log-probabilities of the
initial policy shifted by a fixed pattern, so that the loss depends on them.

    python3 bench/rl_grpo.py --json OUT.json [--quick] [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch

FRUITS = ["apple", "banana", "cherry", "date", "elder", "fig", "grape", "honey"]
WORDS = FRUITS + [f"w{i}" for i in range(56)]
TARGET = "fig"
N_STEPS, QUICK_STEPS = 24, 4
REWARD_STEPS = 4
SKIP_STEPS = 2  # first steps left out of the medians: captures, warm-up


def tokenizer(words: List[str] = WORDS):
    """A word-level tokenizer over ``words`` (ids 0-3: pad, eos, bos, unk)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({w: i + 4 for i, w in enumerate(words)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")


def policy(vocab_size: int, *, hidden: int = 512, layers: int = 4, heads: int = 8,
           kv_heads: int = 2, intermediate: int = 1376, seed: int = 0):
    """A random-init Llama causal LM (hf_decode's shape by default)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden,
                         intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
                         bos_token_id=2, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def prompts(rows: int = 64, words: List[str] = FRUITS):
    """Synthetic prompts of 1 to 5 words, cycling through ``words``."""
    import datasets

    texts = [" ".join(words[(i * 3 + j) % len(words)] for j in range(1 + i % 5))
             for i in range(rows)]
    return datasets.Dataset.from_dict({"prompt": texts})


def reward_fig(completions, **kwargs):
    """The fraction of a completion's words that are the target word."""
    rewards = []
    for completion in completions:
        words = completion.split()
        rewards.append(sum(w == TARGET for w in words) / max(len(words), 1))
    return rewards


def config(output_dir: str, *, steps: int, seed: int = 0, cpu: bool = False, **overrides):
    """The GRPOConfig of every method (overrides on top)."""
    import trl

    settings = dict(output_dir=output_dir, per_device_train_batch_size=32, num_generations=8,
                    max_completion_length=64, max_steps=steps, learning_rate=1e-4,
                    logging_steps=1, report_to=[], save_strategy="no", seed=seed,
                    temperature=1.0, top_k=0, top_p=1.0, disable_tqdm=True,
                    gradient_checkpointing=False)
    if cpu:
        settings.update(use_cpu=True, bf16=False, per_device_train_batch_size=4,
                        num_generations=4, max_completion_length=6)
    settings.update(overrides)
    return trl.GRPOConfig(**settings)


def trainer(cls, args, *, model_seed: int = 0, model_kwargs: Optional[Dict[str, Any]] = None,
            **kwargs):
    """A GRPO trainer of class ``cls`` on the workload's policy, prompts and reward."""
    tok = tokenizer()
    model = policy(len(tok), seed=model_seed, **(model_kwargs or {}))
    return cls(model=model, reward_funcs=reward_fig, processing_class=tok, args=args,
               train_dataset=prompts(), **kwargs)


def rel_diff(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """|a - b| / |b| (None when either is missing)."""
    if a is None or b is None:
        return None
    return abs(a - b) / max(abs(b), 1e-30)


class _Timing:
    """CUDA-synchronized wall times of a trainer's steps, its rollouts
    (_generate_single_turn) and its updates (training_step outside
    _prepare_inputs), one entry per optimizer step."""

    def __init__(self, trainer: Any) -> None:
        self.steps: List[float] = []
        self.generation: List[float] = []
        self.update: List[float] = []
        self._gen = self._prep = self._train = 0.0
        self._started = None
        self._wrap(trainer, "_generate_single_turn", "_gen")
        self._wrap(trainer, "_prepare_inputs", "_prep")
        self._wrap(trainer, "training_step", "_train")
        from transformers import TrainerCallback

        timing = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                _sync()
                timing._started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                _sync()
                timing.steps.append((time.perf_counter() - timing._started) * 1000)
                timing.generation.append(timing._gen * 1000)
                timing.update.append((timing._train - timing._prep) * 1000)
                timing._gen = timing._prep = timing._train = 0.0

        trainer.add_callback(Callback())

    def _wrap(self, trainer: Any, name: str, slot: str) -> None:
        original = getattr(trainer, name)

        def timed(*args, **kwargs):
            _sync()
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                _sync()
                setattr(self, slot, getattr(self, slot) + time.perf_counter() - started)

        setattr(trainer, name, timed)

    def summary(self) -> Dict[str, Any]:
        def median(values: List[float]) -> Optional[float]:
            kept = values[SKIP_STEPS:] or values
            return round(statistics.median(kept), 3) if kept else None

        return {"ms_per_step": median(self.steps),
                "generation_ms_per_step": median(self.generation),
                "update_ms_per_step": median(self.update), "n_steps": len(self.steps),
                "first_steps_ms": [round(v, 1) for v in self.steps[:SKIP_STEPS]]}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _rewards(trainer: Any) -> List[float]:
    return [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]


def run_method(name: str, *, steps: int, seed: int = 0, cpu: bool = False,
               record_batches: int = 0, **overrides: Any) -> Dict[str, Any]:
    """One method's run: its timings and rewards (or its error); with
    ``record_batches``, its first generation batches under ``_batches``."""
    import trl
    from graphed.integrations.trl import GraphedGRPOTrainer

    cls: Any = trl.GRPOTrainer
    if name == "trl_continuous_batching":
        overrides["use_transformers_continuous_batching"] = True
    elif name == "graphed":
        cls = GraphedGRPOTrainer
    with tempfile.TemporaryDirectory() as out:
        result: Dict[str, Any] = {}
        try:
            t = trainer(cls, config(out, steps=steps, seed=seed, cpu=cpu, **overrides),
                        model_kwargs=_cpu_model() if cpu else None)
            timing = _Timing(t)
            batches: List[Any] = []
            if record_batches:
                original = t._generate_and_score_completions

                def recording(inputs):
                    batch = original(inputs)
                    if len(batches) < record_batches:
                        batches.append({k: v.clone() if isinstance(v, torch.Tensor) else v
                                        for k, v in batch.items()})
                    return batch

                t._generate_and_score_completions = recording
            started = time.perf_counter()
            t.train()
            result.update(timing.summary())
            result["train_s"] = round(time.perf_counter() - started, 2)
            rewards = _rewards(t)
            result["rewards"] = [round(r, 4) for r in rewards]
            result["mean_reward_after_n_steps"] = (
                round(statistics.mean(rewards[-REWARD_STEPS:]), 4) if rewards else None)
            if name == "graphed":
                result["graphed_rollouts"] = t.graphed_rollouts.to_dict()
                result["graphed_update"] = t.graphed_update.to_dict()
            if batches:
                result["_batches"] = batches
        except Exception as error:  # a failing method records why, the others still run
            result["error"] = f"{type(error).__name__}: {error}"
            result["traceback"] = traceback.format_exc()[-3000:]
    return result


def _cpu_model() -> Dict[str, Any]:
    return dict(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64)


def same_completions(batches: List[Dict[str, Any]], *, perturb: bool = True, cpu: bool = False,
                     model_path: Optional[str] = None, **overrides: Any) -> Dict[str, Any]:
    """TRL's eager steps and graphed's on the same completions, from the same
    weights: optimizer step i of each trains on generation batch
    ``batches[i]`` (with ``perturb``, the old log-probabilities of the initial
    policy shifted by a fixed pattern, so that the loss depends on the
    policy's numerics). Returns each step's loss and gradient norm per
    method, graphed's update path, and the relative differences (graphed
    against TRL)."""
    import trl
    from graphed.integrations.trl import GraphedGRPOTrainer

    rows: Dict[str, List[Dict[str, Any]]] = {}
    fixed: Optional[List[Dict[str, Any]]] = None
    path: List[str] = []
    for name, cls in (("trl_default", trl.GRPOTrainer), ("graphed", GraphedGRPOTrainer)):
        with tempfile.TemporaryDirectory() as out:
            args = config(out, steps=len(batches), cpu=cpu, **overrides)
            if model_path is not None:
                t = cls(model=model_path, reward_funcs=reward_fig, processing_class=tokenizer(),
                        args=args, train_dataset=prompts())
            else:
                t = trainer(cls, args, model_kwargs=_cpu_model() if cpu else None)
            if fixed is None:
                fixed = [_with_old_logps(t, b) if perturb else b for b in batches]
            served = iter(fixed)
            t._generate_and_score_completions = lambda inputs: {
                k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in next(served).items()}
            t.train()
            rows[name] = [{"loss": e["loss"], "grad_norm": e.get("grad_norm")}
                          for e in t.state.log_history if "loss" in e]
            if name == "graphed" and t.graphed_update is not None:
                path = list(t.graphed_update.steps)
    pairs = list(zip(rows["graphed"], rows["trl_default"]))
    return {"steps": rows, "update_path": path,
            "loss_rel_diffs": [rel_diff(g["loss"], e["loss"]) for g, e in pairs],
            "grad_norm_rel_diffs": [rel_diff(g["grad_norm"], e["grad_norm"]) for g, e in pairs]}


def _with_old_logps(t: Any, batch: Dict[str, Any]) -> Dict[str, Any]:
    """``batch`` off-policy: old_per_token_logps of the initial policy
    shifted by a fixed pattern (within TRL's clipping range and beyond it),
    and advantages of a fixed pattern (a rollout whose rewards are all equal
    has zero advantages, and so zero loss and gradients)."""
    model = t.model
    device = next(model.parameters()).device
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1).to(device)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1).to(device)
    with torch.no_grad():
        logps, _, _ = t._get_per_token_logps_and_entropies(
            model, ids, mask, batch["completion_ids"].shape[1])
    rows, cols = logps.shape
    pattern = torch.linspace(-0.3, 0.3, rows * cols, device=device).reshape(rows, cols)
    out = dict(batch)
    out["old_per_token_logps"] = (logps.float() + pattern).detach()
    advantages = batch["advantages"]
    out["advantages"] = torch.linspace(-1.0, 1.5, advantages.numel(), device=advantages.device,
                                       dtype=advantages.dtype).reshape(advantages.shape)
    return out


def run(quick: bool = False, cpu: bool = False) -> Dict[str, Any]:
    """The workload: every method, the reward spread, the first-step comparison."""
    steps = QUICK_STEPS if quick or cpu else N_STEPS
    methods: Dict[str, Any] = {}
    methods["trl_default"] = run_method("trl_default", steps=steps, cpu=cpu,
                                        record_batches=1)
    first_batch = (methods["trl_default"].pop("_batches", None) or [None])[0]
    seed1 = run_method("trl_default", steps=steps, seed=1, cpu=cpu)
    if not cpu:
        methods["trl_continuous_batching"] = run_method("trl_continuous_batching", steps=steps)
    methods["graphed"] = run_method("graphed", steps=steps, cpu=cpu)
    result: Dict[str, Any] = {"methods": methods, "n_steps": steps,
                              "policy": ("Llama 2 layers d32 (CPU smoke)" if cpu else
                                         "Llama 4 layers d512 GQA, 68-word vocabulary"),
                              "mean_reward_after_n_steps": {
                                  k: v.get("mean_reward_after_n_steps") for k, v in methods.items()},
                              "trl_default_seed1": {k: seed1.get(k) for k in (
                                  "mean_reward_after_n_steps", "rewards", "error")
                                  if k in seed1}}
    r0 = methods["trl_default"].get("mean_reward_after_n_steps")
    r1 = seed1.get("mean_reward_after_n_steps")
    result["reward_spread_trl_default"] = (None if r0 is None or r1 is None
                                           else round(abs(r0 - r1), 4))
    if first_batch is not None:
        # On TRL's own first batch (no old log-probabilities: the ratio is
        # exactly 1), then on the same completions off-policy.
        for key, perturb in (("first_step", False), ("first_step_off_policy", True)):
            try:
                compared = same_completions([first_batch], perturb=perturb, cpu=cpu)
            except Exception as error:
                result[f"{key}_error"] = f"{type(error).__name__}: {error}"
                result[f"{key}_traceback"] = traceback.format_exc()[-3000:]
                continue
            result[f"{key}_comparison"] = compared
            suffix = "" if key == "first_step" else "_off_policy"
            result[f"policy_loss_rel_diff_first_step{suffix}"] = compared["loss_rel_diffs"][0] \
                if compared["loss_rel_diffs"] else None
            result[f"grad_norm_rel_diff_first_step{suffix}"] = compared["grad_norm_rel_diffs"][0] \
                if compared["grad_norm_rel_diffs"] else None
    base = methods["trl_default"].get("ms_per_step")
    for name, method in methods.items():
        if base and method.get("ms_per_step"):
            method["speedup_vs_trl_default"] = round(base / method["ms_per_step"], 2)
    cb = methods.get("trl_continuous_batching", {}).get("ms_per_step")
    if cb and methods["graphed"].get("ms_per_step"):
        methods["graphed"]["speedup_vs_continuous_batching"] = round(
            cb / methods["graphed"]["ms_per_step"], 2)
    return result


def markdown(workload: Dict[str, Any]) -> List[str]:
    """The workload's table for bench/run.py's markdown."""
    lines = [f"### rl_grpo (TRL GRPOTrainer, {workload.get('policy', 'Llama')}, "
             f"{workload['n_steps']} steps, ms per optimizer step)\n",
             "| method | ms/step | generation ms | update ms | x trl_default | mean reward |",
             "|---|---:|---:|---:|---:|---:|"]

    def cell(value: Any) -> str:
        return "" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))

    for name, r in workload["methods"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:120]} | | | | |")
            continue
        lines.append(f"| {name} | {cell(r.get('ms_per_step'))} | "
                     f"{cell(r.get('generation_ms_per_step'))} | "
                     f"{cell(r.get('update_ms_per_step'))} | "
                     f"{cell(r.get('speedup_vs_trl_default'))} | "
                     f"{cell(r.get('mean_reward_after_n_steps'))} |")
    lines.append("")
    lines.append(f"reward spread of trl_default over two seeds: "
                 f"{workload.get('reward_spread_trl_default')}; first-step loss, graphed against "
                 f"TRL on the same completions: rel diff "
                 f"{workload.get('policy_loss_rel_diff_first_step')} (grad norm "
                 f"{workload.get('grad_norm_rel_diff_first_step')}); off-policy "
                 f"{workload.get('policy_loss_rel_diff_first_step_off_policy')} (grad norm "
                 f"{workload.get('grad_norm_rel_diff_first_step_off_policy')})")
    lines.append("")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps per method")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="a tiny policy on the CPU (TRL's paths, graphed's fallbacks): "
                             "checks that the script runs, measures nothing")
    args = parser.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("rl_grpo: needs an NVIDIA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    if not args.cpu_smoke:
        torch.backends.cuda.matmul.allow_tf32 = True
    result = run(quick=args.quick, cpu=args.cpu_smoke)
    with open(args.json, "w") as out:
        json.dump({"workloads": {"rl_grpo": result}}, out, indent=2, default=str)
    print("\n".join(markdown(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
