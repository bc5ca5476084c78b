"""graphed.check: each blocker kind is found at the right line, clean code gives an
empty report, and the check changes nothing (module state, RNG, torch's functions)."""

import json
import os

import numpy as np
import pytest
import torch

import graphed
from source_lines import line_of


def the_finding(report, kind, op):
    found = [f for f in report.findings if f.kind == kind and f.op == op]
    assert len(found) == 1, str(report)
    return found[0]


def assert_points_at(finding, fn, marker):
    assert os.path.samefile(finding.file, __file__), finding.file
    assert finding.line == line_of(fn, marker), finding
    assert finding.function == fn.__name__


# --- one small function per blocker kind ------------------------------------------------


def reads_item(x):
    return x.sum().item() * 2


def reads_truth_value(x):
    if x.sum() > 0:
        return x
    return -x


def reads_tolist(x):
    return x.tolist()


def finds_nonzero(x):
    return torch.nonzero(x)


def selects_masked(x):
    return torch.masked_select(x, x > 1)


def finds_unique(x):
    return torch.unique(x)


def indexes_with_mask(x):
    return x[x > 1]


def synchronizes(x):
    y = x * 2
    torch.cuda.synchronize()
    return y


def moves_to_host(x):
    return x.cpu() + 1


def moves_to_host_by_name(x):
    return x.to("cpu") + 1


def builds_cuda_tensor_from_list(x):
    offsets = torch.tensor([1.0, 2.0], device="cuda")
    return x * 2, offsets


def builds_cuda_tensor_from_numpy(x):
    offsets = torch.as_tensor(np.arange(3.0), device="cuda")
    return x * 2, offsets


_own_generator = torch.Generator().manual_seed(5)


def draws_from_own_generator(x):
    return x + torch.randn(x.shape, generator=_own_generator)


_layer = torch.nn.Linear(4, 4)


def runs_autocast_with_cache(x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _layer(x)


BLOCKERS = [
    (reads_item, ".item()", "host_read", "aten::item"),
    (reads_truth_value, "if x.sum() > 0", "host_read", "aten::is_nonzero"),
    (reads_tolist, ".tolist()", "host_read", "Tensor.tolist"),
    (finds_nonzero, "torch.nonzero", "data_dependent_shape", "aten::nonzero"),
    (selects_masked, "torch.masked_select", "data_dependent_shape", "aten::masked_select"),
    (finds_unique, "torch.unique", "data_dependent_shape", "aten::_unique2"),
    (indexes_with_mask, "x[x > 1]", "data_dependent_shape", "aten::index"),
    (synchronizes, "torch.cuda.synchronize()", "explicit_sync", "torch.cuda.synchronize"),
    (moves_to_host, "x.cpu()", "host_device_copy", "Tensor.cpu"),
    (moves_to_host_by_name, 'x.to("cpu")', "host_device_copy", "Tensor.to('cpu')"),
    (builds_cuda_tensor_from_list, "torch.tensor(", "host_device_copy", "torch.tensor"),
    (builds_cuda_tensor_from_numpy, "torch.as_tensor(", "host_device_copy", "torch.as_tensor"),
    (draws_from_own_generator, "generator=", "unregistered_generator", "aten::randn"),
    (runs_autocast_with_cache, "_layer(x)", "autocast_cache", "aten::linear"),
]


@pytest.mark.parametrize("fn, marker, kind, op", BLOCKERS, ids=[b[0].__name__ for b in BLOCKERS])
def test_each_blocker_is_found_at_its_line(fn, marker, kind, op):
    x = torch.tensor([0.5, 1.5, 2.5, 1.5])
    report = graphed.check(fn, x)
    assert report, f"{fn.__name__}: nothing found"
    assert len(report) == 1, str(report)
    finding = the_finding(report, kind, op)
    assert_points_at(finding, fn, marker)
    assert finding.count == 1
    assert finding.why and finding.fix
    text = str(report)
    where = f"{finding.file}:{finding.line} in {fn.__name__}"
    severity = finding.severity.replace("_", " ")
    assert severity in ("breaks capture", "spoils replay")
    assert f"1. {finding.label} ({severity}): `{op}` at {where}" in text, text
    assert f"why:    {finding.why}" in text
    assert f"fix:    {finding.fix}" in text


def test_cpu_findings_are_predictions_and_the_report_says_so():
    report = graphed.check(reads_item, torch.ones(3))
    assert not report.ran_on_gpu
    finding = report.findings[0]
    assert finding.predicted
    assert finding.inputs == "() float32 cpu"
    assert "This pass ran on CPU tensors only" in str(report)


def test_a_sync_is_not_a_prediction():
    assert not graphed.check(synchronizes, torch.ones(3)).findings[0].predicted


# --- clean code --------------------------------------------------------------------------


def clean_arithmetic(x):
    w = torch.ones(4, 4)
    return torch.softmax(torch.relu(x @ w) + 1, dim=-1)


def clean_fixed_size_masking(x):
    y = x.clone()
    y[y > 1] = 0.0  # becomes masked_fill_: no data-dependent shape
    return torch.where(x > 1, x, torch.zeros_like(x)) + y


def clean_device_agnostic(x):
    scale = torch.tensor([2.0, 2.0, 2.0, 2.0])  # host data for the CPU: ordinary CPU work
    return x.to(x.device) * scale + x.repeat_interleave(2)[:4]


def clean_training_step(x):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(8, 1))
    loss = model(x.unsqueeze(0)).square().mean()
    loss.backward()
    return loss.detach()


