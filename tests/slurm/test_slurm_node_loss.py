"""The batch script's node-loss mode (MH_ON_NODE_LOSS=replan) on the real single-host Slurm of
.ci/slurm-setup.sh: a job step fails on mh-v100, which is drained; the job re-plans from its
checkpoint on the node left (mh-a100), submits itself again excluding mh-v100, and the new job
resumes the checkpoint under plan B. mh-v100 is resumed at teardown whatever happens."""

from __future__ import annotations

import math
import re
import subprocess
import time
from pathlib import Path

import pytest

from megatron_hetero.hardware.inventory import load_inventory
from megatron_hetero.plan import load_plan, save_plan

from .test_slurm_job import A100, SUBMIT, V100, launch_env, wait_job

FLAKY = Path(__file__).with_name("flaky_train.py")
LOST = "mh-v100"
POOL = (f"groups:\n  - {{gpu: {A100}, nodes: 1, gpus_per_node: 2, partition: a100}}\n"
        f"  - {{gpu: {V100}, nodes: 1, gpus_per_node: 1, partition: v100}}\n")


@pytest.fixture
def lost_node(slurm_cluster):
    """mh-v100, resumed at teardown (the test hook drains it)."""
    yield LOST
    subprocess.run(["scontrol", "update", f"nodename={LOST}", "state=resume"],
                   capture_output=True, timeout=30)
    states = subprocess.run(["sinfo", "-h", "-N", "-n", LOST, "-o", "%T"], capture_output=True,
                            text=True, timeout=30).stdout
    assert "drain" not in states, f"{LOST} still drained after teardown: {states}"


def _submit(plan: Path, pool: Path, out: Path, env: dict, *megatron_args: str) -> str:
    cmd = [str(SUBMIT), str(plan), "--inventory", str(pool), "--no-gres",
           f"--sbatch=--output={out}", "--sbatch=--time=8", "--", *megatron_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=out.parent)
    assert proc.returncode == 0, f"submit.sh exit {proc.returncode}: {proc.stderr}"
    return re.search(r"Submitted batch job (\d+)", proc.stdout).group(1)


def _plan_a(tmp_path: Path) -> tuple[Path, Path]:
    from tests.runtime.plans import make_plan

    plan = tmp_path / "plan-a.yaml"  # stage 0 on the A100 node, stage 1 on the V100 node
    save_plan(make_plan(split=(1, 2), devices=[[A100, V100]], replicas=[(1, 4)]), plan)
    pool = tmp_path / "pool.yaml"
    pool.write_text(POOL)
    return plan, pool


@pytest.mark.slow
def test_node_loss_replans_and_resumes_on_the_node_left(lost_node, tmp_path, mcore_env):
    from tests.runtime.launching import BASE_ARGS, TRAIN_SCRIPT, launch, logged_losses

    plan, pool = _plan_a(tmp_path)
    ckpt, out = tmp_path / "ckpt", tmp_path / "job.out"
    env = launch_env(MH_ON_NODE_LOSS="replan", MH_NODE_LOSS_WAIT="10", MH_LAUNCH="module",
                     MH_PRETRAIN_SCRIPT=str(FLAKY), FLAKY_SCRIPT=str(TRAIN_SCRIPT),
                     FLAKY_MARKER=str(tmp_path / "lost"), FLAKY_NODE=lost_node,
                     MEGATRON_HETERO_CPU="1", TINY_LOG=str(tmp_path / "log"),
                     PYTHONPATH=mcore_env["PYTHONPATH"])
    first = _submit(plan, pool, out, env, *BASE_ARGS, "--train-iters", "4", "--save", str(ckpt),
                    "--save-interval", "2", "--ckpt-format", "torch_dist")
    log, states, _ = wait_job(first, out, timeout=420, expect_ok=False)
    assert "FAILED" in states, log[-4000:]
    assert f"on {lost_node} fails" in log
    assert f"lost node(s) {lost_node}; re-planning" in log, log[-4000:]
    again = re.search(r"resubmitted as job (\d+) under plan B (\S+), excluding ([^,\s]+)", log)
    assert again, log[-4000:]
    second, plan_b = again.group(1), Path(again.group(2))
    assert plan_b == tmp_path / f"plan-after-job{first}.yaml" and again.group(3) == lost_node

    # the pool left and plan B: the A100 node only
    left = load_inventory(tmp_path / f"inventory-after-job{first}.yaml")
    assert [(g.gpu, g.nodes, g.partition) for g in left.groups] == [(A100, 1, "a100")]
    b = load_plan(plan_b)
    assert set(b.device_counts()) == {A100} and b.global_batch_size == 4

    log, _, info = wait_job(second, out, timeout=420)
    assert f"ExcNodeList={lost_node}" in info  # Slurm keeps the node out of the new job
    assert "NodeList=mh-a100" in info
    resumed = log[log.index(f"job {second}:"):]  # the same output file, appended to
    assert f"plan {plan_b}" in resumed and "node loss mode" in resumed
    assert "successfully loaded checkpoint" in resumed and "at iteration 2" in resumed, \
        resumed[-4000:]
    losses = logged_losses(resumed)
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses), resumed[-4000:]
    # plan A's 4 steps uninterrupted, on 2 local ranks: the first job trained its steps 1-2,
    # and plan B's are its steps 3 and 4 (weights, optimizer state and data position carried
    # across the node loss and the change of plan; Megatron logs the second step after a
    # resume as the mean of the two, docs/replan.md).
    (tmp_path / "whole").mkdir()
    whole = launch(2, str(plan), tmp_path / "whole", iters=4, timeout=400)
    assert all(code == 0 for code, _, _ in whole), whole[-1][1][-3000:]
    want = logged_losses(whole[-1][1])
    assert len(want) == 4
    assert logged_losses(log[:log.index(f"job {second}:")]) == pytest.approx(want[:2], rel=1e-5)
    assert [losses[0], 2 * losses[1] - losses[0]] == pytest.approx(want[2:], rel=1e-5)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


