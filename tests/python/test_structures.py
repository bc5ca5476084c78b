"""Python containers of other types (named tuples, OrderedDict, transformers'
ModelOutput) keep their type and expose their tensors on the way through the
core (Note [Structured Python containers]); host objects holding tensors or
caches are named (Note [Host objects holding tensors])."""

import collections

import pytest
import torch

import graphed
from graphed import _C

Pair = collections.namedtuple("Pair", "first second")


def test_named_tuples_and_ordered_dicts_keep_their_type_and_tensors():
    value = {"pair": Pair(torch.ones(2), 3), "ordered": collections.OrderedDict(a=torch.zeros(1))}
    got = _C._convert(value)
    assert type(got["pair"]) is Pair and got["pair"].second == 3
    assert got["pair"].first is value["pair"].first
    assert type(got["ordered"]) is collections.OrderedDict
    assert list(got["ordered"]) == ["a"]


def test_plain_containers_are_unchanged():
    value = ([torch.ones(1)], (1, 2.0, "x"), {"k": None})
    got = _C._convert(value)
    assert got == value or (got[1] == value[1] and got[2] == value[2])
    assert type(got[0]) is list and type(got[1]) is tuple and type(got[2]) is dict


def test_transformers_model_outputs_keep_their_type():
    outputs = pytest.importorskip("transformers.modeling_outputs")
    value = outputs.CausalLMOutputWithPast(loss=torch.ones(()), logits=torch.zeros(2, 3))
    got = _C._convert(value)
    assert type(got) is outputs.CausalLMOutputWithPast
    assert got.loss is value.loss and got.logits is value.logits
    assert got.past_key_values is None


def test_equal_structures_are_one_object_so_signatures_match():
    a = _C._convert((Pair(torch.ones(1), 1),))
    b = _C._convert((Pair(torch.ones(1), 1),))
    assert type(a[0]) is type(b[0]) is Pair


class _Holder:
    def __init__(self, tensor):
        self.layers = [{"keys": tensor}]


def test_host_objects_holding_tensors_are_named():
    assert _C.stateful_host_object((torch.ones(1), None, 3), {"mask": None}) is None
    where = _C.stateful_host_object((torch.ones(1),), {"cache": _Holder(torch.ones(2))})
    assert where.startswith("kwargs['cache']"), where
    # Modules hold parameters a graph reads by address: not state it must refuse.
    assert _C.stateful_host_object((torch.nn.Linear(2, 2),), {}) is None


def test_an_empty_transformers_cache_is_named_too():
    cache_utils = pytest.importorskip("transformers.cache_utils")
    where = _C.stateful_host_object((torch.ones(1), cache_utils.DynamicCache()), {})
    assert where is not None and where.startswith("args[1]"), where