CLEAN = [clean_arithmetic, clean_fixed_size_masking, clean_device_agnostic, clean_training_step]


@pytest.mark.parametrize("fn", CLEAN, ids=[fn.__name__ for fn in CLEAN])
def test_clean_functions_give_an_empty_report(fn):
    report = graphed.check(fn, torch.tensor([0.5, 1.5, 2.5, 1.5]))
    assert not report, str(report)
    assert len(report) == 0
    assert report.findings == []
    assert report.operators_observed > 0
    assert f"graphed.check of function `{fn.__name__}`: no capture blockers among" in str(report)


# --- counting, locations, report forms ------------------------------------------------------


def reads_in_a_loop(x):
    total = 0.0
    for _ in range(3):
        total += x.sum().item()  # counted
    return total + x.max().item()  # separate


def test_repeats_at_one_line_are_counted_and_lines_kept_apart():
    report = graphed.check(reads_in_a_loop, torch.ones(3))
    assert [f.line for f in report.findings] == [
        line_of(reads_in_a_loop, "# counted"),
        line_of(reads_in_a_loop, "# separate"),
    ]
    assert [f.count for f in report.findings] == [3, 1]
    assert "2 capture blockers (4 occurrences)" in str(report)


def indexes_with_mask_and_backpropagates(x):
    picked = x[x.detach() > 1]
    picked.sum().backward()  # backward
    return picked


def test_a_blocker_in_backward_names_its_autograd_node():
    x = torch.tensor([0.5, 1.5, 2.5], requires_grad=True)
    report = graphed.check(indexes_with_mask_and_backpropagates, x)
    backward = [f for f in report.findings if f.inside == "IndexBackward0"]
    assert len(backward) == 1, str(report)
    assert backward[0].kind == "data_dependent_shape"
    assert backward[0].line == line_of(indexes_with_mask_and_backpropagates, "# backward")


def test_keyword_arguments_reach_the_function():
    def scaled(x, *, scale):
        return (x * scale).sum().item()

    report = graphed.check(scaled, torch.ones(2), scale=3.0)
    assert report.findings[0].op == "aten::item"


def test_to_dict_is_json_ready():
    report = graphed.check(reads_item, torch.ones(3))
    data = json.loads(json.dumps(report.to_dict()))
    assert data["description"] == "function `reads_item`"
    assert data["ran_on_gpu"] is False
    (finding,) = data["findings"]
    assert finding["kind"] == "host_read"
    assert finding["op"] == "aten::item"
    assert finding["line"] == line_of(reads_item, ".item()")
    assert finding["function"] == "reads_item"
    assert finding["count"] == 1
    assert finding == report.findings[0].to_dict()


