"""graphed's fused decode-step kernels in place of transformers' torch
reference functions for Mamba2-family layers (Mamba2, Bamba, granite-moe-hybrid,
Zamba2, NemotronH, Falcon-H1), while a decoder's adapter runs a step eagerly:
its warm-ups and the capture, so that the decode graphs record the fused
kernels (Note [Fused state-space decode steps] in src/state_space_ops.cpp).
Their RMSNorm modules run graphed's three-kernel RMSNorm in the same steps
(Note [RMSNorm in three kernels] in src/rms_norm_ops.cpp). Arguments the
kernels do not take run transformers' function."""

import ast
import contextlib
import functools
import inspect
import textwrap
import weakref

import torch

from . import _C

_SELECTIVE = "mamba2_selective_state_update"
_CONV = "causal_conv1d_update"


def torch_reference(function):
    """The torch function behind transformers' kernel-or-fallback wrapper
    (use_kernel_func_from_hub_with_fallback) when no package kernel took its
    place, else None (a package kernel, or not that wrapper)."""
    for _ in range(4):  # the wrapper, under at most a few more decorators
        code = getattr(function, "__code__", None)
        closure = getattr(function, "__closure__", None)
        if code is not None and closure:
            cells = dict(zip(code.co_freevars, closure))
            if "implementation" in cells and "torch_function" in cells:
                try:
                    implementation = cells["implementation"].cell_contents
                    reference = cells["torch_function"].cell_contents
                except ValueError:  # an empty cell
                    return None
                return reference if implementation is reference else None
        function = getattr(function, "__wrapped__", None)
        if function is None:
            return None
    return None


def _checked(name, verdicts, on_mismatch, fused, reference, state, mutates=True):
    """``fused(state)``, whose first run outside a capture is checked against
    ``reference`` on a copy of ``state`` (Note [Fused state-space decode steps]):
    equal to the bit, the fused kernel is trusted from then on; otherwise the
    state gets the reference's values, the reference's result is returned and
    ``verdicts[name]`` is False. None when the fused kernel does not take the
    arguments (nothing ran), or when it is unchecked and a capture is running.
    With ``mutates`` False neither function writes ``state`` (an input only
    telling the device), so it is neither copied nor compared."""
    if verdicts.get(name) is True:
        return fused(state)
    if state.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # unchecked: the capture records transformers' function
    reference_state = state.clone() if mutates else state
    out = fused(state)
    if out is None:
        return None
    want = reference(reference_state)
    if torch.equal(out, want) and (not mutates or torch.equal(state, reference_state)):
        verdicts[name] = True
        return out
    verdicts[name] = False
    difference = (out.double() - want.double()).abs().max().item() if \
        out.shape == want.shape else float("inf")
    if mutates:
        difference = max(difference,
                         (state.double() - reference_state.double()).abs().max().item())
        state.copy_(reference_state)
    on_mismatch(name, difference)
    return want


def _fused_selective_state_update(transformers_function, verdicts, on_mismatch):
    def mamba2_selective_state_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None,
                                      dt_softplus=False, z=None, **kwargs):
        def reference(target):
            return transformers_function(target, hidden_states, dt, A, B, C, D=D,
                                         dt_bias=dt_bias, dt_softplus=dt_softplus, z=z, **kwargs)

        def fused(target):
            return _C.try_selective_state_update(target, hidden_states, dt, A, B, C, D, dt_bias,
                                                 dt_softplus)

        if z is None and verdicts.get(_SELECTIVE) is not False:
            out = _checked(_SELECTIVE, verdicts, on_mismatch, fused, reference, state)
            if out is not None:
                return out
        return reference(state)

    return mamba2_selective_state_update


def _fused_conv1d_update(transformers_function, verdicts, on_mismatch):
    def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
        def reference(target):
            return transformers_function(hidden_states, target, weight, bias, activation)

        def fused(target):
            return _C.try_causal_conv1d_update(hidden_states, target, weight, bias,
                                               activation is not None)

        if activation in (None, "silu", "swish") and verdicts.get(_CONV) is not False:
            out = _checked(_CONV, verdicts, on_mismatch, fused, reference, conv_state)
            if out is not None:
                return out
        return reference(conv_state)

    return causal_conv1d_update


_FUSED = {_SELECTIVE: _fused_selective_state_update, _CONV: _fused_conv1d_update}

# The RMSNorm forwards graphed's rms_norm computes to the bit (transformers
# 5.17's LlamaRMSNorm and Mamba2RMSNorm, which dozens of models copy, and
# Mamba2's MambaRMSNormGated). A module is taken when its class's forward
# parses to one of these (docstrings aside), whatever its class is called.
_RMS_NORM_SOURCES = {
    "rms_norm": """
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
""",
    "rms_norm_gated": """
def forward(self, hidden_states, gate=None):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)

    if gate is not None:
        hidden_states = hidden_states * nn.functional.silu(gate.to(torch.float32))
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)

    return self.weight * hidden_states.to(input_dtype)
""",
}


def _function_shape(source):
    """The AST of a function's arguments and body without its docstring and
    annotations (None when it does not parse as one function)."""
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


_RMS_NORM_SHAPES = {_function_shape(source): kind for kind, source in _RMS_NORM_SOURCES.items()}


def rms_norm_kind(module):
    """"rms_norm" or "rms_norm_gated" when ``module``'s class computes one of
    the forwards graphed's rms_norm reproduces (with a float ``weight`` and
    ``variance_epsilon``), else None."""
    if not isinstance(getattr(module, "weight", None), torch.Tensor) or \
            not isinstance(getattr(module, "variance_epsilon", None), float):
        return None
    return _class_rms_norm_kind(type(module))


