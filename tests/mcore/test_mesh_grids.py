"""megatron-core's grids and bridges built from a mesh plan on gloo CPU ranks: the ranks
the plan numbers are the ranks megatron-core's grids and leaders use, and a micro-batch crosses
each bridge whole (TP1 -> TP2 broadcast, DP2 -> DP1 fan-in, DP1 -> DP2 fan-out)."""

from __future__ import annotations

import copy

import pytest
import yaml

from ..conftest import REPO, evaluate_under, evaluated
from .tiny_mesh_plans import tiny_mesh_plan as _plan

BASE = yaml.safe_load((REPO / "examples/meshes/3090-t4-plan.yaml").read_text())

BRIDGES = {"tp1-tp2": ([(1, 1), (2, 1)], 3),   # TP1 -> TP2
           "dp2-dp1": ([(1, 2), (1, 1)], 3),   # DP2 -> DP1: fan-in
           "dp1-dp2": ([(1, 1), (1, 2)], 3)}   # DP1 -> DP2: fan-out
SCHEDULES = {  # case: (meshes, world, recompute of the second mesh)
    "tp1-tp2": ([(1, 1), (2, 1)], 3, None),                            # TP1 -> TP2
    "dp2-dp1": ([(1, 2), (1, 1)], 3, None),                            # DP2 -> DP1: fan-in
    "tp2dp1-tp1dp2": ([(2, 1), (1, 2)], 4, None),                      # TP2.DP1 -> TP1.DP2
    "tp1-tp2-recompute": ([(1, 1), (2, 1)], 3,
                          {"granularity": "full", "method": "uniform", "num_layers": 1}),
}


RANKS_1024 = [0, 300, 511, 512, 777, 1023]


def _plan_1024(tmp_path) -> str:
    """A 1024-rank mesh plan: TP 8 x DP 32 x PP 2 on A100s, then TP 4 x DP 64 x PP 2."""
    data = copy.deepcopy(BASE)
    data["global_batch_size"] = 1024
    data["meshes"] = [
        {"device_type": "A100-SXM-80GB", "tensor_model_parallel_size": 8,
         "replicas": [{"micro_batch_size": 2, "num_microbatches": 16}] * 32,
         "stages": [{"num_layers": 8}, {"num_layers": 8}]},
        {"device_type": "RTX3090-24GB", "tensor_model_parallel_size": 4,
         "replicas": [{"micro_batch_size": 1, "num_microbatches": 16}] * 64,
         "stages": [{"num_layers": 8}, {"num_layers": 8}]}]
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture(scope="module")
def ranks_ran(tmp_path_factory) -> dict:
    """``bridge/<case>`` and ``schedule/<case>``: every rank's result of
    ``tests/mcore/mesh_ranks.py``'s ``bridge_ranks`` and ``schedule_ranks`` on each case's plan;
    ``fake/1024``: ``fake_grid_ranks`` on the 1024-rank plan; all from one subprocess under
    the venv's megatron-core (0.19.2)."""
    calls = {}
    for name, (meshes, world) in BRIDGES.items():
        path = _plan(tmp_path_factory.mktemp("bridge"), meshes)
        calls[f"bridge/{name}"] = f"spawn(bridge_ranks, {world}, args=({path!r},), timeout_s=240)"
    for name, (meshes, world, recompute) in SCHEDULES.items():
        path = _plan(tmp_path_factory.mktemp("schedule"), meshes)
        if recompute:
            data = yaml.safe_load(open(path))
            data["meshes"][1]["stages"][0]["recompute"] = recompute
            with open(path, "w") as f:
                yaml.safe_dump(data, f)
        calls[f"schedule/{name}"] = (f"spawn(schedule_ranks, {world}, args=({path!r},), "
                                     "timeout_s=240)")
    # last: on fake process groups in the subprocess itself, after the spawned ranks
    path = _plan_1024(tmp_path_factory.mktemp("fake"))
    calls["fake/1024"] = f"fake_grid_ranks({path!r}, {RANKS_1024!r})"
    return evaluate_under("from megatron_hetero.mcore.spawn import spawn\n"
                              "from tests.mcore.mesh_ranks import (bridge_ranks, fake_grid_ranks,"
                              " schedule_ranks)", calls, timeout=300 * len(calls))


@pytest.mark.parametrize("name", list(BRIDGES))
def test_a_micro_batch_crosses_the_bridge_whole(ranks_ran, name):
    world = BRIDGES[name][1]
    results = evaluated(ranks_ran, f"bridge/{name}")
    assert [r["rank"] for r in results] == list(range(world))
    for r in results:
        assert r["total_stages"] == 2 and r["current_stage"] == r["mesh"]
        assert r["first"] == (r["mesh"] == 0) and r["last"] == (r["mesh"] == 1)
        assert r["forward_ok" if r["mesh"] else "grad_ok"] is True, r


def test_groups_of_a_1024_rank_mesh_plan_on_fake_process_groups(ranks_ran, tmp_path):
    """A 1024-rank mesh plan (TP 8 x DP 32 x PP 2 -> TP 4 x DP 64 x PP 2, fan-out 32 -> 64):
    the grids and the communicator build on fake process groups, and the groups of sample
    ranks are the plan's."""
    from megatron_hetero.plan import load_any_plan

    plan = load_any_plan(_plan_1024(tmp_path))
    assert plan.world_size == 1024
    got = evaluated(ranks_ran, "fake/1024")
    assert [r["rank"] for r in got] == RANKS_1024
    for r in got:
        slot = plan.slot_of_rank(r["rank"])
        mesh = plan.meshes[slot.mesh]
        T, D = mesh.tensor_model_parallel_size, mesh.data_parallel_size

        def rank(**change):
            fields = {"mesh": slot.mesh, "stage": slot.stage, "replica": slot.replica,
                      "tensor_rank": slot.tensor_rank} | change
            return plan.rank_of_slot(type(slot)(**fields))

        assert r["tp"] == [rank(tensor_rank=t) for t in range(T)]
        assert r["dp"] == [rank(replica=d) for d in range(D)]
        assert r["pp"] == [rank(stage=j) for j in range(len(mesh.stages))]
        assert r["total_stages"] == 4
        assert r["current_stage"] == 2 * slot.mesh + slot.stage


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_training_equals_one_process(ranks_ran, name):
    """Three steps of Megatron's non-interleaved 1F1B with the multimodule communicator over two
    meshes (SGD on both sides): each step's loss, every rank's first gradients (its shard,
    summed over its mesh's replicas and scaled by 1 / D_last) and its parameters after the
    third step equal one process's within fp32 rtol 1e-5; the last case recomputes the second
    mesh in full."""
    world = SCHEDULES[name][1]
    results = evaluated(ranks_ran, f"schedule/{name}")
    assert len(results) == world
    for r in results:
        assert r["grads"] and max(r["grads"].values()) < 1e-5, r["grads"]
        assert r["params"] and max(r["params"].values()) < 1e-5, r["params"]
    last = [r for r in results if r["mesh"] == 1]
    for step in range(3):  # each last-mesh replica's loss is over its own samples
        mean = sum(r["losses"][step] for r in last) / len(last)
        assert mean == pytest.approx(last[0]["ref_losses"][step], rel=1e-5)
    assert last[0]["ref_losses"][2] < last[0]["ref_losses"][0]  # it trains
