"""Per-stage memory policies as megatron-core ``TransformerConfig`` keyword arguments."""

from __future__ import annotations

from ..plan import Stage

__all__ = ["recompute_kwargs"]


def recompute_kwargs(stage: Stage) -> dict:
    """TransformerConfig overrides that make one stage recompute as its plan entry says."""
    r = stage.recompute
    if r.granularity == "none":
        return {"recompute_granularity": None}
    if r.granularity == "selective":
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": "full", "recompute_method": r.method,
            "recompute_num_layers": r.num_layers}
