"""The exact snapshot graphed.optimize restores after a failure: same objects, same
values, same optimizer groups, state and attributes, same random generators."""

import torch

from graphed._state import Snapshot, ValueSnapshot, tensor_shapes


def trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_restore_undoes_what_capture_preparation_changes():
    model, optimizer = trained()
    params = [(p, p.detach().clone(), p.grad) for p in model.parameters()]
    running_mean = model[1].running_mean.clone()
    state_objects = {id(p): (s, dict(s)) for p, s in optimizer.state.items()}
    rng = torch.get_rng_state()
    snapshot = Snapshot(model, optimizer)

    # What TrainStep and trial steps do: train, drop and replace gradients, make
    # the optimizer fused with a tensor lr, move its step, add attributes.
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    for p in model.parameters():
        p.grad = None
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(5.0)
        group["fused"] = True
    for state in optimizer.state.values():
        state["step"] = torch.zeros(())
        state["extra"] = torch.ones(1)
    optimizer._step_supports_amp_scaling = True
    model.eval()
    torch.randn(100)

    snapshot.restore()
    for p, value, grad in params:
        assert torch.equal(p, value)
        assert p.grad is grad
    assert torch.equal(model[1].running_mean, running_mean)
    assert model.training and model[1].training
    assert optimizer.param_groups[0]["lr"] == 1e-3
    assert optimizer.param_groups[0]["fused"] is None
    for p, state in optimizer.state.items():
        original, items = state_objects[id(p)]
        assert state is original and state.keys() == items.keys()
        assert state["step"] is items["step"]
    assert not hasattr(optimizer, "_step_supports_amp_scaling")
    assert torch.equal(torch.get_rng_state(), rng)


def test_value_snapshot_restores_in_place():
    tensor = torch.arange(4.0)
    snapshot = ValueSnapshot([tensor])
    tensor.add_(1)
    snapshot.restore()
    assert torch.equal(tensor, torch.arange(4.0))


def test_tensor_shapes_of_nested_values():
    value = ((torch.ones(2, 3), 5), {"b": torch.ones(1), "a": [torch.zeros(4, dtype=torch.long)]})
    assert tensor_shapes(value) == (((2, 3), "torch.float32"), ((4,), "torch.int64"),
                                    ((1,), "torch.float32"))
