"""The plans the runtime tests train are plans ``megatron-hetero validate`` accepts: what the
CPU ranks run is a configuration a GPU job could run (issue 33: the checkpoint chain's plan A
asked for optimizer offload in fp32, which ``validate`` and the GPU runtime refuse)."""

from __future__ import annotations

import re

import pytest

from megatron_hetero.cli import main
from megatron_hetero.plan import save_any_plan

from . import test_checkpoint_resume, test_launch, test_mesh_training

PLANS = {
    **{f"chain-{name}": plan for name, (_, plan) in test_checkpoint_resume.PLANS.items()},
    "uneven-3-1": test_launch.UNEVEN_3_1,
    "one-replica-4": test_launch.ONE_REPLICA_4,
    "two-stages-4": test_launch.TWO_STAGES_4,
    "interleaved-6": test_launch.INTERLEAVED_6,
    **{f"mesh-{name}": test_mesh_training.mesh_plan(name) for name in test_mesh_training.MESH_PLANS},
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_runtime_test_plan_validates(name, tmp_path, capsys):
    """The launch tests' shared plans, every plan of the checkpoint chain and of the mesh
    chain."""
    path = tmp_path / f"{name}.yaml"
    save_any_plan(PLANS[name], path)
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err
    assert re.match(rf"{re.escape(str(path))}: valid (mesh )?plan for tiny", capsys.readouterr().out)

