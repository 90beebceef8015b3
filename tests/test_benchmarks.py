"""The benchmark scripts run in CI in their short modes; what they print must be consistent
(figures are checked for sense, never for speed)."""

from __future__ import annotations

import subprocess
import sys

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
