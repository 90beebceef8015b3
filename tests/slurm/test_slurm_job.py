"""Launch through a real Slurm (.ci/slurm-setup.sh: one host playing nodes mh-a100 and mh-v100,
partitions a100 and v100) and through torchrun: the batch script's heterogeneous job puts each
GPU type's tasks on its own partition's node, and every rank gets the rank, world size and
device type the plan expects."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_hetero.plan import load_plan

from .conftest import REPO

SUBMIT = REPO / "scripts" / "slurm" / "submit.sh"
TORCHRUN = REPO / "scripts" / "launch_torchrun.sh"
PROBE = Path(__file__).with_name("gloo_probe.py")
PROBE_LINE = re.compile(r"probe rank=(\d+) world=(\d+) local_rank=(\d+) node=(\S+) device_type=(\S+) "
                        r"plan_device_type=(\S+) pipeline=(\d+) stage=(\d+) rank_sum=(\d+)")
A100, V100 = "A100-SXM-80GB", "V100-SXM2-32GB"


def launch_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MH_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(MH_PYTHON=sys.executable, MH_SET_DEVICE_TYPES="1", OMP_NUM_THREADS="1", **extra)
    return env


def sbatch_wait(plan: Path, out: Path, env: dict, *megatron_args: str, timeout: int = 240,
                expect_ok: bool = True) -> tuple[str, list[str]]:
    """Submit ``plan`` with scripts/slurm/submit.sh, wait for the job; return its output and
    the states of its components.

    Polls ``scontrol`` rather than ``sbatch --wait``, whose polling interval grows to tens of
    seconds."""
    cmd = [str(SUBMIT), str(plan), "--gpus-per-node", "2", "--no-gres",
           "--partition", f"{A100}=a100", "--partition", f"{V100}=v100",
           f"--sbatch=--output={out}", "--sbatch=--time=5", "--", *megatron_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=out.parent)
    assert proc.returncode == 0, f"submit.sh exit {proc.returncode}: {proc.stderr}"
    job = re.search(r"Submitted batch job (\d+)", proc.stdout)
    assert job, proc.stdout
    return wait_job(job.group(1), out, timeout=timeout, expect_ok=expect_ok)[:2]


def wait_job(job: str, out: Path, *, timeout: int = 240, expect_ok: bool = True
             ) -> tuple[str, list[str], str]:
    """Wait for Slurm job ``job``; return its output file's text, the states of its components
    and its ``scontrol -o show job`` record."""
    deadline = time.monotonic() + timeout
    while True:
        info = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True,
                              text=True, timeout=30).stdout
        states = re.findall(r"JobState=(\S+)", info)
        if states and all(s not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")
                          for s in states):
            break
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], timeout=30)
            pytest.fail(f"Slurm job {job} did not finish in {timeout} s ({states}); output so "
                        "far:\n" + (out.read_text() if out.exists() else "(none)"))
        time.sleep(0.5)
    log = out.read_text() if out.exists() else ""
    codes = re.findall(r"ExitCode=(\S+)", info)
    if expect_ok:
        assert set(states) == {"COMPLETED"} and set(codes) == {"0:0"}, \
            f"job {job}: states {states}, exit codes {codes}; job output:\n{log}"
    return log, states, info


def probes(log: str) -> dict[int, tuple]:
    found = {}
    for m in PROBE_LINE.finditer(log):
        found[int(m.group(1))] = m.groups()
    return found


def check_probes(found: dict[int, tuple], plan_path: Path, nodes: dict[str, str] | None) -> None:
    plan = load_plan(plan_path)
    assert sorted(found) == list(range(plan.world_size))
    for rank, (_, world, _, node, device, plan_device, pipe, stage, rank_sum) in found.items():
        slot = plan.slot_of_rank(rank)
        assert int(world) == plan.world_size and int(rank_sum) == sum(range(plan.world_size))
        assert (int(pipe), int(stage)) == (slot.pipeline, slot.stage)
        assert device == plan_device == plan.device_type_of_rank(rank), f"rank {rank}"
        if nodes is not None:  # each GPU type's tasks ran on its own partition's node
            assert node == nodes[{A100: "a100", V100: "v100"}[device]], f"rank {rank} on {node}"


@pytest.mark.slow
def test_slurm_hetjob_runs_one_task_per_gpu_on_its_partition(slurm_cluster, plan4, tmp_path):
    out = tmp_path / "job.out"
    log, _ = sbatch_wait(plan4, out, launch_env(MH_LAUNCH="patched", MH_PRETRAIN_SCRIPT=str(PROBE)),
                         "--train-iters", "2")
    assert "2 component(s), 4 tasks" in log
    assert "component 0: partition a100" in log and "component 1: partition v100" in log
    check_probes(probes(log), plan4, slurm_cluster["nodes"])


@pytest.mark.slow
def test_slurm_job_fails_when_a_rank_fails(slurm_cluster, plan4, tmp_path):
    script = tmp_path / "fail_on_rank_2.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '2':\n    sys.exit(3)\n"
                      "time.sleep(60)\n")  # the others are killed (srun --kill-on-bad-exit)
    log, states = sbatch_wait(plan4, tmp_path / "job.out",
                              launch_env(MH_LAUNCH="patched", MH_PRETRAIN_SCRIPT=str(script)),
                              expect_ok=False)
    assert "FAILED" in states, (states, log)


@pytest.mark.slow
def test_torchrun_launcher_two_hosts(plan4, tmp_path):
    hosts = tmp_path / "hosts"
    # two names of this machine: a host file lists each host once (jobspec refuses a repeat)
    hosts.write_text(f"localhost {A100} 2\n127.0.0.1 {V100} 2\n")
    env = launch_env(MH_LAUNCH="patched", MH_PRETRAIN_SCRIPT=str(PROBE), MH_MASTER_PORT=str(
        29000 + os.getpid() % 1000))
    procs = [subprocess.Popen([str(TORCHRUN), str(hosts), str(plan4), "--", "--train-iters", "2"],
                              env={**env, "MH_NODE_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    check_probes(probes("\n".join(logs)), plan4, None)


SLOT_LINE = re.compile(r"megatron-hetero: launcher rank (\d+) \((\S+)\) -> Megatron rank (\d+): "
                       r"pipeline (\d+) stage (\d+) tp (\d+)")


@pytest.mark.slow
def test_slurm_trains_tiny_megatron_on_cpu_backend(slurm_cluster, tmp_path, mcore_env):
    """The batch script runs `python -m megatron_hetero.launch` on a pretrain_gpt.py-style script
    (megatron.training 0.17.1, CPU backend) for 2 steps with a 4-rank PP=2 x DP=2 plan whose
    replicas run 3 and 1 micro-batches and mix GPU types: every rank plays a slot of its device
    type, and the losses are those of one replica running all 4 micro-batches."""
    from tests.runtime.launching import BASE_ARGS, TRAIN_SCRIPT, launch, logged_losses
    from tests.runtime.plans import make_plan

    from megatron_hetero.plan import save_plan

    # Stage 0 runs on an A100 in pipeline 0 and on a V100 in pipeline 1: Slurm's task order
    # (the A100 component first) is not the plan's, so the runtime must move ranks.
    plan = make_plan(split=(1, 1), devices=[[A100, V100], [V100, A100]], replicas=[(1, 3), (1, 1)])
    plan_path = tmp_path / "plan.yaml"
    save_plan(plan, plan_path)
    env = launch_env(MH_LAUNCH="module", MH_PRETRAIN_SCRIPT=str(TRAIN_SCRIPT),
                     MEGATRON_HETERO_CPU="1", MEGATRON_HETERO_VERBOSE="1",
                     TINY_LOG=str(tmp_path / "log"), PYTHONPATH=mcore_env["PYTHONPATH"])
    log, _ = sbatch_wait(plan_path, tmp_path / "job.out", env, *BASE_ARGS, "--train-iters", "2",
                         timeout=420)
    slots = {int(m.group(3)): m.groups() for m in SLOT_LINE.finditer(log)}
    assert sorted(slots) == list(range(plan.world_size)), log[-4000:]
    launchers = set()
    moved = 0
    for rank, (launcher, device, _, pipe, stage, tp) in slots.items():
        slot = plan.slot_of_rank(rank)
        assert (int(pipe), int(stage), int(tp)) == (slot.pipeline, slot.stage, slot.tensor_rank)
        assert device == plan.device_type_of_rank(rank), f"Megatron rank {rank} on a {device}"
        launchers.add(int(launcher))
        moved += int(launcher) != rank
    assert launchers == set(range(plan.world_size)) and moved > 0
    losses = logged_losses(log)
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses), log[-4000:]
    # the same stages with one replica running all 4 micro-batches, launched here on 2 local
    # ranks: the job trained exactly as it (every sample once, in its step, on the plan's
    # stages), not merely to some finite loss
    one = make_plan(split=(1, 1), devices=[[A100, V100]], replicas=[(1, 4)])
    save_plan(one, tmp_path / "one.yaml")
    (tmp_path / "one").mkdir()
    ref = launch(2, str(tmp_path / "one.yaml"), tmp_path / "one", timeout=400)
    assert all(code == 0 for code, _, _ in ref), ref[-1][1][-3000:]
    assert losses == pytest.approx(logged_losses(ref[-1][1]), rel=1e-5)
