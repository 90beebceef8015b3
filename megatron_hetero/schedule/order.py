"""The order in which one pipeline rank runs its forwards and backwards under Megatron's 1F1B
schedules, and the activations it holds at its peak.

Non-interleaved 1F1B (``v = 1``): rank ``r`` of ``p`` runs ``min(p - r - 1, m)`` warm-up
forwards, then one forward and one backward in turn, then the remaining backwards.

Interleaved 1F1B (``v > 1`` model chunks per rank; Megatron's
``forward_backward_pipelining_with_interleaving``): the k-th forward runs entry ``k`` of a table
that takes micro-batches in groups of ``g`` (``microbatch_group_size_per_vp_stage``, by default
``p``; the last group takes what is left) and, inside a group, chunk 0 for each micro-batch of
the group, then chunk 1, and so on; the k-th backward runs entry ``k`` of the same table with
the chunk mirrored (``v - 1 - c``). Rank ``r`` runs ``(p - r - 1) * 2 + (v - 1) * g`` warm-up
forwards (at most all ``m v``), then one forward and one backward in turn, then the remaining
backwards. A larger group gives the later stages more slack in the fill and drain, at the cost
of more micro-batches in flight.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["Op", "schedule_table", "rank_order", "warmup_count", "peak_in_flight",
           "peak_activations"]

Op = tuple[int, int, int]
"""(0 forward / 1 backward, micro-batch, model chunk)."""


def schedule_table(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of the k-th forward, for k in ``0 .. m v - 1``."""
    out: list[tuple[int, int]] = []
    start = 0
    while start < m:
        stop = m if start + group >= m else start + group
        out += [(i, c) for c in range(v) for i in range(start, stop)]
        start = stop
    return out


def warmup_count(p: int, r: int, m: int, v: int = 1, group: int | None = None) -> int:
    """Forwards rank ``r`` of ``p`` runs before its first backward."""
    if v == 1:
        return min(p - r - 1, m)
    return min((p - r - 1) * 2 + (v - 1) * (p if group is None else group), m * v)


def rank_order(p: int, r: int, m: int, v: int = 1, group: int | None = None, *,
               warmup: int | None = None) -> list[Op]:
    """The ops of rank ``r`` of ``p`` for ``m`` micro-batches and ``v`` chunks, in run order;
    ``warmup``: the rank's warm-up forwards where the plan sets them (default Megatron's,
    :func:`warmup_count`; with chunks, forward chunk-steps: a chain of meshes,
    :mod:`.chain`)."""
    return list(rank_order_cached(p, r, m, v, group, warmup))


@lru_cache(maxsize=4096)
def rank_order_cached(p: int, r: int, m: int, v: int = 1, group: int | None = None,
                      warmup: int | None = None) -> tuple[Op, ...]:
    """:func:`rank_order` as a tuple, computed once per shape (the search simulates many plans
    of the same shape)."""
    table = schedule_table(m, v, p if group is None else group)
    fwd = [(0, i, c) for i, c in table]
    bwd = [(1, i, v - 1 - c) for i, c in table]
    warm = warmup_count(p, r, m, v, group) if warmup is None else min(warmup, m * v)
    steady = len(fwd) - warm  # then one forward and one backward in turn
    pairs: list = [None] * (2 * steady)
    pairs[0::2] = fwd[warm:]
    pairs[1::2] = bwd[:steady]
    return tuple(fwd[:warm] + pairs + bwd[steady:])


def peak_in_flight(order: list[Op], weights: list[float]) -> float:
    """The largest sum of ``weights[chunk]`` over the forwards whose backward has not yet run
    (a forward's activations are held from its start to its backward's end)."""
    held = peak = 0.0
    for kind, _, c in order:
        if kind == 0:
            held += weights[c]
            peak = max(peak, held)
        else:
            held -= weights[c]
    return peak


