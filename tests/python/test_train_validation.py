"""graphed.TrainStep and make_capturable argument checks: no GPU needed."""

import pytest
import torch
from torch import nn

import graphed


def test_cpu_model_is_refused_with_the_fix():
    opt = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    with pytest.raises(graphed.GraphedError, match=r"parameter 0 is on cpu.*model.cuda\(\)"):
        graphed.make_capturable(opt)


def test_uncapturable_optimizer_is_named():
    opt = torch.optim.LBFGS(nn.Linear(2, 2).parameters())
    with pytest.raises(graphed.GraphedError):
        graphed.make_capturable(opt)


def test_step_function_without_model_or_optimizer_is_refused():
    with pytest.raises(graphed.GraphedError, match="could not find the model and optimizer"):
        graphed.TrainStep(lambda batch: batch.sum(), torch.ones(2))


def test_microbatch_count_must_match_the_sample():
    model = nn.Linear(2, 2)
    with pytest.raises(graphed.GraphedError, match="list or tuple of 4 microbatches"):
        graphed.TrainStep(lambda batch: model(batch).sum(), [torch.ones(2)] * 3, microbatches=4,
                          modules=[model], optimizers=[])


def test_from_parts_validates_amp_and_microbatches():
    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(graphed.GraphedError, match='amp to be None, "bf16" or "fp16"'):
        graphed.TrainStep.from_parts(model, opt, nn.functional.mse_loss,
                                     (torch.ones(2), torch.ones(2)), amp="fp8")
    with pytest.raises(graphed.GraphedError, match="microbatches >= 1"):
        graphed.TrainStep.from_parts(model, opt, nn.functional.mse_loss,
                                     (torch.ones(2), torch.ones(2)), microbatches=0)


# --- batch forms (Note [Batch forms] in python/graphed/train.py) -------------------------

from graphed.train import (batch_loss, check_batch_form, loss_from_output,  # noqa: E402
                           split_batch, training_forward_kwargs)


class _OwnLoss(torch.nn.Module):
    """Returns its loss the way transformers models do: output.loss from labels."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, features, labels=None, use_cache=None):
        logits = self.linear(features)
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits, "use_cache": use_cache}


def test_a_dict_batch_calls_the_model_with_keywords_and_takes_its_loss():
    model = _OwnLoss()
    batch = {"features": torch.randn(3, 4), "labels": torch.tensor([0, 1, 0])}
    loss = batch_loss(model, None, batch)
    expected = torch.nn.functional.cross_entropy(model.linear(batch["features"]), batch["labels"])
    torch.testing.assert_close(loss, expected)
    # With a loss function, it gets the output and the whole batch.
    got = batch_loss(model, lambda out, b: out["logits"].sum() * 0 + b["labels"].sum(), batch)
    assert float(got) == 1.0


def test_a_model_without_its_own_loss_is_refused_with_the_fix():
    model = _OwnLoss()
    with pytest.raises(graphed.GraphedError, match="loss_fn=None.*labels"):
        batch_loss(model, None, {"features": torch.randn(3, 4)})
    with pytest.raises(graphed.GraphedError, match="returned NoneType"):
        loss_from_output(None, model)


def test_the_training_step_turns_the_cache_off_unless_the_batch_sets_it():
    model = _OwnLoss()
    kwargs, notes = training_forward_kwargs(model, {"features": None})
    assert kwargs == {"use_cache": False} and "use_cache=False" in notes[0]
    assert training_forward_kwargs(model, {"use_cache": True}) == ({}, [])
    assert training_forward_kwargs(torch.nn.Linear(2, 2), (None, None)) == ({}, [])


def test_batches_split_into_microbatches_in_every_form():
    batch = {"ids": torch.arange(8).reshape(4, 2), "flag": True,
             "pair": (torch.arange(4), [torch.arange(4)])}
    parts = split_batch(batch, 2)
    assert len(parts) == 2
    assert parts[1]["ids"].tolist() == [[4, 5], [6, 7]]
    assert parts[0]["flag"] is True
    assert parts[1]["pair"][0].tolist() == [2, 3] and isinstance(parts[1]["pair"][1], list)
    with pytest.raises(graphed.GraphedError, match="divisible by 3"):
        split_batch(torch.arange(2), 3)


def test_a_batch_in_no_known_form_is_refused_with_the_forms():
    with pytest.raises(graphed.GraphedError, match=r"\(inputs, targets\).*dict.*loss_fn=None"):
        check_batch_form((torch.ones(1), torch.ones(1), torch.ones(1)), torch.nn.functional.mse_loss)
    check_batch_form({"a": 1}, None)
    check_batch_form((torch.ones(1),), None)
