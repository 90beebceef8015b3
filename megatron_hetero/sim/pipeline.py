"""One pipeline under Megatron's 1F1B schedule (non-interleaved or interleaved), simulated op
by op (:func:`interleaved_1f1b`), and in bounded time for any number of micro-batches
(:func:`pipeline_run`).

Every op starts when its stage is free and the op it waits for has ended and its activations
(or gradients) have crossed the link (under Megatron's non-interleaved 1F1B a stage is free
only once its op's send has crossed too: :func:`_run`); the durations are the same for every micro-batch. Such a
schedule is a max-plus linear system: past its warm-up the ends of the ops repeat, every ``c``
micro-batches, shifted by the same time. :func:`pipeline_run` simulates one short probe of
the pipeline, reads that period off its end and moves the probe's ends on by the whole periods
a long run adds; where no period shows within :data:`PROBE_MOST` micro-batches it simulates
every op up to :data:`EXACT_MOST`, and extrapolates the last probe beyond.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

import numpy as np

from ..schedule.chain import waits_for
from ..schedule.order import rank_order_cached

__all__ = ["one_f_one_b", "interleaved_1f1b", "pipeline_run", "finish_lower_bound",
           "backward_holds", "DIRECT_MICROBATCHES", "PROBE_MOST", "EXACT_MOST"]

DIRECT_MICROBATCHES = 256
"""Pipelines of up to this many micro-batches are simulated op by op (:func:`pipeline_run`)."""

PROBE_MOST = 16384
"""The longest probe of the steady state, in micro-batches (:func:`_steady_state_run`)."""

EXACT_MOST = 2 * PROBE_MOST
"""A pipeline whose steady state shows no period within :data:`PROBE_MOST` micro-batches is
simulated op by op up to this many micro-batches, and extrapolated from its probe beyond."""

_TOLERANCE = 1e-9
"""Relative agreement asked of the repeats of the steady state."""


def pipeline_run(fwd: list[list[float]], bwd: list[list[float]], send_f: list[float],
                 send_b: list[float], m: int, *, record: bool = False,
                 group: int | None = None, warmups: tuple[int, ...] | None = None,
                 limits: list[float] | None = None):
    """What :func:`interleaved_1f1b` returns, in time that does not grow with ``m``: a run of
    more than :data:`DIRECT_MICROBATCHES` micro-batches (without ``record``: its events would
    be as many) is extrapolated from its steady state (:func:`_steady_state_run`) when that
    repeats within a short probe, else simulated op by op. Runs are cached by their inputs
    (:data:`_RUNS`); the lists returned are the caller's. ``limits`` (per stage, without
    ``record``): a run op by op stops, and returns None, once some stage's finish is sure to
    reach its limit (:func:`_run`)."""
    if record:
        return interleaved_1f1b(fwd, bwd, send_f, send_b, m, record=record, group=group,
                                warmups=warmups)
    key = (tuple(map(tuple, fwd)), tuple(map(tuple, bwd)), tuple(send_f), tuple(send_b), m,
           group, None if warmups is None else tuple(warmups))
    got = _RUNS.get(key)
    if got is None and limits is not None and m <= DIRECT_MICROBATCHES:
        run = _run(fwd, bwd, send_f, send_b, m, group=group, record=False, warmups=warmups,
                   limits=limits)
        if run is None:
            return None
        got = (run[0], run[1], run[2], [])
        if len(_RUNS) >= _RUNS_MOST:
            _RUNS.clear()
        _RUNS[key] = got
    if got is None:
        if len(_RUNS) >= _RUNS_MOST:
            _RUNS.clear()
        got = _RUNS[key] = _fresh_run(fwd, bwd, send_f, send_b, m, group=group, warmups=warmups)
    free, busy, last_b, _ = got
    return list(free), list(busy), [list(row) for row in last_b], []


_RUNS: dict[tuple, tuple] = {}
"""Runs by their durations, sends, length and order: the search simulates plans that share
most of their pipelines (a local-search move changes one or two), and a run is a pure function
of these."""

_RUNS_MOST = 4096
"""Runs :data:`_RUNS` holds before it starts again (each is a few lists of ``p`` numbers)."""


def _fresh_run(fwd, bwd, send_f, send_b, m: int, *, group: int | None,
               warmups: tuple[int, ...] | None):
    if m > DIRECT_MICROBATCHES:
        got = _steady_state_run(fwd, bwd, send_f, send_b, m, group=group, warmups=warmups)
        if got is not None:
            return got
    return interleaved_1f1b(fwd, bwd, send_f, send_b, m, group=group, warmups=warmups)


def _steady_state_run(fwd, bwd, send_f, send_b, m: int, *, group: int | None,
                      warmups: tuple[int, ...] | None):
    """:func:`interleaved_1f1b`'s answer for ``m`` micro-batches from one probe of its steady
    state, or None when no probe up to :data:`PROBE_MOST` micro-batches shows a period and
    ``m`` is short enough (:data:`EXACT_MOST`) to simulate op by op.

    The order repeats every ``q`` micro-batches (1; interleaved, the micro-batch group), and an
    op waits only on ops of micro-batches less than ``tail`` away. A probe of ``n``
    micro-batches, ``n`` congruent to ``m`` modulo ``q``, gives the end of every op; its period
    ``c`` is the least multiple of ``q`` (up to ``q * p``) such that every op of the
    ``c + tail`` micro-batches before the drain ends the same time after the same op ``c``
    micro-batches earlier. Each later op then waits on ops that repeat, so the run of ``m``
    micro-batches is the probe's with ``(m - n) / c`` such times added (``n`` made congruent to
    ``m`` modulo ``c`` first: one more run where ``c`` is not ``q``). Where the probe shows no
    period (a transient can outlast the warm-up by hundreds of micro-batches where two stages'
    paces are close) the next one is twice as long. Beyond :data:`EXACT_MOST` micro-batches a
    run whose last probe shows no period is moved on by that probe's last ``q * p``
    micro-batches (its error is then that of a transient longer than the probe)."""
    p, v = len(fwd), len(fwd[0])
    q = 1 if v == 1 else (p if group is None else group)
    tail = p + q + max(warmups or (0,))  # micro-batches an op's wait may reach
    probe, ran = 6 * tail + 2 * q, 0  # the common transient settles within the first probe
    run = None  # each longer probe resumes from the one before (_run's since)
    while True:
        probe += (m - probe) % q  # the same remainder modulo q as m
        if m < 2 * probe or probe > PROBE_MOST:
            if m <= EXACT_MOST or ran < 3 * tail + 2 * q * p:
                return None
            probe, period = ran, q * p  # too long to simulate: the last probe's last periods
            break
        ran = probe
        run = _run(fwd, bwd, send_f, send_b, probe, group=group, record=False,
                   warmups=warmups, since=run)
        first = max(0, probe - 2 * tail - 2 * q * p)
        ends = _ends(run, probe, p, v, first=first, group=group, warmups=warmups)
        period = _period(ends, first=first, stop=probe - tail, step=q, longest=q * p,
                         reach=tail)
        if period is not None:
            break
        probe *= 2
    last = probe - tail - 1 - first
    shifts = ends[last] - ends[last - period]
    n = probe + (m - probe) % period
    if n != probe:
        run = _run(fwd, bwd, send_f, send_b, n, group=group, record=False, warmups=warmups,
                   since=run)
    periods = (m - n) // period
    shift = float(shifts.max())
    free = [x + periods * shift for x in run[0]]
    last_b = [[x + periods * shift for x in row] for row in run[2]]
    busy = [m * sum(list(f) + list(b)) for f, b in zip(fwd, bwd)]  # as _run sums
    return free, busy, last_b, []


def _ends(run, n: int, p: int, v: int, *, first: int, group: int | None,
          warmups: tuple[int, ...] | None) -> np.ndarray:
    """Per micro-batch of a run of ``n`` from ``first`` on (a row), the end of each of its ops,
    by stage, kind and chunk."""
    where = _compiled_order(p, n, v, group, None if warmups is None else tuple(warmups))[1][first:]
    low, end = int(where.min()), run[3]
    # fromiter with a count: no copy of the list, no guessing of its type
    return np.fromiter(itertools.islice(end, low, None), float, len(end) - low)[where - low]


def _period(ends: np.ndarray, *, first: int, stop: int, step: int, longest: int,
            reach: int) -> int | None:
    """The least multiple ``c`` of ``step`` up to ``longest`` such that every op of the
    ``c + reach`` micro-batches before ``stop`` ends one common time after the same op ``c``
    micro-batches earlier, within :data:`_TOLERANCE` of its end (None: no such ``c`` fits in
    ``ends``, micro-batches ``first`` on, past ``reach``)."""
    for c in range(step, longest + 1, step):
        low = stop - 2 * c - reach
        if low < reach:
            return None
        shift = ends[stop - 1 - first, 0] - ends[stop - 1 - c - first, 0]
        later = ends[low + c - first:stop - first]
        if (np.abs((later - ends[low - first:stop - c - first]) - shift)
                <= _TOLERANCE * np.maximum(np.abs(later), 1e-30)).all():
            return c
    return None


def one_f_one_b(fwd: list[float], bwd: list[float], send_f: list[float], send_b: list[float],
                m: int, *, record: bool = False):
    """Simulate one pipeline. ``send_f[s]``/``send_b[s]``: seconds over the link between stage
    ``s`` and ``s + 1``. Returns (finish, busy, last_backward_start, events) per stage, where
    events is a list of (stage, kind, microbatch, start, end) when ``record``: the interleaved
    schedule's simulation with one model chunk per stage (its order is then plain 1F1B)."""
    free, busy, last_b, events = interleaved_1f1b([[f] for f in fwd], [[b] for b in bwd],
                                                  send_f, send_b, m, record=record)
    return free, busy, [x[0] for x in last_b], [e[:5] for e in events]


