"""scripts/gpu_telemetry_evidence.py, the telemetry's evidence on a lent GPU (docs/gpu.md, runs 5
and 6): its arithmetic (which steps the telemetry armed, the side-by-side ratios), and the whole
script rehearsed on CPU ranks against Megatron-LM core_v0.19.0's pretrain_gpt.py with the venv's
megatron-core 0.19.2: every run trains, the runs with telemetry write records whose stages carry
measured and predicted figures, and the losses do not depend on the telemetry."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from .launching import REPO, needs_megatron_git
from .test_gpu_evidence import MCORE019, megatron_lm_019

_spec = importlib.util.spec_from_file_location(
    "gpu_telemetry_evidence", REPO / "scripts" / "gpu_telemetry_evidence.py")
evidence = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(evidence)


@pytest.mark.parametrize("interval", [1, 2, 3, 10])
def test_armed_steps_are_the_multiples_of_the_interval(interval):
    times = [float(100 + i) for i in range(12)]  # step i + 1 took 100 + i ms
    split = evidence.split_steps(times, skip=2, interval=interval)
    armed = [round(t * 1e3) - 99 for t in split["armed"]]  # back to step numbers
    unarmed = [round(t * 1e3) - 99 for t in split["unarmed"]]
    assert armed == [s for s in range(3, 13) if s % interval == 0]
    assert sorted(armed + unarmed) == list(range(3, 13))


def test_overhead_compares_medians_side_by_side():
    runs = [{"kind": "off", "steps": {"armed": [1.0, 1.0], "unarmed": [1.0, 1.2]}},
            {"kind": "on", "steps": {"armed": [1.1, 1.1, 1.3], "unarmed": [1.0, 1.0, 1.1]}}]
    s = evidence.overhead(runs)
    assert s["off_median_s"] == 1.0 and s["armed_median_s"] == 1.1
    assert s["armed_over_unarmed"] == 1.1 and s["unarmed_over_off"] == 1.0
    assert s["interval10_over_off"] == pytest.approx((1.1 + 9 * 1.0) / 10)
    assert evidence.overhead([runs[1]])["off_median_s"] is None  # no run without: no ratio
    assert "interval10_over_off" not in evidence.overhead([runs[1]])


@needs_megatron_git
def test_gpu_telemetry_evidence_rehearses_on_cpu(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_telemetry_evidence.py"),
                           "--cpu", "--megatron-lm-019", str(megatron_lm_019(tmp_path)),
                           "--mcore019", str(MCORE019), "--out", str(out), "--layers", "2",
                           "--moe-layers", "2", "--iters", "4", "--order", "off,on"],
                          capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "evidence.json").read_text())
    off, on = data["telemetry"]["runs"]
    assert off["ok"] and on["ok"] and off["losses"] == on["losses"] and len(on["losses"]) == 4
    assert len(on["steps"]["armed"]) == len(on["steps"]["unarmed"]) == 1  # steps 3 and 4
    for rec in (on["telemetry"], data["moe_run"]["telemetry"]):
        assert rec["steps_reported"] == [2, 4] and rec["clock"] == "wall"
        [(path, stage)] = rec["stages"].items()
        assert path == "pipelines[0].stages[0]"
        assert stage["measured"]["forward_s"] > 0 and stage["measured"]["backward_s"] > 0
        assert stage["predicted"]["forward_s"] > 0
    assert (out / "moe_run" / "telemetry" / "timeline.png").stat().st_size > 0
    assert data["telemetry"]["predicted"]["step_time_s"] > 0
    assert "parts: telemetry ok" in proc.stdout and "moe_run ok" in proc.stdout
