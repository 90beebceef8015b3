"""Sequence parallelism inside meshes of TP > 1 (issue 28) on CPU ranks: a mesh plan with
``sequence_parallel`` trains equal to one process (fp32, rtol 1e-5, 3 steps). Each TP 2 mesh
holds its shard of the sequence; a bridge out of it carries its TP group's shards joined, a
bridge into it hands each rank its shard; the local layers' norms sum their gradients over the
TP group (megatron_hetero/mcore/model.py: without that the norms' weights drift off at step
1). Non-interleaved (megatron-core's multimodule 1F1B: the shards joined and cut inside
autograd, mcore/mesh_stage.py) and interleaved (the chain's own schedule: at its links,
mcore/mesh_interleaved.py, the wrap-around bridge out of the TP 2 mesh included); the first
also under megatron-core 0.17.1."""

from __future__ import annotations

import pytest

from ..conftest import evaluate_under, evaluated
from ..mcore.tiny_mesh_plans import tiny_mesh_plan

pytestmark = pytest.mark.slow  # each case spawns 3-4 ranks twice and one process twice

LR, CLIP = 0.05, 0.05
SP = {"fields": {"sequence_parallel": True}, "seq_length": 4}
CASES = {  # case: (meshes, world, tiny_mesh_plan's keyword arguments, interleaved)
    # TP2.DP1 (sequence shards) -> TP1.DP2: the shards joined before the bridge
    "tp2dp1-tp1dp2": ([(2, 1), (1, 2)], 4, SP, False),
    # TP1 -> TP2 with two chunks a stage: cut into shards at the bridge, joined at the wrap-around
    "interleaved-tp1-tp2": ([(1, 1), (2, 1)], 3, {**SP, "chunks": {0: [[1, 1]], 1: [[1, 1]]}},
                            True),
}


@pytest.fixture(scope="module")
def trained_017(tmp_path_factory) -> dict:
    """The non-interleaved case under megatron-core 0.17.1, the oldest supported."""
    meshes, _, kwargs, _ = CASES["tp2dp1-tp1dp2"]
    plan = tiny_mesh_plan(tmp_path_factory.mktemp("stack-017"), meshes, **kwargs)
    return evaluate_under("from tests.emulate.mesh_cases import train_against_one_process",
                          {"tp2dp1-tp1dp2": f"train_against_one_process({plan!r}, {CLIP!r})"},
                          timeout=300, stack="0.17")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    calls = {}
    for name, (meshes, _, kwargs, interleaved) in CASES.items():
        plan = tiny_mesh_plan(tmp_path_factory.mktemp(name), meshes, **kwargs)
        calls[name] = (f"train_interleaved_against_one_process({plan!r}, {LR!r}, {CLIP!r})"
                       if interleaved else f"train_against_one_process({plan!r}, {CLIP!r})")
    return evaluate_under("from tests.emulate.mesh_cases import train_against_one_process, "
                          "train_interleaved_against_one_process", calls,
                          timeout=300 * len(calls))


@pytest.mark.parametrize("name", list(CASES))
def test_sequence_parallel_mesh_plan_trains_equal_to_one_process(trained, name):
    _check(trained, name)


def test_sequence_parallel_on_megatron_core_017(trained_017):
    _check(trained_017, "tp2dp1-tp1dp2")


def _check(trained: dict, name: str) -> None:
    got, world = evaluated(trained, name), CASES[name][1]
    runs = ({k: got[k] for k in ("sgd", "adam")} if CASES[name][3]
            else {k: got[k] | {"reference": got["reference"]} for k in ("plain", "distributed")})
    for run_name, run in runs.items():
        ref = run["reference"]
        assert ref["losses"][2] < ref["losses"][0], run_name  # it trains
        assert run["diverges"] is None, (run_name, run["diverges"])
        assert len(run["grad_norms"]) == world
        for norms in run["grad_norms"]:  # every rank: the norm of the whole model
            assert norms == pytest.approx(ref["grad_norms"], rel=1e-5), (run_name, norms)
