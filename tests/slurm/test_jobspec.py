"""megatron_hetero.launch.jobspec: Slurm components per GPU type, host-file checks (pure logic)."""

from __future__ import annotations

import pytest

from megatron_hetero.launch import jobspec
from megatron_hetero.errors import HeteroError
from megatron_hetero.hardware.catalog import load_catalog
from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.plan import load_plan

from .conftest import PLAN4

A100, V100 = "A100-SXM-80GB", "V100-SXM2-32GB"


@pytest.fixture
def plan(tmp_path):
    path = tmp_path / "plan.yaml"
    # Put V100 on stage 0 so that rank 0 is a V100: components must follow rank order.
    path.write_text(PLAN4.replace(A100, "@@").replace(V100, A100).replace("@@", V100)
                    .replace("num_layers: 1}", "num_layers: 2}").replace("num_layers: 3}", "num_layers: 2}"))
    return load_plan(path)


def inventory(**extra):
    return inventory_from_data({"groups": [
        {"gpu": A100, "nodes": 1, "gpus_per_node": 8, **extra.get(A100, {})},
        {"gpu": V100, "nodes": 2, "gpus_per_node": 1, **extra.get(V100, {})}]}, source="inv.yaml")


def test_components_follow_rank_order_and_count_nodes(plan):
    comps = jobspec.slurm_components(
        plan, inventory(), partitions={A100: "a100", V100: "v100"})
    assert [c.device_type for c in comps] == [plan.device_type_of_rank(0), A100]
    by_type = {c.device_type: c for c in comps}
    assert sum(c.num_gpus for c in comps) == plan.world_size
    # V100 nodes hold 1 GPU each: 2 GPUs need 2 nodes; A100 nodes hold 8: 2 GPUs fit on 1.
    assert (by_type[V100].nodes, by_type[A100].nodes) == (2, 1)
    assert by_type[V100].sbatch_args() == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
                                           "--partition=v100", "--gpus-per-node=1"]


def test_sbatch_args_separate_components_and_repeat_common(plan):
    comps = jobspec.slurm_components(plan, gpus_per_node=4, constraints={A100: "a100", V100: "v100"})
    args = jobspec.sbatch_args(comps, gres=False, common=["--time=5"])
    assert args.count(":") == 1
    first, second = args[:args.index(":")], args[args.index(":") + 1:]
    assert first[0] == second[0] == "--time=5"
    assert "--constraint=v100" in first and "--constraint=a100" in second
    assert not any(a.startswith("--gpus-per-node") for a in args)


def test_inventory_partitions_used_and_flags_override(plan):
    inv = inventory(**{A100: {"partition": "gpu-a"}, V100: {"constraint": "volta"}})
    comps = {c.device_type: c for c in jobspec.slurm_components(plan, inv)}
    assert (comps[A100].partition, comps[V100].constraint) == ("gpu-a", "volta")
    comps = {c.device_type: c for c in jobspec.slurm_components(plan, inv, partitions={A100: "x"})}
    assert comps[A100].partition == "x"


def test_mixed_plan_without_selector_is_refused(plan):
    with pytest.raises(HeteroError, match="nothing selects the nodes of .*V100"):
        jobspec.slurm_components(plan, gpus_per_node=8, partitions={A100: "a100"})


def test_missing_gpus_per_node_and_unused_mapping(plan):
    with pytest.raises(HeteroError, match="--gpus-per-node"):
        jobspec.slurm_components(plan, partitions={A100: "a", V100: "v"})
    with pytest.raises(HeteroError, match="H100-SXM-80GB, which .* does not use"):
        jobspec.slurm_components(plan, gpus_per_node=8,
                                 partitions={A100: "a", V100: "v", "H100-SXM-80GB": "h"})


def test_parse_mapping_resolves_aliases_and_rejects_bad_items():
    cat = load_catalog()
    assert jobspec.parse_mapping([f"{A100.lower()}=a100"], cat, option="--partition") == {A100: "a100"}
    with pytest.raises(HeteroError, match="GPU_TYPE=NAME"):
        jobspec.parse_mapping(["a100"], cat, option="--partition")
    with pytest.raises(HeteroError, match="catalog"):
        jobspec.parse_mapping(["NoSuchGPU=x"], cat, option="--partition")


