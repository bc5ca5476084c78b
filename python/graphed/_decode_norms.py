"""graphed's three-kernel RMSNorm (Note [RMSNorm in three kernels] in
src/rms_norm_ops.cpp) in place of transformers' RMSNorm modules' forwards
while a decoder's adapter runs a decode step eagerly (its warm-ups and the
capture), so that the decode graphs record three kernels per norm instead of
six to ten. Each form is checked against the module's own forward on its
first call, to the bit.

Note [RMSNorm in every decode step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A decode step's graph replays every kernel of the step, and at decode sizes
(one token per row) a kernel of an RMSNorm runs for about a microsecond and
leaves a gap of about as much before the next. The 4-layer Mistral of
bench/hf_decode_models.py has 9 RMSNorms (2 per layer and the last): 54 of
its step's 224 kernels at b8; its Gemma 3 has 25 (6 per layer: q and k norms
and two more around each block), 7 kernels each with (1 + weight): 175 of
367. The three-kernel form computes the same bits (the mean is ATen's own
kernel on the same squares), so it is used in every decode step on a GPU,
not only state-space models', which it was written for, and in bfloat16 and
float16 as well as float32 (their casts, two to three kernels more in
transformers' forward, fold into graphed's): greedy tokens stay
transformers'. Measured in bench/hf_decode_models.py ("transformers' step
floor" is the same step with transformers' forwards; float32 at f3454c8:
Gemma 3's step floor 0.82x transformers' at b1).

A module is taken when its class computes one of the forms below, whatever
it is called: its forward (and, for Gemma's, its _norm) parses to the form's
source, docstrings and annotations aside. The forms differ where the result
is rounded to the input's dtype (before the weight's product in Llama's,
after it in gpt-oss's and Gemma's), which matters outside float32 only, so
each has its own verdict. The kernels take a weight of the input's dtype;
a float32 model run under autocast keeps transformers' forwards. transformers 5.17 has these in
LlamaRMSNorm and its copies (Mistral, Qwen2/3, Qwen3-MoE, Phi-3, Granite,
Mamba2RMSNorm, Bamba), gpt-oss's and OLMo 2's (weight * h, then the cast: the
same bits in float32), Gemma, Gemma 2 and Gemma 3's (1 + weight) and Mamba2's
gated MambaRMSNormGated."""

from __future__ import annotations

import ast
import collections
import contextlib
import functools
import inspect
import textwrap
import weakref
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from . import _C


class _Form(NamedTuple):
    """What a recognised RMSNorm computes: the verdict name of its check, the
    attribute holding its epsilon, whether it rounds the normalized value to
    the input's dtype before the weight's product (Llama's weight *
    h.to(input_dtype)) or after it, whether it scales by 1 + weight, and the
    other methods of the class whose source must match too."""
    kind: str
    epsilon: str
    round_before_weight: bool = True
    weight_plus_one: bool = False
    helpers: Tuple[Tuple[str, str], ...] = ()


_LLAMA = """
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
"""

# gpt-oss, OLMo 2: the product in float32, then the cast (nothing in float32).
_WEIGHT_THEN_CAST = """
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden_states).to(input_dtype)
"""

_GATED = """
def forward(self, hidden_states, gate=None):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)

    if gate is not None:
        hidden_states = hidden_states * nn.functional.silu(gate.to(torch.float32))
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)

    return self.weight * hidden_states.to(input_dtype)
"""

_GEMMA = """
def forward(self, x):
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)
"""

_GEMMA_NORM = """
def _norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
"""


def _function_shape(source):
    """The AST of a function's arguments and body without its docstring,
    comments and annotations (None when it does not parse as one function)."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return None
    function = tree.body[0]
    arguments = function.args
    for argument in arguments.posonlyargs + arguments.args + arguments.kwonlyargs:
        argument.annotation = None  # LlamaRMSNorm annotates, Mamba2RMSNorm does not
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None),
                                                            ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return ast.dump(function.args) + "".join(ast.dump(statement) for statement in body)


_FORMS = {
    _function_shape(_LLAMA): _Form("rms_norm", "variance_epsilon"),
    _function_shape(_WEIGHT_THEN_CAST): _Form("rms_norm_cast_last", "variance_epsilon", False),
    _function_shape(_GATED): _Form("rms_norm_gated", "variance_epsilon"),
    _function_shape(_GEMMA): _Form("rms_norm_plus_one", "eps", False, True,
                                   (("_norm", _function_shape(_GEMMA_NORM)),)),
}


def _method_shape(cls, name):
    method = getattr(cls, name, None)
    if method is None:
        return None
    try:
        return _function_shape(inspect.getsource(method))
    except (OSError, TypeError):
        return None


@functools.lru_cache(maxsize=None)
def _class_form(cls) -> Optional[_Form]:
    """The form ``cls`` computes, from its methods' source, parsed once per class."""
    form = _FORMS.get(_method_shape(cls, "forward"))
    if form is None or any(_method_shape(cls, name) != shape for name, shape in form.helpers):
        return None
    return form