def test_a_check_inside_a_check_is_refused():
    def nested(x):
        return graphed.check(reads_item, x)

    with pytest.raises(graphed.GraphedError, match="one safety check at a time"):
        graphed.check(nested, torch.ones(2))
    assert not graphed.check(clean_arithmetic, torch.ones(4))  # the first check was cleaned up


# --- the check changes nothing -----------------------------------------------------------------


def _torch_functions():
    return (torch.cuda.synchronize, torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize,
            torch.tensor, torch.as_tensor, torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.tolist,
            set(vars(torch.Tensor)))


def test_a_module_keeps_its_buffers_and_the_generator_its_state():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Dropout(0.5)).train()
    x = torch.randn(8, 4)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    rng = torch.get_rng_state()
    before = _torch_functions()
    report = graphed.check(model, x)
    assert not report, str(report)
    assert report.description == "module `Sequential`"
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    assert torch.equal(torch.get_rng_state(), rng)
    assert _torch_functions() == before


def test_everything_is_restored_when_the_function_raises():
    norm = torch.nn.BatchNorm1d(3).train()
    mean = norm.running_mean.clone()
    x = torch.randn(4, 3)
    rng = torch.get_rng_state()
    before = _torch_functions()

    class Failing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = norm

        def forward(self, x):
            self.norm(x)
            torch.randn(10)
            x.tolist()
            raise ValueError("the user's bug")

    with pytest.raises(ValueError, match="the user's bug"):
        graphed.check(Failing(), x)
    assert torch.equal(norm.running_mean, mean)
    assert torch.equal(torch.get_rng_state(), rng)
    assert _torch_functions() == before


# --- on a GPU: the kinds a CPU pass cannot see, and real syncs ------------------------------------


def copies_gpu_to_host(x):
    return x.cpu()


def indexes_gpu_with_cpu_indices(x):
    return x[torch.arange(2)]


def syncs_device_stream_and_event(x):
    y = x * 2
    torch.cuda.synchronize()  # device
    torch.cuda.current_stream().synchronize()  # stream
    event = torch.cuda.Event()
    event.record()
    event.synchronize()  # event
    return y


def reads_cpu_counter_and_gpu_value(x, counter):
    steps = counter.item()  # CPU: free on a GPU
    return x.sum().item() + steps  # GPU: a sync


_cuda_generator = None


def draws_from_own_cuda_generator(x):
    return x + torch.randn(x.shape, device=x.device, generator=_cuda_generator)


def runs_cuda_autocast_with_cache(x, layer):
    with torch.autocast("cuda", dtype=torch.float16):
        return layer(x)


@pytest.mark.gpu
def test_gpu_copy_to_the_host_is_found():
    report = graphed.check(copies_gpu_to_host, torch.ones(4, device="cuda"))
    assert report.ran_on_gpu
    finding = the_finding(report, "host_device_copy", "Tensor.cpu")
    assert_points_at(finding, copies_gpu_to_host, "x.cpu()")
    assert not finding.predicted
    assert "CPU tensors only" not in str(report)


@pytest.mark.gpu
def test_gpu_cpu_tensor_mixed_into_gpu_work_is_found():
    report = graphed.check(indexes_gpu_with_cpu_indices, torch.ones(4, device="cuda"))
    finding = the_finding(report, "cpu_tensor", "aten::index")
    assert_points_at(finding, indexes_gpu_with_cpu_indices, "torch.arange(2)")
    assert "(2,) int64 cpu" in finding.detail


