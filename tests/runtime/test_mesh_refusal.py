"""A mesh plan under the runtime hooks on megatron-core 0.16: refused on every rank before the
model is built, naming the megatron-core it needs (tier 1/2: no process group; 0.16 is below the
supported range and no longer installed, so the installed release is made to say 0.16.1). On
0.17 and later the hooks run it (``test_mesh_training.py``); what they refuse there is checked
here too."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from megatron_hetero.errors import HeteroError
from megatron_hetero.runtime import hooks, releases
from megatron_hetero.runtime.meshes import mesh_plan_of

from ..conftest import EXAMPLE_PLANS, REPO, mcore_environ

MESH = REPO / "examples/meshes/3090-t4-plan.yaml"


def test_mesh_plan_refused_on_megatron_core_016_naming_017(monkeypatch):
    monkeypatch.setattr(releases, "installed", lambda: ("0.16.1", (0, 16)))
    runtime = hooks.Runtime()
    with pytest.raises(HeteroError, match=r"needs megatron-core 0\.17 or later.*"
                                          r"MultiModulePipelineCommunicator.*0\.16\.1 is installed"):
        runtime.start(argparse.Namespace(hetero_plan=str(MESH), rank=0, world_size=32),
                      argv=[])
    assert runtime.state is None


def test_format_1_plans_pass_the_gate():
    for path in EXAMPLE_PLANS:
        assert mesh_plan_of(str(path)) is None


_ON_017 = """
import argparse, contextlib, io, json, sys
from megatron_hetero.errors import HeteroError
from megatron_hetero.runtime import hooks, placement
{cpu}
# the other 31 launcher ranks, as the rank exchange would report them: the 3090s last
types = ["T4-16GB"] * 16 + ["RTX3090-24GB"] * 16
placement._launcher_store = lambda *a, **kw: None
placement.exchange_rank_infos = lambda mine, world, store: [
    placement.RankInfo(launcher_rank=r, device_type=types[r], host="h", local_rank=r)
    for r in range(world)]
printed = []
for world, argv in json.loads(sys.stdin.read()):  # one case after the other
    runtime = hooks.Runtime()  # a fresh process's
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        args = argparse.Namespace(hetero_plan={path!r}, rank=21, world_size=world,
                                  hetero_device_type="RTX3090-24GB")
        try:
            st = runtime.start(args, argv=argv).state
        except HeteroError as exc:
            print("refused:", exc)
        else:
            print("rank", st.launcher_rank, st.rank, args.rank)
            print("slot", st.slot.mesh, st.slot.stage, st.slot.replica, st.slot.tensor_rank)
            print("args", args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.micro_batch_size, args.pipeline_model_parallel_layout, args.num_layers,
                  args.global_batch_size)
    printed.append(out.getvalue())
print("CASES" + json.dumps(printed))
"""

CASES = {  # test: (world size, command line, on CPU ranks)
    "placed": (32, [], True),
    "refused-args": (32, ["--tensor-model-parallel-size", "2", "--global-batch-size", "64"], True),
    "refused-world": (8, [], True),
    "refused-policy": (32, [], False),
}
_CPU = "from megatron_hetero.mcore.cpu_backend import enable_cpu_backend; enable_cpu_backend()"


@pytest.fixture(scope="module")
def on_017() -> dict:
    """What the hooks printed for each of ``CASES`` (launcher rank 21, a 3090) on
    the venv's megatron-core (0.19.2): one subprocess for the cases on CPU ranks (the CPU
    backend enabled, as ``launch --cpu`` runs them: they run the example's module-input offload
    without Transformer Engine), one for the others."""
    printed = {}
    for cpu in (True, False):
        names = [name for name, case in CASES.items() if case[2] is cpu]
        out = subprocess.run([sys.executable, "-c", _ON_017.format(
                                  path=str(MESH), cpu=_CPU if cpu else "")],
                             input=json.dumps([CASES[n][:2] for n in names]),
                             env=mcore_environ(), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        printed.update(zip(names, json.loads(out.stdout.split("CASES", 1)[1])))
    return printed


def test_mesh_plan_on_017_gives_each_rank_its_mesh(on_017):
    """Launcher rank 21, a 3090 where the launcher put the T4s first, is placed on the plan's
    rank 5 (the 3090 mesh comes first in the plan): mesh 0 (TP 1, DP 8, 2 stages), its TP, PP,
    micro-batch and its mesh's segments of the layout; the common arguments from the plan."""
    out = on_017["placed"]
    assert "rank 21 5 5" in out
    assert "slot 0 0 5 0" in out
    assert "args 1 2 1 Et*10|t*10 32 128" in out


def test_mesh_plan_on_017_refuses_what_each_mesh_sets(on_017):
    out = on_017["refused-args"]
    assert "refused:" in out
    assert "--tensor-model-parallel-size: each rank takes its mesh's from the plan" in out
    assert "--global-batch-size: the command line has" in out


def test_mesh_plan_on_017_refuses_another_world_size(on_017):
    out = on_017["refused-world"]
    assert "refused:" in out
    assert ("the plan needs world size 32 (16x RTX3090-24GB, 16x T4-16GB; mesh 0: TP=1 x DP=8 x "
            "PP=2; mesh 1: TP=2 x DP=8 x PP=1); the launcher started 8 ranks") in out


def test_mesh_plan_on_017_refuses_a_policy_by_its_mesh_stage(on_017):
    """Off CPU ranks, without Transformer Engine and with Transformer Engine's layers asked for
    (Megatron-LM's default), the example's module-input offload (the 3090 mesh's stages)
    cannot run: every rank refuses it at start, naming each stage's field, rather than run
    without it."""
    from megatron_hetero.hardware.optional import have_transformer_engine
    if have_transformer_engine():
        pytest.skip("Transformer Engine is installed")
    out = on_017["refused-policy"]
    assert out.startswith(f"refused: {MESH}: the plan asks for memory policies this Megatron "
                          "cannot apply:")
    for j in (0, 1):
        assert (f"meshes[0].stages[{j}].offload.module_inputs: megatron-core's fine-grained "
                "activation offloading runs on Transformer Engine's layers, which is not "
                "installed, or on megatron-core's local layers: pass --transformer-impl local") \
            in out
    assert "meshes[1]" not in out
