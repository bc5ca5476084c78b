"""Which mixture-of-experts layers graphed switches to an implementation that
graphs can capture, for every entry point that captures a model (auto,
TrainStep, optimize, capture, make_graphed_callables). transformers is
imported only when the model holds its experts layers; see
graphed.integrations.transformers_experts."""

from __future__ import annotations

from typing import Any, List

from torch import nn


def capturable_experts(model: Any) -> List[str]:
    """Selects graphed's experts implementation where ``model`` (a module, or
    anything else, which is left alone) holds transformers experts whose
    grouped GEMM would read its offsets on the host, and, for any transformers
    model, makes transformers' mask rules decide under capture as they do
    eagerly (Note [transformers' mask rules under capture]). Returns the
    notes."""
    if not isinstance(model, nn.Module):
        return []
    if type(model).__module__.startswith("transformers.") or any(
            type(m).__module__.startswith("transformers.") for m in model.children()):
        # Note [transformers' mask rules under capture]: every captured
        # transformers model, experts or not.
        from .integrations import transformers_masks

        transformers_masks.install()
    if not any(type(m).__module__.startswith("transformers.") and hasattr(m, "has_gate")
               for m in model.modules()):
        return []
    from .integrations.transformers_experts import use_graphed_experts

    return use_graphed_experts(model)
