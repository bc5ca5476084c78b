"""The advice arithmetic on stored traces (tests/python/data/trace_*.json), checked
against figures computed here independently; the report's text and JSON; the
timeline PNG. No GPU needed."""

import json
import os

import numpy as np
import pytest

import graphed
from graphed import _C
from graphed.advise import Advice, format_advice
from graphed.plot import predicted_trace, timeline_png

DATA = os.path.join(os.path.dirname(__file__), "data")
COST = {"per_node_us": 0.35, "launch_us": 8.0}


def load(name):
    with open(os.path.join(DATA, f"trace_{name}.json")) as handle:
        trace = json.load(handle)
    return {key: [tuple(item) for item in trace[key]] for key in ("gpu", "launches", "iterations")}


def independent_summary(trace):
    """The figures of Note [Predicting the graphed time], computed with numpy."""
    n = len(trace["iterations"])
    durations = np.array([a[3] for a in trace["gpu"]], dtype=float) / 1e3
    intervals = sorted((a[2], a[2] + a[3]) for a in trace["gpu"])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    busy = sum(end - start for start, end in merged)
    gaps = np.array([b[0] - a[1] for a, b in zip(merged, merged[1:])], dtype=float) / 1e3
    first = min([it[1] for it in trace["iterations"]] + [a[2] for a in trace["gpu"]])
    last = max([it[1] + it[2] for it in trace["iterations"]] + [a[2] + a[3] for a in trace["gpu"]])
    return {
        "activities_per_iter": len(trace["gpu"]) / n,
        "kernels_per_iter": sum(a[1] == "kernel" for a in trace["gpu"]) / n,
        "gpu_ms_per_iter": durations.sum() / 1e3 / n,
        "duration_p50_us": np.percentile(durations, 50),
        "duration_p90_us": np.percentile(durations, 90),
        "duration_max_us": durations.max(),
        "small_fraction": float((durations < 50).mean()),
        "gpu_busy_fraction": busy / (last - first),
        "idle_ms_per_iter": (last - first - busy) / 1e6 / n,
        "gap_p50_us": np.percentile(gaps, 50) if len(gaps) else 0.0,
        "host_ms_per_iter": sum(it[2] for it in trace["iterations"]) / 1e6 / n,
        "launch_call_us": np.mean([l[2] for l in trace["launches"]]) / 1e3,
    }


@pytest.mark.parametrize("name", ["launch_bound", "gpu_bound", "two_streams"])
def test_summary_matches_an_independent_computation(name):
    trace = load(name)
    summary = _C.summarize_trace(trace)
    for key, expected in independent_summary(trace).items():
        assert summary[key] == pytest.approx(expected, rel=1e-9, abs=1e-12), key


def test_launch_bound_trace_helps_with_full_capture():
    trace = load("launch_bound")
    expected = independent_summary(trace)
    eager_ms = expected["host_ms_per_iter"]
    advice = _C.advise_trace(trace, COST, eager_ms)
    predicted = expected["gpu_ms_per_iter"] + (80 * 0.35 + 8.0) / 1e3
    assert advice["summary"]["activities_per_iter"] == 80
    assert advice["predicted_ms"] == pytest.approx(predicted, rel=1e-12)
    assert advice["predicted_speedup"] == pytest.approx(eager_ms / predicted, rel=1e-12)
    assert advice["verdict"] == "graphs help"
    assert advice["strategy"] == "full_capture"
    assert _C.predict_graphed_ms(trace, COST) == pytest.approx(predicted, rel=1e-12)


def test_gpu_bound_trace_stays_eager():
    trace = load("gpu_bound")
    eager_ms = independent_summary(trace)["host_ms_per_iter"]
    advice = _C.advise_trace(trace, COST, eager_ms)
    assert advice["eager_gpu_busy"] > 0.95
    assert advice["verdict"] == "already GPU-bound"
    assert advice["strategy"] == "stay_eager"


@pytest.mark.parametrize("inputs, strategy", [
    ({"blockers": 2}, "fix_blockers"),
    ({"blockers": 1, "blockers_between_modules": True, "module_graphs": 16}, "per_module"),
    ({"shapes_vary": True}, "bucketed"),
])
def test_strategy_follows_the_decision_chart(inputs, strategy):
    trace = load("launch_bound")
    advice = _C.advise_trace(trace, COST, 1.0, **inputs)
    assert advice["strategy"] == strategy
    if strategy == "per_module":
        assert advice["graphs"] == 16
        assert advice["predicted_ms"] == pytest.approx(
            _C.predict_graphed_ms(trace, COST, 16), rel=1e-12)


def test_replay_cost_fit():
    cost = _C.fit_replay_cost(32, 80.0, 512, 1040.0, 1.5)
    assert cost["per_node_us"] == pytest.approx(0.5)
    assert cost["launch_us"] == pytest.approx(16.0)
    with pytest.raises(graphed.GraphedError, match="0 < small < large"):
        _C.fit_replay_cost(512, 80.0, 32, 1040.0, 1.5)


def test_bad_traces_say_what_was_expected():
    with pytest.raises(graphed.GraphedError, match="at least one iteration"):
        _C.summarize_trace({"gpu": [], "launches": [], "iterations": []})
    with pytest.raises(graphed.GraphedError, match='"kernel", "memcpy" or "memset"'):
        _C.summarize_trace({"gpu": [("k", "sync", 0, 1)], "iterations": [("it", 0, 1)]})


