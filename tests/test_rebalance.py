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


def _flat_plan_path(tmp_path_factory, replicas: int = 8) -> str:
    """PLAN without its model chunks: ``replicas`` of its 8 replicas of 16 micro-batches, one
    at a time."""
    import yaml

    from megatron_hetero.plan import plan_from_data, save_plan
    data = yaml.safe_load(open(PLAN))
    data["pipelines"] = data["pipelines"][:replicas]
    data["global_batch_size"] = 16 * replicas
    for pipe in data["pipelines"]:
        for stage in pipe["stages"]:
            stage.pop("chunk_layers", None)
    data.pop("microbatch_group_size", None)
    data["virtual_pipeline_size"] = 1
    path = tmp_path_factory.mktemp("flat") / "plan.yaml"
    save_plan(plan_from_data(data, source="flat"), path)
    return str(path)


def _run(plan_path, *, replica, factor, noise, seed, reports=10):
    """Decide on ``reports`` reports of a run whose (replica, stage 0) is ``factor`` x slower
    and every stage measures within ``noise`` of that; each move is applied as the runtime
    applies it (:func:`with_shares`, which refuses shares the plan cannot run). The moves."""
    import random

    from megatron_hetero.telemetry.rebalance import with_shares
    rng = random.Random(seed)
    plan = load_any_plan(plan_path)
    rebalancer, moves = Rebalancer(policy=RebalancePolicy(patience=2)), []
    for step in range(reports):
        factors = {(r, s): rng.uniform(1 - noise, 1 + noise)
                   for r in range(plan.data_parallel_size) for s in range(2)}
        factors[(replica, 0)] *= factor
        decision = rebalancer.decide(plan, _records(plan_path, factors, steps=(step,))[2][0])
        if decision.shares is not None:
            plan = with_shares(plan, decision.shares, source="rebalancing")
            moves.append(decision.shares)
    return plan, moves


@settings(max_examples=20, deadline=None)
@given(replica=st.integers(0, 7), factor=st.floats(1.6, 4.0), noise=st.floats(0.0, 0.03),
       seed=st.integers(0, 10**6))
def test_noise_after_a_move_does_not_move_shares_again(tmp_path_factory, replica, factor,
                                                       noise, seed):
    """Once shares are cut for a slow replica, reports as slow as the ones the cut rested on
    (within 3%: a drift ratio within (1.03 / 0.97)^2 < 1.15 of the median) move nothing: the
    drift is measured against what the current shares expect, not against the plan's first
    prediction. (Before, the slowed replica drifted at every report and each noisy report
    re-split the batch: 1 to 6 moves in 10 reports at 8% noise, 20 runs, measured.)"""
    _, moves = _run(_flat_plan_path(tmp_path_factory), replica=replica, factor=factor,
                    noise=noise, seed=seed)
    assert len(moves) == 1 and moves[0][replica] < 16


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisier_reports_after_a_move_still_move_nothing(tmp_path_factory, seed):
    """At 8% noise the bound above does not hold, yet one move is what these runs make (the
    code before made 2 to 6 here: each report re-split the batch)."""
    _, moves = _run(_flat_plan_path(tmp_path_factory), replica=2, factor=2.5, noise=0.08,
                    seed=seed)
    assert len(moves) == 1


@settings(max_examples=10, deadline=None)
@given(replica=st.integers(0, 7), factor=st.floats(1.6, 4.0), noise=st.floats(0.0, 0.15),
       seed=st.integers(0, 10**6))
def test_an_interleaved_plan_moves_whole_micro_batch_groups(replica, factor, noise, seed):
    """PLAN is interleaved with micro-batch groups of 4: every decided split is one the plan
    runs (whole groups; before, the split ignored the groups and the runtime's with_shares
    refused it mid-run), and the slow replica loses at least one group."""
    plan, moves = _run(PLAN, replica=replica, factor=factor, noise=noise, seed=seed)
    assert moves and all(m % 4 == 0 for shares in moves for m in shares)
    assert plan.pipelines[replica].num_microbatches <= 12