@functools.lru_cache(maxsize=None)
def _class_rms_norm_kind(cls):
    """rms_norm_kind's answer from the class's forward, parsed once per class."""
    forward = getattr(cls, "forward", None)
    if forward is None:
        return None
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return None
    return _RMS_NORM_SHAPES.get(_function_shape(source))


def _fused_rms_norm_forward(module, kind, verdicts, on_mismatch):
    """The forward ``module`` runs while a decoder's fused kernels are active:
    graphed's rms_norm, checked against the class's own forward on its first
    call (one verdict per kind, the gate given or not)."""
    original = type(module).forward

    def run(hidden_states, gate):
        name = "rms_norm_gated" if gate is not None else "rms_norm"

        def reference(_):
            return original(module, hidden_states) if kind == "rms_norm" else \
                original(module, hidden_states, gate)

        def fused(_):
            return _C.try_rms_norm(hidden_states, gate, module.weight, module.variance_epsilon)

        if isinstance(hidden_states, torch.Tensor) and verdicts.get(name) is not False:
            out = _checked(name, verdicts, on_mismatch, fused, reference, hidden_states,
                           mutates=False)
            if out is not None:
                return out
        return reference(None)

    if kind == "rms_norm":
        def forward(hidden_states):
            return run(hidden_states, None)
    else:
        def forward(hidden_states, gate=None):
            return run(hidden_states, gate)
    return forward


_ABSENT = object()


class FusedDecodeKernels:
    """The modules of `model` whose forward calls transformers' reference
    state update or convolution update, and graphed's kernels for them while
    active() is entered, each checked against transformers' function on its
    first call. `notes` (the list given, else a new one) says what was found,
    whether it applies, and any kernel whose check failed."""

    def __init__(self, model, notes=None):
        self.notes = [] if notes is None else notes
        # Per function name: None unchecked, True equal to transformers' to the
        # bit on its first call, False not (transformers' function from then on).
        self.verdicts = {}
        # (id of the forward's globals, function name) -> (those globals, fused function)
        self._swaps = {}
        # (weak reference to an RMSNorm module, its kind): Note [RMSNorm in three
        # kernels]. Weak, as decoders hold their model.
        self._norms = []
        layers = {}
        for module in model.modules():
            # The forward as written (transformers decorates Mamba2Mixer's), whose
            # globals are the modeling module's, where it looks the functions up.
            forward = inspect.unwrap(getattr(type(module), "forward", None) or (lambda: None))
            names = getattr(getattr(forward, "__code__", None), "co_names", ())
            namespace = getattr(forward, "__globals__", {})
            for name, fuse in _FUSED.items():
                original = namespace.get(name)
                if name in names and torch_reference(original) is not None:
                    self._swaps.setdefault((id(namespace), name), (
                        namespace, fuse(original, self.verdicts, self._mismatch)))
                    layers.setdefault(type(module).__name__, set()).add(id(module))
        if not self._swaps:
            return
        norms = {}
        for module in model.modules():
            kind = rms_norm_kind(module)
            if kind is not None:
                self._norms.append((weakref.ref(module), kind))
                norms[type(module).__name__] = norms.get(type(module).__name__, 0) + 1
        found = ", ".join(f"{len(ids)} {kind}" for kind, ids in sorted(layers.items()))
        dtype = getattr(model, "dtype", None)
        on_gpu = any(p.is_cuda for p in model.parameters())
        if dtype != torch.float32 or not on_gpu:
            self._swaps = {}
            self._norms = []
            self.notes.append(
                f"the decode steps of {found} keep transformers' torch reference functions: "
                f"graphed's fused state-space kernels take float32 on a GPU, the model is "
                f"{dtype} on {'the GPU' if on_gpu else 'the CPU'} (Note [Fused state-space "
                f"decode steps])")
            return
        self.notes.append(
            f"the decode steps of {found} run graphed's fused selective state update and "
            f"convolution update (3 and 1 kernels) in place of transformers' torch reference "
            f"functions (14 and 4), bitwise their results (Note [Fused state-space decode "
            f"steps])")
        if norms:
            listed = ", ".join(f"{count} {name}" for name, count in sorted(norms.items()))
            self.notes.append(
                f"the RMSNorms of those steps ({listed}) run graphed's rms_norm, 3 kernels in "
                f"place of 6 (8 gated), bitwise their forwards (Note [RMSNorm in three "
                f"kernels])")

    def _mismatch(self, name, difference):
        self.notes.append(
            f"graphed's fused {name} differed from transformers' on its first call (largest "
            f"difference {difference:.3g}), so the decode steps keep transformers' function for "
            f"it (Note [Fused state-space decode steps])")

    @contextlib.contextmanager
    def active(self):
        """transformers' two functions replaced by graphed's inside the block,
        restored after it (whatever the block raises)."""
        saved = []
        shadowed = []
        try:
            for (_, name), (namespace, fused) in self._swaps.items():
                saved.append((namespace, name, namespace[name]))
                namespace[name] = fused
            for reference, kind in self._norms:
                module = reference()
                if module is None:
                    continue
                shadowed.append((module, module.__dict__.get("forward", _ABSENT)))
                module.__dict__["forward"] = _fused_rms_norm_forward(
                    module, kind, self.verdicts, self._mismatch)
            yield
        finally:
            for module, previous in reversed(shadowed):
                if previous is _ABSENT:
                    module.__dict__.pop("forward", None)
                else:
                    module.__dict__["forward"] = previous
            for namespace, name, original in reversed(saved):
                namespace[name] = original