@lru_cache(maxsize=256)
def _compiled_order(p: int, m: int, v: int, group: int | None = None,
                    warmups: tuple[int, ...] | None = None):
    """Every op of a ``p``-stage pipeline of ``m`` micro-batches and ``v`` chunks (micro-batch
    group ``group``, default ``p``: :func:`.cost.schedule.rank_order`) in one order
    that respects each rank's run order and every cross-stage dependency (a topological
    order, which does not depend on the durations), as the simulation's loop reads them: per
    op its stage, its duration's index in the stages' durations laid end to end (``stage * 2
    * v + kind * v + chunk``), one more than the index of the op it waits for (0: none) and the
    index of the link that dependency crosses in ``send_f + send_b + [0.0]``, each of ``p``
    links (``2 * p``: none); per micro-batch (a row) and op by stage, kind and chunk (``stage
    * 2 * v + kind * v + chunk``) the op's index in that order (read-only: :func:`_ends`); and
    per (stage, chunk) the index of its last backward. The simulation is then one pass over
    these ops."""
    ranks = [rank_order_cached(p, s, m, v, group, None if warmups is None else warmups[s])
             for s in range(p)]
    vm, none = v * m, 2 * p
    tables = []  # per stage, by kind * v + chunk: (the op it waits for, less its micro-batch
    for s in range(p):  # (-1: none); the link that crosses; the op, less its micro-batch; slot)
        row = []
        for kind in (0, 1):
            for c in range(v):
                waited = waits_for(p, v, s, kind, c)
                if waited is None:
                    dep, link = -1, none
                else:  # the link it crosses: forwards from the stage before (the wrap-around
                    ws, wk, wc = waited  # link p - 1), backwards from the stage after; none
                    dep = ws * 2 * vm + wk * vm + wc * m  # from its own forward
                    link = none if kind > wk else ws if kind == 0 else p + s
                row.append((dep, link, s * 2 * vm + kind * vm + c * m, (2 * s + kind) * v + c))
        tables.append(row)
    where = [0] * (2 * p * vm)  # op (stage, kind, chunk, micro-batch) -> its position + 1
    ops: list[tuple[int, int, int, int]] = []
    append = ops.append
    ptr = [0] * p
    remaining = sum(len(o) for o in ranks)
    while remaining:
        progressed = False
        for s in range(p):
            seq, k, row = ranks[s], ptr[s], tables[s]
            n = len(seq)
            while k < n:
                kind, i, c = seq[k]
                dep, link, own, slot = row[kind * v + c]
                if dep < 0:
                    dep = 0
                else:
                    dep = where[dep + i]
                    if not dep:
                        break
                append((s, slot, dep, link))
                where[own + i] = len(ops)
                k += 1
            if k > ptr[s]:
                remaining -= k - ptr[s]
                ptr[s], progressed = k, True
        assert progressed, "1F1B schedule deadlocked"
    last_b = tuple(tuple(where[s * 2 * vm + vm + c * m + m - 1] - 1 for c in range(v))
                   for s in range(p))
    # op (stage, kind, chunk, micro-batch i) is entry slot * m + i of where
    at = (np.array(where) - 1).reshape(2 * p * v, m).T
    at.flags.writeable = False
    return tuple(ops), at, last_b