def test_expert_groups_keep_one_count_and_irregular_ones_are_refused():
    from megatron_hetero.telemetry.rebalance import share_rules
    from tests.runtime.plans import make_plan

    experts = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32}
    plan = make_plan(split=(1, 2), replicas=[(1, 2)] * 4, experts=experts,
                     expert_model_parallel_size=2)
    assert share_rules(plan) == (1, 2)
    check_rebalanceable(plan, source="ep.yaml")
    costs = [(0.0, 1.0), (0.0, 1.0), (0.0, 3.0), (0.0, 3.0)]
    from megatron_hetero.schedule.shares import fill_shares
    shares = fill_shares([a for a, _ in costs], [c for _, c in costs], 8, alike=2)
    assert shares == [3, 3, 1, 1]
    two = make_plan(split=(1, 2), replicas=[(1, 2)] * 2, experts=experts,
                    expert_model_parallel_size=2)
    with pytest.raises(HeteroError, match="leave no such move"):
        check_rebalanceable(two, source="ep2.yaml")


def test_a_replica_that_recovers_gets_its_share_back(tmp_path_factory):
    """Drift is measured against the costs the current shares rest on, both ways: once the slow
    card is fast again, its replica drifts faster than expected and the shares move back."""
    path = _flat_plan_path(tmp_path_factory)
    plan = load_any_plan(path)
    rebalancer = Rebalancer(policy=RebalancePolicy(patience=2))
    from megatron_hetero.telemetry.rebalance import with_shares
    history = []
    for step, factor in enumerate([3.0] * 4 + [1.0] * 4):
        rec = _records(path, {(5, 0): factor}, steps=(step,))[2][0]
        decision = rebalancer.decide(plan, rec)
        if decision.shares is not None:
            plan = with_shares(plan, decision.shares, source="rebalancing")
            history.append((step, decision.shares[5], decision.message))
    assert [(s, m) for s, m, _ in history][0][0] == 1 and history[0][1] < 16
    assert len(history) == 2 and history[1][0] == 5 and history[1][1] == 16
    assert "replica 5 drifts" in history[0][2]


@pytest.mark.parametrize("factor, advised", [(4.0, True), (1.3, False)])
def test_a_decision_says_what_moving_layers_would_add(tmp_path_factory, factor, advised):
    """Of two replicas (PP=2 each), replica 1's first stage 4x slower: shares move, and since
    re-splitting that replica's layers at its stages' measured cost per layer would beat the
    best share split by more than 10%, the decision says so and points to a re-plan (layers
    never move live). At 1.3x the share split comes within 10% of it and nothing more is said.
    The figure it names is the one recomputed here from the tuner's own split."""
    import numpy as np

    from megatron_hetero.schedule.shares import fill_shares
    from megatron_hetero.schedule.split import min_max_split

    path = _flat_plan_path(tmp_path_factory, replicas=2)
    plan = load_any_plan(path)
    rebalancer = Rebalancer(policy=RebalancePolicy(patience=1, threshold=1.05))
    rec = _records(path, {(1, 0): factor}, steps=(1,))[2][0]
    decision = rebalancer.decide(plan, rec)
    assert decision.shares is not None and decision.shares[1] < 16
    assert ("moving layers as well" in decision.message) is advised
    if advised:
        assert "tune INVENTORY --from-run DIR" in decision.message
        per = {}  # each replica's stages per micro-batch, split anew by their cost per layer
        for s in rec.stages:
            per.setdefault(s.replica, []).append(s.measured.compute_s / s.micro_batches)
        costs = []
        for r, stage_costs in sorted(per.items()):
            layers = [st.num_layers for st in plan.pipelines[r].stages]
            unit = np.array(stage_costs) / np.array(layers)
            _, split = min_max_split(unit[:, None] * np.arange(33)[None, :], 32)
            c = list(unit * split)
            costs.append((sum(c) - max(c), max(c)))
        shares = fill_shares([a for a, _ in costs], [c for _, c in costs], 32)
        moved = max(a + m * c for (a, c), m in zip(costs, shares))
        assert f"would make it {moved:.3g} s" in decision.message
