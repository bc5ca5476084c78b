"""bench/hf_serving.py on the CPU: its arguments, requests, table and the
graphed, static-batch and per-request paths on a tiny model (the real run is
``python3 bench/hf_serving.py --json OUT.json`` on a GPU)."""

import importlib.util
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


def test_the_markdown_table_and_the_opt_in_workload(bench):
    lines = bench.markdown({"models": {
        "llama": {"graphed_tokens_per_s": 100.0, "hf_generate_batch_tokens_per_s": 10.0,
                  "hf_generate_batch_cuda_graphs_tokens_per_s": "RuntimeError: no graphs",
                  "hf_generate_static_batch_tokens_per_s": 5.0, "same_tokens": True,
                  "p50_ms_per_token": 1.0, "p99_ms_per_token": 2.0},
        "qwen3_moe": {"error": "boom"}}})
    text = "\n".join(lines)
    assert "| llama | 100.0 | 10.0 | failed: RuntimeError: no graphs | 5.0 | True | 1.0 / 2.0 |" \
        in text
    assert "| qwen3_moe | FAILED: boom |" in text
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