def interleaved_1f1b(fwd: list[list[float]], bwd: list[list[float]], send_f: list[float],
                     send_b: list[float], m: int, *, record: bool = False,
                     group: int | None = None, warmups: tuple[int, ...] | None = None):
    """Simulate one pipeline under the interleaved schedule. ``fwd[s][c]``/``bwd[s][c]``: seconds
    of chunk ``c`` on stage ``s``; ``send_f[s]``/``send_b[s]``: seconds over the link between
    stage ``s`` and ``s + 1``, index ``p - 1`` the link from the last stage back to the first.
    ``group``: micro-batches per chunk in a row (Megatron's default ``p`` when None).
    Returns what :func:`one_f_one_b` returns, except that the last backward's start is per
    stage and chunk; events are (stage, kind, microbatch, start, end, chunk). ``warmups``:
    each stage's warm-up forwards where the plan sets them (non-interleaved; default
    Megatron's)."""
    free, busy, last_b_start, end, start, columns, _ = _run(fwd, bwd, send_f, send_b, m,
                                                           group=group, record=record,
                                                           warmups=warmups)
    events: list[tuple] = []
    if record:
        ops, at = columns  # each op's micro-batch: the row it is at
        mb_of = np.empty(len(ops), dtype=np.int64)
        mb_of[at] = np.arange(m)[:, None]
        mb_of = mb_of.tolist()
        v = len(fwd[0])
        events = [(s, "FB"[i % (2 * v) >= v], mb, start[k], end[k], i % v)
                  for k, ((s, i, _, _), mb) in enumerate(zip(ops, mb_of))]
    return free, busy, last_b_start, events


