"""Expert parallelism in the search: which EP sizes a structure can run (its micro-batch shares
keep every EP group's replicas on one count: :func:`megatron_hetero.schedule.shares.fill_shares`).

An MoE model's structures carry an expert-parallel size (``Structure.ep``, expert TP 1): the
tables price its stages with the all-to-alls over the EP group's link and the experts sharded
over it (:mod:`megatron_hetero.cost.experts`), so EP is weighed together with TP, the stage
count and types, the layer split and the data-parallel shares. A larger EP holds fewer experts
per rank (less memory, so fewer recomputed layers or more micro-batches in flight) and pays
all-to-alls over a wider, and past one node slower, group.

The stage tables price a stage of ``n`` layers as ``n`` mean layers (the model's share of MoE
layers); where a model mixes MoE and dense layers, the layer split weighs each stage by its own
layers (:func:`split_scale`), and the plans it gives are simulated stage by stage at their own
mix (:attr:`~megatron_hetero.cost.stage.StageShape.moe_layers`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import models as M
from ..plan import ModelSpec

__all__ = ["expert_sizes", "split_scale"]


def expert_sizes(model: ModelSpec, tp: int, templates, microbatches: int) -> list[int]:
    """The expert-parallel sizes a structure of TP ``tp`` and these templates can run (1 for a
    dense model): divisors of ``num_experts`` whose EP groups (expert TP 1) divide the stage's
    ``tp x D`` ranks, cover whole tensor groups or fit in one, and never straddle two
    templates (each template's pipelines form whole groups), so that replicas of one EP group
    can take one micro-batch count (the search shares them by group); the ``microbatches``
    must split evenly over the groups (0: replicas alike, nothing to split). The bound is the same for every EP (the
    all-to-alls are left out of it): the search weighs them."""
    if not model.is_moe:
        return [1]
    out = []
    for ep in range(1, model.num_experts + 1):
        if model.num_experts % ep or (ep > tp and ep % tp) or (ep < tp and tp % ep):
            continue
        g = max(1, ep // tp)  # replicas per EP group
        if all(n % g == 0 for _, n in templates) and microbatches % g == 0:
            out.append(ep)
    return out


def split_scale(model: ModelSpec) -> np.ndarray | None:
    """For :func:`.split.min_max_split`: per (layers so far ``l``, a stage's layers ``n``) its
    layers' forward FLOPs over ``n`` mean layers' (MoE and dense layers by their own FLOPs);
    None where the layers are alike (a dense model, or MoE layers throughout)."""
    pattern = model.moe_layer_pattern
    if not model.is_moe or all(pattern):
        return None
    moe = M.layer_forward_flops(dataclasses.replace(model, moe_layer_freq=1), 1)
    dense = M.layer_forward_flops(M.mixed_model(model, 0, 1), 1)
    mean = M.layer_forward_flops(model, 1)
    prefix = np.concatenate([[0.0], np.cumsum([moe if x else dense for x in pattern])])
    L = model.num_layers
    ends = np.arange(L + 1)[:, None]
    sizes = np.arange(1, L + 1)[None, :]
    starts = np.clip(ends - sizes, 0, None)
    out = (prefix[ends] - prefix[starts]) / (sizes * mean)
    out[ends < sizes] = 1.0  # a stage longer than the layers so far: never read
    return out