def _form(module) -> Optional[_Form]:
    form = _class_form(type(module))
    if form is None or not isinstance(getattr(module, "weight", None), torch.Tensor) or \
            not isinstance(getattr(module, form.epsilon, None), float):
        return None
    return form


def rms_norm_kind(module) -> Optional[str]:
    """"rms_norm" (Llama's), "rms_norm_cast_last" (gpt-oss's), "rms_norm_gated"
    or "rms_norm_plus_one" (Gemma's) when ``module``'s class computes one of
    the forwards graphed's rms_norm reproduces (with a tensor ``weight`` and a
    float epsilon), else None."""
    form = _form(module)
    return None if form is None else form.kind


def _fused_forward(module, form: _Form, check: Callable):
    """The forward ``module`` runs while the norms are active: graphed's
    rms_norm through ``check`` (the first call compared with the class's own
    forward; one verdict per kind, the gated form's per gate given or not)."""
    original = type(module).forward
    epsilon = getattr(module, form.epsilon)

    def run(hidden_states, *gate):
        if gate and gate[0] is not None:
            name = "rms_norm_gated"
        else:  # the gated form without its gate is the plain one
            name = "rms_norm" if form.kind == "rms_norm_gated" else form.kind

        def reference(_):
            return original(module, hidden_states, *gate)

        def fused(_):
            return _C.try_rms_norm(hidden_states, gate[0] if gate else None, module.weight,
                                   epsilon, form.weight_plus_one, form.round_before_weight)

        if isinstance(hidden_states, torch.Tensor):
            out = check(name, fused, reference, hidden_states)
            if out is not None:
                return out
        return reference(None)

    if form.kind == "rms_norm_gated":
        def forward(hidden_states, gate=None):
            return run(hidden_states, gate)
    else:
        def forward(hidden_states):
            return run(hidden_states)
    return forward


_ABSENT = object()


def describe_counts(counts: Dict[str, int]) -> str:
    """'5 Mamba2RMSNorm, 4 MambaRMSNormGated': modules by class, sorted."""
    return ", ".join(f"{count} {name}" for name, count in sorted(counts.items()))


def written_forward(module) -> Tuple[tuple, dict]:
    """The names the forward of ``module``'s class looks up and its globals (the
    modeling module's, where it finds transformers' functions), from the forward
    as written: decorators (transformers wraps some) unwrapped."""
    forward = inspect.unwrap(getattr(type(module), "forward", None) or (lambda: None))
    return (getattr(getattr(forward, "__code__", None), "co_names", ()),
            getattr(forward, "__globals__", {}))


class DecodeNorms:
    """The RMSNorm modules of ``model`` that graphed's rms_norm reproduces
    (Note [RMSNorm in every decode step]); while active() is entered, their
    forwards are graphed's. ``check(name, fused, reference, hidden)`` runs one
    call: the fused function once trusted, else the first check (see
    _state_space_kernels._checked)."""

    def __init__(self, model, check: Callable):
        self._check = check
        # Weak references: decoders hold their model.
        self._norms: List[Tuple[weakref.ref, _Form]] = []
        self.counts: Dict[str, int] = collections.Counter()
        for module in model.modules():
            form = _form(module)
            if form is not None:
                self._norms.append((weakref.ref(module), form))
                self.counts[type(module).__name__] += 1

    def __bool__(self):
        return bool(self._norms)

    def describe(self) -> str:
        """'5 Mamba2RMSNorm, 4 MambaRMSNormGated': the modules taken, by class."""
        return describe_counts(self.counts)

    def clear(self):
        self._norms, self.counts = [], collections.Counter()

    @contextlib.contextmanager
    def active(self):
        """The modules' forwards shadowed by graphed's inside the block, put back
        after it (whatever the block raises)."""
        shadowed = []
        try:
            for reference, form in self._norms:
                module = reference()
                if module is None:
                    continue
                shadowed.append((module, module.__dict__.get("forward", _ABSENT)))
                module.__dict__["forward"] = _fused_forward(module, form, self._check)
            yield
        finally:
            for module, previous in reversed(shadowed):
                if previous is _ABSENT:
                    module.__dict__.pop("forward", None)
                else:
                    module.__dict__["forward"] = previous
