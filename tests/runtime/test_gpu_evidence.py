"""scripts/gpu_evidence.py, the script a lent GPU runs (docs/gpu.md), rehearsed on CPU with tiny
shapes against Megatron-LM's own pretrain_gpt.py: every part runs within its budget and records
its outcome; the shapes part trains each shape under --hetero-plan next to its predictions; the
MoE part (scripts/gpu_moe_profile.py) times megatron-core's MoE and dense layers and counts the
tokens per expert; the megatron-core 0.19.2 part records its outcome either way (it passes only
where megatron-core 0.19.2 is installed with what it imports: the venv's own). Here the shapes
and MoE parts run on the oldest supported megatron-core, 0.17.1 (with core_v0.17.1's scripts),
and the 0.19.2 part on the venv's site-packages."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

from ..conftest import OLD_STACK, mcore_environ
from .launching import MEGATRON_GIT, REPO, megatron_lm_checkout, needs_megatron_git

MCORE019 = Path(sysconfig.get_paths()["platlib"])
"""Where the venv's megatron-core 0.19.2 is installed (scripts/install_mcore019.sh)."""


def megatron_lm_019(tmp_path):
    """Megatron-LM core_v0.19.0's pretrain_gpt.py and what it imports beside megatron-core."""
    archive = subprocess.run(["git", "--git-dir", str(MEGATRON_GIT), "archive", "core_v0.19.0",
                              "pretrain_gpt.py", "gpt_builders.py", "model_provider.py"],
                             capture_output=True, check=True).stdout
    checkout = tmp_path / "Megatron-LM-019"
    checkout.mkdir()
    subprocess.run(["tar", "-x", "-C", str(checkout)], input=archive, check=True)
    return checkout


@needs_megatron_git
def test_gpu_evidence_script_rehearses_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = mcore_environ(OLD_STACK)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_evidence.py"), "--cpu",
                           "--megatron-lm", str(megatron_lm_checkout(tmp_path, OLD_STACK)),
                           "--megatron-lm-019", str(megatron_lm_019(tmp_path)),
                           "--mcore019", str(MCORE019), "--out", str(out), "--layers", "2",
                           "--iters", "3", "--profile-warmup", "1", "--profile-repeats", "2"],
                          capture_output=True, text=True, env=env, timeout=600)
    evidence = json.loads((out / "evidence.json").read_text())
    parts = evidence["parts"]
    assert set(parts) == {"shapes", "moe", "mcore019"}, proc.stdout[-3000:]
    assert parts["shapes"]["ok"] and parts["moe"]["ok"], proc.stdout[-3000:] + proc.stderr[-3000:]

    shapes = evidence["shapes"]
    assert set(shapes) == {"mbs1-seq128", "mbs4-seq64", "mbs2-seq128-full"}
    assert shapes["mbs2-seq128-full"]["recompute"] == "full"
    for name, s in shapes.items():
        m = s["measured"]
        assert m["ok"] and len(m["step_times_ms"]) == 3 and m["median_step_s"] > 0, name
        assert len(m["losses"]) == 3 and m["megatron_theoretical_mb"] > 0, name
        for source in ("profile", "catalog"):
            assert s["predicted"][source]["step_time_s"] > 0, (name, source)
            assert s["predicted"][source]["memory_bytes"] > 0, (name, source)
    # full recompute keeps less per layer than none at the same shape (the prediction)
    assert (shapes["mbs2-seq128-full"]["predicted"]["catalog"]["memory_bytes"]
            < shapes["mbs1-seq128"]["predicted"]["catalog"]["memory_bytes"] * 2)

    moe = evidence["moe"]
    assert not moe["failed"] and not moe["skipped"]
    cases = {c["case"]: c for c in moe["cases"]}
    assert set(cases) == {"mixtral:alltoall", "mixtral:allgather", "dense-mixtral",
                          "qwen3-30b-a3b:alltoall", "qwen3-30b-a3b:allgather",
                          "dense-qwen3-30b-a3b"}
    for name, c in cases.items():
        assert c["layer"]["forward_s"] > 0 and c["layer"]["backward_s"] > 0, name
        assert c["mlp"]["forward_s"] > 0, name
        if c["kind"] == "moe":
            seq, topk = c["shape"]["seq_length"], c["shape"]["topk"]
            assert len(c["tokens_per_expert"]) == c["shape"]["experts"]
            assert sum(c["tokens_per_expert"]) == seq * topk  # every token to top-k experts
            assert c["imbalance_max_over_mean"] >= 1 and c["routing_repeats_identical"]
    # the same router weights (seed) route alike under either dispatcher
    assert (cases["mixtral:alltoall"]["tokens_per_expert"]
            == cases["mixtral:allgather"]["tokens_per_expert"])

    m019 = evidence["mcore019"]  # an outcome either way: measured, or why not
    runs = [m019.get(r) or {} for r in ("hetero_plan", "plain_megatron")]
    assert parts["mcore019"].get("error") or all(r.get("ok") or r.get("log_tail") or r.get("error")
                                                 for r in runs), m019
    if (MCORE019 / "megatron" / "core").is_dir():  # scripts/bootstrap.sh builds it
        assert parts["mcore019"]["ok"], m019
    if parts["mcore019"]["ok"]:
        assert m019["megatron_core"].startswith("0.19.2 ")
        assert runs[0]["losses"] == runs[1]["losses"] and len(runs[0]["losses"]) == 3
    assert "parts: shapes ok" in proc.stdout
