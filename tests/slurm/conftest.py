"""Fixtures for the launch tests: a real single-host Slurm (started by .ci/slurm-setup.sh) and
a 4-rank plan over two GPU types."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / ".ci" / "slurm-setup.sh"
SLURM_NODES = {"a100": "mh-a100", "v100": "mh-v100"}
"""Partition -> node of the test cluster that .ci/slurm-setup.sh configures."""

PLAN4 = """\
format_version: 1
model: {name: tiny, num_layers: 4, hidden_size: 64, ffn_hidden_size: 128, num_attention_heads: 4,
        num_query_groups: 4, vocab_size: 128, seq_length: 32}
global_batch_size: 6
precision: fp32
use_distributed_optimizer: false
tensor_model_parallel_size: 1
pipelines:
  - micro_batch_size: 1
    num_microbatches: 4
    stages:
      - {device_type: A100-SXM-80GB, num_layers: 1}
      - {device_type: V100-SXM2-32GB, num_layers: 3}
  - micro_batch_size: 1
    num_microbatches: 2
    stages:
      - {device_type: A100-SXM-80GB, num_layers: 1}
      - {device_type: V100-SXM2-32GB, num_layers: 3}
"""


@pytest.fixture
def plan4(tmp_path) -> Path:
    """PP=2 x DP=2: stage 0 on A100, stage 1 on V100; uneven micro-batches (4 and 2)."""
    path = tmp_path / "plan4.yaml"
    path.write_text(PLAN4)
    return path


def _slurm_ready() -> str | None:
    """None when both test nodes are up, else why not."""
    if shutil.which("sinfo") is None:
        return "sinfo not found: Slurm is not installed (run .ci/slurm-setup.sh as root)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%N %T", "-N"], capture_output=True,
                             text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo timed out: slurmctld does not answer"
    if out.returncode:
        return f"sinfo failed: {out.stderr.strip()}"
    states = dict(line.split()[:2] for line in out.stdout.splitlines() if line.strip())
    bad = {n: states.get(n, "missing") for n in SLURM_NODES.values()
           if states.get(n, "missing") not in ("idle", "mixed", "allocated", "completing")}
    return f"test nodes not ready: {bad}" if bad else None


@pytest.fixture(scope="session")
def slurm_cluster() -> dict:
    """The single-host Slurm of .ci/slurm-setup.sh: started here when possible (as root, with
    Slurm installed; MH_SLURM_INSTALL=1 also lets it apt-get install), else the test is skipped
    with the reason."""
    why = _slurm_ready()
    if why is not None and os.geteuid() == 0 and SETUP.exists():
        args = [] if os.environ.get("MH_SLURM_INSTALL") == "1" else ["--no-install"]
        try:
            proc = subprocess.run(["bash", str(SETUP), *args], capture_output=True, text=True,
                                  timeout=180)
        except subprocess.TimeoutExpired:
            pytest.skip("no Slurm: .ci/slurm-setup.sh took over 180 s")
        if proc.returncode:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            pytest.skip(f"no Slurm: .ci/slurm-setup.sh failed: {lines[-1] if lines else proc.returncode}")
        why = _slurm_ready()
    elif why is not None:
        why += " (and not root, so the fixture cannot start it)"
    if why is not None:
        pytest.skip(f"no Slurm: {why}")
    return {"nodes": dict(SLURM_NODES)}
