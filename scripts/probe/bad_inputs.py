"""Run the bad inputs of issue 32 part B as a user would and print one table row each:
exit code, lines on stderr, a traceback or not, seconds, files of the folder changed.

    .venv/bin/python scripts/probe/bad_inputs.py [CASE-SUBSTRING]

Each case runs in a fresh temporary folder with the 7B example's inventory and plan; a case
that runs past 30 s is killed and shown as a hang."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.fake_checkpoint import ARGS, write_checkpoint  # noqa: E402

PY = f"{sys.executable} -m megatron_hetero.cli"
INV = (REPO / "examples/llama2/7b/inventory.yaml").read_text()
PLAN = (REPO / "examples/llama2/7b/plan.yaml").read_text()
SMALL_INV = "groups:\n  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 2}\n"
TUNE = f"{PY} tune inv.yaml --model llama2-7b --global-batch-size 64"


def _ckpt(d: Path, **kw) -> None:
    write_checkpoint(d / "ck", **kw)


def _set(d: Path, rel: str, text: str | bytes) -> None:
    p = d / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(text if isinstance(text, bytes) else text.encode())


REPLAN = f"{PY} replan ck small.yaml -o b.yaml"
CASES: list[tuple[str, callable, str]] = [
    # streams and indirect inputs
    ("tune -o /dev/stdout >> log", lambda d: _set(d, "log", "old log line\n"),
     f"{TUNE} -o /dev/stdout >> log"),
    ("tune --report /dev/stderr 2>> log", lambda d: _set(d, "log", "old log line\n"),
     f"{TUNE} --report /dev/stderr 2>> log"),
    ("replan -o a file of the checkpoint", lambda d: _ckpt(d),
     f"{PY} replan ck small.yaml -o ck/latest_checkpointed_iteration.txt"),
    ("replan -o the old plan named by the checkpoint's args", lambda d: (
        _ckpt(d, args={**ARGS, "hetero_plan": str(d / "a.yaml")}),
        shutil.copy(REPO / "tests/data/plan_a100_v100.yaml", d / "a.yaml")),
     f"{PY} replan ck small.yaml -o a.yaml"),
    # absurd but finite numbers
    ("tune: inter_group_bandwidth_gb_s 1e-300", lambda d: _set(d, "inv.yaml", INV.replace("12.5", "1e-300")), TUNE),
    ("tune: inter_group_bandwidth_gb_s 1e300", lambda d: _set(d, "inv.yaml", INV.replace("12.5", "1.0e+300")), TUNE),
    ("tune: custom GPU bf16_tflops 1e299", lambda d: _set(d, "inv.yaml", INV + "gpus:\n  A100-SXM-80GB: {bf16_tflops: 1.0e+299}\n"), TUNE),
    ("tune: custom GPU memory_bandwidth 1e-300", lambda d: _set(d, "inv.yaml", INV + "gpus:\n  V100-SXM2-32GB: {memory_bandwidth_gb_s: 1.0e-300}\n"), TUNE),
    ("tune: custom GPU intra_node_bandwidth 1e-300", lambda d: _set(d, "inv.yaml", INV + "gpus:\n  V100-SXM2-32GB: {intra_node_bandwidth_gb_s: 1.0e-300}\n"), TUNE),
    ("simulate: plan gpus bf16_tflops 1e-300", lambda d: _set(d, "p.yaml", PLAN + "gpus:\n  V100-SXM2-32GB: {bf16_tflops: 1.0e-300}\n"),
     f"{PY} simulate p.yaml --inventory inv.yaml"),
    ("rehearse --time-scale 1e308", None, f"{PY} rehearse plan.yaml --time-scale 1e308 --steps 2"),
    ("rehearse --link-latency 1e300", None, f"{PY} rehearse plan.yaml --link-latency 1e300 --steps 2"),
    # documented limits
    ("tune: 512 layers on 1,048,576 GPUs (the GPU limit before)", lambda d: (
        _set(d, "inv.yaml", "groups:\n  - {gpu: A100-SXM-80GB, nodes: 65536, gpus_per_node: 8}\n"
                            "  - {gpu: V100-SXM2-32GB, nodes: 65536, gpus_per_node: 8}\n"),
        _set(d, "m.yaml", "name: deep\nnum_layers: 512\nhidden_size: 4096\nffn_hidden_size: 11008\n"
                          "num_attention_heads: 32\nnum_query_groups: 32\nvocab_size: 32000\nseq_length: 4096\n")),
     f"{PY} tune inv.yaml --model m.yaml --global-batch-size 4096"),
    ("simulate --timeline: mesh plan of 8*10^8 micro-batches", lambda d: _set(d, "p.yaml", (REPO / "examples/meshes/3090-t4-plan.yaml").read_text().replace("global_batch_size: 128", "global_batch_size: 800000000").replace("num_microbatches: 16", "num_microbatches: 100000000")),
     f"{PY} simulate p.yaml --inventory {REPO}/examples/meshes/inventory.yaml --timeline t.png"),
    ("simulate: mesh plan of 8*10^8 micro-batches", lambda d: _set(d, "p.yaml", (REPO / "examples/meshes/3090-t4-plan.yaml").read_text().replace("global_batch_size: 128", "global_batch_size: 800000000").replace("num_microbatches: 16", "num_microbatches: 100000000")),
     f"{PY} simulate p.yaml --inventory {REPO}/examples/meshes/inventory.yaml"),
    # checkpoints
    ("replan: saved num_layers is a string", lambda d: _ckpt(d, args={**ARGS, "num_layers": "four"}), REPLAN),
    ("replan: saved tensor_model_parallel_size a string", lambda d: _ckpt(d, args={**ARGS, "tensor_model_parallel_size": "x"}), REPLAN),
    ("replan: saved global_batch_size missing", lambda d: _ckpt(d, drop=("global_batch_size",)), REPLAN),
    ("replan: saved num_layers 10^6", lambda d: _ckpt(d, args={**ARGS, "num_layers": 10**6}), REPLAN),
    ("replan: saved make_vocab_size_divisible_by 0", lambda d: _ckpt(d, args={**ARGS, "make_vocab_size_divisible_by": 0}), REPLAN),
    ("replan: saved global_batch_size 3 (not a multiple)", lambda d: _ckpt(d, args={**ARGS, "global_batch_size": 3}), REPLAN),
    ("replan: tracker '\u00b2'", lambda d: (_ckpt(d), _set(d, "ck/latest_checkpointed_iteration.txt", "\u00b2")), REPLAN),
    ("replan: tracker of 5000 digits", lambda d: (_ckpt(d), _set(d, "ck/latest_checkpointed_iteration.txt", "9" * 5000)), REPLAN),
    ("replan: tracker is a folder", lambda d: (_ckpt(d), os.remove(d / "ck/latest_checkpointed_iteration.txt"), (d / "ck/latest_checkpointed_iteration.txt").mkdir()), REPLAN),
    ("replan: metadata.json is []", lambda d: (_ckpt(d), _set(d, "ck/iter_0000002/metadata.json", "[]")), REPLAN),
    ("replan: metadata.json sharded_backend 5", lambda d: (_ckpt(d), _set(d, "ck/iter_0000002/metadata.json", '{"sharded_backend": 5}')), REPLAN),
    ("replan: metadata.json not UTF-8", lambda d: (_ckpt(d), _set(d, "ck/iter_0000002/metadata.json", b'{"sharded_backend": "\xff"}')), REPLAN),
    ("replan: content_metadata sharding type a list", lambda d: _ckpt(d, args={**ARGS, "use_distributed_optimizer": True}, content_metadata={"distrib_optim_sharding_type": []}), REPLAN),
    # launch helpers
    ("submit.sh --inventory a pool the plan does not fit", lambda d: _set(d, "small.yaml", SMALL_INV),
     f"MH_PYTHON={sys.executable} MEGATRON_LM={REPO} MH_PRETRAIN_SCRIPT=x {REPO}/scripts/slurm/submit.sh plan.yaml --inventory small.yaml --dry-run --no-gres --partition A100-SXM-80GB=a --partition V100-SXM2-32GB=v"),
    ("tune.sh with -o among tune's options", None,
     f"MH_PYTHON={sys.executable} {REPO}/scripts/tune.sh inv.yaml out --model llama2-7b --global-batch-size 64 -o elsewhere.yaml"),
    ("jobspec hosts: a host listed twice", lambda d: _set(d, "hosts", "n1 A100-SXM-80GB 8\nn1 V100-SXM2-32GB 8\n"),
     f"{sys.executable} -m megatron_hetero.launch.jobspec plan.yaml --hostfile hosts --print hosts"),
    ("jobspec hosts: nodes of 3 GPUs for TP 2", lambda d: (
        _set(d, "p.yaml", (REPO / "examples/llama2/70b/plan.yaml").read_text()), _set(d, "hosts", "".join(f"a{i} A800-80GB 3\n" for i in range(10)) + "a10 A800-80GB 2\n" + "".join(f"b{i} A40-48GB 8\n" for i in range(4)))),
     f"{sys.executable} -m megatron_hetero.launch.jobspec p.yaml --hostfile hosts --print hosts"),
    # custom GPUs
    ("tune: custom GPU vendor NVIDIA torch_device npu", lambda d: _set(d, "inv.yaml", INV.replace("V100-SXM2-32GB", "X1") + "gpus:\n  X1: {vendor: NVIDIA, torch_device: npu, bf16_tflops: 100, bf16: true, fp32_tflops: 20, memory_gb: 32, memory_bandwidth_gb_s: 900, intra_node_link: NVLink, intra_node_bandwidth_gb_s: 150, efficiency: 0.5}\n"), TUNE),
    ("tune: custom GPU vendor Huawei dist_backend nccl", lambda d: _set(d, "inv.yaml", INV.replace("V100-SXM2-32GB", "X1") + "gpus:\n  X1: {vendor: Huawei, dist_backend: nccl, bf16_tflops: 100, bf16: true, fp32_tflops: 20, memory_gb: 32, memory_bandwidth_gb_s: 900, intra_node_link: HCCS, intra_node_bandwidth_gb_s: 150, efficiency: 0.5}\n"), TUNE),
    ("tune: custom GPU named ''", lambda d: _set(d, "inv.yaml", INV.replace("V100-SXM2-32GB", "''") + "gpus:\n  '': {vendor: NVIDIA, bf16_tflops: 100, bf16: true, fp32_tflops: 20, memory_gb: 32, memory_bandwidth_gb_s: 900, intra_node_link: NVLink, intra_node_bandwidth_gb_s: 150, efficiency: 0.5}\n"), TUNE),
    ("tune: custom GPU vendor ''", lambda d: _set(d, "inv.yaml", INV.replace("V100-SXM2-32GB", "X1") + "gpus:\n  X1: {vendor: '', bf16_tflops: 100, bf16: true, fp32_tflops: 20, memory_gb: 32, memory_bandwidth_gb_s: 900, intra_node_link: NVLink, intra_node_bandwidth_gb_s: 150, efficiency: 0.5}\n"), TUNE),
    # profiles
    ("tune --profile with a zero bandwidth / negative latency", None, "PROFILE"),
    # file names
    ("tune: inventory is a symlink loop", lambda d: os.symlink("inv.yaml", d / "loop.yaml") or (os.remove(d / "inv.yaml"), os.symlink("loop.yaml", d / "inv.yaml")), TUNE),
    ("tune -o a symlink loop", lambda d: (os.symlink("l2", d / "l1"), os.symlink("l1", d / "l2")), f"{TUNE} -o l1"),
    ("tune -o newdir/", None, f"{TUNE} -o newdir/"),
    ("tune -o a 255-byte name", None, f"{TUNE} -o {'p' * 250}.yaml"),
    ("tune --report a 255-byte name", None, f"{TUNE} --report {'r' * 250}.json"),
    ("tune: inventory with a YAML merge key", lambda d: _set(d, "inv.yaml", "base: &b {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 8}\ngroups:\n  - <<: *b\n    nodes: 2\n"), TUNE),
    ("validate: plan with a YAML merge key", lambda d: _set(d, "p.yaml", PLAN.replace("model:", "model: &m", 1) + "x: {<<: *m}\n"), f"{PY} validate p.yaml"),
]


def _profile(d: Path) -> str:
    sys.path.insert(0, str(REPO))
    from megatron_hetero.cost.profile_file import save_profile
    from tests.test_profile_file import _profile as make
    import dataclasses
    prof = make()
    save_profile(prof, d / "prof.yaml")
    text = (d / "prof.yaml").read_text()
    import re
    text = re.sub(r"(bandwidth_gb_s|latency_s|bytes)(:\s*)[0-9.e+-]+", r"\1\2-1", text, count=3)
    (d / "prof.yaml").write_text(text)
    return f"{TUNE} --profile prof.yaml"


def _snapshot(d: Path) -> dict[str, str]:
    out = {}
    for p in sorted(d.rglob("*")):
        try:
            out[str(p.relative_to(d))] = hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        except OSError:
            out[str(p.relative_to(d))] = "?"
    return out


def run(name: str, setup, command: str) -> str:
    d = Path(tempfile.mkdtemp(prefix="probe-"))
    (d / "inv.yaml").write_text(INV)
    (d / "plan.yaml").write_text(PLAN)
    (d / "small.yaml").write_text(SMALL_INV)
    if setup:
        setup(d)
    if command == "PROFILE":
        command = _profile(d)
    before = _snapshot(d)
    t = time.monotonic()
    try:
        proc = subprocess.run(command, shell=True, cwd=d, capture_output=True, text=True, timeout=30,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, errors="replace")
        code, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired:
        code, err = "hang (killed at 30 s)", ""
    took = time.monotonic() - t
    after = _snapshot(d)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[rehearse]")]
    shape = ("traceback" if "Traceback" in err else f"{len(lines)} line(s)") if lines else "silent"
    last = lines[-1][:160] if lines else ""
    shutil.rmtree(d, ignore_errors=True)
    ch = ", ".join(c[:30] for c in changed[:3]) or "-"
    return f"| {name} | exit {code}, {shape}, {took:.1f} s, changed: {ch} | {last} |"


if __name__ == "__main__":
    want = sys.argv[1] if len(sys.argv) > 1 else ""
    for case in CASES:
        if want in case[0]:
            print(run(*case), flush=True)