def test_hostfile_checked_against_plan(plan, tmp_path):
    cat = load_catalog()
    good = tmp_path / "hosts"
    good.write_text(f"# comment\nh0 {V100} 2\n\nh1 {A100}   # 2 from the default\n")
    entries = jobspec.read_hostfile(good, cat, default_gpus=2)
    assert [(e.host, e.device_type, e.num_gpus) for e in entries] == [("h0", V100, 2), ("h1", A100, 2)]
    jobspec.check_hosts(plan, entries)
    short = [entries[0], jobspec.HostEntry(host="h1", device_type=A100, num_gpus=1)]
    with pytest.raises(HeteroError, match=r"offers 1x A100-SXM-80GB, 2x V100.*needs 2x A100.*"
                                          r": 1 more A100-SXM-80GB$"):
        jobspec.check_hosts(plan, short, hostfile="hosts")
    with pytest.raises(HeteroError, match="no NUM_GPUS"):
        jobspec.read_hostfile(good, cat)
    bad = tmp_path / "bad"
    bad.write_text(f"h0 {A100} two\n")
    with pytest.raises(HeteroError, match=r"bad:1: NUM_GPUS 'two'"):
        jobspec.read_hostfile(bad, cat)


def test_main_prints_and_fails_with_one_line(plan4, capsys):
    assert jobspec.main([str(plan4), "--gpus-per-node", "2", "--partition", f"{A100}=a100",
                         "--partition", f"{V100}=v100", "--print", "device-types"]) == 0
    assert capsys.readouterr().out.strip() == f"{A100},{V100}"
    assert jobspec.main([str(plan4), "--print", "world-size"]) == 0
    assert capsys.readouterr().out.strip() == "4"
    assert jobspec.main([str(plan4), "--gpus-per-node", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("megatron-hetero jobspec: error:") and err.count("\n") == 1


def test_mesh_plan_components_follow_its_meshes(capsys):
    """A mesh plan (format 2): one component per device type in the meshes' rank order, with
    the GPUs each type's meshes need; a host file is checked against them."""
    from megatron_hetero.plan import load_any_plan

    from ..conftest import REPO

    path = REPO / "examples/meshes/3090-t4-plan.yaml"
    plan = load_any_plan(path)
    comps = jobspec.slurm_components(plan, gpus_per_node=4,
                                     partitions={"RTX3090-24GB": "a", "T4-16GB": "b"})
    assert [(c.device_type, c.num_gpus, c.nodes) for c in comps] == [
        ("RTX3090-24GB", 16, 4), ("T4-16GB", 16, 4)]
    assert jobspec.main([str(path), "--print", "world-size"]) == 0
    assert capsys.readouterr().out.strip() == "32"
    assert jobspec.main([str(path), "--gpus-per-node", "8", "--print", "device-types",
                         "--partition", "RTX3090-24GB=a", "--partition", "T4-16GB=b"]) == 0
    assert capsys.readouterr().out.strip() == "RTX3090-24GB,T4-16GB"


def test_a_larger_hostfile_gives_the_plan_its_first_hosts(plan, tmp_path, capsys):
    """Issue 32 A.4: the whole pool's host file; the plan takes the first hosts of each type in
    file order (the last one in part) and says which stay idle."""
    entries = [jobspec.HostEntry(host="v0", device_type=V100, num_gpus=1),
               jobspec.HostEntry(host="a0", device_type=A100, num_gpus=8),
               jobspec.HostEntry(host="v1", device_type=V100, num_gpus=1),
               jobspec.HostEntry(host="v2", device_type=V100, num_gpus=1),
               jobspec.HostEntry(host="a1", device_type=A100, num_gpus=8)]
    picked = jobspec.check_hosts(plan, entries)
    assert [(e.host, e.device_type, e.num_gpus) for e in picked] == [
        ("v0", V100, 1), ("a0", A100, 2), ("v1", V100, 1)]
    assert jobspec.left_out(entries, picked) == [f"6 of a0's 8 {A100}", f"v2 (1 {V100})",
                                                 f"a1 (8 {A100})"]
    path, hosts = tmp_path / "plan.yaml", tmp_path / "hosts"
    from megatron_hetero.plan import save_plan
    save_plan(plan, path)
    hosts.write_text("".join(f"{e.host} {e.device_type} {e.num_gpus}\n" for e in entries))
    assert jobspec.main([str(path), "--hostfile", str(hosts), "--print", "hosts"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"v0 {V100} 1", f"a0 {A100} 2", f"v1 {V100} 1"]
    assert f"runs on 3 of its 5 hosts (v0, a0, v1); left idle: 6 of a0's 8 {A100}" in err
    # the exact host file says nothing on stderr
    hosts.write_text(f"v0 {V100} 1\na0 {A100} 2\nv1 {V100} 1\n")
    assert jobspec.main([str(path), "--hostfile", str(hosts), "--print", "hosts"]) == 0
    assert capsys.readouterr().err == ""
