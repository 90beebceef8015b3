"""The launch scripts: bash -n and shellcheck clean, and early, clear failures on bad input."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

SCRIPTS = sorted([*REPO.glob("scripts/slurm/*.sh"), *REPO.glob("scripts/slurm/*.sbatch"),
                  REPO / "scripts" / "launch_torchrun.sh", REPO / "scripts" / "tune.sh",
                  REPO / ".ci" / "slurm-setup.sh", *REPO.glob("examples/llama2/*/launch.sh")])
SUBMIT = REPO / "scripts" / "slurm" / "submit.sh"
BATCH = REPO / "scripts" / "slurm" / "megatron_hetero.sbatch"
TORCHRUN = REPO / "scripts" / "launch_torchrun.sh"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MH_", "MEGATRON_LM"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["MH_PYTHON"] = sys.executable
    env.update(extra)
    return env


def _run(cmd, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=60,
                          env=_env(**env), cwd=REPO)


def test_every_script_exists_and_parses():
    assert len(SCRIPTS) >= 8
    for script in SCRIPTS:
        assert script.is_file(), script
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script}: {proc.stderr}"


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck not installed (apt-get install shellcheck; .ci/slurm-setup.sh does)")
def test_shellcheck_clean():
    proc = subprocess.run(["shellcheck", "--shell=bash", *map(str, SCRIPTS)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_batch_script_needs_slurm_and_plan(plan4):
    proc = _run(["bash", BATCH])
    assert proc.returncode == 1 and "not inside a Slurm job" in proc.stderr
    proc = _run(["bash", BATCH], SLURM_JOB_ID="7")
    assert proc.returncode == 1 and "MH_PLAN is not set" in proc.stderr
    proc = _run(["bash", BATCH], SLURM_JOB_ID="7", MH_PLAN=str(plan4))
    assert proc.returncode == 1 and "MEGATRON_LM is not set" in proc.stderr
    proc = _run(["bash", BATCH], SLURM_JOB_ID="7", MH_PLAN=str(plan4), MEGATRON_LM="/nonexistent")
    assert proc.returncode == 1 and "/nonexistent/pretrain_gpt.py: no such file" in proc.stderr


def test_batch_script_refuses_a_world_size_mismatch(plan4, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    proc = _run(["bash", BATCH], SLURM_JOB_ID="7", MH_PLAN=str(plan4), MH_PRETRAIN_SCRIPT=str(script),
                SLURM_HET_SIZE="2", SLURM_NTASKS_HET_GROUP_0="2", SLURM_NTASKS_HET_GROUP_1="1")
    assert proc.returncode == 1
    assert "the job has 3 tasks but" in proc.stderr and "needs world size 4" in proc.stderr


def test_submit_needs_megatron_and_a_selector(plan4):
    proc = _run([SUBMIT, plan4, "--gpus-per-node", "2"])
    assert proc.returncode == 1 and "MEGATRON_LM is not set" in proc.stderr
    fake = plan4.parent / "Megatron-LM"
    (fake / "megatron").mkdir(parents=True)
    (fake / "pretrain_gpt.py").write_text("")
    proc = _run([SUBMIT, plan4, "--gpus-per-node", "2"], MEGATRON_LM=str(fake))
    assert proc.returncode == 1 and "nothing selects the nodes" in proc.stderr
    proc = _run([SUBMIT, plan4, "--gpus-per-node", "2", "--partition", "A100-SXM-80GB=a",
                 "--constraint", "V100-SXM2-32GB=volta", "--sbatch=--time=5", "--dry-run",
                 "--", "--train-iters", "2"], MEGATRON_LM=str(fake))
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert line.startswith(f"MH_PLAN={plan4} sbatch --time=5 --nodes=1 --ntasks=2")
    assert "--partition=a --gpus-per-node=2 : --time=5" in line
    assert line.endswith(f"--constraint=volta --gpus-per-node=2 {BATCH} --train-iters 2")


def test_example_launch_scripts_make_an_sbatch_line(tmp_path):
    fake = tmp_path / "Megatron-LM"
    (fake / "megatron").mkdir(parents=True)
    (fake / "pretrain_gpt.py").write_text("")
    for launch in REPO.glob("examples/llama2/*/launch.sh"):
        proc = _run([launch], MEGATRON_LM=str(fake), DATA_PATH="/d", TOKENIZER_MODEL="/t",
                    MH_DRY_RUN="1")
        assert proc.returncode == 0, f"{launch}: {proc.stderr}"
        assert " sbatch " in proc.stdout and " : " in proc.stdout and "--tokenizer-model /t" in proc.stdout
        proc = _run([launch], MEGATRON_LM=str(fake))
        assert proc.returncode != 0 and "DATA_PATH" in proc.stderr


def test_torchrun_launcher_checks_hosts_first(plan4, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    hosts = tmp_path / "hosts"
    hosts.write_text("h0 A100-SXM-80GB 2\n")
    proc = _run([TORCHRUN, hosts, plan4], MH_PRETRAIN_SCRIPT=str(script))
    assert proc.returncode == 1 and "offers 2x A100-SXM-80GB; " in proc.stderr
    hosts.write_text("h0 A100-SXM-80GB 2\nh1 V100-SXM2-32GB 2\n")
    proc = _run([TORCHRUN, hosts, plan4], MH_PRETRAIN_SCRIPT=str(script))
    assert proc.returncode == 1 and "is not in" in proc.stderr and "MH_NODE_RANK" in proc.stderr
    proc = _run([TORCHRUN, hosts, plan4], MH_PRETRAIN_SCRIPT=str(script), MH_NODE_RANK="2")
    assert proc.returncode == 1 and "expected 0..1" in proc.stderr
    proc = _run([TORCHRUN, hosts, plan4])
    assert proc.returncode == 1 and "MEGATRON_LM is not set" in proc.stderr


def test_torchrun_launcher_on_a_host_the_plan_does_not_need(plan4, tmp_path):
    """A host file larger than the plan (issue 32 A.4): on a host left out, nothing runs."""
    script = tmp_path / "train.py"
    script.write_text("")
    hosts = tmp_path / "hosts"
    hosts.write_text("h0 A100-SXM-80GB 2\nh1 V100-SXM2-32GB 2\n"
                     f"{socket.gethostname()} V100-SXM2-32GB 2\n")
    proc = _run([TORCHRUN, hosts, plan4], MH_PRETRAIN_SCRIPT=str(script))
    assert proc.returncode == 0, proc.stderr
    assert "does not need it: nothing to run here" in proc.stdout
    assert f"left idle: {socket.gethostname()} (2 V100-SXM2-32GB)" in proc.stderr


def test_tune_wrapper_needs_model_and_batch(tmp_path):
    inv = REPO / "examples" / "llama2" / "7b" / "inventory.yaml"
    proc = _run([REPO / "scripts" / "tune.sh", inv, tmp_path, "--global-batch-size", "8"])
    assert proc.returncode == 1 and "missing --model" in proc.stderr


def test_tune_wrapper_writes_plan_report_and_args(tmp_path):
    inv = REPO / "examples" / "llama2" / "7b" / "inventory.yaml"
    proc = _run([REPO / "scripts" / "tune.sh", inv, tmp_path / "out", "--model", "llama2-7b",
                 "--global-batch-size", "64", "--quiet"])
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / "out" / "megatron_args.txt").read_text().split()
    assert args[-2:] == ["--hetero-plan", str(tmp_path / "out" / "plan.yaml")]
    assert args[args.index("--global-batch-size") + 1] == "64"
    assert (tmp_path / "out" / "report.json").stat().st_size > 0


def test_slurm_setup_is_idempotent(slurm_cluster):
    """A second run on a healthy cluster restarts nothing and rewrites nothing."""
    if os.geteuid() != 0:
        pytest.skip(".ci/slurm-setup.sh needs root")
    proc = subprocess.run(["bash", str(REPO / ".ci" / "slurm-setup.sh"), "--no-install"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ready:" in proc.stdout
    assert "starting" not in proc.stdout and "writing" not in proc.stdout, proc.stdout


def test_batch_script_node_loss_mode_needs_pool_and_checkpoint(plan4, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    base = dict(SLURM_JOB_ID="7", MH_PLAN=str(plan4), MH_PRETRAIN_SCRIPT=str(script))
    proc = _run(["bash", BATCH], **base, MH_ON_NODE_LOSS="retry")
    assert proc.returncode == 1 and "MH_ON_NODE_LOSS=retry: expected 'replan'" in proc.stderr
    proc = _run(["bash", BATCH], **base, MH_ON_NODE_LOSS="replan")
    assert proc.returncode == 1 and "needs MH_INVENTORY" in proc.stderr
    pool = tmp_path / "pool.yaml"
    pool.write_text("groups:\n  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 2}\n")
    proc = _run(["bash", BATCH, "--train-iters", "4"], **base, MH_ON_NODE_LOSS="replan",
                MH_INVENTORY=str(pool))
    assert proc.returncode == 1 and "needs the run's checkpoint folder: pass --save DIR" in proc.stderr
    # a job Slurm requeued (after a node went down) resumes from the checkpoint: --load added
    proc = _run(["bash", BATCH, "--save", tmp_path / "ck"], **base, MH_ON_NODE_LOSS="replan",
                MH_INVENTORY=str(pool), SLURM_RESTART_COUNT="1", SLURM_NTASKS="3")
    assert f"requeued by Slurm (restart 1): resuming from {tmp_path / 'ck'}" in proc.stdout
    assert proc.returncode == 1 and "the job has 3 tasks" in proc.stderr


def test_submit_passes_pool_and_options_on_for_the_node_loss_mode(plan4, tmp_path):
    """submit.sh exports MH_INVENTORY, its selectors and --sbatch options (one a line) to the
    batch script, which gives them to the resubmission under plan B."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text("#!/bin/sh\nenv | grep '^MH_' > \"$MH_ENV_OUT\"\n")
    (fake / "sbatch").chmod(0o755)
    pool = tmp_path / "pool.yaml"
    pool.write_text("groups:\n  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 2, partition: a}\n"
                    "  - {gpu: V100-SXM2-32GB, nodes: 1, gpus_per_node: 2, partition: v}\n")
    script = tmp_path / "train.py"
    script.write_text("")
    env_out = tmp_path / "env"
    proc = _run([SUBMIT, plan4, "--inventory", pool, "--no-gres", "--sbatch=--time=5"],
                MH_PRETRAIN_SCRIPT=str(script), MH_ENV_OUT=str(env_out),
                PATH=f"{fake}{os.pathsep}{_env()['PATH']}")
    assert proc.returncode == 0, proc.stderr
    seen = env_out.read_text()
    assert f"MH_INVENTORY={pool}\n" in seen and "MH_SUBMIT_SPEC=--no-gres\n" in seen
    assert "MH_SUBMIT_COMMON=--common=--time=5\n" in seen and f"MH_BATCH_SCRIPT={BATCH}" in seen
    # the mode asks Slurm to keep the job when a node goes down, else to requeue it
    proc = _run([SUBMIT, plan4, "--inventory", pool, "--no-gres", "--dry-run"],
                MH_PRETRAIN_SCRIPT=str(script), MH_ON_NODE_LOSS="replan")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("--no-kill --requeue --open-mode=append --nodes=1") == 2


@pytest.mark.parametrize("script", ["tune.sh", "launch_torchrun.sh", "slurm/submit.sh"])
def test_a_python_without_the_package_is_named(script, tmp_path):
    """Issue 32 A.11: with a Python that lacks megatron_hetero the scripts said the plan "does
    not validate"; they now say which Python and what to set."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    inv = REPO / "examples" / "llama2" / "7b" / "inventory.yaml"
    plan = REPO / "examples" / "llama2" / "7b" / "plan.yaml"
    args = {"tune.sh": [inv, tmp_path / "out", "--model", "llama2-7b", "--global-batch-size", "8"],
            "launch_torchrun.sh": [tmp_path / "hosts", plan],
            "slurm/submit.sh": [plan]}[script]
    (tmp_path / "hosts").write_text("h0 A100-SXM-80GB 8\n")
    (tmp_path / "pretrain_gpt.py").write_text("")
    proc = _run([REPO / "scripts" / script, *args], MH_PYTHON=str(fake),
                MEGATRON_LM=str(tmp_path), MH_DRY_RUN="1")
    assert proc.returncode == 1
    assert f"{fake} cannot import megatron_hetero: set MH_PYTHON" in proc.stderr
    assert "does not validate" not in proc.stderr
