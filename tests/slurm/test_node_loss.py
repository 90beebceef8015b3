"""megatron_hetero.launch.node_loss: lost nodes, the pool left, the restart's arguments (pure logic)."""

from __future__ import annotations

import pytest

from megatron_hetero.launch import node_loss
from megatron_hetero.errors import HeteroError
from megatron_hetero.hardware.inventory import inventory_from_data

from .conftest import PLAN4

A100, V100 = "A100-SXM-80GB", "V100-SXM2-32GB"


def test_lost_states_are_slurms_unavailable_ones():
    for state in ("drained", "draining", "mixed+drain", "ALLOCATED+DRAIN", "down", "down*",
                  "idle*", "fail", "failing", "maint", "reboot_requested", "unknown"):
        assert node_loss.is_lost(state), state
    for state in ("idle", "mixed", "allocated", "completing", "ALLOCATED", "planned"):
        assert not node_loss.is_lost(state), state


def test_checkpoint_folder_and_restart_args():
    args = ["--train-iters", "4", "--save", "/ck", "--save-interval", "2"]
    assert str(node_loss.checkpoint_folder(args)) == "/ck"
    assert str(node_loss.checkpoint_folder(["--save=/a"], override="/b")) == "/b"
    with pytest.raises(HeteroError, match="--save DIR"):
        node_loss.checkpoint_folder(["--train-iters", "4"])
    from pathlib import Path
    assert node_loss.restart_args(args, Path("/ck"))[-2:] == ["--load", "/ck"]
    assert node_loss.restart_args([*args, "--load=/x"], Path("/ck")) == [*args, "--load=/x"]


def test_job_nodes_per_component():
    env = {"SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "a[1-2]",
           "SLURM_JOB_NODELIST_HET_GROUP_1": "v1"}
    expand = {"a[1-2]": ["a1", "a2"], "v1": ["v1"]}.__getitem__
    assert node_loss.job_nodes(env, expand=expand) == [["a1", "a2"], ["v1"]]
    assert node_loss.job_nodes({"SLURM_JOB_NODELIST": "v1"}, expand=expand) == [["v1"]]
    with pytest.raises(HeteroError, match="SLURM_JOB_NODELIST_HET_GROUP_1 unset"):
        node_loss.job_nodes({"SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "a1"},
                            expand=expand)


def _pool():
    return inventory_from_data({"groups": [
        {"gpu": A100, "nodes": 2, "gpus_per_node": 8, "partition": "a100", "hosts": ["a1", "a2"]},
        {"gpu": V100, "nodes": 3, "gpus_per_node": 4, "partition": "v100"}]}, source="inv.yaml")


def test_remaining_inventory_takes_out_named_hosts_and_counts():
    data = node_loss.remaining_inventory(_pool(), {A100: ["a2"], V100: ["v7"]})
    left = inventory_from_data(data, source="left.yaml")
    assert [(g.gpu, g.nodes, g.hosts, g.partition) for g in left.groups] == [
        (A100, 1, ["a1"], "a100"), (V100, 2, None, "v100")]
    data = node_loss.remaining_inventory(_pool(), {V100: ["v1", "v2", "v3"]})
    assert [g["gpu"] for g in data["groups"]] == [A100]  # a group with no node left goes
    with pytest.raises(HeteroError, match="no nodes left"):
        node_loss.remaining_inventory(_pool(), {A100: ["a1", "a2"], V100: ["v1", "v2", "v3"]})


def test_resubmit_args_exclude_the_lost_nodes_and_keep_the_output(tmp_path, capsys):
    plan = tmp_path / "plan-b.yaml"  # PLAN4 with every stage on an A100
    plan.write_text(PLAN4.replace(V100, A100))
    pool = tmp_path / "left.yaml"
    pool.write_text(f"groups:\n  - {{gpu: {A100}, nodes: 1, gpus_per_node: 4, partition: a100}}\n")
    assert node_loss.main(["resubmit", "--plan", str(plan), "--inventory", str(pool),
                           "--exclude", "mh-v100", "--partition", f"{V100}=v100", "--no-gres",
                           "--common=--time=5", "--common=--wait",
                           "--keep=--output=/o/job.out", "--keep=--open-mode=append"]) == 0
    args = capsys.readouterr().out.split()
    # plan B's one component; the first submission's V100 selector is dropped, not refused
    assert args == ["--time=5", "--exclude=mh-v100", "--output=/o/job.out", "--open-mode=append",
                    "--nodes=1", "--ntasks=4", "--ntasks-per-node=4", "--partition=a100"]


def test_lost_refuses_outside_a_job_with_one_line(plan4, tmp_path, capsys):
    pool = tmp_path / "inv.yaml"
    pool.write_text(f"groups:\n  - {{gpu: {A100}, nodes: 1, gpus_per_node: 2, partition: a100}}\n"
                    f"  - {{gpu: {V100}, nodes: 1, gpus_per_node: 2, partition: v100}}\n")
    assert node_loss.main(["lost", "--plan", str(plan4), "--inventory", str(pool), "--checkpoint",
                           str(tmp_path), "-o", str(tmp_path / "left.yaml")], env={}) == 1
    err = capsys.readouterr().err
    assert err.startswith("megatron-hetero node-loss: error: SLURM_") and err.count("\n") == 1
    assert not (tmp_path / "left.yaml").exists()
