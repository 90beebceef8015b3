"""The mini trainer of mesh plans (megatron_hetero/emulate/mesh_trainer.py) trains equal to one
process: megatron-core 0.17.1's DDP, optimizer (plain and distributed) and finalize over each
mesh, Adam with gradient clipping that clips (so the norm over the whole model is checked: every
rank's norm equals the one process's), the 1 / D_last gradient scale, per-token loss where
replicas differ."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ..conftest import REPO
from ..mcore.tiny_mesh_plans import tiny_mesh_plan as _plan

pytestmark = pytest.mark.slow  # each test spawns 3-4 ranks three times

CLIP = 0.05  # below every step's norm (about 1.2-1.3 on this model): clipping happens


def _train(env, plan_path: str) -> dict:
    script = ("import json\nfrom tests.emulate.mesh_cases import train_against_one_process\n"
              f"print(json.dumps(train_against_one_process({plan_path!r}, {CLIP!r})))\n")
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check(got: dict, world: int) -> None:
    ref = got["reference"]
    assert all(n > 2 * CLIP for n in ref["grad_norms"]), ref  # clipping is active
    assert ref["losses"][2] < ref["losses"][0]  # it trains
    for name in ("plain", "distributed"):
        run = got[name]
        assert run["diverges"] is None, (name, run["diverges"])
        assert len(run["grad_norms"]) == world
        for norms in run["grad_norms"]:  # every rank: the norm of the whole model
            assert norms == pytest.approx(ref["grad_norms"], rel=1e-5), (name, norms, ref)


@pytest.mark.parametrize("meshes, world, recompute", [
    ([(1, 1), (2, 1)], 3, None),                                       # TP1 -> TP2
    ([(1, 2), (1, 1)], 3, None),                                       # DP2 -> DP1: fan-in
    ([(2, 1), (1, 2)], 4, None),                                       # TP2.DP1 -> TP1.DP2
    ([(1, 1), (2, 1)], 3, {"granularity": "full", "method": "uniform", "num_layers": 1}),
], ids=["tp1-tp2", "dp2-dp1", "tp2dp1-tp1dp2", "tp1-tp2-recompute"])
def test_mesh_plan_trains_equal_to_one_process(mcore017_env, tmp_path, meshes, world,
                                               recompute):
    """Three Adam steps with clipping, plain and distributed optimizer: losses, forward-only
    loss, final parameters and every rank's gradient norm equal one process's."""
    _check(_train(mcore017_env, _plan(tmp_path, meshes, recompute=recompute)), world)


def test_meshes_of_two_stages_train_equal_to_one_process(mcore017_env, tmp_path):
    """Two meshes of two stages (one layer each): a stage takes its input from the stage
    before it in its mesh, and the last mesh's first stage passes its output on (only the
    model's last stage returns the loss)."""
    _check(_train(mcore017_env, _plan(tmp_path, [(1, 1), (1, 1)], stages={0: [1, 1],
                                                                          1: [1, 1]})), 4)


def test_uneven_replicas_train_equal_to_one_process(mcore017_env, tmp_path):
    """Two meshes of two replicas each, replica 0 running 3 samples and replica 1 one (uneven
    data parallelism, the bridge keeping every sample on its replica's path): the loss is summed
    per token and the gradients divided by the global batch's tokens, counted on the last mesh
    and summed over the world."""
    replicas = [{"micro_batch_size": 1, "num_microbatches": 3},
                {"micro_batch_size": 1, "num_microbatches": 1}]
    _check(_train(mcore017_env, _plan(tmp_path, [(1, 2), (1, 2)], replicas=replicas)), 4)
