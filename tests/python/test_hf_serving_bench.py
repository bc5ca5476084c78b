"""bench/hf_serving.py on the CPU: its arguments, requests, table and the
graphed, static-batch and per-request paths on a tiny model (the real run is
``python3 bench/hf_serving.py --json OUT.json`` on a GPU)."""

import importlib.util
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        spec = importlib.util.spec_from_file_location("hf_serving",
                                                      os.path.join(ROOT, "bench/hf_serving.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))


def test_arguments_are_checked(bench, capsys):
    args = bench.parse_args(["--json", "out.json", "--models", "llama", "--device", "cpu",
                             "--quick"])
    assert args.models == ["llama"] and args.quick and args.json == "out.json"
    assert bench.parse_args(["--device", "cpu"]).models == list(bench.MODELS)
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "gpt9", "--device", "cpu"])
    assert "unknown model(s) gpt9" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench.parse_args([])
        assert "--device cpu" in capsys.readouterr().err


def test_requests_are_fixed_by_the_seed_and_in_range(bench):
    prompts, budgets = bench.make_requests(64, bench.PROMPT_RANGE, bench.BUDGET_RANGE, 32000)
    again = bench.make_requests(64, bench.PROMPT_RANGE, bench.BUDGET_RANGE, 32000)
    assert (prompts, budgets) == again
    assert all(16 <= len(p) <= 512 for p in prompts) and all(32 <= b <= 256 for b in budgets)
    assert len(set(len(p) for p in prompts)) > 20


SERVING = {"tf32": True, "models": {
    "llama": {"graphed_tokens_per_s": 100.0, "graphed_first_pass_tokens_per_s": 90.0,
              "hf_generate_batch_tokens_per_s": 10.0,
              "hf_generate_batch_cuda_graphs_tokens_per_s": "RuntimeError: no graphs",
              "hf_generate_static_batch_tokens_per_s": 5.0, "same_tokens": True,
              "speedup_vs_fastest_hf_generate_batch": 10.0,
              "hf_generate_batch_vs_static_batch_fraction": 0.1875,
              "p50_ms_per_token": 1.0, "p99_ms_per_token": 2.0},
    "qwen3_moe": {"model": "HF Qwen3-MoE 4 layers d512, 16 experts top-4, vocab 32000, bf16",
                  "graphed_tokens_per_s": 50.0, "graphed_first_pass_tokens_per_s": 20.0,
                  "hf_generate_batch_tokens_per_s": 5.0,
                  "hf_generate_batch_cuda_graphs_tokens_per_s": 25.0,
                  "hf_generate_static_batch_tokens_per_s": 4.0, "same_tokens": False,
                  "same_tokens_fraction": 0.328, "speedup_vs_fastest_hf_generate_batch": 2.0,
                  "hf_generate_batch_vs_static_batch_fraction": 0.2344,
                  "p50_ms_per_token": 1.5, "p99_ms_per_token": 2.5},
    "mamba": {"error": "boom"}}}


def test_the_markdown_table_and_the_opt_in_workload(bench):
    text = "\n".join(bench.markdown(SERVING))
    assert "TF32 on" in text
    assert ("| llama | 100.0 (90.0) | 10.0 | failed: RuntimeError: no graphs | 5.0 | 10.0 | "
            "True | 19% | 1.0 / 2.0 |") in text
    assert ("| qwen3_moe (bf16) | 50.0 (20.0) | 5.0 | 25.0 | 4.0 | 2.0 | False (33%) | 23% | "
            "1.5 / 2.5 |") in text
    assert "| mamba | FAILED: boom |" in text
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        spec = importlib.util.spec_from_file_location("bench_run_serving",
                                                      os.path.join(ROOT, "bench/run.py"))
        run = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(run)
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    assert "hf_serving" in run.WORKLOADS and "hf_serving" in run.OPT_IN


def test_graphed_static_and_alone_paths_agree_on_a_tiny_model(bench):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompts, budgets = bench.make_requests(6, (3, 12), (2, 7), 128)
    ours = bench.run_graphed(model, prompts, budgets, "cpu")
    alone = bench.run_alone(model, prompts, budgets, 6, "cpu")
    static = bench.run_static_batch(model, prompts, budgets, "cpu")
    assert ours["tokens"] == alone
    assert [len(t) for t in static["tokens"]] == budgets
    assert ours["tokens_per_s"] > 0 and ours["stats"]["prefills"] == 6
    assert ours["p50_ms_per_token"] is not None


def test_the_gpu_check_summary_prints_the_serving_table(tmp_path, capsys):
    """The summary names the table and prints it, not the zoo's (which have
    no serving columns)."""
    spec = importlib.util.spec_from_file_location(
        "gpu_check_summary_serving", os.path.join(ROOT, "scripts/gpu_check_summary.py"))
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    (tmp_path / "h200.json").write_text(json.dumps(
        {"device": "H100", "torch": "2.11", "workloads": {"hf_serving": SERVING}}))
    summary.main(str(tmp_path))
    out = capsys.readouterr().out
    assert "| hf_serving | see the hf_serving table |" in out
    assert "### hf_serving" in out and "| llama | 100.0 (90.0) |" in out
    assert "zoo:" not in out
