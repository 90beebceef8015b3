"""The `megatron-hetero` command line: exit codes and messages (tier 1)."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys

import pytest

from megatron_hetero import __version__
from megatron_hetero.cli import main

from .conftest import EXAMPLE_PLANS, REPO

PLAN = REPO / "tests/data/plan_a100_v100.yaml"


def test_validate_accepts_every_example(capsys):
    for plan in EXAMPLE_PLANS:
        assert main(["validate", str(plan)]) == 0
        assert "valid plan" in capsys.readouterr().out


def test_validate_rejects_with_field_path(tmp_path, capsys):
    bad = tmp_path / "plan.yaml"
    bad.write_text(PLAN.read_text().replace("num_microbatches: 58", "num_microbatches: 57"))
    assert main(["validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-hetero validate: error: {bad}: global_batch_size: found 128")
    assert err.count("\n") == 1  # one message, no traceback


def test_validate_against_inventory(tmp_path, capsys):
    inv = tmp_path / "inventory.yaml"
    inv.write_text("groups:\n  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 8}\n")
    assert main(["validate", str(PLAN), "--inventory", str(inv)]) == 1
    assert "V100-SXM2-32GB; expected at most 0" in capsys.readouterr().err
    inv.write_text(inv.read_text() + "  - {gpu: Tesla V100-SXM2-32GB, nodes: 1, gpus_per_node: 8}\n")
    # the README's hand-written plan is tight: its V100 stage needs 44 GB under the cost model
    assert main(["validate", str(PLAN), "--inventory", str(inv)]) == 1
    assert "stage 1 (V100-SXM2-32GB, layers 14-31) needs 44.2 GB of 30.6" in capsys.readouterr().err
    assert main(["validate", str(PLAN), "--inventory", str(inv), "--no-memory-check"]) == 0


def test_args_prints_one_shell_line(capsys):
    assert main(["args", str(PLAN)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    argv = shlex.split(out)
    assert argv[-2:] == ["--hetero-plan", str(PLAN)]
    assert argv[argv.index("--pipeline-model-parallel-size") + 1] == "2"


def test_console_script_version_and_help():
    exe = [sys.executable, "-m", "megatron_hetero.cli"]
    out = subprocess.run([*exe, "--version"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"megatron-hetero {__version__}"
    helptext = subprocess.run([*exe, "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("validate", "args"):
        assert command in helptext


def test_tuner_side_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['megatron'] = None\n"
            "import megatron_hetero, megatron_hetero.cli, megatron_hetero.cli.plan_commands\n"
            "import megatron_hetero.runtime.arguments\n"
            "for name in ('megatron_hetero.tuner', 'megatron_hetero.sim.step', 'megatron_hetero.cost'):\n"
            "    try:\n"
            "        __import__(name)\n"
            "    except ModuleNotFoundError as e:\n"
            "        if e.name != name: raise\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_command_is_a_usage_error():
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


# A custom card of the same vendor as the A100s it is tuned beside (a plan on two vendors'
# GPUs is refused by validate: tests/test_vendors.py).
ACME_NPU = ("{vendor: NVIDIA, bf16_tflops: 400, bf16: true, fp32_tflops: 60, memory_gb: 64, "
            "memory_bandwidth_gb_s: 2000, intra_node_link: PCIe5, intra_node_bandwidth_gb_s: 64, "
            "efficiency: 0.5, aliases: ['ACME NPU-9 Pro']}")


def test_tuned_plan_on_a_custom_gpu_carries_it_to_validate_and_args(tmp_path, capsys):
    import yaml

    from megatron_hetero.hardware import load_inventory
    from megatron_hetero.plan import load_plan

    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"gpus:\n  Acme-NPU: {ACME_NPU}\n  NVIDIA A100-SXM4-80GB: {{efficiency: 0.55}}\n"
                   "groups:\n  - {gpu: ACME NPU-9 Pro, nodes: 1, gpus_per_node: 4}\n"
                   "  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 4}\n")
    model = tmp_path / "model.yaml"
    model.write_text("{name: small, num_layers: 8, hidden_size: 1024, ffn_hidden_size: 2816, "
                     "num_attention_heads: 8, num_query_groups: 8, vocab_size: 32000, "
                     "seq_length: 1024}\n")
    plan_path = tmp_path / "plan.yaml"
    assert main(["tune", str(inv), "--model", str(model), "--global-batch-size", "32", "-q",
                 "-o", str(plan_path)]) == 0
    capsys.readouterr()
    data = yaml.safe_load(plan_path.read_text())
    used = {st["device_type"] for p in data["pipelines"] for st in p["stages"]}
    assert "Acme-NPU" in used  # the fastest card of the pool
    # every type of the plan is custom or overridden, so every one is written out in full
    assert set(data["gpus"]) == used
    assert data["gpus"]["Acme-NPU"]["bf16_tflops"] == 400
    catalog = load_inventory(inv).catalog
    for name in used:  # the inventory's figures, overrides applied (A100: efficiency 0.55)
        assert load_plan(plan_path).gpus[name] == catalog.get(name)
    # no inventory needed any more
    assert main(["validate", str(plan_path)]) == 0
    assert "valid plan" in capsys.readouterr().out
    assert main(["args", str(plan_path)]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"--hetero-plan {plan_path}")
    assert load_plan(plan_path).catalog.resolve("acme npu-9 pro") == "Acme-NPU"
    assert main(["validate", str(plan_path), "--inventory", str(inv)]) == 0
    capsys.readouterr()
    # the launchers' job spec reads a host file naming the custom type, without the inventory
    from megatron_hetero.launch import jobspec
    hosts = tmp_path / "hosts"
    counts = load_plan(plan_path).device_counts()
    hosts.write_text("".join(f"node{i} {gpu} {n}\n" for i, (gpu, n) in enumerate(counts.items())))
    assert jobspec.main([str(plan_path), "--print", "hosts", "--hostfile", str(hosts)]) == 0
    assert "node0 " in capsys.readouterr().out
    # an inventory that changed the card's figures since: one line naming the plan's field
    inv.write_text(inv.read_text().replace("bf16_tflops: 400", "bf16_tflops: 300"))
    for command in (["validate"], ["args"]):
        assert main([*command, str(plan_path), "--inventory", str(inv)]) == 1
        err = capsys.readouterr().err
        assert f"{plan_path}: gpus.Acme-NPU.bf16_tflops: found 400.0; expected 300.0" in err
        assert err.count("\n") == 1


@pytest.mark.parametrize("argv", [
    ["args", "--one-per-line", str(REPO / "examples/llama2/7b/plan.yaml")],
    ["validate", str(REPO / "examples/llama2/7b/plan.yaml")],
    ["tune", "--help"],
])
def test_a_reader_that_left_ends_the_output_quietly(argv):
    """`megatron-hetero ... | head -1`: stdout is a pipe nobody reads; no BrokenPipeError
    traceback, the command's own exit code (issue 32)."""
    read, write = os.pipe()
    os.close(read)  # every write meets the closed pipe
    try:
        proc = subprocess.run([sys.executable, "-m", "megatron_hetero.cli", *argv], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120, cwd=REPO)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (0, "")


