"""The rule for per-stage warm-ups on a chain of meshes with model chunks
(megatron_hetero/schedule/chain.py): the counts a plan may give are those whose per-rank
interleaved orders complete when each op waits only for its input (the chain's own schedule,
whose sends never block). Checked against a dependency graph built here from the schedule's
description (Kahn's algorithm: a cycle is a deadlock) and against the simulator: every count
vector it accepts completes in both, every one it refuses breaks the stated bounds or
deadlocks in both, and the counts an error names complete (tier 1)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from megatron_hetero.errors import SchemaError
from megatron_hetero.schedule.chain import blocked_stage, chain_warmups, check_chain_warmups
from megatron_hetero.schedule.order import rank_order, warmup_count
from megatron_hetero.sim.pipeline import interleaved_1f1b


def _completes(p: int, m: int, v: int, group, warmups) -> bool:
    """Whether the ranks' orders have no cycle with their inputs: an op of stage ``s`` needs
    the op before it on its rank; a forward of (i, c) the forward of (i, c) on ``s - 1`` (stage
    0: of (i, c - 1) on the last stage); a backward of (i, c) its own forward and the backward
    of (i, c) on ``s + 1`` (the last stage: of (i, c + 1) on stage 0)."""
    orders = [rank_order(p, s, m, v, group, warmup=warmups[s]) for s in range(p)]
    needs: dict = {}
    for s, order in enumerate(orders):
        for k, (kind, i, c) in enumerate(order):
            deps = [(s, *order[k - 1])] if k else []
            if kind == 0 and s > 0:
                deps.append((s - 1, 0, i, c))
            elif kind == 0 and c > 0:
                deps.append((p - 1, 0, i, c - 1))
            elif kind == 1:
                deps.append((s, 0, i, c))
                if s < p - 1:
                    deps.append((s + 1, 1, i, c))
                elif c < v - 1:
                    deps.append((0, 1, i, c + 1))
            needs[(s, kind, i, c)] = deps
    waiting = {op: len(d) for op, d in needs.items()}
    users: dict = {}
    for op, deps in needs.items():
        for d in deps:
            users.setdefault(d, []).append(op)
    ready = [op for op, n in waiting.items() if n == 0]
    seen = 0
    while ready:
        op = ready.pop()
        seen += 1
        for u in users.get(op, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    return seen == len(needs)


def _simulates(p: int, m: int, v: int, group, warmups) -> bool:
    """Whether the simulator's step of these orders completes (with positive times)."""
    try:
        free, _, _, _ = interleaved_1f1b([[1.0] * v] * p, [[2.0] * v] * p, [0.1] * p,
                                         [0.1] * p, m, group=group, warmups=tuple(warmups))
    except AssertionError:  # its walk found no op to run: a deadlock
        return False
    return all(t > 0 for t in free)


@st.composite
def _chains(draw):
    p = draw(st.integers(2, 4))
    v = draw(st.integers(2, 3))
    m = draw(st.integers(1, 3)) * p
    group = draw(st.sampled_from([None, *range(p, m + 1)]))
    given = [draw(st.one_of(st.none(), st.integers(-1, m * v + 1))) for _ in range(p)]
    return p, m, v, group, given


@settings(max_examples=150, deadline=None)
@given(_chains())
def test_accepted_counts_complete_and_refused_ones_deadlock_or_break_the_bounds(chain):
    p, m, v, group, given = chain
    try:
        check_chain_warmups(given, m, v, group, lambda s: f"stages[{s}]", "replica")
    except SchemaError as err:
        s = int(err.path[len("stages["):-1])
        assert given[s] is not None and err.found == given[s]  # a count the plan gave
        if any(w is not None and not 0 <= w <= m * v for w in given):
            assert "0 to" in err.expected  # the stated bounds
            return
        counts = chain_warmups(p, m, v, group, given)
        assert not _completes(p, m, v, group, counts)
        assert not _simulates(p, m, v, group, counts)
        assert blocked_stage(p, m, v, group, counts) is not None
        # the counts named complete (the first of them here, with the others as given)
        first = int(err.expected.split()[0].rstrip(","))
        fixed = counts[:s] + (first,) + counts[s + 1:]
        if "as given" in err.expected:
            assert _completes(p, m, v, group, fixed) and _simulates(p, m, v, group, fixed)
        return
    counts = chain_warmups(p, m, v, group, given)
    assert all(0 <= w <= m * v for w in counts)
    assert _completes(p, m, v, group, counts)
    assert _simulates(p, m, v, group, counts)


@pytest.mark.parametrize("p,m,v,group", [(2, 4, 2, None), (3, 6, 2, None), (4, 8, 3, None),
                                         (3, 16, 2, 4), (3, 7, 2, None)])
def test_megatrons_counts_complete(p, m, v, group):
    counts = tuple(warmup_count(p, s, m, v, group) for s in range(p))
    assert chain_warmups(p, m, v, group, [None] * p) == counts
    assert blocked_stage(p, m, v, group, counts) is None and _completes(p, m, v, group, counts)
    check_chain_warmups([None] * p, m, v, group, str, "r")


def test_a_warmup_beyond_megatrons_on_stage_0_completes_and_too_far_deadlocks():
    """Two stages, 4 micro-batches, two chunks: stage 0's Megatron count is 4; 6 (two forward
    chunk-steps more) completes, 7 runs a chunk-1 forward whose input the last stage sends only
    after a backward that waits for stage 0."""
    assert warmup_count(2, 0, 4, 2) == 4
    check_chain_warmups([6, None], 4, 2, None, lambda s: f"s{s}", "r")
    with pytest.raises(SchemaError) as err:
        check_chain_warmups([7, None], 4, 2, None, lambda s: f"s{s}", "r")
    assert err.value.path == "s0" and err.value.expected.startswith("2 to 6 with the other")
    assert not _completes(2, 4, 2, None, (7, 2)) and not _simulates(2, 4, 2, None, (7, 2))
