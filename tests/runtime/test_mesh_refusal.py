"""A mesh plan under the runtime hooks: refused on every rank before the model is built,
naming the megatron-core it needs on 0.16 (tier 1/2: no process group)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from megatron_hetero.errors import HeteroError
from megatron_hetero.runtime import hooks
from megatron_hetero.runtime.meshes import refuse_mesh_plan

from ..conftest import EXAMPLE_PLANS, REPO

MESH = REPO / "examples/meshes/3090-t4-plan.yaml"


def test_mesh_plan_refused_on_megatron_core_016_naming_017():
    with pytest.raises(HeteroError, match=r"needs megatron-core 0\.17 or later.*"
                                          r"MultiModulePipelineCommunicator.*0\.16\.1 is installed"):
        hooks.before_validate(argparse.Namespace(hetero_plan=str(MESH), rank=0, world_size=32),
                              argv=[])


def test_format_1_plans_pass_the_gate():
    for path in EXAMPLE_PLANS:
        refuse_mesh_plan(str(path))


def test_mesh_plan_refused_on_017_as_not_built_yet(mcore017_env):
    script = ("from megatron_hetero.runtime.meshes import refuse_mesh_plan\n"
              f"refuse_mesh_plan({str(MESH)!r})\n")
    out = subprocess.run([sys.executable, "-c", script], env=mcore017_env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 1
    assert "mesh plans (format_version 2) do not run yet (megatron-core 0.17.1 has what they " \
           "need" in out.stderr
