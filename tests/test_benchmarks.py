"""The benchmark scripts run in CI in their short modes; what they print must be consistent
(figures are checked for sense, never for speed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from megatron_hetero._schema import read_yaml, write_yaml
from megatron_hetero.cli import main as cli_main
from megatron_hetero.hardware.inventory import inventory_from_data

from .conftest import REPO


def _tuned_by_the_cli(scenario, tmp_path) -> dict:
    """``tune --report`` and ``simulate --json`` of ``scenario`` (an examples/scenarios file)
    through the command line: the report's figures, the GPUs and the simulated step."""
    data = read_yaml(scenario)
    inv, plan, report = (tmp_path / f"{scenario.stem}.{n}" for n in ("inv.yaml", "plan.yaml",
                                                                     "json"))
    write_yaml(data["inventory"], inv)
    seq = ["--seq-length", str(data["seq_length"])] if data.get("seq_length") else []
    assert cli_main(["tune", str(inv), "--model", str(data["model"]), *seq,
                     "--global-batch-size", str(data["global_batch_size"]), "-q",
                     "-o", str(plan), "--report", str(report)]) == 0
    got = json.loads(report.read_text())
    sim = tmp_path / f"{scenario.stem}.sim.json"
    assert cli_main(["simulate", str(plan), "--inventory", str(inv), "--json", str(sim)]) == 0
    got["simulated_s"] = json.loads(sim.read_text())["step_time_s"]
    got["gpus"] = inventory_from_data(data["inventory"]).num_gpus
    return got


