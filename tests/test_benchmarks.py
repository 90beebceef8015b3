"""The benchmark scripts run in CI in their short modes; what they print must be consistent
(figures are checked for sense, never for speed)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from .conftest import REPO


def test_bench_tuner_quick():
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
    for row in rows:
        tuned, searched, baseline, bound = (float(x) for x in row[4:8])
        assert abs(float(row[8]) - baseline / tuned) < 0.01, row
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


def test_bench_meshes_quick():
    proc = subprocess.run([sys.executable, str(REPO / "scripts/bench_meshes.py"), "--quick"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    assert any(r[0] == "3090-t4-llama2-7b" for r in rows), proc.stdout
    for r in rows:
        uniform, speedup, eff_uniform, eff_best = float(r[2]), float(r[4][:-1]), float(r[5]), float(r[6])
        # the winner is never slower than the uniform-TP plan, and wins only where faster
        assert speedup >= 1.0 and eff_best >= eff_uniform - 1e-9, r
        if r[3] != "-" and "(wins)" not in " ".join(r):
            assert float(r[3]) >= uniform - 1e-9 and speedup == 1.0, r


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


@pytest.mark.slow
def test_bench_mesh_rehearse_prints_both_plans(mcore_env):
    """Both mesh plans rehearse (2 steps, hidden 32, 4 CPU ranks each, one after the other) and
    their row's ratio is measured over predicted."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts/bench_mesh_rehearse.py"), "--steps",
                           "2", "--hidden-size", "32"], env=mcore_env, capture_output=True,
                          text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r[0]: r for r in (line.split() for line in proc.stdout.splitlines())
            if r and r[0] in ("fan-in", "fan-out")}
    assert set(rows) == {"fan-in", "fan-out"}, proc.stdout
    for r in rows.values():
        predicted, measured, ratio = float(r[1]), float(r[3]), float(r[4])
        assert predicted > 0 and measured > 0
        assert ratio == pytest.approx(measured / predicted, abs=0.006), r


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
