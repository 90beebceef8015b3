"""megatron-core 0.17.1's grids and bridges built from a mesh plan on gloo CPU ranks: the ranks
the plan numbers are the ranks megatron-core's grids and leaders use, and a micro-batch crosses
each bridge whole (TP1 -> TP2 broadcast, DP2 -> DP1 fan-in, DP1 -> DP2 fan-out)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import yaml

from ..conftest import REPO
from .tiny_mesh_plans import tiny_mesh_plan as _plan

BASE = yaml.safe_load((REPO / "examples/meshes/3090-t4-plan.yaml").read_text())


def _run(env, plan_path: str, world: int) -> list[dict]:
    script = ("import json\nfrom megatron_hetero.mcore.spawn import spawn\n"
              "from tests.mcore.mesh_ranks import bridge_ranks\n"
              f"print(json.dumps(spawn(bridge_ranks, {world}, args=({plan_path!r},), "
              "timeout_s=240)))\n")
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("meshes, world", [([(1, 1), (2, 1)], 3),   # TP1 -> TP2
                                           ([(1, 2), (1, 1)], 3),   # DP2 -> DP1: fan-in
                                           ([(1, 1), (1, 2)], 3)],  # DP1 -> DP2: fan-out
                         ids=["tp1-tp2", "dp2-dp1", "dp1-dp2"])
def test_a_micro_batch_crosses_the_bridge_whole(mcore017_env, tmp_path, meshes, world):
    results = _run(mcore017_env, _plan(tmp_path, meshes), world)
    assert [r["rank"] for r in results] == list(range(world))
    for r in results:
        assert r["total_stages"] == 2 and r["current_stage"] == r["mesh"]
        assert r["first"] == (r["mesh"] == 0) and r["last"] == (r["mesh"] == 1)
        assert r["forward_ok" if r["mesh"] else "grad_ok"] is True, r


def test_groups_of_a_1024_rank_mesh_plan_on_fake_process_groups(mcore017_env, tmp_path):
    """A 1024-rank mesh plan (TP 8 x DP 32 x PP 2 -> TP 4 x DP 64 x PP 2, fan-out 32 -> 64):
    the grids and the communicator build on fake process groups, and the groups of sample
    ranks are the plan's."""
    from megatron_hetero.plan_mesh import load_any_plan

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
    plan = load_any_plan(path)
    assert plan.world_size == 1024
    ranks = [0, 300, 511, 512, 777, 1023]
    script = ("import json\nfrom tests.mcore.mesh_ranks import fake_grid_ranks\n"
              f"print(json.dumps(fake_grid_ranks({str(path)!r}, {ranks!r})))\n")
    out = subprocess.run([sys.executable, "-c", script], env=mcore017_env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
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


@pytest.mark.parametrize("meshes, world, recompute", [
    ([(1, 1), (2, 1)], 3, None),                                       # TP1 -> TP2
    ([(1, 2), (1, 1)], 3, None),                                       # DP2 -> DP1: fan-in
    ([(2, 1), (1, 2)], 4, None),                                       # TP2.DP1 -> TP1.DP2
    ([(1, 1), (2, 1)], 3, {"granularity": "full", "method": "uniform", "num_layers": 1}),
], ids=["tp1-tp2", "dp2-dp1", "tp2dp1-tp1dp2", "tp1-tp2-recompute"])
def test_training_equals_one_process(mcore017_env, tmp_path, meshes, world, recompute):
    """Three steps of Megatron's non-interleaved 1F1B with the multimodule communicator over two
    meshes (SGD on both sides): each step's loss, every rank's first gradients (its shard,
    summed over its mesh's replicas and scaled by 1 / D_last) and its parameters after the
    third step equal one process's within fp32 rtol 1e-5; the last case recomputes the second
    mesh in full."""
    plan_path = _plan(tmp_path, meshes)
    if recompute:
        data = yaml.safe_load(open(plan_path))
        data["meshes"][1]["stages"][0]["recompute"] = recompute
        with open(plan_path, "w") as f:
            yaml.safe_dump(data, f)
    script = ("import json\nfrom megatron_hetero.mcore.spawn import spawn\n"
              "from tests.mcore.mesh_ranks import schedule_ranks\n"
              f"print(json.dumps(spawn(schedule_ranks, {world}, args=({plan_path!r},), "
              "timeout_s=240)))\n")
    out = subprocess.run([sys.executable, "-c", script], env=mcore017_env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(results) == world
    for r in results:
        assert r["grads"] and max(r["grads"].values()) < 1e-5, r["grads"]
        assert r["params"] and max(r["params"].values()) < 1e-5, r["params"]
    last = [r for r in results if r["mesh"] == 1]
    for step in range(3):  # each last-mesh replica's loss is over its own samples
        mean = sum(r["losses"][step] for r in last) / len(last)
        assert mean == pytest.approx(last[0]["ref_losses"][step], rel=1e-5)
    assert last[0]["ref_losses"][2] < last[0]["ref_losses"][0]  # it trains
