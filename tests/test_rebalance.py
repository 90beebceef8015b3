"""Live rebalancing's decision (:mod:`megatron_hetero.telemetry.rebalance`) on records of a
known slowdown: a replica that drifts for ``patience`` reports gets fewer micro-batches, a stage
slow in every replica is named instead, an even run moves nothing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from megatron_hetero.errors import HeteroError
from megatron_hetero.plan import load_any_plan
from megatron_hetero.telemetry.rebalance import (Rebalancer, RebalancePolicy,
                                                 check_rebalanceable, replica_costs)

from .test_telemetry_report import MESH_PLAN, PLAN, _records


def _slow(plan, *, replica=None, stage, factor):
    """(replica, stage) -> factor for one stage of one replica, or of every replica."""
    reps = range(plan.data_parallel_size) if replica is None else [replica]
    return {(r, stage): factor for r in reps}


@settings(max_examples=15, deadline=None)
@given(replica=st.integers(0, 7), stage=st.integers(0, 1), factor=st.floats(1.6, 4.0),
       overall=st.floats(0.3, 3.0))
def test_a_drifting_replica_gets_fewer_micro_batches(replica, stage, factor, overall):
    plan = load_any_plan(PLAN)
    counts = [p.num_microbatches for p in plan.pipelines]
    rebalancer = Rebalancer(policy=RebalancePolicy(threshold=1.15, patience=2))
    _, _, (first, second) = _records(PLAN, _slow(plan, replica=replica, stage=stage,
                                                 factor=factor), overall=overall)
    assert rebalancer.decide(plan, first).shares is None  # one report: not yet
    decision = rebalancer.decide(plan, second)
    shares = decision.shares
    assert shares is not None and sum(shares) == sum(counts)
    assert shares[replica] < counts[replica]
    assert f"replica {replica} drifts" in decision.message
    costs = replica_costs(second)
    before = max(a + m * c for (a, c), m in zip(costs, counts))
    after = max(a + m * c for (a, c), m in zip(costs, shares))
    assert after < before


def test_a_stage_slow_in_every_replica_is_named_and_moves_nothing():
    plan = load_any_plan(PLAN)
    rebalancer = Rebalancer(policy=RebalancePolicy(patience=1))
    _, _, records = _records(PLAN, _slow(plan, stage=1, factor=2.0))
    decision = rebalancer.decide(plan, records[0])
    assert decision.shares is None
    assert decision.message.startswith("stage 1 is slow in every replica")
    assert "--from-run" in decision.message


def test_an_even_run_moves_nothing():
    plan = load_any_plan(PLAN)
    rebalancer = Rebalancer(policy=RebalancePolicy(patience=1))
    for rec in _records(PLAN, {}, overall=2.5)[2]:
        decision = rebalancer.decide(plan, rec)
        assert decision.shares is None and decision.message == ""


def test_a_drift_that_stops_resets_the_count():
    plan = load_any_plan(PLAN)
    rebalancer = Rebalancer(policy=RebalancePolicy(patience=2))
    slow = _records(PLAN, _slow(plan, replica=3, stage=0, factor=3.0))[2][0]
    even = _records(PLAN, {})[2][0]
    for rec in (slow, even, slow):
        assert rebalancer.decide(plan, rec).shares is None
    assert rebalancer.decide(plan, slow).shares is not None


def test_what_cannot_rebalance_is_refused_at_start():
    with pytest.raises(HeteroError, match="chain of meshes"):
        check_rebalanceable(load_any_plan(MESH_PLAN), source="m.yaml")
    check_rebalanceable(load_any_plan(PLAN), source="p.yaml")
    with pytest.raises(HeteroError, match="--hetero-rebalance-threshold"):
        RebalancePolicy(threshold=1.0)
    with pytest.raises(HeteroError, match="--hetero-rebalance-patience"):
        RebalancePolicy(patience=0)


def test_a_split_barely_faster_does_not_move():
    """Two near-equal splits do not swap on noise: a split that shortens the slowest replica by
    less than min_gain stays put (and says so once)."""
    plan = load_any_plan(PLAN)
    _, _, (rec, again) = _records(PLAN, _slow(plan, replica=2, stage=0, factor=1.25))
    eager = Rebalancer(policy=RebalancePolicy(patience=1, threshold=1.05, min_gain=1.0))
    moved = eager.decide(plan, rec).shares
    assert moved is not None
    costs = replica_costs(rec)
    counts = [p.num_microbatches for p in plan.pipelines]
    gain = max(a + m * c for (a, c), m in zip(costs, counts)) / \
        max(a + m * c for (a, c), m in zip(costs, moved))
    steady = Rebalancer(policy=RebalancePolicy(patience=1, threshold=1.05, min_gain=gain * 1.01))
    first = steady.decide(plan, rec)
    assert first.shares is None and "shares stay" in first.message
    assert steady.decide(plan, again).message == ""  # said once
