"""The uneven layer split: dynamic programming over stages that minimises the slowest stage."""

from __future__ import annotations

import numpy as np

__all__ = ["min_max_split"]


def min_max_split(costs: np.ndarray, total: int) -> tuple[float, list[int]] | None:
    """Split ``total`` layers over ``p`` stages, each at least one layer, minimising the largest
    ``costs[s, n]`` (the cost of stage ``s`` holding ``n`` layers; ``inf`` where it cannot).

    ``costs`` has shape ``(p, total + 1)``; column 0 is ignored. Returns (cost, split), or None
    when no split is finite. Among ties, earlier stages get fewer layers: in 1F1B the first
    stage finishes last, so its optimizer step (and the embedding's) ends the step.
    """
    p = costs.shape[0]
    if p > total:
        return None
    inf = np.inf
    n_idx = np.arange(1, total + 1)
    l_idx = np.arange(total + 1)
    prev_pos = l_idx[:, None] - n_idx[None, :]  # layers left for earlier stages
    valid = prev_pos >= 0
    prev_pos = np.where(valid, prev_pos, 0)
    best = np.full(total + 1, inf)
    best[0] = 0.0
    choice = np.zeros((p, total + 1), dtype=np.int64)
    for s in range(p):
        cand = np.maximum(best[prev_pos], costs[s, 1:][None, :])
        cand[~valid] = inf
        # first argmin: the fewest layers on this stage among ties, so later stages take more
        pick = cand.argmin(axis=1)
        choice[s] = pick + 1
        best = cand[np.arange(total + 1), pick]
    if not np.isfinite(best[total]):
        return None
    split = []
    left = total
    for s in range(p - 1, -1, -1):
        n = int(choice[s, left])
        split.append(n)
        left -= n
    assert left == 0
    return float(best[total]), split[::-1]
