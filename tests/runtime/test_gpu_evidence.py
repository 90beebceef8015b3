"""scripts/gpu_evidence.py, the script a lent GPU runs (docs/gpu.md), rehearsed on CPU with a
tiny model against Megatron-LM's own pretrain_gpt.py: every step runs, and the three training
runs agree (the plan equals plain Megatron; module-input offload changes no loss in fp32)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ..conftest import mcore_environ
from .launching import REPO, megatron_lm_checkout, needs_megatron_git


@needs_megatron_git
@pytest.mark.parametrize("stack", ["0.17", "0.19"])
def test_gpu_evidence_script_rehearses_on_cpu(tmp_path, stack):
    checkout = megatron_lm_checkout(tmp_path, stack)
    out = tmp_path / "out"
    env = mcore_environ(stack)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_evidence.py"), "--cpu",
                           "--megatron-lm", str(checkout), "--out", str(out), "--layers", "2",
                           "--global-batch-size", "4", "--iters", "3", "--profile-warmup", "1",
                           "--profile-repeats", "2"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    evidence = json.loads((out / "evidence.json").read_text())
    runs = evidence["measured"]
    assert set(runs) == {"hetero_plan", "plain_megatron", "hetero_plan_offload"}
    losses = [runs[r]["losses"] for r in runs]
    assert len(losses[0]) == 3 and all(x == losses[0] for x in losses)
    for r in runs.values():
        assert r["ok"] and len(r["step_times_ms"]) == 3 and r["median_step_s"] > 0
    for name in ("plan", "plan_offload"):
        assert evidence["predicted"][name]["profile"]["step_time_s"] > 0
    assert "losses of plain_megatron equal hetero_plan's" in proc.stdout