def test_tune_into_a_closed_pipe_still_writes_its_plan(tmp_path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text("groups:\n  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 2}\n")
    plan = tmp_path / "plan.yaml"
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "megatron_hetero.cli", "tune", str(inv),
                               "--model", "llama2-7b", "--global-batch-size", "4",
                               "--seq-length", "512", "-o", str(plan)], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120, cwd=REPO)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert main(["validate", str(plan)]) == 0


def test_rehearse_refuses_a_plan_larger_than_the_machine_before_loading_torch():
    """Issue 32 A.11: it spent 11 s importing megatron-core before saying so."""
    plan = REPO / "examples/llama2/70b/plan.yaml"  # 64 ranks
    code = ("import sys; from megatron_hetero.cli import main; "
            f"rc = main(['rehearse', {str(plan)!r}]); print(rc, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.stdout.split() == ["1", "False"], proc.stderr
    assert "the plan has 64 ranks; this rehearsal starts at most 16" in proc.stderr


def test_simulate_quiet_and_what_it_wrote(tmp_path, capsys):
    plan = REPO / "examples/llama2/7b/plan.yaml"
    inv = REPO / "examples/llama2/7b/inventory.yaml"
    out = tmp_path / "sim.json"
    assert main(["simulate", str(plan), "--inventory", str(inv), "--json", str(out)]) == 0
    full = capsys.readouterr().out
    assert "  pipeline 0 stage 0 (A100-SXM-80GB): busy" in full and "┃" in full
    assert full.rstrip().endswith(f"wrote {out}")
    assert main(["simulate", str(plan), "--inventory", str(inv), "-q", "--json", str(out)]) == 0
    quiet = capsys.readouterr().out
    assert "stage 0" not in quiet and "┃" not in quiet
    assert quiet.startswith("predicted: step 14.900 s") and quiet.rstrip().endswith(f"wrote {out}")


def test_tune_help_says_what_runs_mesh_plans(capsys):
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "refuses mesh plans" not in text
    assert "the runtime runs mesh plans from megatron-core 0.17" in text


@pytest.mark.parametrize("has, distributed", [(True, True), (False, True), (True, False)])
def test_args_saves_the_optimizer_fully_reshardable_where_megatron_can(tmp_path, capsys,
                                                                      monkeypatch, has,
                                                                      distributed):
    """With the distributed optimizer, `args` adds --dist-ckpt-optim-fully-reshardable where the
    installed Megatron-LM has it, so that replan may change TP and PP (issue 32 A.7)."""
    from megatron_hetero.cli import plan_commands
    from megatron_hetero.plan import load_plan, save_plan

    plan = load_plan(REPO / "examples/llama2/7b/plan.yaml")
    path = tmp_path / "plan.yaml"
    save_plan(dataclasses.replace(plan, use_distributed_optimizer=distributed), path)
    monkeypatch.setattr(plan_commands, "megatron_training_option",
                        lambda dest: has and dest == "dist_ckpt_optim_fully_reshardable")
    assert main(["args", str(path)]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert ("--dist-ckpt-optim-fully-reshardable" in argv) == (has and distributed)
    assert argv[-2:] == ["--hetero-plan", str(path)]


def test_megatron_options_are_read_from_the_installed_source():
    from megatron_hetero.hardware.optional import have_megatron_core, megatron_training_option

    assert not megatron_training_option("no_such_option_of_megatron")
    if have_megatron_core():  # the venv's megatron-core 0.19.2 ships megatron.training
        assert megatron_training_option("dist_ckpt_optim_fully_reshardable")
