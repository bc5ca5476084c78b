"""`graphed advise|optimize|bench`: bad input exits 2 with a message that names the
factory and what was expected; without a GPU the profiling commands say so. Most
cases call the entry point in-process (a subprocess per case would import torch
each time); one runs the installed command end to end."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

WORKLOADS = textwrap.dedent(
    """\
    import torch


    def inference():
        return (lambda x: x * 2), (torch.ones(3),)


    def training():
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, optimizer, torch.nn.functional.mse_loss, (torch.ones(2, 3), torch.ones(2, 1))


    def raises():
        raise ValueError("no data here")


    def returns_a_number():
        return 42


    def bad_optimizer():
        model = torch.nn.Linear(3, 1)
        return model, "sgd", torch.nn.functional.mse_loss, (torch.ones(2, 3), torch.ones(2, 1))


    def bad_batch():
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, optimizer, torch.nn.functional.mse_loss, torch.ones(2, 3)
    """
)

EXPECTED = "a factory returns an inference workload (fn, args)"


@pytest.fixture
def workloads(tmp_path, monkeypatch):
    (tmp_path / "my_workloads.py").write_text(WORKLOADS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_workloads", raising=False)
    return tmp_path


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def main(capsys, *args):
    from graphed.cli import main as cli_main

    capsys.readouterr()
    code = cli_main(list(args))
    out, err = capsys.readouterr()
    return Result(code, out, err)


def run(directory, *args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "graphed", *args], capture_output=True,
                          text=True, timeout=600, env=env)


BAD_INPUT = [
    ("no_such_module:make", "cannot import module 'no_such_module' of factory "
                            "'no_such_module:make'"),
    ("my_workloads:missing", "module 'my_workloads' has no attribute 'missing', so factory "
                             "'my_workloads:missing' does not exist"),
    ("my_workloads:raises", "factory 'my_workloads:raises' raised ValueError: no data here"),
    ("my_workloads:returns_a_number", "factory 'my_workloads:returns_a_number' returned int 42"),
    ("my_workloads:bad_optimizer", "returned optimizer (the second of four elements) str 'sgd'"),
    ("my_workloads:bad_batch", "returned batch (the fourth of four elements) Tensor"),
    ("no_colon", "expected MODULE:FACTORY"),
]


@pytest.mark.parametrize("command", ["advise", "optimize"])
@pytest.mark.parametrize("spec, message", BAD_INPUT, ids=[spec for spec, _ in BAD_INPUT])
def test_bad_factories_exit_2_naming_the_factory(workloads, capsys, command, spec, message):
    result = main(capsys, command, spec)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr, result.stderr
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith(f"graphed {command}: ")
    if spec != "no_colon":
        assert EXPECTED in " ".join(result.stderr.split())
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["advise", "optimize"])
@pytest.mark.parametrize("factory", ["inference", "training"])
def test_without_a_gpu_profiling_commands_exit_2(workloads, capsys, command, factory):
    if torch.cuda.is_available():
        pytest.skip("checks the message on machines without a GPU")
    result = main(capsys, command, f"my_workloads:{factory}")
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"graphed {command}: profiling needs an NVIDIA GPU" in result.stderr
    assert "graphed check` works without one" in result.stderr


def test_the_installed_command_exits_2_on_a_bad_factory(workloads):
    result = run(workloads, "advise", "my_workloads:raises")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "ValueError: no data here" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("graphed advise: factory ")


def test_bench_rejects_unknown_workloads(capsys):
    result = main(capsys, "bench", "resnet")
    assert result.returncode == 2
    assert "graphed bench: unknown workload(s) resnet; choose from mlp_inference, gpt_train" \
        in result.stderr


@pytest.mark.parametrize("command, phrase", [
    ("advise", "0 advice given, 2 bad input"),
    ("optimize", "0 applied, 1 not applied (the report says why), 2 bad input or no GPU"),
    ("bench", "0 every prediction within 15%"),
])
def test_help_describes_the_exit_codes(capsys, command, phrase):
    with pytest.raises(SystemExit) as exit_info:
        main(capsys, command, "--help")
    assert exit_info.value.code == 0
    result = Result(0, capsys.readouterr().out, "")
    assert phrase in " ".join(result.stdout.split())
    if command != "bench":
        assert "--plot FILE" in result.stdout and "--json" in result.stdout


@pytest.mark.parametrize("command", ["advise", "optimize"])
def test_training_options_on_an_inference_workload_exit_2(workloads, capsys, command):
    result = main(capsys, command, "my_workloads:inference", "--clip-grad-norm", "1.0",
                  "--microbatches", "2")
    assert result.returncode == 2, result.stdout + result.stderr
    assert (f"graphed {command}: microbatches=2, clip_grad_norm=1.0 applies to training "
            "workloads; factory 'my_workloads:inference' returned an inference workload"
            in result.stderr), result.stderr


@pytest.mark.parametrize("command", ["advise", "optimize"])
def test_bad_training_options_exit_2_with_the_setting(workloads, capsys, command):
    result = main(capsys, command, "my_workloads:training", "--microbatches", "0")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Expected microbatches to be an int >= 1, got 0" in result.stderr


def test_compile_is_an_optimize_flag_with_three_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(capsys, "optimize", "my_workloads:training", "--compile", "sometimes")
    assert exit_info.value.code == 2
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err
