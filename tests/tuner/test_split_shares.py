"""The layer-split dynamic program and the micro-batch water-filling against brute force."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings, strategies as st

from megatron_hetero.schedule.shares import water_fill
from megatron_hetero.schedule.split import min_max_split, whole_layers_bound


def _compositions(total, parts):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.integers(1, 9), st.integers(0, 2**31 - 1), st.booleans())
def test_split_matches_brute_force(p, total, seed, holes):
    rng = np.random.default_rng(seed)
    costs = rng.random((p, total + 1)) * 10
    if holes:
        costs[rng.random(costs.shape) < 0.3] = np.inf
    got = min_max_split(costs, total)
    best = min((max(costs[s, n] for s, n in enumerate(split)) for split in _compositions(total, p)),
               default=np.inf) if p <= total else np.inf
    if not np.isfinite(best):
        assert got is None
        return
    value, split = got
    assert value == best
    assert sum(split) == total and all(n >= 1 for n in split)
    assert max(costs[s, n] for s, n in enumerate(split)) == best


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_whole_layers_bound_is_the_split_of_linear_costs_and_below_any_larger(p, total, seed):
    # linear stage costs (seconds per layer, fixed seconds such as the output layer): the bound
    # is the dynamic program's least slowest stage; costs above the linear ones (recompute,
    # memory that does not fit) never split below it
    rng = np.random.default_rng(seed)
    per_layer = rng.uniform(0.1, 2.0, p)
    fixed = rng.uniform(0.0, 3.0, p) * (rng.random(p) < 0.5)
    costs = np.full((p, total + 1), np.inf)
    costs[:, 1:] = per_layer[:, None] * np.arange(1, total + 1)[None, :] + fixed[:, None]
    bound = whole_layers_bound([(a, e, 1) for a, e in zip(per_layer, fixed)], total)
    got = min_max_split(costs, total)
    if got is None:
        assert p > total and bound == np.inf
        return
    assert bound == got[0]
    more = costs + rng.uniform(0.0, 1.0, costs.shape)
    more[rng.random(costs.shape) < 0.2] = np.inf
    worse = min_max_split(more, total)
    assert worse is None or worse[0] >= bound


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), min_size=1, max_size=4),
       st.integers(0, 14))
def test_water_fill_matches_brute_force(pipes, total):
    fixed = [float(a) for a, _ in pipes]
    per = [float(c) for _, c in pipes]
    got = water_fill(fixed, per, total)
    options = [m for m in itertools.product(range(1, total + 1), repeat=len(pipes)) if sum(m) == total]
    if not options:
        assert got is None
        return
    best = min(max(a + k * c for a, c, k in zip(fixed, per, m)) for m in options)
    assert sum(got) == total and min(got) >= 1
    assert max(a + k * c for a, c, k in zip(fixed, per, got)) == best


def test_water_fill_proportional_shares():
    # two speeds at 70:58 get 70:58 micro-batches
    assert water_fill([0.0, 0.0], [1 / 70, 1 / 58], 128) == [70, 58]