def peak_activations(p: int, r: int, m: int, v: int, weights: list[float],
                     group: int | None = None, *, warmup: int | None = None) -> float:
    """:func:`peak_in_flight` of rank ``r``'s order for non-negative ``weights``, without walking
    all ``m`` micro-batches each time: the table repeats every ``g v`` entries (``g`` the group,
    ``group``, default ``p``), so the chunks held after each steady-state forward repeat too,
    and the first ``g v`` steady steps (after the warm-up, which only adds) reach every state
    the whole order reaches before its last group. When ``m`` is not a multiple of ``g`` that
    last group is shorter; a shorter order with the same remainder ends in the same way. The
    states (chunks held per chunk index) are cached per shape. ``warmup``: the rank's warm-up
    forwards where the plan sets them (a chain of meshes: more warm-up, more chunks in flight),
    as :func:`rank_order` takes it."""
    g = p if group is None else group
    warm = warmup_count(p, r, 10**9, v, g) if warmup is None else warmup
    enough = g * -(-(warm + g * v + 1) // (g * v))
    if m % g == 0:
        m = min(m, enough)
    else:  # a last group of m % g: the same steady states, then the same last group and drain
        m = min(m, enough + g + m % g)
    return _peak(p, r, m, v, g, tuple(weights), warmup)


@lru_cache(maxsize=65536)
def _peak(p: int, r: int, m: int, v: int, g: int, weights: tuple[float, ...],
          warmup: int | None = None) -> float:
    """:func:`peak_activations` once its ``m`` is cut to the orders that reach every state
    (cached: stages of many pipelines and batches share it)."""
    return float((_held_states(p, r, m, v, g, warmup) @ np.asarray(weights, dtype=float)).max())


@lru_cache(maxsize=8192)
def _held_states(p: int, r: int, m: int, v: int, g: int,
                 warmup: int | None = None) -> np.ndarray:
    """The chunk counts held after each forward of rank ``r``'s order (warm-up ``warmup``,
    default Megatron's), keeping only those no
    other state holds at least as much of in every chunk (the candidates for a peak), one row
    per state."""
    # rank_order's forwards by chunk: the table's chunks (each group of g micro-batches runs
    # chunk 0, then chunk 1, ...), the backwards' mirrored; forward f runs once the warm-up's
    # forwards and, past it, the first f - warm backwards have
    full, left = divmod(m, g)
    chunks = np.concatenate((np.tile(np.repeat(np.arange(v), g), full),
                             np.repeat(np.arange(v), left)))
    eye = np.eye(v, dtype=np.int64)
    forwards = np.cumsum(eye[chunks], axis=0)  # [f]: per chunk, forwards up to f
    backwards = np.cumsum(eye[v - 1 - chunks], axis=0)
    warm = warmup_count(p, r, m, v, g) if warmup is None else min(warmup, m * v)
    held = forwards.copy()
    held[warm + 1:] -= backwards[:max(0, len(chunks) - warm - 1)]
    # in order of the most held first (then by the counts); kept: those no other state covers
    # (at least as much in every chunk), each compared with every other at once
    held = held[np.lexsort(held.T[::-1])]  # by the counts, chunk 0 first
    states = held[np.concatenate(([True], (held[1:] != held[:-1]).any(axis=1)))]
    states = states[np.argsort(-states.sum(axis=1), kind="stable")]
    n = len(states)
    covered = np.zeros(n, dtype=bool)
    rows = max(1, (1 << 22) // max(1, n * v))  # compared at once (at most 4M entries)
    for low in range(0, n, rows):
        part = states[low:low + rows]
        ge = (states[:, None, :] >= part[None, :, :]).all(axis=2)  # [other, state]
        ge[np.arange(low, low + len(part)), np.arange(len(part))] = False  # not itself
        covered[low:low + len(part)] = ge.any(axis=0)
    out = states[~covered].astype(float)
    out.flags.writeable = False  # cached and shared
    return out
