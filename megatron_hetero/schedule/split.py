"""The uneven layer split: dynamic programming over stages that minimises the slowest stage
(the tuner's split, and live rebalancing's estimate of what re-planning would move)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["min_max_split", "whole_layers_bound"]


def min_max_split(costs: np.ndarray, total: int,
                  scale: np.ndarray | None = None) -> tuple[float, list[int]] | None:
    """Split ``total`` layers over ``p`` stages, each at least one layer, minimising the largest
    ``costs[s, n]`` (the cost of stage ``s`` holding ``n`` layers; ``inf`` where it cannot).

    ``costs`` has shape ``(p, total + 1)``; column 0 is ignored. Returns (cost, split), or None
    when no split is finite. Among ties, earlier stages get fewer layers: in 1F1B the first
    stage finishes last, so its optimizer step (and the embedding's) ends the step.

    ``scale``: where layers differ (a model that mixes MoE and dense layers), ``scale[l, n - 1]``
    multiplies the cost of a stage of ``n`` layers that ends after layer ``l`` (its layers' cost
    over ``n`` mean layers', :func:`megatron_hetero.tuner.experts.split_scale`); shape
    ``(total + 1, total)``.
    """
    p = costs.shape[0]
    if p > total:
        return None
    prev_pos, rows = _indices(total)
    # best[l]: the least slowest stage of the stages so far holding l layers; best[total + 1]
    # is inf, what a stage asked for more layers than are left reads
    best = np.full(total + 2, np.inf)
    best[0] = 0.0
    choice = np.zeros((p, total + 1), dtype=np.int64)
    for s in range(p - 1):
        stage = costs[s, 1:][None, :] if scale is None else costs[s, 1:][None, :] * scale
        cand = np.maximum(best[prev_pos], stage)
        # first argmin: the fewest layers on this stage among ties, so later stages take more
        pick = cand.argmin(axis=1)
        choice[s] = pick + 1
        best[:total + 1] = cand[rows, pick]
    # the last stage: only the row of all the layers is read
    last = np.maximum(best[prev_pos[total]],
                      costs[p - 1, 1:] if scale is None else costs[p - 1, 1:] * scale[total])
    pick = int(last.argmin())
    if not np.isfinite(last[pick]):
        return None
    choice[p - 1, total] = pick + 1
    split = []
    left = total
    for s in range(p - 1, -1, -1):
        n = int(choice[s, left])
        split.append(n)
        left -= n
    assert left == 0
    return float(last[pick]), split[::-1]


def whole_layers_bound(stages: list[tuple[float, float, int]], total: int) -> float:
    """:func:`min_max_split`'s cost for linear costs, without the dynamic program: ``stages``
    lists (seconds per layer ``a``, fixed seconds ``e``, how many stages) for stages that cost
    ``a n + e`` with ``n`` layers, each at least one; the least of those costs at which they
    hold ``total`` layers (``inf`` where there are more stages than layers). Where a stage's
    true costs are at least its linear ones, a lower bound on their split's (the mesh search
    bounds candidates by it before building their stage tables).

    From the split of fractions of layers (every stage at the same cost ``T``) it steps up
    through the costs ``a n + e`` where some stage takes one more layer until the stages hold
    ``total``: at most one step per stage."""
    if sum(k for _, _, k in stages) > total:
        return float("inf")
    t = max(max(a + e for a, e, _ in stages),  # every stage one layer
            (total + sum(k * e / a for a, e, k in stages)) / sum(k / a for a, _, k in stages))
    while True:
        held, step, reached = 0, float("inf"), 0.0
        for a, e, k in stages:
            n = max(0, int((t - e) // a))
            while n > 0 and a * n + e > t:  # the float division may round up
                n -= 1
            while a * (n + 1) + e <= t:  # ... or down
                n += 1
            held += k * n
            step = min(step, a * (n + 1) + e)
            reached = max(reached, a * n + e)
        if held >= total:  # first reached at the largest of the stages' costs up to t
            return reached
        t = step


@lru_cache(maxsize=64)
def _indices(total: int) -> tuple[np.ndarray, np.ndarray]:
    """For :func:`min_max_split` of ``total`` layers: per (layers so far ``l``, layers on this
    stage ``n`` from 1) the layers left for the earlier stages, ``l - n``, or ``total + 1``
    (an infinite entry) where ``n > l``; and the rows ``0 .. total`` (both read-only)."""
    left = np.arange(total + 1)[:, None] - np.arange(1, total + 1)[None, :]
    left[left < 0] = total + 1
    rows = np.arange(total + 1)
    left.flags.writeable = False
    rows.flags.writeable = False
    return left, rows
