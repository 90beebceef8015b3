#!/usr/bin/env python3
"""Predicted against measured on one real GPU, in parts that each keep their own time budget.

    python scripts/gpu_evidence.py --megatron-lm DIR --out DIR [--parts shapes,moe,mcore019] \\
        [--megatron-lm-019 DIR --mcore019 WHEEL_OR_SITE] [--layers 8] [--iters 6]

DIR is a Megatron-LM checkout (its ``pretrain_gpt.py``) for the megatron-core installed (0.17.1
on the lent GPU, docs/gpu.md). A part that fails or runs out of its budget records its
failure (the traceback or log tail) in ``evidence.json`` and the next part runs; the file is
written again after every part, so a call cut short still brings back what finished.

0. ``env.json``: Python, torch, the GPU and its driver, megatron-core, Transformer Engine, Apex.
1. ``shapes``: the memory reserve and the step at several shapes of Llama-2 7B's layer cut to
   ``--layers`` layers (``SHAPES``: micro-batch size 1 at sequence 4096; 4 at 2048; 2 at 4096
   with full recompute). One ``megatron-hetero profile`` per sequence length (bf16, its
   micro-batch sizes), a hand-written one-GPU plan per shape (``shape-NAME/plan.yaml``),
   ``simulate`` with the profile and without it (catalog x efficiency), then Megatron-LM's
   ``pretrain_gpt.py`` under ``--hetero-plan`` (mock data). Measured: the median of
   ``elapsed time per iteration`` after the first two, the largest ``max allocated`` and
   ``max reserved`` Megatron reports, its theoretical memory, the losses.
2. ``moe``: ``scripts/gpu_moe_profile.py`` (megatron-core's MoE layer against a dense one).
3. ``mcore019``: megatron-core 0.19.2 (``--mcore019``: its wheel, installed into OUT's
   scratch, or a directory it is installed in) with Megatron-LM core_v0.19.0's
   ``pretrain_gpt.py`` (``--megatron-lm-019``): the first shape's plan under
   ``--hetero-plan``, then the same arguments without the plugin, as far as the budget goes.

``--cpu`` rehearses everything on this machine's CPU with tiny shapes (the CPU backend, fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
LLAMA2_7B_LAYER = dict(hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                       num_query_groups=32, vocab_size=32000)
TINY = dict(hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=4,
            vocab_size=128)
# name: micro-batch size, sequence length, global batch size, recompute granularity
SHAPES = {"mbs1-seq4096": (1, 4096, 4, "none"), "mbs4-seq2048": (4, 2048, 8, "none"),
          "mbs2-seq4096-full": (2, 4096, 4, "full")}
TINY_SHAPES = {"mbs1-seq128": (1, 128, 4, "none"), "mbs4-seq64": (4, 64, 8, "none"),
               "mbs2-seq128-full": (2, 128, 4, "full")}
PARTS = ("shapes", "moe", "mcore019")
BUDGETS = {"shapes": 230, "moe": 110, "mcore019": 150}
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
# Plain Megatron-LM: no plan, no hooks; only the preparation the launcher makes before Megatron
# on this device (runtime/stack.py: pip's megatron-core has its dataset helpers built and no
# Makefile; on CPU the CPU backend's, which includes it).
_PREPARE = {False: "from megatron_hetero.runtime.stack import prepare_stack as prepare\n",
            True: "from megatron_hetero.runtime.cpu import prepare_cpu_run as prepare\n"}
_RUN_PLAIN = ("prepare()\n"
              "import runpy, sys\n"
              "sys.argv = sys.argv[1:]\n"
              "sys.path.insert(0, __import__('os').path.dirname(sys.argv[0]))\n"
              "runpy.run_path(sys.argv[0], run_name='__main__')\n")
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:5.0f}s] {msg}", flush=True)


def tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run_step(name: str, cmd: list[str], out: Path, *, env=None, timeout: float = 600) -> tuple[
        bool, str]:
    """Run one command, its output in OUT/<name>.log; (succeeded, output)."""
    log(f"{name}: {' '.join(str(c) for c in cmd[:6])} ... (timeout {timeout:.0f} s)")
    t0 = time.perf_counter()
    # its own session: on a timeout the whole group goes (no rank left holding the GPU)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=max(timeout, 1))
        ok = proc.returncode == 0
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        text, ok = f"{text}\nTIMEOUT after {timeout:.0f} s", False
    (out / f"{name}.log").parent.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.log").write_text(text)
    log(f"{name}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s")
    if not ok:
        print(tail(text, 20), flush=True)
    return ok, text


def environment(out: Path, cpu: bool) -> dict:
    import torch
    from importlib.metadata import version
    info = {"torch": torch.__version__, "python": sys.version.split()[0],
            "time_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if not cpu:
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,"
                                  "clocks.max.sm,power.limit", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            info["nvidia_smi"] = smi.stdout.strip()
            info["driver"] = smi.stdout.split(",")[1].strip() if smi.stdout else None
        except Exception as exc:  # noqa: BLE001 - recorded
            info["nvidia_smi"] = f"failed: {exc}"
    for name in ("megatron-core", "transformer-engine", "transformer_engine", "apex", "triton"):
        try:
            info[name] = version(name)
        except Exception:  # noqa: BLE001 - absent
            info[name] = None
    (out / "env.json").write_text(json.dumps(info, indent=1))
    return info


def step_times_ms(text: str) -> list[float]:
    return [float(m) for m in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", text)]


def losses(text: str) -> list[float]:
    return [float(m) for m in re.findall(r"lm loss: ([\d.E+-]+)", text)]


def largest(pattern: str, text: str) -> float | None:
    found = [float(m) for m in re.findall(pattern, text)]
    return max(found) if found else None


def measured(ok: bool, text: str, wall_s: float) -> dict:
    times = step_times_ms(text)
    m = re.search(r"Theoretical memory footprints: .*total=([\d.]+) MB", text)
    return {"ok": ok, "wall_s": round(wall_s, 1), "step_times_ms": times, "losses": losses(text),
            "median_step_s": statistics.median(times[2:]) / 1e3 if len(times) > 2 else None,
            "max_allocated_mb": largest(r"max allocated: ([\d.]+)", text),
            "max_reserved_mb": largest(r"max reserved: ([\d.]+)", text),
            "megatron_theoretical_mb": float(m.group(1)) if m else None,
            **({} if ok else {"log_tail": tail(text, 40)})}


class Evidence:
    """evidence.json, written again after every change; the parts' outcomes and the deadline."""

    def __init__(self, out: Path, deadline_s: float, info: dict):
        self.out, self.deadline = out, T0 + deadline_s
        self.data = {"environment": info, "parts": {}, "shapes": {}, "moe": None,
                     "mcore019": {}}
        self.save()

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def save(self) -> None:
        (self.out / "evidence.json").write_text(json.dumps(self.data, indent=1))

    def part(self, name: str, budget: float, fn) -> None:
        budget = min(budget, self.left())
        t0 = time.perf_counter()
        if budget < 10:
            self.data["parts"][name] = {"ok": False, "error": f"skipped: {budget:.0f} s left"}
        else:
            log(f"== part {name} (budget {budget:.0f} s)")
            try:
                ok = fn(t0 + budget)
                self.data["parts"][name] = {"ok": bool(ok)}
            except Exception:  # noqa: BLE001 - recorded, the next part runs
                self.data["parts"][name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
                log(f"part {name} raised:\n{traceback.format_exc()[-1500:]}")
        self.data["parts"][name]["wall_s"] = round(time.perf_counter() - t0, 1)
        log(f"== part {name}: {self.data['parts'][name]['ok']} in "
            f"{self.data['parts'][name]['wall_s']} s")
        self.save()


def plan_for(model: dict, mbs: int, gbs: int, recompute: str, device_type: str,
             precision: str) -> dict:
    rc = {"granularity": recompute} | ({"method": "uniform", "num_layers": 1}
                                       if recompute == "full" else {})
    return {"format_version": 1, "model": model, "global_batch_size": gbs,
            "tensor_model_parallel_size": 1,
            "pipelines": [{"micro_batch_size": mbs, "num_microbatches": gbs // mbs,
                           "stages": [{"device_type": device_type,
                                       "num_layers": model["num_layers"], "recompute": rc}]}],
            "precision": precision, "use_distributed_optimizer": True,
            "sequence_parallel": False, "overlap_grad_reduce": True, "virtual_pipeline_size": 1}


def simulate(py: str, plan: Path, inventory: Path, profile: Path | None, out: Path, name: str,
             env: dict) -> dict | None:
    cmd = [py, "-m", "megatron_hetero.cli", "simulate", str(plan), "--inventory", str(inventory),
           "--json", str(out / f"{name}.json"), "--warn-only"]
    if profile is not None:
        cmd += ["--profile", str(profile)]
    ok, _ = run_step(name, cmd, out, env=env, timeout=60)
    return json.loads((out / f"{name}.json").read_text()) if ok else None


def brief_prediction(sim: dict | None) -> dict | None:
    if not sim:
        return None
    stage = sim["stages"][0]
    return {"step_time_s": sim["step_time_s"], "memory_bytes": stage["memory_bytes"],
            "fits_memory": sim.get("fits_memory"), "memory_capacity_bytes":
            stage.get("memory_capacity_bytes")}


class Run:
    """What every part shares: the options, the environments, the Megatron command base."""

    def __init__(self, a, info: dict):
        self.a, self.info, self.py = a, info, sys.executable
        self.out = a.out.resolve()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")]
                                            if p)
        if a.cpu:
            env.update(MEGATRON_HETERO_CPU="1", OMP_NUM_THREADS="1")
        self.env = env
        self._launch_env = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                                MASTER_ADDR="127.0.0.1", CUDA_DEVICE_MAX_CONNECTIONS="1")
        self._port = 29510
        self.shapes = TINY_SHAPES if a.cpu else SHAPES
        self.layer = TINY if a.cpu else LLAMA2_7B_LAYER
        self.precision = "fp32" if a.cpu else "bf16"
        self.plans: dict[str, Path] = {}

    def launch_env(self, **extra) -> dict:
        """The environment of one Megatron run: one rank, a port of its own (a killed run's
        port may linger)."""
        self._port += 1
        return dict(self._launch_env, MASTER_PORT=str(self._port), **extra)

    def model(self, seq: int) -> dict:
        name = "tiny" if self.a.cpu else f"llama2-7b-{self.a.layers}l"
        return dict(name=f"{name}-s{seq}", num_layers=self.a.layers, **self.layer,
                    seq_length=seq)

    def megatron_base(self, vocab: int) -> list[str]:
        impl = "transformer_engine" if self.info.get("transformer-engine") or self.info.get(
            "transformer_engine") else "local"
        base = [*COMMON_ARGS, "--vocab-size", str(vocab), "--train-iters", str(self.a.iters),
                "--transformer-impl", impl]
        if self.a.cpu:
            base += ["--use-cpu-initialization", "--distributed-backend", "gloo",
                     "--no-create-attention-mask-in-dataloader"]
        return base

    def profile(self, seq: int, mbs_list: list[int], until: float) -> Path | None:
        out = self.out / f"profile-s{seq}"
        out.mkdir(exist_ok=True)
        (out / "model.yaml").write_text(yaml.safe_dump(self.model(seq), sort_keys=False))
        device = ["--device", "cpu", "--device-type", "A100-SXM-80GB", "--precision", "fp32",
                  "--cpu-threads", "1"] if self.a.cpu else ["--device", "cuda", "--precision",
                                                             "bf16"]
        profile = out / "profile.yaml"
        ok, _ = run_step(f"profile-s{seq}/profile", [
            self.py, "-m", "megatron_hetero.cli", "profile", "--model", str(out / "model.yaml"),
            "--micro-batch-sizes", ",".join(map(str, mbs_list)), "--no-bandwidth", "--warmup",
            str(self.a.profile_warmup), "--repeats", str(self.a.profile_repeats), "-q", "-o",
            str(profile), *device], self.out, env=self.env, timeout=min(120, until - time.perf_counter()))
        return profile if ok else None

    def shapes_part(self, ev: Evidence, until: float) -> bool:
        by_seq: dict[int, list[int]] = {}
        for mbs, seq, _, _ in self.shapes.values():
            by_seq.setdefault(seq, []).append(mbs)
        profiles = {seq: self.profile(seq, sorted(set(m)), until) for seq, m in by_seq.items()}
        first = next((p for p in profiles.values() if p), None)
        device_type = (yaml.safe_load(first.read_text())["device"]["type"] if first else
                       "H200-SXM-141GB")
        self.device_type = device_type  # the 0.19.2 part plans for the card the profile found
        inventory = self.out / "inventory.yaml"
        inventory.write_text(yaml.safe_dump({"groups": [{"gpu": device_type, "nodes": 1,
                                                         "gpus_per_node": 1}]}))
        script = self.a.megatron_lm.resolve() / "pretrain_gpt.py"
        all_ok = True
        for name, (mbs, seq, gbs, recompute) in self.shapes.items():
            d = self.out / f"shape-{name}"
            d.mkdir(exist_ok=True)
            plan = d / "plan.yaml"
            plan.write_text(yaml.safe_dump(plan_for(self.model(seq), mbs, gbs, recompute,
                                                    device_type, self.precision),
                                           sort_keys=False))
            self.plans[name] = plan
            rec = ev.data["shapes"][name] = {
                "micro_batch_size": mbs, "seq_length": seq, "global_batch_size": gbs,
                "recompute": recompute, "num_layers": self.a.layers,
                "predicted": {"profile": brief_prediction(simulate(
                    self.py, plan, inventory, profiles[seq], self.out, f"shape-{name}/sim_profile",
                    self.env)) if profiles[seq] else None,
                    "catalog": brief_prediction(simulate(
                        self.py, plan, inventory, None, self.out, f"shape-{name}/sim_catalog",
                        self.env))}}
            left = until - time.perf_counter()
            if left < 20:
                rec["measured"] = {"ok": False, "error": f"skipped: {left:.0f} s left"}
                all_ok = False
                continue
            t0 = time.perf_counter()
            ok, text = run_step(f"shape-{name}/hetero_plan", [
                self.py, "-m", "megatron_hetero.launch", str(script),
                *self.megatron_base(self.layer["vocab_size"]), "--hetero-plan", str(plan)],
                self.out, env=self.launch_env(), timeout=min(self.a.run_timeout, left))
            rec["measured"] = measured(ok, text, time.perf_counter() - t0)
            all_ok &= ok
            ev.save()
        return all_ok

    def moe_part(self, ev: Evidence, until: float) -> bool:
        out = self.out / "moe.json"
        left = until - time.perf_counter()
        cmd = [self.py, str(REPO / "scripts" / "gpu_moe_profile.py"), "--out", str(out),
               "--budget-s", str(max(left - 40, 5))]
        if self.a.cpu:
            cmd.append("--cpu")
        ok, text = run_step("moe", cmd, self.out, env=self.env, timeout=left)
        ev.data["moe"] = json.loads(out.read_text()) if out.exists() else {
            "failed": [{"case": "all", "traceback": tail(text, 40)}]}
        return ok

    def env019(self) -> tuple[dict, str]:
        """The environment of a run on megatron-core 0.19.2 (``--mcore019``: its wheel, installed
        into OUT's scratch once, or a directory it is installed in), and what it imports."""
        src = self.a.mcore019
        if src is None or self.a.megatron_lm_019 is None:
            raise RuntimeError("--mcore019 and --megatron-lm-019 are needed for this part")
        src, site = Path(src), self.out / "_scratch" / "site019"
        if src.is_dir():
            site = src
        elif not src.is_file():
            raise FileNotFoundError(f"--mcore019 {src}: neither a wheel nor a directory")
        elif not (site / "megatron").is_dir():
            ok, text = run_step("mcore019/install", [
                self.py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                "--target", str(site), str(src)], self.out, env=self.env, timeout=120)
            if not ok:
                raise RuntimeError(f"installing {src} failed:\n{tail(text, 20)}")
        env = self.launch_env(PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))  # no 0.17.1
        # megatron-core 0.19's __version__ appends the git commit of the working directory
        probe = subprocess.run([self.py, "-c", "from importlib.metadata import version as v; "
                                "import megatron.core as m; print(v('megatron-core'), "
                                "m.__file__, m.__version__)"],
                               capture_output=True, text=True, env=env, timeout=60)
        return env, probe.stdout.strip() or tail(probe.stderr, 5)

    def mcore019_part(self, ev: Evidence, until: float) -> bool:
        rec = ev.data["mcore019"]
        env, rec["megatron_core"] = self.env019()
        name = next(iter(self.shapes))
        plan = self.plans.get(name)
        if plan is None:  # the shapes part did not run: its first plan, without a profile
            mbs, seq, gbs, recompute = self.shapes[name]
            plan = self.out / "mcore019" / "plan.yaml"
            plan.parent.mkdir(exist_ok=True)
            plan.write_text(yaml.safe_dump(plan_for(self.model(seq), mbs, gbs, recompute,
                                                    getattr(self, "device_type", "H200-SXM-141GB")
                                                    if not self.a.cpu else "A100-SXM-80GB",
                                                    self.precision)))
        rec["plan"] = str(plan.relative_to(self.out))
        script = self.a.megatron_lm_019.resolve() / "pretrain_gpt.py"
        base = self.megatron_base(self.layer["vocab_size"])
        sys.path.insert(0, str(REPO))
        from megatron_hetero.plan.megatron_args import megatron_args
        from megatron_hetero.plan import load_plan
        runs = {"hetero_plan": [self.py, "-m", "megatron_hetero.launch", str(script), *base,
                                "--hetero-plan", str(plan)],
                "plain_megatron": [self.py, "-c", _PREPARE[self.a.cpu] + _RUN_PLAIN, str(script),
                                   *base, *megatron_args(load_plan(plan))]}
        ok_all = True
        for run, cmd in runs.items():
            left = until - time.perf_counter()
            if left < 20:
                rec[run] = {"ok": False, "error": f"skipped: {left:.0f} s left"}
                ok_all = False
                continue
            t0 = time.perf_counter()
            ok, text = run_step(f"mcore019/{run}", cmd, self.out, env=dict(
                env, MASTER_PORT=self.launch_env()["MASTER_PORT"]),
                                timeout=min(self.a.run_timeout, left))
            rec[run] = measured(ok, text, time.perf_counter() - t0)
            ok_all &= ok
            ev.save()
        return ok_all


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megatron-lm", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"of {','.join(PARTS)}")
    ap.add_argument("--megatron-lm-019", type=Path, help="Megatron-LM core_v0.19.0's scripts")
    ap.add_argument("--mcore019", help="megatron-core 0.19.2's wheel, or a directory with it")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--profile-warmup", type=int, default=20,
                    help="untimed profile iterations (the GPU's clock ramps up from idle)")
    ap.add_argument("--profile-repeats", type=int, default=20)
    ap.add_argument("--run-timeout", type=float, default=150,
                    help="seconds one training run may take")
    ap.add_argument("--deadline", type=float, default=450,
                    help="seconds for the whole script: no part starts past it")
    for part, seconds in BUDGETS.items():
        ap.add_argument(f"--budget-{part}", type=float, default=seconds,
                        help=f"seconds for the {part} part (default {seconds})")
    ap.add_argument("--cpu", action="store_true", help="rehearse the script on CPU, tiny shapes")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    info = environment(a.out, a.cpu)
    log(f"environment: {info}")
    ev = Evidence(a.out.resolve(), a.deadline, info)
    run = Run(a, info)
    for part in [p for p in a.parts.split(",") if p]:
        fn = {"shapes": run.shapes_part, "moe": run.moe_part, "mcore019": run.mcore019_part}[part]
        ev.part(part, getattr(a, f"budget_{part}"), lambda until, fn=fn: fn(ev, until))
    print_summary(ev.data)
    return 0 if all(p["ok"] for p in ev.data["parts"].values()) else 1