@pytest.mark.slow
@pytest.mark.parametrize("state, tracker, refusal", [
    ("none", None, "but no node of the job is drained, down or not responding"),
    ("drain", None, "holds no complete checkpoint yet"),
    ("drain", "2", "replan: error: "),  # the tracker names a save that is not there
])
def test_node_loss_refusals_stop_the_job(lost_node, tmp_path, state, tracker, refusal):
    """A step that fails with every node healthy is no node loss; a lost node before the first
    save leaves nothing to resume; a checkpoint replan refuses stops the job with replan's
    message: each time the job stops with the reason, submitting nothing."""
    plan, pool = _plan_a(tmp_path)
    out, ckpt = tmp_path / "job.out", tmp_path / "ckpt"
    if tracker:
        ckpt.mkdir()
        (ckpt / "latest_checkpointed_iteration.txt").write_text(tracker)
    env = launch_env(MH_ON_NODE_LOSS="replan", MH_NODE_LOSS_WAIT="0", MH_LAUNCH="patched",
                     MH_PRETRAIN_SCRIPT=str(FLAKY), FLAKY_MARKER=str(tmp_path / "lost"),
                     FLAKY_NODE=lost_node, FLAKY_STATE=state)
    job = _submit(plan, pool, out, env, "--save", str(ckpt))
    log, states, _ = wait_job(job, out, timeout=120, expect_ok=False)
    assert "FAILED" in states and "the step failed (exit" in log, log[-3000:]
    assert refusal in log and "resubmitted" not in log, log[-3000:]
    if tracker:
        assert "iter_0000002: found no such folder" in log
        assert "megatron-hetero replan refused (its message above): the job stops" in log
    assert not list(tmp_path.glob("plan-after-job*"))


@pytest.mark.slow
def test_node_down_in_a_mixed_job_is_requeued_and_resumes(lost_node, tmp_path):
    """A node set DOWN during the step of a heterogeneous job whose component it is: Slurm
    (22.05) ends the whole job, batch script included, even with --no-kill, and requeues it as
    submitted (--requeue, which submit.sh adds in the mode): same components, exclude list
    unchanged. The requeued job runs the same plan with --load added."""
    busy = subprocess.run(["squeue", "-h", "-w", lost_node, "-o", "%i"], capture_output=True,
                          text=True, timeout=30).stdout.split()
    if busy:
        pytest.skip(f"jobs {busy} run on {lost_node}: setting it DOWN would end them")
    plan, pool = _plan_a(tmp_path)
    out, ckpt = tmp_path / "job.out", tmp_path / "ckpt"
    env = launch_env(MH_ON_NODE_LOSS="replan", MH_NODE_LOSS_WAIT="0", MH_LAUNCH="patched",
                     MH_PRETRAIN_SCRIPT=str(FLAKY), FLAKY_MARKER=str(tmp_path / "lost"),
                     FLAKY_NODE=lost_node, FLAKY_STATE="down")
    job = _submit(plan, pool, out, env, "--save", str(ckpt))
    deadline = time.monotonic() + 120
    while True:  # until Slurm has requeued it
        info = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True,
                              text=True, timeout=30).stdout
        if "Restarts=1" in info or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "Restarts=1" in info, info
    assert "ExcNodeList=(null)" in info  # Slurm does not exclude the failed node itself
    assert "node loss mode" in out.read_text()
    # Slurm holds a requeued job back for the credential lifetime (its BeginTime; AuthInfo's
    # cred_expire, 10 s in .ci/slurm-setup.sh; starting it sooner with StartTime=now fails it
    # here: "Job credential revoked"), then runs it again
    log, states, info = wait_job(job, out, timeout=360)
    assert "requeued by Slurm (restart 1): resuming from" in log, log[-3000:]
    assert f"--save {ckpt} --load {ckpt}" in log and "resubmitted" not in log
