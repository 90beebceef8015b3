"""Per-stage warm-up over a chain of meshes (issue 28) on CPU ranks: a mesh plan whose stages
warm up beyond Megatron's ``P - s - 1`` runs the chain's own schedule
(megatron_hetero/mcore/mesh_interleaved.py, one chunk a stage, each rank's order with its
stage's warm-up: tests/test_plan_mesh_warmup.py checks the orders) and trains equal to one
process (fp32, rtol 1e-5, 3 steps, Adam with clipping, plain and distributed optimizer): the
issue's TP2·DP1 -> TP1·DP2 with a warm-up (4 ranks), two meshes of two stages warming up 4, 3,
2, 0 of 4 micro-batches, TP2·DP1 -> TP1·DP2 with sequence parallelism in the TP 2 mesh, and
TP2·DP1 -> TP1·DP2 interleaved (two chunks a stage) with stage 1 warmed up beyond Megatron's
interleaved count (the issue's case); and ``rehearse --verify`` of the first."""

from __future__ import annotations

import pytest

from megatron_hetero.plan import load_any_plan
from megatron_hetero.schedule.order import rank_order
from megatron_hetero.schedule.rules import chain_warmup

from ..conftest import evaluate_under, evaluated
from ..mcore.tiny_mesh_plans import tiny_mesh_plan
from .mesh_cases import check_against_one_process

pytestmark = pytest.mark.slow  # each case spawns 4 ranks twice and one process once

CLIP = 0.05  # below every step's norm: clipping happens
CASES = {  # case: (meshes, world, tiny_mesh_plan's keyword arguments)
    # stage 0 (TP 2) warms up both micro-batches, Megatron's 1
    "tp2dp1-tp1dp2": ([(2, 1), (1, 2)], 4, {"warmups": {0: [2]}}),
    # Megatron's 3, 2, 1, 0 raised to 4, 3, 2, 0 (4 micro-batches of 1)
    "four-stages": ([(1, 1), (1, 1)], 4, {
        "stages": {0: [1, 1], 1: [1, 1]}, "warmups": {0: [4, 3], 1: [2, None]},
        "replicas": [{"micro_batch_size": 1, "num_microbatches": 4}]}),
    # with sequence parallelism in the TP 2 mesh (its bridge joins the shards at the link)
    "sequence-parallel": ([(2, 1), (1, 2)], 4, {
        "warmups": {0: [2]}, "seq_length": 4, "fields": {"sequence_parallel": True}}),
    # interleaved: two chunks a stage, stage 1 (TP 1, DP 2) warms up 3 forward chunk-steps of
    # 4, Megatron's 2 (its second micro-batch's chunk-1 forward before its first backward)
    "interleaved-tp2dp1-tp1dp2": ([(2, 1), (1, 2)], 4, {
        "chunks": {0: [[1, 1]], 1: [[1, 1]]}, "warmups": {1: [3]}}),
}


def test_the_interleaved_case_runs_its_warmup_on_every_rank_of_stage_1(tmp_path):
    """What the chain's schedule takes of the interleaved case: stage 1's two replicas warm up
    3 chunk-steps, an order other than Megatron's; stage 0 keeps Megatron's 4 (all of them)."""
    meshes, world, kwargs = CASES["interleaved-tp2dp1-tp1dp2"]
    plan = load_any_plan(tiny_mesh_plan(tmp_path, meshes, **kwargs))
    assert plan.interleaved_chain and plan.world_size == world
    for rank in range(world):
        slot = plan.slot_of_rank(rank)
        s = plan.global_stage(slot)
        assert chain_warmup(plan, slot) == [4, 3][s]
        if s == 1:
            assert rank_order(2, 1, 2, 2, warmup=3) != rank_order(2, 1, 2, 2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    calls = {}
    for name, (meshes, _, kwargs) in CASES.items():
        plan = tiny_mesh_plan(tmp_path_factory.mktemp(name), meshes, **kwargs)
        calls[name] = f"train_against_one_process({plan!r}, {CLIP!r})"
        if name == "tp2dp1-tp1dp2":
            calls["rehearse"] = f"rehearse_verified({plan!r})"
    return evaluate_under("from tests.emulate.mesh_cases import train_against_one_process, "
                          "rehearse_verified", calls, timeout=300 * len(calls))


@pytest.mark.parametrize("name", list(CASES))
def test_chain_with_warmups_trains_equal_to_one_process(trained, name):
    check_against_one_process(evaluated(trained, name), world=CASES[name][1], clip=CLIP)


def test_rehearse_runs_a_chain_with_warmups(trained):
    """``rehearse --verify`` of the TP2·DP1 -> TP1·DP2 plan with a warm-up: a row per (mesh,
    stage of the model, replica), equal to one process, a measured and a predicted step."""
    got = evaluated(trained, "rehearse")
    assert got["rows"] == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert got["verify"] is None
    assert got["measured"] > 0 and got["predicted"] > 0
