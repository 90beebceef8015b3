#!/usr/bin/env python3
"""Predicted against measured on one real GPU: profile, tune, then Megatron-LM's own training.

    python scripts/gpu_evidence.py --megatron-lm DIR --out DIR [--layers 8] \\
        [--global-batch-size 8] [--iters 8]

DIR is a Megatron-LM checkout (its ``pretrain_gpt.py``; megatron-core 0.17 or later installed).
Every step writes its log under OUT and the run goes on past a failed step, so one call of a
lent GPU brings back everything that worked:

1. ``env.json``: torch, the GPU, megatron-core, Transformer Engine.
2. ``profile.yaml``: ``megatron-hetero profile`` on this GPU (bf16; Transformer Engine's layers
   where it is installed, else megatron-core's local ones) for the model (Llama-2 7B's layer
   shapes, ``--layers`` layers, sequence 4096) at micro-batch sizes 1 and 2.
3. ``plan.yaml``: ``tune`` for this one GPU with that profile; ``plan_offload.yaml``: the same
   plan with its stage's module inputs offloaded to the host (``offload.module_inputs``).
4. ``simulate`` of each plan with the profile and without (catalog datasheet x efficiency).
5. Megatron-LM's ``pretrain_gpt.py`` (mock data, bf16) three times: the plan under
   ``--hetero-plan``; plain Megatron with the plan's arguments (no plugin); the offload plan
   under ``--hetero-plan``. Step time: the median of Megatron's ``elapsed time per iteration``
   after the first two; memory: the largest ``max allocated`` Megatron reports.
6. ``evidence.json`` and a table: predicted against measured, and the three runs' losses.

``--cpu`` rehearses the whole script on this machine's CPU with a tiny model (no GPU needed),
through the CPU backend (``MEGATRON_HETERO_CPU=1``), fp32: it checks the script, not a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
LLAMA2_7B_LAYER = dict(hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                       num_query_groups=32, vocab_size=32000, seq_length=4096)
TINY = dict(hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=4,
            vocab_size=128, seq_length=128)
# Megatron-LM arguments besides the plan's: mock data, no dropout and none of the fused kernels
# (the profiler's layers have none either; they need Apex or TE), the local layers unless TE.
COMMON_ARGS = [
    "--mock-data", "--split", "100,0,0", "--tokenizer-type", "NullTokenizer",
    "--lr", "1e-4", "--min-lr", "1e-4", "--lr-decay-style", "constant", "--seed", "1234",
    "--eval-iters", "0", "--eval-interval", "100000", "--log-interval", "1",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--num-workers", "0",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
    "--no-rope-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
]
RUNS = ("hetero_plan", "plain_megatron", "hetero_plan_offload")
# Plain Megatron-LM: no plan, no hooks; only the preparation the launcher makes before Megatron
# on this device: the installed stack's (runtime/stack.py: pip's megatron-core has its dataset
# helpers built and no Makefile), and on CPU the CPU backend's, which includes it.
_PREPARE = {False: "from megatron_hetero.runtime.stack import prepare_stack as prepare\n",
            True: "from megatron_hetero.runtime.cpu import prepare_cpu_run as prepare\n"}
_RUN_PLAIN = ("prepare()\n"
              "import runpy, sys\n"
              "sys.argv = sys.argv[1:]\n"
              "sys.path.insert(0, __import__('os').path.dirname(sys.argv[0]))\n"
              "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_step(name: str, cmd: list[str], out: Path, *, env=None, timeout: float = 600) -> tuple[
        bool, str]:
    """Run one step, its output in OUT/<name>.log; (succeeded, output)."""
    log(f"{name}: {' '.join(cmd[:6])} ...")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        text, ok = proc.stdout + proc.stderr, proc.returncode == 0
    except subprocess.TimeoutExpired as exc:
        text, ok = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMEOUT after {timeout} s", False
    (out / f"{name}.log").write_text(text if isinstance(text, str) else text.decode())
    log(f"{name}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s")
    if not ok:
        print("\n".join(text.splitlines()[-25:]), flush=True)
    return ok, text


def environment(out: Path, cpu: bool) -> dict:
    import torch
    info = {"torch": torch.__version__, "python": sys.version.split()[0],
            "time_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if not cpu:
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    for name in ("megatron-core", "transformer-engine", "transformer_engine", "apex"):
        try:
            from importlib.metadata import version
            info[name] = version(name)
        except Exception:  # noqa: BLE001 - absent
            info[name] = None
    (out / "env.json").write_text(json.dumps(info, indent=1))
    return info


def step_times_ms(text: str) -> list[float]:
    return [float(m) for m in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", text)]


def losses(text: str) -> list[float]:
    return [float(m) for m in re.findall(r"lm loss: ([\d.E+-]+)", text)]


def max_allocated_mb(text: str) -> float | None:
    found = [float(m) for m in re.findall(r"max allocated: ([\d.]+)", text)]
    return max(found) if found else None


def theoretical_mb(text: str) -> float | None:
    m = re.search(r"Theoretical memory footprints: .*total=([\d.]+) MB", text)
    return float(m.group(1)) if m else None


def simulate(py: str, plan: Path, inventory: Path, profile: Path | None, out: Path,
             name: str) -> dict | None:
    cmd = [py, "-m", "megatron_hetero.cli", "simulate", str(plan), "--inventory", str(inventory),
           "--json", str(out / f"{name}.json"), "--warn-only"]
    if profile is not None:
        cmd += ["--profile", str(profile)]
    ok, _ = run_step(name, cmd, out, timeout=120)
    return json.loads((out / f"{name}.json").read_text()) if ok else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megatron-lm", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--global-batch-size", type=int, default=8)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--profile-warmup", type=int, default=20,
                    help="untimed profile iterations (the GPU's clock ramps up from idle)")
    ap.add_argument("--profile-repeats", type=int, default=20)
    ap.add_argument("--runs", default=",".join(RUNS),
                    help=f"which training runs, of {','.join(RUNS)}")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each training run this many times (losses must agree: a race "
                         "would not repeat)")
    ap.add_argument("--cpu", action="store_true", help="rehearse the script on CPU, tiny model")
    a = ap.parse_args()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    if a.cpu:
        env.update(MEGATRON_HETERO_CPU="1", OMP_NUM_THREADS="1")
    info = environment(out, a.cpu)
    log(f"environment: {info}")

    shape = TINY if a.cpu else LLAMA2_7B_LAYER
    model = dict(name=f"llama2-7b-{a.layers}l" if not a.cpu else "tiny", num_layers=a.layers,
                 **shape)
    (out / "model.yaml").write_text(yaml.safe_dump(model, sort_keys=False))
    device_args = ["--device", "cpu", "--device-type", "A100-SXM-80GB", "--precision", "fp32",
                   "--cpu-threads", "1"] if a.cpu else ["--device", "cuda", "--precision", "bf16"]
    profile = out / "profile.yaml"
    ok, _ = run_step("profile", [py, "-m", "megatron_hetero.cli", "profile", "--model",
                                 str(out / "model.yaml"), "--micro-batch-sizes", "1,2",
                                 "--no-bandwidth", "--warmup", str(a.profile_warmup),
                                 "--repeats", str(a.profile_repeats), "-q",
                                 "-o", str(profile), *device_args], out, env=env)
    if not ok:
        return 1
    device_type = yaml.safe_load(profile.read_text())["device"]["type"]
    inventory = out / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"groups": [{"gpu": device_type, "nodes": 1,
                                                     "gpus_per_node": 1}]}))
    plan = out / "plan.yaml"
    ok, tuned = run_step("tune", [py, "-m", "megatron_hetero.cli", "tune", "--model",
                                  str(out / "model.yaml"), "--global-batch-size",
                                  str(a.global_batch_size), "--micro-batch-sizes", "1,2",
                                  "--profile", str(profile), "-o", str(plan),
                                  "--timeline", str(out / "timeline.png"), str(inventory)],
                         out, env=env, timeout=120)
    if not ok:
        return 1
    data = yaml.safe_load(plan.read_text())
    if a.cpu:
        data["precision"] = "fp32"
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    for stage in data["pipelines"][0]["stages"]:
        stage.setdefault("offload", {})["module_inputs"] = True
    data.pop("prediction", None)
    plan_offload = out / "plan_offload.yaml"
    plan_offload.write_text(yaml.safe_dump(data, sort_keys=False))

    predicted = {}
    for name, p in (("plan", plan), ("plan_offload", plan_offload)):
        predicted[name] = {"profile": simulate(py, p, inventory, profile, out, f"sim_{name}"),
                           "catalog": simulate(py, p, inventory, None, out,
                                               f"sim_{name}_catalog")}

    script = a.megatron_lm.resolve() / "pretrain_gpt.py"
    impl = "transformer_engine" if info.get("transformer-engine") or info.get(
        "transformer_engine") else "local"
    base = [*COMMON_ARGS, "--vocab-size", str(shape["vocab_size"]), "--train-iters",
            str(a.iters), "--transformer-impl", impl]
    if a.cpu:
        base += ["--use-cpu-initialization", "--distributed-backend", "gloo",
                 "--no-create-attention-mask-in-dataloader"]
    launch_env = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29511", CUDA_DEVICE_MAX_CONNECTIONS="1")
    sys.path.insert(0, str(REPO))
    from megatron_hetero.plan.megatron_args import megatron_args
    from megatron_hetero.plan import load_plan
    runs = {
        "hetero_plan": [py, "-m", "megatron_hetero.launch", str(script), *base,
                        "--hetero-plan", str(plan)],
        "plain_megatron": [py, "-c", _PREPARE[a.cpu] + _RUN_PLAIN, str(script), *base,
                           *megatron_args(load_plan(plan))],  # no --hetero-plan without a path
        "hetero_plan_offload": [py, "-m", "megatron_hetero.launch", str(script), *base,
                                "--hetero-plan", str(plan_offload)],
    }
    measured = {}
    wanted = a.runs.split(",")
    for name in wanted:
        for k in range(a.repeat):
            key = name if k == 0 else f"{name}.{k + 1}"
            ok, text = run_step(key, runs[name], out, env=launch_env, timeout=420)
            times = step_times_ms(text)
            measured[key] = {"ok": ok, "step_times_ms": times, "losses": losses(text),
                             "median_step_s": statistics.median(times[2:]) / 1e3
                             if len(times) > 2 else None,
                             "max_allocated_mb": max_allocated_mb(text),
                             "megatron_theoretical_mb": theoretical_mb(text)}
    report = {"environment": info, "model": model, "predicted": predicted, "measured": measured}
    (out / "evidence.json").write_text(json.dumps(report, indent=1))
    print_table(report)
    return 0 if all(m["ok"] for m in measured.values()) else 1


def print_table(report: dict) -> None:
    pred, meas = report["predicted"], report["measured"]
    print("\nrun | predicted s (catalog) | predicted s (profile) | measured s | error (profile) "
          "| predicted GB | measured max allocated GB | Megatron's theoretical GB")
    for run, m in meas.items():
        plan = "plan_offload" if run.startswith("hetero_plan_offload") else "plan"
        p, c = pred[plan]["profile"], pred[plan]["catalog"]
        ps = p["step_time_s"] if p else None
        ms = m["median_step_s"]
        err = f"{(ps - ms) / ms:+.1%}" if ps and ms else "-"
        mem = p["stages"][0]["memory_bytes"] / 1e9 if p else None
        alloc = m["max_allocated_mb"] * 2**20 / 1e9 if m["max_allocated_mb"] else None
        theo = m["megatron_theoretical_mb"] * 2**20 / 1e9 if m["megatron_theoretical_mb"] else None
        fmt = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
        print(f"{run} | {fmt(c and c['step_time_s'])} | {fmt(ps)} | {fmt(ms)} | {err} | "
              f"{fmt(mem, 1)} | {fmt(alloc, 1)} | {fmt(theo, 1)}")
    first = next(iter(meas))
    ref = meas[first]["losses"]
    for run in list(meas)[1:]:
        other = meas[run]["losses"]
        same = bool(ref) and len(ref) == len(other) and all(
            abs(x - y) <= 1e-5 * max(abs(x), 1e-12) for x, y in zip(ref, other))
        print(f"losses of {run} {'equal' if same else 'DIFFER from'} {first}'s "
              f"(rtol 1e-5): {other} vs {ref}")


if __name__ == "__main__":
    sys.exit(main())
