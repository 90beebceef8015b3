"""Issue 32 part B: each kind of bad input gets one line naming the file, the field, what was
found and what was expected, in bounded time, with no file lost. One test (or a parametrized
family) per mechanism; ``scripts/probe/bad_inputs.py`` runs the same cases as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_hetero._schema import read_yaml, to_data
from megatron_hetero.cli import main
from megatron_hetero.cost.profile_file import load_profile, save_profile
from megatron_hetero.errors import HeteroError, SchemaError
from megatron_hetero.hardware.catalog import load_catalog
from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.launch.checkpoint import read_checkpoint
from megatron_hetero.launch.jobspec import check_hosts, read_hostfile
from megatron_hetero.outputs import Outputs, own_descriptor
from megatron_hetero.plan.format2 import load_any_plan

from .fake_checkpoint import ARGS, write_checkpoint
from .test_profile_file import _profile_v2

REPO = Path(__file__).resolve().parents[1]
INV = {"groups": [{"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 8}]}
GPU = dict(vendor="NVIDIA", bf16_tflops=100, bf16=True, fp32_tflops=20, memory_gb=32,
           memory_bandwidth_gb_s=900, intra_node_link="NVLink", intra_node_bandwidth_gb_s=150,
           efficiency=0.5)


def _one_line(exc: BaseException, *words: str) -> str:
    text = str(exc)
    assert "\n" not in text, text
    for w in words:
        assert w in text, text
    return text


# -- outputs: streams, indirect inputs, file names ---------------------------------------------

def test_a_descriptor_path_is_written_through_the_descriptor_and_the_file_kept(tmp_path):
    """``-o /dev/stdout >> log`` replaced the log with the plan; now the plan is appended."""
    log = tmp_path / "log"
    log.write_text("old line\n")
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    inode = log.stat().st_ino
    try:
        target = f"/dev/fd/{fd}"
        assert own_descriptor(target) == fd and own_descriptor("/dev/stdout") == 1
        with Outputs("t", inputs={}, outputs={"-o": target}) as out:
            out.staged(target).write_text("plan\n")
            assert log.read_text() == "old line\n"  # nothing before success
    finally:
        os.close(fd)
    assert log.read_text() == "old line\nplan\n" and log.stat().st_ino == inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log"]


def test_another_process_descriptor_is_refused(tmp_path):
    target = f"/proc/{os.getppid()}/fd/1"
    assert own_descriptor(target) == -1
    with pytest.raises(HeteroError) as got:
        Outputs("t", inputs={}, outputs={"-o": target})
    _one_line(got.value, "another process's open file")


def test_an_output_inside_an_input_folder_or_an_input_found_later_is_refused(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "t.txt").write_text("2")
    with pytest.raises(HeteroError) as got:
        Outputs("t", inputs={"CHECKPOINT": str(tmp_path / "ck")},
                outputs={"-o": str(tmp_path / "ck" / "t.txt")})
    _one_line(got.value, "lies inside the input CHECKPOINT")
    (tmp_path / "old.yaml").write_text("old")
    out = Outputs("t", inputs={}, outputs={"-o": str(tmp_path / "old.yaml")})
    with pytest.raises(HeteroError) as got:
        out.add_input("the old plan (args.hetero_plan)", tmp_path / "old.yaml")
    _one_line(got.value, "it is also the input the old plan")
    assert (tmp_path / "old.yaml").read_text() == "old"


@pytest.mark.parametrize("name, words", [
    ("newdir/", "a folder's path"),
    ("loop", "a symlink loop"),
    ("p" * 256, "a name of 256 bytes; expected at most 255"),
])
def test_bad_output_names_are_refused_before_any_work(tmp_path, name, words):
    os.symlink("loop2", tmp_path / "loop")
    os.symlink("loop", tmp_path / "loop2")
    target = str(tmp_path / name) + ("/" if name.endswith("/") else "")
    with pytest.raises(HeteroError) as got:
        Outputs("t", inputs={}, outputs={"-o": target})
    _one_line(got.value, words)
    assert not (tmp_path / "newdir").exists()


def test_a_legal_255_byte_name_is_written(tmp_path):
    """Its staged name (``.NAME.partial-PID.EXT``) was longer than 255 bytes, so it failed
    after the search; the staged name is cut to fit and tried before any work."""
    target = tmp_path / ("p" * 250 + ".yaml")
    with Outputs("t", inputs={}, outputs={"-o": str(target)}) as out:
        out.staged(target).write_text("plan")
    assert target.read_text() == "plan" and len(os.listdir(tmp_path)) == 1


def test_a_symlink_loop_as_input_is_one_line(tmp_path, capsys):
    os.symlink("b.yaml", tmp_path / "a.yaml")
    os.symlink("a.yaml", tmp_path / "b.yaml")
    assert main(["validate", str(tmp_path / "a.yaml")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Too many levels of symbolic links" in err, err


def test_a_yaml_merge_key_is_refused_by_name(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_text("base: &b {gpu: A100-SXM-80GB}\ngroups:\n  - <<: *b\n    nodes: 2\n")
    with pytest.raises(SchemaError) as got:
        read_yaml(path)
    _one_line(got.value, "line 3, column 5", "a YAML merge key (<<)")


# -- absurd but finite numbers, and profiles' zero or negative figures ------------------------

@pytest.mark.parametrize("edit, where", [
    (lambda d: d.update(inter_group_bandwidth_gb_s=1e-300), "inter_group_bandwidth_gb_s"),
    (lambda d: d.update(gpus={"A100-SXM-80GB": {"bf16_tflops": 1e299}}), "gpus.A100-SXM-80GB.bf16_tflops"),
    (lambda d: d.update(gpus={"A100-SXM-80GB": {"memory_bandwidth_gb_s": 1e-300}}),
     "gpus.A100-SXM-80GB.memory_bandwidth_gb_s"),
    (lambda d: d["groups"][0].update(nic_bandwidth_gb_s=1e8), "groups[0].nic_bandwidth_gb_s"),
    (lambda d: d["groups"][0].update(host_memory_gb=1e12), "groups[0].host_memory_gb"),
])
def test_absurd_figures_in_an_inventory_are_refused_with_their_bounds(edit, where):
    data = yaml.safe_load(yaml.safe_dump(INV))
    edit(data)
    with pytest.raises(SchemaError) as got:
        inventory_from_data(data, source="inv.yaml")
    _one_line(got.value, f"inv.yaml: {where}: found", " from ", "a typo?")


@pytest.mark.parametrize("edit, where", [
    (lambda d: d["entries"][0]["memory"].update(activation_bytes_per_layer=0),
     "entries[0].memory.activation_bytes_per_layer"),
    (lambda d: d["entries"][0]["memory"].update(peak_bytes=-5), "entries[0].memory.peak_bytes"),
    (lambda d: d["communication"].update(p2p_latency_s=0.0), "communication.p2p_latency_s"),
    (lambda d: d["communication"]["p2p"][0].update(gb_s=-1.0), "communication.p2p[0].gb_s"),
    (lambda d: d["communication"]["all_reduce"][0].update(bytes=0), "communication.all_reduce[0].bytes"),
])
def test_zero_or_negative_measurements_in_a_profile_are_refused(tmp_path, edit, where):
    path = tmp_path / "p.yaml"
    save_profile(_profile_v2(), path)
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(SchemaError) as got:
        load_profile(path)
    _one_line(got.value, f"{where}: found")


def test_a_plans_own_gpu_entry_has_the_same_bounds(tmp_path, capsys):
    text = (REPO / "examples/llama2/7b/plan.yaml").read_text()
    entry = {**GPU, "bf16_tflops": 1e-300}
    (tmp_path / "p.yaml").write_text(text + yaml.safe_dump({"gpus": {"X1": entry}}))
    assert main(["validate", str(tmp_path / "p.yaml")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gpus.X1.bf16_tflops: found 1e-300" in err, err


# -- custom GPU entries ---------------------------------------------------------------------

@pytest.mark.parametrize("name, fields, words", [
    ("X1", {"torch_device": "npu"}, "X1.torch_device: found 'npu'; expected 'cuda'"),
    ("X1", {"vendor": "Huawei", "dist_backend": "nccl"}, "X1.dist_backend: found 'nccl'; expected 'hccl'"),
    ("X1", {"vendor": "Acme", "torch_device": "npu", "dist_backend": "nccl"}, "X1.dist_backend"),
    ("X1", {"vendor": " "}, "X1.vendor: found ' '"),
    ("", {}, "a GPU name with at least one letter or digit"),
    ("--", {}, "a GPU name with at least one letter or digit"),
])
def test_custom_gpu_entries_that_contradict_themselves_or_have_no_name(name, fields, words):
    data = {"groups": [{"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 8}],
            "gpus": {name: {**GPU, **fields}}}
    with pytest.raises(SchemaError) as got:
        inventory_from_data(data, source="inv.yaml")
    _one_line(got.value, "inv.yaml: gpus.", words)


# -- checkpoints ----------------------------------------------------------------------------

@pytest.mark.parametrize("damage, words", [
    ({"args": {**ARGS, "num_layers": "four"}}, "args.num_layers: found 'four'; expected a positive integer"),
    ({"args": {**ARGS, "tensor_model_parallel_size": "x"}}, "args.tensor_model_parallel_size"),
    ({"args": {**ARGS, "make_vocab_size_divisible_by": 0}}, "args.make_vocab_size_divisible_by: found 0"),
    ({"args": {**ARGS, "swiglu": "yes"}}, "args.swiglu: found 'yes'; expected true or false"),
    ({"drop": ("hidden_size",)}, "args.hidden_size: found nothing"),
    ({"content_metadata": {"distrib_optim_sharding_type": []}},
     "content_metadata.distrib_optim_sharding_type: found []"),
])
def test_damaged_or_foreign_saved_arguments_are_one_line(tmp_path, damage, words):
    write_checkpoint(tmp_path / "ck", **damage)
    with pytest.raises(SchemaError) as got:
        read_checkpoint(tmp_path / "ck")
    _one_line(got.value, "common.pt: ", words)


@pytest.mark.parametrize("tracker", ["\u00b2", "9" * 5000, "-2", "2 3", "iter_2"])
def test_odd_tracker_contents_are_one_line(tmp_path, tracker):
    write_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "latest_checkpointed_iteration.txt").write_text(tracker)
    with pytest.raises(SchemaError) as got:
        read_checkpoint(tmp_path / "ck")
    _one_line(got.value, "latest_checkpointed_iteration.txt: found", "ASCII digits")


@pytest.mark.parametrize("meta", ['[]', 'null', '{"sharded_backend": 5}', '{"a": ' * 100000, b'\xff'])
def test_bad_metadata_is_one_line(tmp_path, meta):
    write_checkpoint(tmp_path / "ck")
    path = tmp_path / "ck" / "iter_0000002" / "metadata.json"
    path.write_bytes(meta if isinstance(meta, bytes) else meta.encode())
    if meta == '{"sharded_backend": 5}':  # read; replan refuses the format
        assert read_checkpoint(tmp_path / "ck").format == "5"
        return
    with pytest.raises(SchemaError) as got:
        read_checkpoint(tmp_path / "ck")
    _one_line(got.value, "metadata.json: found not a JSON object")


def _small_pool(tmp_path) -> Path:
    (tmp_path / "inv.yaml").write_text("groups:\n  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 2}\n")
    return tmp_path / "inv.yaml"


def test_replan_writes_only_a_plan_its_validate_accepts(tmp_path, capsys, monkeypatch):
    write_checkpoint(tmp_path / "ck")
    inv = _small_pool(tmp_path)
    argv = ["replan", str(tmp_path / "ck"), str(inv), "-o", str(tmp_path / "b.yaml")]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["validate", str(tmp_path / "b.yaml"), "--inventory", str(inv)]) == 0
    (tmp_path / "b.yaml").write_text("old")
    import megatron_hetero.tuner.replan as replan

    def refuse(plan, inventory, *, source, memory_check=True, memory_headroom=0.1):
        raise SchemaError(source, "pipelines[0]", 1, "what validate wants")

    monkeypatch.setattr(replan, "validate_plan", refuse)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "b.yaml: pipelines[0]" in err and "not written" in err, err
    assert (tmp_path / "b.yaml").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.yaml", "ck", "inv.yaml"]


def test_replan_output_into_the_checkpoint_or_onto_the_plan_its_args_name(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text((REPO / "tests/data/plan_a100_v100.yaml").read_text())
    write_checkpoint(tmp_path / "ck", args={**ARGS, "hetero_plan": str(tmp_path / "a.yaml")})
    inv = _small_pool(tmp_path)
    tracker = tmp_path / "ck" / "latest_checkpointed_iteration.txt"
    for target, words in ((tracker, "lies inside the input CHECKPOINT_OR_PLAN"),
                          (tmp_path / "a.yaml", "args.hetero_plan")):
        before = target.read_text()
        assert main(["replan", str(tmp_path / "ck"), str(inv), "-o", str(target)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
        assert target.read_text() == before


# -- launch helpers -------------------------------------------------------------------------

def test_a_host_listed_twice_is_refused(tmp_path):
    (tmp_path / "hosts").write_text("n1 A100-SXM-80GB 8\n# x\nn1 V100-SXM2-32GB 8\n")
    with pytest.raises(HeteroError) as got:
        read_hostfile(tmp_path / "hosts", load_catalog())
    _one_line(got.value, "hosts:3: found the host 'n1' a second time (first on line 1)")


def test_hosts_that_split_a_tensor_parallel_group_are_refused(tmp_path):
    plan = load_any_plan(REPO / "examples/llama2/70b/plan.yaml")
    assert plan.tensor_model_parallel_size == 2
    lines = [f"a{i} A800-80GB 3" for i in range(10)] + ["a10 A800-80GB 2"]
    lines += [f"b{i} A40-48GB 8" for i in range(4)]
    (tmp_path / "hosts").write_text("\n".join(lines) + "\n")
    entries = read_hostfile(tmp_path / "hosts", plan.catalog)
    with pytest.raises(HeteroError) as got:
        check_hosts(plan, entries, source="plan.yaml", hostfile="hosts")
    _one_line(got.value, "host a0: found 3 A800-80GB GPUs; expected a multiple of 2")
    lines = [f"a{i} A800-80GB 8" for i in range(4)] + [f"b{i} A40-48GB 8" for i in range(4)]
    (tmp_path / "hosts").write_text("\n".join(lines) + "\n")
    check_hosts(plan, read_hostfile(tmp_path / "hosts", plan.catalog), source="p", hostfile="h")


@pytest.mark.parametrize("option", ["-o", "--output=x.yaml", "-ox.yaml", "--report"])
def test_tune_sh_refuses_the_outputs_it_sets_itself(tmp_path, option):
    (tmp_path / "inv.yaml").write_text(yaml.safe_dump(INV))
    run = subprocess.run([str(REPO / "scripts/tune.sh"), "inv.yaml", "out", "--model", "llama2-7b",
                          "--global-batch-size", "64", option, "elsewhere.yaml"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert "tune.sh writes OUTDIR/plan.yaml and OUTDIR/report.json itself" in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inv.yaml"]


def test_submit_sh_validates_against_its_inventory(tmp_path):
    (tmp_path / "small.yaml").write_text(yaml.safe_dump(INV))
    run = subprocess.run([str(REPO / "scripts/slurm/submit.sh"), str(REPO / "examples/llama2/7b/plan.yaml"),
                          "--inventory", "small.yaml", "--dry-run", "--no-gres"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MH_PYTHON": sys.executable, "MH_PRETRAIN_SCRIPT": "x",
                              "PYTHONPATH": str(REPO)})
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1, run.stderr  # validate's reason on submit's line
    assert "does not validate against small.yaml: " in run.stderr, run.stderr
    assert "pipelines" in run.stderr and "expected" in run.stderr, run.stderr


# -- the documented limits ------------------------------------------------------------------

def test_a_mesh_plans_timeline_has_the_op_count_limit(tmp_path, capsys):
    text = (REPO / "examples/meshes/3090-t4-plan.yaml").read_text()
    text = text.replace("global_batch_size: 128", "global_batch_size: 800000000")
    (tmp_path / "p.yaml").write_text(text.replace("num_microbatches: 16", "num_microbatches: 100000000"))
    assert main(["simulate", str(tmp_path / "p.yaml"), "--inventory",
                 str(REPO / "examples/meshes/inventory.yaml"), "--timeline", str(tmp_path / "t.png")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected at most 2,000,000" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml"]
