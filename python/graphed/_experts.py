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
    grouped GEMM would read its offsets on the host. Returns the notes."""
    if not isinstance(model, nn.Module):
        return []
    if not any(type(m).__module__.startswith("transformers.") and hasattr(m, "has_gate")
               for m in model.modules()):
        return []
    from .integrations.transformers_experts import use_graphed_experts

    return use_graphed_experts(model)
