"""Micro-batch shares of uneven data parallelism: exact min-max integer assignment (the
tuner's split of a global batch among replicas, and the runtime's when it rebalances live)."""

from __future__ import annotations

import heapq
import math

__all__ = ["water_fill", "fill_shares"]


def water_fill(fixed: list[float], per_item: list[float], total: int, *, minimum: int = 1) -> list[int] | None:
    """Give pipeline ``d`` ``m_d >= minimum`` micro-batches, summing to ``total``, minimising
    ``max_d fixed[d] + m_d * per_item[d]`` (per_item > 0). Greedy filling of the currently
    cheapest next item is exact for costs linear and increasing in ``m``; a continuous
    estimate places most items first so the greedy part is short. None when ``total`` is too small.
    """
    D = len(fixed)
    if total < minimum * D:
        return None
    inv = sum(1.0 / c for c in per_item)
    level = (total + sum(a / c for a, c in zip(fixed, per_item))) / inv
    m = [max(minimum, int(math.floor((level - a) / c))) for a, c in zip(fixed, per_item)]
    # never overshoot: remove from the currently most loaded until within total
    while sum(m) > total:
        d = max((i for i in range(D) if m[i] > minimum),
                key=lambda i: (fixed[i] + m[i] * per_item[i], -i))
        m[d] -= 1
    heap = [(fixed[d] + (m[d] + 1) * per_item[d], d) for d in range(D)]
    heapq.heapify(heap)
    for _ in range(total - sum(m)):
        _, d = heapq.heappop(heap)
        m[d] += 1
        heapq.heappush(heap, (fixed[d] + (m[d] + 1) * per_item[d], d))
    return m


def fill_shares(fixed: list[float], per: list[float], total: int, *, unit: int = 1,
                alike: int = 1) -> list[int] | None:
    """:func:`water_fill` of ``total`` micro-batches under a plan's rules: in whole ``unit``s
    (an interleaved pipeline's micro-batch group) and with every run of ``alike`` consecutive
    pipelines (one expert-parallel group's replicas, whose all-to-alls pair up) taking one
    count, filled over the runs with their first pipeline's costs. None where ``total`` does
    not divide into such shares."""
    if total % (unit * alike):
        return None
    got = water_fill(fixed[::alike], [c * unit for c in per[::alike]], total // (unit * alike))
    return None if got is None else [k * unit for k in got for _ in range(alike)]
