"""Expert parallelism in the search: which EP sizes a structure can run, and micro-batch
shares that keep every EP group's replicas on one count.

An MoE model's structures carry an expert-parallel size (``Structure.ep``, expert TP 1): the
tables price its stages with the all-to-alls over the EP group's link and the experts sharded
over it (:mod:`megatron_hetero.cost.experts`), so EP is weighed together with TP, the stage
count and types, the layer split and the data-parallel shares. A larger EP holds fewer experts
per rank (less memory, so fewer recomputed layers or more micro-batches in flight) and pays
all-to-alls over a wider, and past one node slower, group.
"""

from __future__ import annotations

from ..plan import ModelSpec
from ..schedule.shares import water_fill

__all__ = ["expert_sizes", "shared_fill"]


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


def shared_fill(fixed: list[float], per: list[float], total: int, g: int) -> list[int] | None:
    """:func:`~megatron_hetero.schedule.shares.water_fill` of ``total`` micro-batches over the pipelines with every run
    of ``g`` consecutive pipelines (one EP group's replicas, alike: :func:`expert_sizes`)
    taking one count: filled over the groups, ``total / g`` each."""
    if g == 1:
        return water_fill(fixed, per, total)
    got = water_fill(fixed[::g], per[::g], total // g)
    return None if got is None else [k for k in got for _ in range(g)]
