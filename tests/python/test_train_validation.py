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
