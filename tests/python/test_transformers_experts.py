"""Which transformers experts layers graphed switches to its grouped GEMM
(graphed.integrations.transformers_experts), told on the CPU: the choice
depends on the weights and the user's experts_implementation, not on a GPU."""

import pytest
import torch

import graphed
from graphed._experts import capturable_experts

transformers = pytest.importorskip("transformers")


def _mixtral(**overrides):
    config = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32,
                                        intermediate_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, vocab_size=64, **overrides)
    return transformers.MixtralForCausalLM(config)


def _implementations(model):
    return {m.config._experts_implementation for m in model.modules() if hasattr(m, "has_gate")}


def test_fp32_experts_are_switched_and_the_note_says_why():
    model = _mixtral()
    assert _implementations(model) == {"grouped_mm"}
    notes = capturable_experts(model)
    assert _implementations(model) == {"graphed_grouped_mm"}
    assert len(notes) == 1 and "reads the per-expert offsets on the host" in notes[0], notes
    assert "float32" in notes[0] and "model.layers.0.mlp.experts" in notes[0]
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    assert "graphed_grouped_mm" in ALL_EXPERTS_FUNCTIONS
    assert capturable_experts(model) == []  # once is enough


def test_the_users_choice_of_experts_is_kept():
    model = _mixtral()
    model.set_experts_implementation("eager")
    assert capturable_experts(model) == []
    assert _implementations(model) == {"eager"}


def test_models_without_transformers_experts_are_left_alone():
    assert capturable_experts(torch.nn.Linear(4, 4)) == []
    assert capturable_experts(lambda x: x) == []


def test_auto_switches_the_experts_and_undo_puts_them_back():
    model = _mixtral()
    graphed.auto(model)
    assert _implementations(model) == {"graphed_grouped_mm"}
    assert any("graphed_grouped_mm" in note for note in graphed.auto_stats(model)["notes"])
    graphed.auto_undo(model)
    assert _implementations(model) == {"grouped_mm"}


def test_optimize_names_blockers_inside_installed_packages_as_theirs():
    # Issue 28: a blocker inside transformers is never "in your code".
    from graphed.optimize import _where_blockers_sit

    inside = {"file": "/venv/lib/python3.12/site-packages/transformers/integrations/moe.py",
              "line": 332, "label": "host-device copy", "in_installed_package": True}
    mine = {"file": "/home/me/train.py", "line": 7, "label": "host read",
            "in_installed_package": False}
    reason = _where_blockers_sit([inside])
    assert "inside installed packages, not in your code" in reason
    assert "transformers/integrations/moe.py:332" in reason
    assert "/venv/lib" not in reason
    reason = _where_blockers_sit([inside, mine])
    assert "in your code: host read at /home/me/train.py:7" in reason
