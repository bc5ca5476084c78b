"""bench/hf_decode_models.py on the CPU: its arguments, its table, its place in
bench/run.py and the gpu-check summary, and the quick smoke run end to end on
two families (a sliding-window Mistral and Mamba2), whose graphed tokens must
equal transformers' there (the real run is ``python3 bench/hf_decode_models.py
--json OUT.json`` on a GPU)."""

import importlib.util
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytest.importorskip("transformers")


def _load(name, path):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))


@pytest.fixture(scope="module")
def bench():
    return _load("hf_decode_models", "bench/hf_decode_models.py")


def test_arguments_are_checked(bench, capsys):
    args = bench.parse_args(["--json", "out.json", "--models", "mamba2,gemma3", "--device",
                             "cpu", "--quick"])
    assert args.models == ["mamba2", "gemma3"] and args.quick and args.json == "out.json"
    assert args.batches == [1, 8]
    assert bench.parse_args(["--device", "cpu"]).models == list(bench.MODELS)
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "gpt9", "--device", "cpu"])
    assert "unknown model(s) gpt9" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--batches", "one", "--device", "cpu"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench.parse_args([])
        assert "--device cpu" in capsys.readouterr().err


def test_the_issues_models_at_hf_decodes_scale(bench):
    assert set(bench.MODELS) == {"mistral_sliding", "gpt_oss", "gemma3", "mamba2",
                                 "granite_hybrid", "qwen3_moe"}
    size = bench.BENCH
    assert (size.layers, size.width, size.vocab) == (4, 512, 32000)
    # The windows must matter: prompt and new tokens run past them.
    assert bench.PROMPT + bench.NEW_TOKENS > size.window
    assert bench.PROMPT + bench.QUICK_NEW_TOKENS > bench.TINY.window


def test_the_table_the_opt_in_workload_and_the_summary(bench, tmp_path, capsys):
    record = {"prompt": 32, "new_tokens": 128, "batches": [1, 8], "tf32": False, "models": {
        "mamba2": {"model": "Mamba2", "b1": {
            "ms_per_token": 0.5, "kernel_floor_ms": 0.4, "ratio_to_floor": 1.25,
            "ratio_to_call_floor": 1.21,
            "decode_ms_per_token": 0.48, "decode_ratio_to_floor": 1.2,
            "hf_kernel_floor_ms": 0.625, "ratio_to_hf_floor": 0.8,
            "hf_dynamic_ms_per_token": 10.0, "speedup_vs_hf_dynamic": 20.0,
            "max_speedup_vs_hf_dynamic": 25.0,
            "same_tokens": True, "compared_with": "hf_static",
            "graph_notes": ["Mamba2ForCausalLM decodes on its recurrent states, sized for 1 "
                            "rows", "the RMSNorms of the decode steps (5 Mamba2RMSNorm) run "
                            "graphed's rms_norm, 3 kernels in place of 6"]},
            "b8": {"error": "RuntimeError: boom"}},
        "gpt_oss": {"error": "ImportError: no gpt-oss"},
        "gemma3": {"b1": {"ms_per_token": 1.0, "same_tokens": False,
                          "compared_with": "hf_dynamic", "new_tokens_equal_fraction": 0.5,
                          "errors": {"kernel_floor": {"error": "no profiler"}}}}}}
    text = "\n".join(bench.markdown(record))
    assert ("| mamba2 | 1 | 0.5000 | 0.4000 | 1.25 | 1.21 | 0.4800 (1.20) | 0.6250 (0.80) "
            "| 10.0000 | 20.00 (of 25.00) | "
            "True (vs hf_static) | "
            "state-space states sized once; RMSNorms in 3 kernels (bitwise) |") in text
    assert "| mamba2 | 8 | FAILED: RuntimeError: boom |" in text
    assert "| gpt_oss | | FAILED: ImportError: no gpt-oss |" in text
    assert "False (vs hf_dynamic), 50.0% of new tokens | kernel_floor failed: no profiler" in text
    assert "(of " not in text.split("| gemma3 |")[1]  # no floor, no bound
    run = _load("bench_run_decode_models", "bench/run.py")
    assert "hf_decode_models" in run.WORKLOADS and "hf_decode_models" in run.OPT_IN
    assert "### hf_decode_models" in run.markdown({"workloads": {"hf_decode_models": record}})
    summary = _load("gpu_check_summary_decode_models", "scripts/gpu_check_summary.py")
    (tmp_path / "h200.json").write_text(json.dumps(
        {"device": "H200", "torch": "2.14", "workloads": {"hf_decode_models": record}}))
    summary.main(str(tmp_path))
    out = capsys.readouterr().out
    assert "| hf_decode_models | see the hf_decode_models table |" in out
    assert "| mamba2 | 1 | 0.5000 |" in out and "zoo:" not in out


def test_the_quick_cpu_smoke_run_gives_transformers_tokens(bench, tmp_path, capsys):
    out = tmp_path / "decode_models.json"
    rc = bench.main(["--json", str(out), "--models", "mistral_sliding,mamba2", "--device", "cpu",
                     "--quick"])
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert rc == 0, json.dumps(record, indent=1)[-4000:]
    assert record["tf32"] is False and record["new_tokens"] == bench.QUICK_NEW_TOKENS
    assert "### hf_decode_models" in printed and "| mamba2 | 8 |" in printed
    for name, note in (("mistral_sliding", "sliding window of 8"),
                       ("mamba2", "recurrent states")):
        model = record["models"][name]
        assert model["dtype"] == "float32" and "error" not in model, model
        for batch in (1, 8):
            row = model[f"b{batch}"]
            assert "errors" not in row, row["errors"]
            for field in ("ms_per_token", "kernel_floor_ms", "hf_dynamic_ms_per_token",
                          "same_tokens", "compared_with", "ratio_to_floor",
                          "speedup_vs_hf_dynamic", "graph_notes"):
                assert field in row, (name, batch, field)
            assert row["same_tokens"] is True, (name, batch, row)
            assert row["compared_with"] == "hf_static"
            assert row["new_tokens_equal_fraction"] == 1.0
            assert row["ms_per_token"] > 0 and row["hf_dynamic_ms_per_token"] > 0
            assert row["speedup_vs_hf_dynamic"] > 0
            assert row["max_speedup_vs_hf_dynamic"] is None  # no floor on the CPU
            assert row["prefill_call_ms"] > 0 and row["decode_ms_per_token"] is not None
            assert row["decode_ratio_to_floor"] is None  # no floor on the CPU
            # No GPU kernels to sum on the CPU: the floor says why it is missing.
            assert row["kernel_floor_ms"] is None and "CUDA" in row["kernel_floor_note"]
            assert any(note in n for n in row["graph_notes"]), row["graph_notes"]
    assert record["models"]["mistral_sliding"]["sliding_window"] == bench.TINY.window
    assert record["models"]["mistral_sliding"]["b1"]["hf_static_cache_layers"] == [
        "StaticSlidingWindowLayer"]