def make_advice(trace_name="launch_bound", **inputs):
    trace = load(trace_name)
    data = _C.advise_trace(trace, COST, 1.0, **inputs)
    finding = {"label": "host read", "op": "aten::item", "file": "train.py", "line": 12,
               "fix": "keep the value on the GPU"}
    return Advice(data, description="module `Net`", training=False,
                  blockers=[finding] if inputs.get("blockers") else [], trace=trace,
                  device="test GPU")


def test_report_text_and_json():
    advice = make_advice()
    text = str(advice)
    assert text.startswith("## graphed advice: module `Net`")
    assert "**graphs help**" in text and "**full_capture**" in text
    assert "| GPU activities per iteration | 80 (80 kernels) |" in text
    assert "0.35 us per node + 8.0 us per launch" in text
    assert "Capture blockers: none" in text
    data = json.loads(advice.to_json())
    assert data["strategy"] == "full_capture"
    assert data["predicted_ms"] == pytest.approx(advice.predicted_ms)
    assert "trace" not in data
    assert "blockers" in data and data["blockers"] == []
    assert "full_capture" in repr(advice)


def test_report_lists_blockers():
    advice = make_advice(blockers=1)
    text = format_advice(advice)
    assert "Capture blockers (1)" in text
    assert "`aten::item` at train.py:12" in text


def test_predicted_trace_lays_kernels_back_to_back():
    trace = load("launch_bound")
    predicted = predicted_trace(trace, per_node_us=0.35, launch_us=8.0)
    assert len(predicted["gpu"]) == len(trace["gpu"])
    assert len(predicted["iterations"]) == len(trace["iterations"])
    span_ms = (predicted["gpu"][-1][2] + predicted["gpu"][-1][3]) / 1e6
    per_iteration = _C.predict_graphed_ms(trace, {"per_node_us": 0.35, "launch_us": 8.0})
    assert span_ms == pytest.approx(3 * per_iteration - 0.35e-3, rel=1e-3)


def test_timeline_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the timeline needs matplotlib")
    trace = load("launch_bound")
    path = tmp_path / "timeline.png"
    timeline_png(str(path), [("eager", trace), ("graphed (predicted)",
                                                predicted_trace(trace, 0.35, 8.0)),
                             ("missing", None)], "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000


def test_advise_without_gpu_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the message on machines without a GPU")
    with pytest.raises(graphed.GraphedError, match="graphed.check works without a GPU"):
        graphed.advise(lambda x: x + 1, torch.ones(3))


def test_work_in_graphs_is_told_from_work_launched_eagerly():
    """Note [Work in graphs and work launched eagerly]: a replay of 200 kernels
    and 40 kernels launched eagerly, per iteration; an all-eager trace has
    nothing in graphs."""
    from graphed._optimize_report import OptimizeReport, describe_graphed_work, graphed_work

    eager = load("launch_bound")
    assert _C.summarize_trace(eager)["graphed_activities_per_iter"] == 0
    assert graphed_work(eager)["fraction_in_graphs"] == 0
    trace = {"gpu": [], "launches": [], "iterations": []}
    for i in range(2):
        t = i * 10**6
        trace["iterations"].append(("it", t, 900_000))
        trace["launches"].append(("cudaGraphLaunch", t, 9_000))
        trace["gpu"] += [(f"g{k}", "kernel", t + 10_000 + 2_000 * k, 1_000) for k in range(200)]
        for k in range(40):
            at = t + 500_000 + 5_000 * k
            trace["launches"].append(("cudaLaunchKernel", at, 3_000))
            trace["gpu"].append(("e", "kernel", at + 4_000, 1_000))
    work = graphed_work(trace)
    assert work == {"activities_per_step": 240, "in_graphs": 200, "launched_eagerly": 40,
                    "fraction_in_graphs": 200 / 240}
    assert describe_graphed_work(work).startswith("83% (200 of 240 GPU activities per step")
    assert graphed_work(None) == {} and graphed_work({**trace, "launches": []}) == {}
    report = OptimizeReport("m", training=True, applied=True, strategy="per_block",
                            graphed_work=work)
    assert "| GPU work in graphs | 83% (200 of 240" in str(report)
    assert report.to_dict()["graphed_work"] == work


@pytest.mark.parametrize("eager_ms, graphed_ms, kept", [
    (10.0, 9.0, True), (10.0, 10.0 / 1.05, True), (10.0, 9.6, False), (10.0, 10.0, False),
    (10.0, 11.0, False)])
def test_optimize_keeps_graphs_only_when_they_are_clearly_faster(eager_ms, graphed_ms, kept):
    # Note [A candidate must be clearly faster]: a few percent is within what
    # the same step's timings spread on the GPU machine's host.
    from graphed._optimize_report import OptimizeReport
    from graphed.optimize import MIN_SPEEDUP, _Rejected, _reject_if_slower

    report = OptimizeReport("m", training=True, eager_ms=eager_ms, graphed_ms=graphed_ms)
    if kept:
        _reject_if_slower(report, force=False)
    else:
        with pytest.raises(_Rejected, match=rf"not clearly faster: .*{MIN_SPEEDUP:.2f}x faster "
                                            r"or more, force=True keeps them anyway"):
            _reject_if_slower(report, force=False)
    _reject_if_slower(report, force=True)  # forced: kept whatever it measured
