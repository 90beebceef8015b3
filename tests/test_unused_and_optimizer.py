"""Issue 32 A.4 (the GPUs a plan leaves idle are named, in the text and in report.json) and
A.5 (the optimizer step of each stage in the table, in `simulate`'s text and in the per-stage
JSON)."""

from __future__ import annotations

import json

import pytest

from megatron_hetero.cli import main
from megatron_hetero.cost import CostModel
from megatron_hetero.hardware.inventory import load_inventory
from megatron_hetero.plan import load_any_plan
from megatron_hetero.sim.step import simulate

A100_T4 = ("groups:\n  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 8}\n"
           "  - {gpu: T4-16GB, nodes: 1, gpus_per_node: 4}\n")
TIGHT = "groups:\n  - {gpu: RTX4090-24GB, nodes: 1, gpus_per_node: 4}\n"
TUNE = ["--model", "llama2-7b", "--seq-length", "1024"]


def test_unused_gpus_in_text_and_report(tmp_path, capsys):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(A100_T4)
    plan, report = tmp_path / "plan.yaml", tmp_path / "report.json"
    assert main(["tune", str(inv), *TUNE, "--global-batch-size", "8", "-o", str(plan),
                 "--report", str(report), "-q"]) == 0
    out = capsys.readouterr().out
    used = load_any_plan(plan).device_counts()
    assert used == {"A100-SXM-80GB": 8}  # the T4s would only slow the step
    assert json.loads(report.read_text())["unused_gpus"] == {"T4-16GB": 4}
    assert "unused: 4 of 4x T4-16GB (the plan needs 8 of the inventory's 12 GPUs" in out
    # simulate says it too, and nothing when every GPU is used
    assert main(["simulate", str(plan), "--inventory", str(inv)]) == 0
    assert "unused: 4 of 4x T4-16GB" in capsys.readouterr().out
    inv.write_text(A100_T4.split("  - {gpu: T4")[0])
    assert main(["simulate", str(plan), "--inventory", str(inv)]) == 0
    assert not any(line.startswith("unused:") for line in capsys.readouterr().out.splitlines())


def test_optimizer_time_of_an_offloading_stage(tmp_path, capsys):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(TIGHT)
    plan, report, sim_json = tmp_path / "plan.yaml", tmp_path / "r.json", tmp_path / "s.json"
    assert main(["tune", str(inv), *TUNE, "--global-batch-size", "16", "-o", str(plan),
                 "--report", str(report), "--memory-headroom", "0"]) == 0
    table = capsys.readouterr().out
    p = load_any_plan(plan)
    stage = p.pipelines[0].stages[0]
    assert stage.offload.optimizer_fraction > 0  # the card is too small without it
    # the simulator's own optimizer interval: the O event of the recorded step
    inventory = load_inventory(inv)
    sim = simulate(p, CostModel(p.model, inventory, precision=p.precision,
                                     memory_headroom=0.0), record_events=True)
    opt = [e.end - e.start for e in sim.events if e.kind == "O" and e.pipeline == 0
           and e.stage == 0][0]
    assert opt > 1.0  # seconds: the host's rate, not the device's
    assert f"optimizer {opt:.2f} s" in table
    stages = json.loads(report.read_text())["stages"]
    assert stages[0]["optimizer_s"] == pytest.approx(opt)
    assert stages[0]["optimizer_s"] <= stages[0]["sync_s"]
    assert main(["simulate", str(plan), "--inventory", str(inv), "--memory-headroom", "0",
                 "--json", str(sim_json)]) == 0
    text = capsys.readouterr().out
    assert f"(optimizer {opt:.3f} s)" in text
    assert f"wrote {sim_json}" in text
    assert json.loads(sim_json.read_text())["stages"][0]["optimizer_s"] == pytest.approx(opt)


def test_a_stage_without_offload_shows_no_optimizer_line(tmp_path, capsys):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(A100_T4)
    plan = tmp_path / "plan.yaml"
    assert main(["tune", str(inv), *TUNE, "--global-batch-size", "8", "-o", str(plan)]) == 0
    assert "optimizer offload" not in capsys.readouterr().out
    assert main(["simulate", str(plan), "--inventory", str(inv)]) == 0
    table = capsys.readouterr().out
    assert "│ optimizer" not in table and "(optimizer " in table