@pytest.mark.gpu
def test_gpu_syncs_are_found_and_still_run():
    report = graphed.check(syncs_device_stream_and_event, torch.ones(4, device="cuda"))
    fn = syncs_device_stream_and_event
    assert_points_at(the_finding(report, "explicit_sync", "torch.cuda.synchronize"), fn, "# device")
    assert_points_at(the_finding(report, "explicit_sync", "torch.cuda.Stream.synchronize"), fn,
                     "# stream")
    assert_points_at(the_finding(report, "explicit_sync", "torch.cuda.Event.synchronize"), fn,
                     "# event")


@pytest.mark.gpu
def test_gpu_pass_drops_predictions_about_cpu_tensors():
    report = graphed.check(reads_cpu_counter_and_gpu_value, torch.ones(4, device="cuda"),
                           torch.tensor(3))
    (finding,) = report.findings
    assert finding.kind == "host_read"
    assert_points_at(finding, reads_cpu_counter_and_gpu_value, "# GPU")
    assert not finding.predicted


@pytest.mark.gpu
def test_gpu_non_default_generator_is_found():
    global _cuda_generator
    _cuda_generator = torch.Generator(device="cuda").manual_seed(1)
    report = graphed.check(draws_from_own_cuda_generator, torch.ones(4, device="cuda"))
    finding = the_finding(report, "unregistered_generator", "aten::randn")
    assert_points_at(finding, draws_from_own_cuda_generator, "generator=")
    assert not finding.predicted


@pytest.mark.gpu
def test_gpu_autocast_cache_is_found():
    layer = torch.nn.Linear(8, 8).cuda()
    report = graphed.check(runs_cuda_autocast_with_cache, torch.randn(2, 8, device="cuda"), layer)
    finding = the_finding(report, "autocast_cache", "aten::linear")
    assert_points_at(finding, runs_cuda_autocast_with_cache, "layer(x)")
    assert not finding.predicted


@pytest.mark.gpu
def test_gpu_tensor_from_a_list_is_built_on_the_gpu_and_found():
    report = graphed.check(builds_cuda_tensor_from_list, torch.ones(2, device="cuda"))
    finding = the_finding(report, "host_device_copy", "torch.tensor")
    assert_points_at(finding, builds_cuda_tensor_from_list, "torch.tensor(")
    assert len(report) == 1, str(report)


# --- severity and the path taken under capture (Note [Finding severity], Note
# [Checking the path taken under capture]) --------------------------------------------


def builds_empty_cuda_tensor(x):
    empty = torch.tensor([], device="cuda")
    return x * 2, empty


def reads_only_when_not_capturing(x):
    if not torch.cuda.is_current_stream_capturing() and x.sum() > 0:  # host read outside capture
        return x
    return x * 2


def test_a_copy_of_zero_bytes_is_harmless_and_not_counted():
    report = graphed.check(builds_empty_cuda_tensor, torch.ones(3))
    assert not report, str(report)
    assert [f.op for f in report.harmless] == ["torch.tensor"]
    assert report.harmless[0].severity == "harmless"
    assert report.verdict == "clean"
    assert "harmless" in str(report)
    assert report.to_dict()["harmless"][0]["severity"] == "harmless"


def test_a_real_copy_from_host_data_breaks_capture():
    report = graphed.check(builds_cuda_tensor_from_list, torch.ones(3))
    finding = the_finding(report, "host_device_copy", "torch.tensor")
    assert finding.severity == "breaks_capture"
    assert not finding.in_installed_package
    assert report.verdict == "blocked"  # in the user's own code
    assert "(breaks capture)" in str(report)


def test_code_that_asks_whether_it_is_captured_is_checked_along_the_capture_path():
    report = graphed.check(reads_only_when_not_capturing, torch.ones(3))
    assert not report, str(report)
    # ... and the question is answered truthfully again after the check.
    assert torch.cuda.is_current_stream_capturing.__module__ == "torch.cuda.graphs"


def test_every_severity_has_a_name():
    severities = {f.severity for report in (graphed.check(reads_item, torch.ones(3)),
                                            graphed.check(builds_empty_cuda_tensor, torch.ones(3)))
                  for f in list(report.findings) + list(report.harmless)}
    assert severities <= {"breaks_capture", "spoils_replay", "harmless"}
