"""`megatron-hetero profile` on a CUDA GPU (skipped without one)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_hetero.cost.profile_file import load_profile
from megatron_hetero.hardware.catalog import load_catalog

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

TINY = ("name: tiny\nnum_layers: 4\nhidden_size: 256\nffn_hidden_size: 704\nnum_attention_heads: 4\n"
        "num_query_groups: 4\nvocab_size: 1024\nseq_length: 128\n")


def test_profile_on_gpu(tmp_path):
    import torch

    (tmp_path / "tiny.yaml").write_text(TINY)
    out = tmp_path / "gpu.yaml"
    name = torch.cuda.get_device_name()
    extra = [] if load_catalog().resolve(name) else ["--device-type", "A100-SXM-80GB"]
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_hetero.cli", "profile", "--model", str(tmp_path / "tiny.yaml"),
         "--micro-batch-sizes", "1,2", "--repeats", "3", "-q", "-o", str(out), *extra],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = load_profile(out).data
    assert d.device.backend == "cuda" and d.device.name == name
    assert d.timing.method == "cuda-events" and d.timing.precision in ("bf16", "fp16")
    assert all(e.memory.method == "cuda-max-memory-allocated" for e in d.entries)
    by = {e.micro_batch_size: e for e in d.entries}
    assert by[2].memory.activation_bytes_per_layer > by[1].memory.activation_bytes_per_layer
    assert d.efficiency is not None and 0 < d.efficiency <= 1