def print_summary(data: dict) -> None:
    fmt = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    gb = lambda mb: None if mb is None else mb * 2**20 / 1e9  # noqa: E731
    print("\nshape | measured s | predicted s (profile) | (catalog) | measured max allocated GB "
          "| max reserved GB | predicted GB (profile) | (catalog) | Megatron's theoretical GB")
    for name, r in data["shapes"].items():
        m, p, c = r.get("measured") or {}, r["predicted"]["profile"] or {}, \
            r["predicted"]["catalog"] or {}
        print(f"{name} | {fmt(m.get('median_step_s'))} | {fmt(p.get('step_time_s'))} | "
              f"{fmt(c.get('step_time_s'))} | {fmt(gb(m.get('max_allocated_mb')), 2)} | "
              f"{fmt(gb(m.get('max_reserved_mb')), 2)} | "
              f"{fmt(p.get('memory_bytes') and p['memory_bytes'] / 1e9, 2)} | "
              f"{fmt(c.get('memory_bytes') and c['memory_bytes'] / 1e9, 2)} | "
              f"{fmt(gb(m.get('megatron_theoretical_mb')), 2)}")
    for case in (data.get("moe") or {}).get("cases", []):
        print(f"moe {case['case']}: layer {case['layer']['forward_s'] * 1e3:.2f} + "
              f"{case['layer']['backward_s'] * 1e3:.2f} ms, imbalance "
              f"{case.get('imbalance_max_over_mean', '-')}")
    for run in ("hetero_plan", "plain_megatron"):
        r = data["mcore019"].get(run)
        if r:
            print(f"mcore019 {run}: {'ok' if r['ok'] else 'FAILED'}, step "
                  f"{fmt(r.get('median_step_s'))} s, losses {r.get('losses')}")
    print("parts: " + ", ".join(f"{k} {'ok' if v['ok'] else 'FAILED'} ({v['wall_s']} s)"
                                for k, v in data["parts"].items()))


if __name__ == "__main__":
    sys.exit(main())