def test_bench_tuner_quick(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts/bench_tuner.py"), "--quick"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("scenario"))
    # scenario, GPUs, search s, cpu s, tuned s, searched, baseline s, bound s, speedup, ...
    assert lines[header].split()[:12] == ["scenario", "GPUs", "search", "s", "cpu", "s", "tuned",
                                          "s", "searched", "baseline", "s", "bound"], lines[header]
    rows = [line.split() for line in lines[header + 2:]]
    rows = [r for r in rows if len(r) > 7 and r[1].isdigit()]
    assert rows, proc.stdout
    quick = sorted(p.stem for p in (REPO / "examples/scenarios").glob("*.yaml")
                   if read_yaml(p).get("quick"))
    assert sorted(r[0] for r in rows) == quick, proc.stdout
    for row in rows:
        tuned, searched, baseline, bound = (float(x) for x in row[4:8])
        assert abs(float(row[8]) - baseline / tuned) < 0.01, row
        # the figures are the scenario's as the command line tunes it: its report's tuned,
        # baseline and bound seconds, and the simulate command's step for the plan it wrote
        got = _tuned_by_the_cli(REPO / "examples/scenarios" / f"{row[0]}.yaml", tmp_path)
        assert [tuned, baseline, bound] == pytest.approx(
            [got["predicted_step_time_s"], got["baseline_step_time_s"],
             got["upper_bound_step_time_s"]], abs=0.006), (row, got)
        assert tuned == pytest.approx(got["simulated_s"], abs=0.006), (row, got)
        assert int(row[1]) == got["gpus"], row
        # the local search on the simulator only ever keeps a faster plan
        assert tuned <= searched + 1e-9, row
        # The tuner never emits a plan slower than the baseline it reports, and no plan beats the
        # upper bound (model FLOPs over the pool's summed achievable rate).
        assert tuned <= baseline + 1e-9, row
        assert bound <= tuned, row


def test_bench_vendors_on_the_13b_scenario():
    scenario = REPO / "examples/scenarios/a100-mi300x-llama2-13b.yaml"
    proc = subprocess.run([sys.executable, str(REPO / "scripts/bench_vendors.py"), "--rdma-only",
                           str(scenario)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("scenario"))
    (row,) = [line.split() for line in lines[header + 2:] if line.startswith("a100-mi300x")]
    tuned, fabric, single, speedup, bound, eff = (float(x) for x in row[2:8])
    assert row[1] == "RDMA"
    assert abs(speedup - single / tuned) < 0.01 and abs(eff - bound / tuned) < 0.01, row
    assert bound <= tuned and bound <= fabric, row
    assert tuned < single, row  # both vendors together beat the faster one alone


def test_bench_moe_prints_each_figure():
    """scripts/bench_moe.py on the issue's two MoE pools: each tuned plan at least as fast as
    plain Megatron's and within the bound, each figure printed."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts/bench_moe.py")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    speedups = [float(x.split()[-1][:-1]) for x in out.splitlines() if "speedup" in x]
    effs = [float(x.split()[-1]) for x in out.splitlines() if "efficiency" in x]
    shares = [float(x.split()[-1]) for x in out.splitlines() if "all-to-all share" in x]
    assert len(speedups) == len(effs) == len(shares) == 2, out
    assert all(s >= 1.0 for s in speedups) and all(0 < e <= 1 for e in effs), out
    assert all(0 <= a < 1 for a in shares) and "search:" in out, out


def test_bench_meshes_quick():
    """Uniform, mesh and mesh-with-chunks side by side: the best column is the tuner's winner
    (``TuneResult.best``), never slower than the uniform plan and the fastest of the three; a
    pool that misses its target says what separates it from the bound."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts/bench_meshes.py"), "--quick"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = proc.stdout.split("\n\n")[0].splitlines()
    assert table[0].split()[:11] == ["scenario", "GPUs", "uniform", "s", "eff", "mesh", "s", "eff",
                                     "spdup", "chunks", "s"], table[0]
    rows = [line.split() for line in table[1:]]
    assert any(r[0] == "3090-t4-llama2-7b" for r in rows), proc.stdout
    for r in rows:
        effs = [float(r[3])] + [float(r[k]) for k in (5, 8) if r[k] != "-"]
        best = float(r[10])
        assert best >= float(r[3]) - 1e-9 and best == pytest.approx(max(effs), abs=1e-3), r
    for r in rows:
        if float(r[10]) < 0.95 and r[0] == "3090-t4-llama2-7b":
            assert f"{r[0]} best (" in proc.stdout and "busy+" in proc.stdout, proc.stdout
            # and, per plan that misses it, the points each cost takes off the bound
            assert f"{r[0]} uniform (" in proc.stdout and " TP " in proc.stdout, proc.stdout


def test_bench_efficiency_shares_add_up():
    """The rate-weighted shares of the step are what separates the plan from the bound: they add
    up to 1 - efficiency; with the links inside a node free the same plan is no slower; and
    ``--per-tp`` prints one row per searched TP size, the tuned plan's among them."""
    scenario = REPO / "examples/scenarios/3090-t4-llama2-7b.yaml"
    proc = subprocess.run([sys.executable, str(REPO / "scripts/bench_efficiency.py"), "--per-tp",
                           str(scenario)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:11] == ["scenario", "step", "s", "bound", "s", "effic.", "free", "TP",
                                     "unused", "busy+", "bubble"], lines[0]
    rows = [line.split() for line in lines[1:] if re.match(r"^(3090-t4-llama2-7b|  TP\d only) ", line)]
    tuned, *per_tp = rows
    assert [r[0] for r in per_tp] == ["TP1", "TP2", "TP4", "TP8"], proc.stdout
    for r in rows:
        values = [float(x) for x in (r[1:10] if r is tuned else r[2:11])]
        step, bound, eff, free, *shares = values
        assert abs(eff - bound / step) < 1e-3 and free >= eff - 1e-3, r
        assert abs(sum(shares) / 100 - (1 - eff)) < 2e-3, r
    # the tuned plan is the best of the per-size ones
    assert float(tuned[3]) >= max(float(r[4]) for r in per_tp) - 1e-3, proc.stdout


@pytest.mark.slow
def test_bench_recovery_prints_every_part():
    """A node lost after a save: the parts from the failure to plan B's first step add up to
    (at most) the wall time between them, and the checkpoint's size is its files' (3 CPU ranks
    in all, one at a time)."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts/bench_recovery.py"), "--hidden", "32"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    parts = dict((name.strip(), float(s)) for name, s in
                 re.findall(r"^  (.+?)\s+(-?[\d.]+) s$", out, flags=re.M))
    names = [p.split(" (")[0] for p in parts]
    starts = [n for n in names if n.startswith("restart: process start") or "initialized" in n]
    assert starts in (["restart: process start to Megatron initialized"],  # the tests' script
                      ["restart: process start to pretrain()", "restart: Megatron initialized"])
    assert names == ["re-plan", *starts, "restart: model and optimizer built", "checkpoint load",
                     "set-up", "first step", "sum of the parts"], parts
    *each, total = parts.values()
    assert all(s >= 0 for s in each) and abs(sum(each) - total) < 0.05
    wall = float(re.search(r"failure to end of first step \(wall\): ([\d.]+) s", out).group(1))
    assert total <= wall + 0.05, out
    assert "plan B: TP=1 PP=1 DP=1 on 1 A100" in out
    size = re.search(r"checkpoint: torch_dist, [\d.]+ MB \((\d+) bytes\), saved in [\d.]+ s", out)
    assert size and int(size.group(1)) > 0, out


def _bench_mesh_rehearse():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import bench_mesh_rehearse as bench
    finally:
        sys.path.pop(0)
    return bench


def test_bench_mesh_rehearse_rehearses_each_plan_in_rounds_and_prints_medians(monkeypatch,
                                                                              capsys):
    """scripts/bench_mesh_rehearse.py without its rehearsals (minutes on CPU ranks; the tests
    in tests/emulate rehearse mesh plans once each, untimed): it rehearses the plans its
    docstring names (fan-in, and fan-in with chunks [7, 7] and [9, 9]) in rounds, one of each
    plan a round, with the command line's steps, time scale and hidden size, memory metered
    not capped; it prints each plan's medians and each run's figures, and exits 1 where a
    median ratio misses the target (0 where every plan meets it)."""
    from types import SimpleNamespace

    from megatron_hetero.plan import load_any_plan

    bench = _bench_mesh_rehearse()
    calls = []
    ratios = {"fan-in": [1.0, 1.3, 1.05], "fan-in-chunked": [0.7, 1.2, 1.25]}

    def rehearse(plan, config, *, source, inventory):
        calls.append((source, plan, config, inventory))
        ratio = ratios[source][sum(c[0] == source for c in calls) - 1]
        return SimpleNamespace(predicted_step_s=2.0, a_priori_step_s=4.0, step_s=2.0 * ratio,
                               ratio=ratio)

    monkeypatch.setattr(bench, "rehearse", rehearse)
    monkeypatch.setattr(sys, "argv", ["bench_mesh_rehearse.py", "--steps", "3", "--time-scale",
                                      "2", "--hidden-size", "32"])
    assert bench.main() == 1  # fan-in-chunked's median, 1.20, misses 10%
    out = capsys.readouterr().out
    rows = {r[0]: r for r in (line.split() for line in out.splitlines())
            if r and r[0] in ratios}
    # plan, predicted s, a priori s, measured s, ratio (medians), then each run's figures
    assert rows["fan-in"][1:5] == ["2.000", "4.000", "2.100", "1.05"]
    assert rows["fan-in-chunked"][1:5] == ["2.000", "4.000", "2.400", "1.20"]
    assert " ".join(rows["fan-in"][5:]) == ("2.000 / 2.000 = 1.00, 2.000 / 2.600 = 1.30, "
                                            "2.000 / 2.100 = 1.05")
    assert "MISSED by fan-in-chunked 1.20" in out and "fan-in 1.05" not in out
    assert [c[0] for c in calls] == ["fan-in", "fan-in-chunked"] * 3  # rounds
    for _, _, config, inventory in calls:
        assert (config.steps, config.time_scale, config.hidden_size, config.memory_cap,
                config.emulate_links, inventory) == (3, 2.0, 32, False, False, None)
    fan_in, chunked = calls[0][1], calls[1][1]
    assert fan_in.to_data() == load_any_plan(REPO / "examples/meshes/rehearse-plan.yaml").to_data()
    shape = [(m.device_type, m.layer_split, m.tensor_model_parallel_size) for m in fan_in.meshes]
    assert shape == [("RTX3090-24GB", [14], 1), ("T4-16GB", [18], 2)]
    assert [(m.device_type, m.layer_split, m.tensor_model_parallel_size)
            for m in chunked.meshes] == shape
    assert [m.pipelines[0].stages[0].chunk_layers for m in chunked.meshes] == [[7, 7], [9, 9]]
    ratios["fan-in-chunked"] = [1.0, 0.95, 1.05]
    calls.clear()
    monkeypatch.setattr(sys, "argv", ["bench_mesh_rehearse.py", "--runs", "3"])
    assert bench.main() == 0 and "met by every plan" in capsys.readouterr().out


def test_bench_mesh_rehearse_runs_the_two_vendor_plan_over_its_emulated_links(monkeypatch,
                                                                               capsys):
    """``--plans a100-mi300x-tcp,a100-mi300x-rdma``: the format-1 plan of
    examples/rehearse/a100-mi300x over each inventory, its links emulated, time scale 3; the
    fan-out plan has the meshes the other way round."""
    from types import SimpleNamespace

    bench = _bench_mesh_rehearse()
    calls = []

    def rehearse(plan, config, *, source, inventory):
        calls.append((source, plan, config, inventory))
        return SimpleNamespace(predicted_step_s=1.0, a_priori_step_s=1.0, step_s=1.0, ratio=1.0)

    monkeypatch.setattr(bench, "rehearse", rehearse)
    monkeypatch.setattr(sys, "argv", ["bench_mesh_rehearse.py", "--runs", "1", "--plans",
                                      "a100-mi300x-tcp,a100-mi300x-rdma,fan-out"])
    assert bench.main() == 0
    (tcp, _, tcp_config, tcp_inv), (rdma, _, _, rdma_inv), (_, fan_out, out_config, none) = calls
    assert (tcp, rdma) == ("a100-mi300x-tcp", "a100-mi300x-rdma")
    assert tcp_config.emulate_links and tcp_config.time_scale == 3.0
    assert tcp_inv.source.endswith("tcp.yaml") and rdma_inv.source.endswith("rdma.yaml")
    assert not out_config.emulate_links and out_config.time_scale is None and none is None
    assert [(m.device_type, m.layer_split, m.tensor_model_parallel_size)
            for m in fan_out.meshes] == [("T4-16GB", [14], 2), ("RTX3090-24GB", [18], 1)]


def test_gpu_evidence_table_in_the_docs_is_what_the_cost_model_predicts_now():
    """docs/gpu.md's table is the kept H200 measurements against this commit's predictions
    (scripts/gpu_evidence_figure.py): a change of the cost model that moves a prediction must
    update the page."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_evidence_figure as fig
    finally:
        sys.path.pop(0)
    runs = sorted(p for p in (REPO / "docs" / "gpu").glob("run*") if p.is_dir())
    found = fig.rows(runs)
    assert {r["run"] for r in found} >= {"run1/hetero_plan", "run1/plain_megatron",
                                         "run3/hetero_plan"}
    page = (REPO / "docs" / "gpu.md").read_text()
    assert fig.table(found) in page
    current = fig.rows(runs, profile=REPO / "docs" / "gpu" / "run3" / "profile.yaml")
    assert fig.table(current) in page
    # what the page claims of run 3: the profile within 10% of the measured step and memory
    run3 = next(r for r in found if r["run"] == "run3/hetero_plan")
    assert abs(run3["profile_s"] / run3["measured_s"] - 1) < 0.10
    assert abs(run3["profile_gb"] / run3["measured_gb"] - 1) < 0.10
