"""Which op each op of a pipeline's interleaved order waits for, and whether the ranks' orders
complete: the rule that decides the per-stage warm-ups a chain of meshes with model chunks
takes.

The chain's own schedule (:mod:`megatron_hetero.mcore.mesh_interleaved`) runs every rank's
:func:`~.order.rank_order` with the rank's warm-up; its sends never block (each goes to a
sender thread of its own), so an op waits only for its input: the forward of (micro-batch
``i``, chunk ``c``) on stage ``s`` for that of (``i``, ``c``) on stage ``s - 1``, on stage 0
for (``i``, ``c - 1``) on the last stage (the wrap-around); a backward for that of the stage
after it, on the last stage for (``i``, ``c + 1``) on stage 0, and the last chunk's backward
on the last stage for its own forward (:func:`waits_for`; the simulator reads the same). The
orders complete exactly when every rank, running its ops in order, only ever waits for ops that
some other rank reaches: :func:`blocked_stage` walks them (each op once, ``P m v`` in all) and
names the first stage left waiting where they do not. Per-stage counts are not monotone in
this: a stage that warms up too far runs the forwards of a later chunk whose input the
wrap-around has not sent yet, since the last stage waits for its backward. So the plan's
check (:func:`check_chain_warmups`) walks the orders of the counts given, and where they
stall names the range of counts that would complete with the other stages' as given.

No torch here.
"""

from __future__ import annotations

from functools import lru_cache

from ..errors import SchemaError
from .order import rank_order_cached, warmup_count

__all__ = ["waits_for", "blocked_stage", "check_chain_warmups", "chain_warmups"]


def waits_for(p: int, v: int, s: int, kind: int, c: int) -> tuple[int, int, int] | None:
    """(stage, kind, chunk) of the op of the same micro-batch that the op ``kind`` (0 forward,
    1 backward) of chunk ``c`` on stage ``s`` of ``p`` (``v`` chunks) waits for; None: the
    model's first forward (virtual stage 0), which waits for nothing."""
    if kind == 0:
        if s > 0:
            return s - 1, 0, c
        return (p - 1, 0, c - 1) if c > 0 else None
    if s < p - 1:
        return s + 1, 1, c
    return (0, 1, c + 1) if c < v - 1 else (s, 0, c)


def chain_warmups(p: int, m: int, v: int, group: int | None, given) -> tuple[int, ...]:
    """Every stage's warm-up: ``given[s]``, else Megatron's interleaved count
    (:func:`~.order.warmup_count`)."""
    return tuple(warmup_count(p, s, m, v, group) if w is None else w for s, w in enumerate(given))


@lru_cache(maxsize=1024)
def blocked_stage(p: int, m: int, v: int, group: int | None,
                  warmups: tuple[int, ...]) -> int | None:
    """The first stage whose order stalls when stage ``s`` of ``p`` runs
    :func:`~.order.rank_order` with warm-up ``warmups[s]`` (``m`` micro-batches, ``v`` chunks,
    micro-batch group ``group``), each op waiting for :func:`waits_for`; None: every order
    completes."""
    orders = [rank_order_cached(p, s, m, v, group, warmups[s]) for s in range(p)]
    done: set[tuple[int, int, int, int]] = set()
    ptr = [0] * p
    moved = True
    while moved:
        moved = False
        for s, order in enumerate(orders):
            k = ptr[s]
            while k < len(order):
                kind, i, c = order[k]
                dep = waits_for(p, v, s, kind, c)
                if dep is not None and (dep[0], dep[1], i, dep[2]) not in done:
                    break
                done.add((s, kind, i, c))
                k += 1
            moved |= k > ptr[s]
            ptr[s] = k
    return next((s for s in range(p) if ptr[s] < len(orders[s])), None)


def check_chain_warmups(given: list, m: int, v: int, group: int | None, path,
                        replica: str) -> None:
    """Raise :class:`SchemaError` where the counts ``given`` (None: Megatron's) of a chain's
    path of ``len(given)`` stages with ``v`` chunks, ``m`` micro-batches and micro-batch group
    ``group`` fall outside ``0 .. m v`` or stall (:func:`blocked_stage`); ``path(s)`` is the
    field path of stage ``s``'s count, ``replica`` that of the path's micro-batch count's
    owner."""
    p, most = len(given), m * v
    for s, w in enumerate(given):
        if w is not None and not 0 <= w <= most:
            raise SchemaError("", path(s), w, f"0 to {most}: warm-up forwards of the stage's "
                              f"{v} chunks, at most all {m} micro-batches of {replica} "
                              "(num_microbatches) through each")
    counts = chain_warmups(p, m, v, group, given)
    stuck = blocked_stage(p, m, v, group, counts)
    if stuck is None:
        return
    named = [s for s, w in enumerate(given) if w is not None]
    for s in named:  # the first stage given a count whose own change would complete them
        fits = [w for w in range(most + 1)
                if blocked_stage(p, m, v, group, counts[:s] + (w,) + counts[s + 1:]) is None]
        if fits:
            return _stalls(path(s), given[s], stuck, fits, "with the other stages' counts as given")
    s = named[0]
    default = warmup_count(p, s, m, v, group)
    return _stalls(path(s), given[s], stuck, [default],
                   "and the other stages' counts changed to match (Megatron's default)")


def _stalls(where: str, found: int, stuck: int, fits: list[int], how: str) -> None:
    """Raise the error of a count whose orders stall at stage ``stuck``, ``fits`` the counts
    that would complete them (a range where they run without a gap)."""
    shown = (str(fits[0]) if len(fits) == 1 else f"{fits[0]} to {fits[-1]}"
             if fits[-1] - fits[0] == len(fits) - 1 else ", ".join(map(str, fits)))
    raise SchemaError("", where, found, f"{shown} {how}: with the counts given, stage {stuck} "
                      "waits for an input its neighbour never sends (each stage's forwards "
                      "wait for the stage before, its backwards for the stage after, and "
                      "stage 0's later chunks for the last stage over the wrap-around)")