def _run(fwd, bwd, send_f, send_b, m: int, *, group: int | None, record: bool,
         warmups: tuple[int, ...] | None = None, since: tuple | None = None,
         limits: list[float] | None = None):
    """One pass over the compiled order: (finish, busy and last backwards' starts per stage,
    every op's end, every op's start when ``record``, the order's ops and their micro-batches,
    what a longer run resumes from).

    ``limits`` (not with ``record``): None as soon as, after some stride of ops, a stage is
    sure to finish at or past its limit: stage ``s`` finishes no sooner than its free time
    plus the hold of its ops still to run (they run after it, one at a time), and stage
    ``t < s`` no sooner than that plus the drain from ``s`` to ``t`` (:func:`_drains`).

    Megatron's non-interleaved 1F1B (``v = 1``, ``warmups`` None) waits for each send before
    its next op (``send_forward`` and the batched send-and-receive wait on their requests, and
    an NCCL send ends on delivery): a stage is held after a forward until it has crossed the
    next link, and after a backward until it has crossed the previous one. The interleaved
    schedule (Megatron overlaps its p2p there) and the per-stage warm-up schedule
    (:mod:`megatron_hetero.mcore.warmup_schedule` waits for a send only when it needs the
    buffer) go on computing.

    Each op starts at ``max(free[stage], end[waited] + link)`` (an op that waits for none
    waits for an end of minus infinity, a dependency over no link adds 0.0: the same sums).
    ``since``: an earlier run of the same durations (not recorded) whose order begins with the
    same ops: this one takes their ends and the stages' free times from it, up to the last of
    its copies of those (every :data:`_STRIDE` ops) within the ops both share. Every op's end
    depends only on the ops before it, so the figures are those of a run from the start."""
    p, v = len(fwd), len(fwd[0])
    key = (p, m, v, group, None if warmups is None else tuple(warmups))
    ops, at, last_b = _compiled_order(*key)
    durs = [list(f) + list(b) for f, b in zip(fwd, bwd)]
    held = _held(fwd, bwd, send_f, send_b, warmups) or durs  # how long an op keeps its stage
    dur = [x for row in durs for x in row]
    hold = [x for row in held for x in row]
    link = [*send_f[:p], *[0.0] * (p - len(send_f)), *send_b[:p], *[0.0] * (p - len(send_b)), 0.0]
    end = [-math.inf]  # end[k + 1]: op k's end; end[0]: that of no op
    free = [0.0] * p
    start: list[float] | None = None
    resume = None
    stops = None if limits is None else _stops(key, ops, held, durs, bwd, send_b, limits)
    if record:
        start = []
        for s, i, d, lk in ops:
            t = free[s]
            ready = end[d] + link[lk]
            if ready > t:
                t = ready
            start.append(t)
            end.append(t + dur[i])
            free[s] = t + hold[i]
    else:
        done, kept = 0, []
        if since is not None:  # whole strides of ops both orders share
            done = _shared_ops(since[6][0], key) // _STRIDE
            kept = since[6][1][:done]
            if done:
                end += since[3][:done * _STRIDE]
                free = list(kept[-1])
        append = end.append
        for low in range(done * _STRIDE, len(ops), _STRIDE):
            if held is durs:  # the stage is free when its op ends: one sum for both
                for s, i, d, lk in ops[low:low + _STRIDE]:
                    t = free[s]
                    ready = end[d] + link[lk]
                    if ready > t:
                        t = ready
                    free[s] = t = t + dur[i]
                    append(t)
            else:
                for s, i, d, lk in ops[low:low + _STRIDE]:
                    t = free[s]
                    ready = end[d] + link[lk]
                    if ready > t:
                        t = ready
                    append(t + dur[i])
                    free[s] = t + hold[i]
            kept.append(tuple(free))
            if stops is not None:
                need, left = stops
                row = left[low // _STRIDE]
                if any(f + r >= n for f, r, n in zip(free, row, need)):
                    return None
        resume = (key, kept)
    del end[0]
    busy = [m * sum(row) for row in durs]
    last_b_start = [[end[k] - durs[s][v + c] for c, k in enumerate(last_b[s])] for s in range(p)]
    return free, busy, last_b_start, end, start, (ops, at), resume


def _held(fwd, bwd, send_f, send_b, warmups) -> list[list[float]] | None:
    """How long a forward and a backward keep their stage where Megatron's non-interleaved
    1F1B holds it until the op's send has crossed (:func:`_run`), per stage; None where a stage
    is free when its op ends."""
    if len(fwd[0]) > 1 or warmups is not None:
        return None
    p = len(fwd)
    return [[f[0] + (send_f[s] if s < p - 1 else 0.0), b[0] + (send_b[s - 1] if s else 0.0)]
            for s, (f, b) in enumerate(zip(fwd, bwd))]


def backward_holds(fwd, bwd, send_f, send_b, warmups) -> list[list[float]]:
    """Per stage and chunk, how long a backward keeps its stage (:func:`_held`)."""
    held = _held(fwd, bwd, send_f, send_b, warmups)
    return [list(b) for b in bwd] if held is None else [[h[1]] for h in held]


def finish_lower_bound(fwd, bwd, send_f, send_b, m: int, *,
                       warmups: tuple[int, ...] | None = None) -> list[float]:
    """A lower bound of each stage's finish (the free times :func:`pipeline_run` returns) that
    holds under every order of the ops, found in ``O(p^2 v)`` without simulating:

    * stage ``s`` starts no op before micro-batch 0's forward of chunk 0 has run on stages
      ``0 .. s - 1`` and crossed their links (any op of stage ``s`` waits, through a chain of
      forwards, on that of some micro-batch), and then runs its ``m`` forwards and backwards of
      every chunk one after another, each holding the stage for its held time (:func:`_held`);
    * a stage's last op is a backward (every forward's backward runs on its stage after it), of
      some chunk ``c``; the backward of that micro-batch and chunk then runs on every earlier
      stage in turn, each after crossing its link, so stage ``t < s`` finishes no sooner than
      stage ``s``'s last op ends plus those backwards and sends (the least over ``c``).

    Each op starts no sooner than its stage is free and its dependency's end plus the link, as
    in :func:`_run`, so the simulated finish is never below these sums."""
    p = len(fwd)
    durs = [list(f) + list(b) for f, b in zip(fwd, bwd)]
    held = _held(fwd, bwd, send_f, send_b, warmups) or durs
    bound, head = [], 0.0
    for s in range(p):
        bound.append(head + m * sum(held[s]))
        if s < p - 1:
            head += fwd[s][0] + send_f[s]
    drain = _drains(held, durs, bwd, send_b)
    for s in range(p - 1, 0, -1):
        for t in range(s):
            bound[t] = max(bound[t], bound[s] + drain[s][t])
    return bound


def _drains(held, durs, bwd, send_b) -> list[list[float]]:
    """``[s][t]`` for ``t < s``: the least time from stage ``s`` being free after its last op
    (a backward, of some chunk ``c``) to stage ``t`` finishing: that op's hold beyond its end
    taken off, the backwards of chunk ``c`` on stages ``s - 1 .. t`` and their links added
    (:func:`finish_lower_bound`)."""
    p, v = len(bwd), len(bwd[0])
    out = []
    for s in range(p):
        row, chain = [0.0] * s, [0.0] * v
        back = -max(h - d for h, d in zip(held[s], durs[s]))
        for t in range(s - 1, -1, -1):
            chain = [chain[c] + send_b[t] + bwd[t][c] for c in range(v)]
            row[t] = back + min(chain)
        out.append(row)
    return out


def _stops(key: tuple, ops, held, durs, bwd, send_b, limits):
    """For :func:`_run`'s ``limits``: per stage the free time (plus the hold still to run) at
    which some stage is sure to finish at or past its limit, and per stride of ops the hold
    each stage has left after it."""
    p = len(held)
    drain = _drains(held, durs, bwd, send_b)
    need = [min([limits[s]] + [limits[t] - drain[s][t] for t in range(s)]) for s in range(p)]
    left = _ops_left(key) * np.array(held).reshape(1, p, -1)
    return need, left.sum(axis=2).tolist()


@lru_cache(maxsize=64)
def _ops_left(key: tuple) -> np.ndarray:
    """``[k, s, i]``: the ops of stage ``s`` and kind-and-chunk ``i`` that
    :func:`_compiled_order` ``key``'s order runs after its first ``k + 1`` strides."""
    ops = _compiled_order(*key)[0]
    p, v = key[0], key[2]
    slots = np.fromiter((op[1] for op in ops), np.int64, len(ops))
    strides = -(-len(ops) // _STRIDE)
    block = np.arange(len(ops)) // _STRIDE
    done = np.bincount(block * 2 * p * v + slots, minlength=strides * 2 * p * v)
    done = np.cumsum(done.reshape(strides, 2 * p * v), axis=0)
    left = (done[-1] - done).reshape(strides, p, 2 * v).astype(float)
    left.flags.writeable = False
    return left


_STRIDE = 256
"""Ops between the copies of the stages' free times a run keeps for a longer one to resume from
(:func:`_run`'s ``since``)."""


@lru_cache(maxsize=256)
def _shared_ops(key: tuple, other: tuple) -> int:
    """How many ops the orders of :func:`_compiled_order` ``key`` and ``other`` share from
    their first (the ops before a run's drain are those of any longer run)."""
    a, b = _compiled_order(*key)[0], _compiled_order(*other)[0]
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
