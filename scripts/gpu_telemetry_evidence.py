#!/usr/bin/env python3
"""The telemetry and a mixture of experts on one real GPU, on megatron-core 0.19.2: what
``--hetero-telemetry`` costs a step, and its measured figures per stage against the predicted.

    python scripts/gpu_telemetry_evidence.py --megatron-lm-019 DIR --mcore019 WHEEL_OR_SITE \\
        --out DIR [--parts telemetry,moe_run] [--layers 8] [--iters 14] [--cpu]

Megatron-LM's ``pretrain_gpt.py`` (core_v0.19.0, ``--megatron-lm-019``) under ``python -m
megatron_hetero.launch ... --hetero-plan``, mock data, megatron-core's local layers (the GPU
image has no Transformer Engine, docs/gpu.md), one GPU. Every run logs each step's time
(``--log-interval 1``). The parts (each with its own time budget; a part that fails records why
in ``evidence.json`` and the next one runs, as in ``scripts/gpu_evidence.py``):

1. ``telemetry``: Llama-2 7B's layer cut to ``--layers`` layers, micro-batch 1 at sequence 4096,
   4 micro-batches, bf16. Runs without telemetry and with ``--hetero-telemetry`` at interval 2, in
   the order off, on, on, off. With interval 2 every second step is armed (its forwards and
   backwards marked by CUDA events, read after the step, gathered and written), so one run holds
   both kinds side by side: armed over unarmed steps of the same run is what a report costs;
   unarmed steps over the runs without telemetry is what the pass-through costs. The cost at the
   default interval (10) follows: (armed + 9 x unarmed) / 10 against off.
2. ``moe_run``: Qwen3-30B-A3B's layers (128 experts of 768, top 8) cut to ``--moe-layers``, one
   GPU (EP 1), with the telemetry at interval 2: the MoE step measured against the plan's
   prediction, per stage and kind of work, and the report's cost on an MoE step.

Each telemetry run keeps its ``telemetry.jsonl``, ``profile.<device>.yaml`` and the text of
``megatron-hetero report``. ``--cpu`` rehearses the script on this machine (tiny shapes, CPU
ranks), as tests/runtime/test_gpu_evidence.py does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_evidence as ge  # noqa: E402  (the script beside this one)
sys.path.insert(0, str(ge.REPO))  # megatron_hetero in this process too (the report, the catalog)

PARTS = ("telemetry", "moe_run")
BUDGETS = {"telemetry": 220, "moe_run": 120}
INTERVAL = 2
ORDER = ("off", "on", "on", "off")
QWEN3_LAYER = dict(hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                   num_query_groups=4, kv_channels=128, vocab_size=151936, qk_layernorm=True,
                   num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768)
TINY_MOE = dict(ge.TINY, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                kv_channels=32, qk_layernorm=True)  # the same structure as QWEN3_LAYER


def split_steps(times_ms: list[float], *, skip: int, interval: int) -> dict[str, list[float]]:
    """Step times (s) after the first ``skip``, by whether the telemetry armed the step: step
    ``i + 1`` (Megatron's iteration) is armed where it is a multiple of ``interval``."""
    out: dict[str, list[float]] = {"armed": [], "unarmed": []}
    for i, ms in enumerate(times_ms):
        if i >= skip:
            out["armed" if (i + 1) % interval == 0 else "unarmed"].append(ms / 1e3)
    return out


def stage_table(directory: Path) -> dict:
    """The last record of ``directory/telemetry.jsonl``: the step, its prediction, and per stage
    the measured against the predicted seconds by kind of work."""
    from megatron_hetero.telemetry.records import read_records

    records = read_records(directory)
    last = records[-1]
    return {"steps_reported": [r.step for r in records], "step": last.step,
            "step_time_s": last.step_time_s, "predicted_step_time_s": last.predicted_step_time_s,
            "clock": last.clock, "prediction": last.prediction,
            "stages": {s.path: {"measured": _figures(s.measured), "predicted":
                                _figures(s.predicted)} for s in last.stages}}


def _figures(f) -> dict | None:
    if f is None:
        return None
    return {k: round(getattr(f, k), 6) for k in ("forward_s", "backward_s", "sync_s",
                                                  "optimizer_s", "wait_s")}


class TelemetryRuns:
    """The parts: plans, runs, and what each run measured."""

    def __init__(self, a, info: dict):
        self.a, self.run = a, ge.Run(a, info)
        self.out = self.run.out
        self.script = a.megatron_lm_019.resolve() / "pretrain_gpt.py"
        self.device_type = "A100-SXM-80GB" if a.cpu else _device_type(info)
        self.env019: dict | None = None
        """megatron-core 0.19.2's environment, installed and probed at the first run."""

    def launch_env(self) -> dict:
        """One run's environment on megatron-core 0.19.2, with a port of its own."""
        if self.env019 is None:
            self.env019, _ = self.run.env019()
        return dict(self.env019, MASTER_PORT=self.run.launch_env()["MASTER_PORT"])

    def plan(self, name: str, model: dict, *, mbs: int, gbs: int) -> Path:
        d = self.out / name
        d.mkdir(exist_ok=True)
        plan = ge.plan_for(model, mbs, gbs, "none", self.device_type, self.run.precision)
        path = d / "plan.yaml"
        path.write_text(yaml.safe_dump(plan, sort_keys=False))
        (d / "inventory.yaml").write_text(yaml.safe_dump({"groups": [
            {"gpu": self.device_type, "nodes": 1, "gpus_per_node": 1}]}))
        return path

    def predicted(self, plan: Path) -> dict | None:
        """``simulate``'s step and memory of ``plan`` on its inventory (catalog figures)."""
        return ge.brief_prediction(ge.simulate(
            self.run.py, plan, plan.parent / "inventory.yaml", None, self.out,
            f"{plan.parent.name}/simulate", self.run.env))

    def train(self, name: str, plan: Path, *, telemetry: Path | None, until: float,
              vocab: int) -> dict:
        env = self.launch_env()
        cmd = [self.run.py, "-m", "megatron_hetero.launch", str(self.script),
               *self.run.megatron_base(vocab), "--hetero-plan", str(plan)]
        if telemetry is not None:
            cmd += ["--hetero-telemetry", str(telemetry), "--hetero-telemetry-interval",
                    str(INTERVAL), "--hetero-inventory", str(plan.parent / "inventory.yaml")]
        left = until - time.perf_counter()
        if left < 20:
            return {"ok": False, "error": f"skipped: {left:.0f} s left"}
        t0 = time.perf_counter()
        ok, text = ge.run_step(name, cmd, self.out, env=env,
                               timeout=min(self.a.run_timeout, left))
        rec = ge.measured(ok, text, time.perf_counter() - t0)
        rec["steps"] = split_steps(ge.step_times_ms(text), skip=2, interval=INTERVAL)
        if telemetry is not None and (telemetry / "telemetry.jsonl").exists():
            rec["telemetry"] = stage_table(telemetry)
            report = subprocess.run([self.run.py, "-m", "megatron_hetero.cli", "report",
                                     str(telemetry), "--timeline", str(telemetry / "timeline.png"),
                                     "--inventory", str(plan.parent / "inventory.yaml")],
                                    capture_output=True, text=True,
                                    env=dict(self.run.env, COLUMNS="160"), timeout=120)
            (telemetry / "report.txt").write_text(report.stdout + report.stderr)
        return rec

    def telemetry_part(self, ev: ge.Evidence, until: float) -> bool:
        model = dict(name=f"llama2-7b-{self.a.layers}l", num_layers=self.a.layers,
                     **self.run.layer, seq_length=128 if self.a.cpu else 4096)
        plan = self.plan("telemetry", model, mbs=1, gbs=4)
        rec = ev.data["telemetry"] = {"plan": "telemetry/plan.yaml", "interval": INTERVAL,
                                      "order": self.a.order, "predicted": self.predicted(plan),
                                      "runs": []}
        for i, kind in enumerate(self.a.order):
            tdir = self.out / "telemetry" / f"run{i}" if kind == "on" else None
            rec["runs"].append({"kind": kind, **self.train(
                f"telemetry/run{i}-{kind}", plan, telemetry=tdir, until=until,
                vocab=model["vocab_size"])})
            ev.save()
        rec["summary"] = overhead(rec["runs"])
        ev.save()
        return all(r["ok"] for r in rec["runs"])

    def moe_run_part(self, ev: ge.Evidence, until: float) -> bool:
        layer = TINY_MOE if self.a.cpu else QWEN3_LAYER
        model = dict(name=f"qwen3-30b-a3b-{self.a.moe_layers}l", num_layers=self.a.moe_layers,
                     **layer, seq_length=128 if self.a.cpu else 4096)
        plan = self.plan("moe_run", model, mbs=1, gbs=4)
        run = self.train("moe_run/run", plan, telemetry=self.out / "moe_run" / "telemetry",
                         until=until, vocab=model["vocab_size"])
        ev.data["moe_run"] = {"plan": "moe_run/plan.yaml", "interval": INTERVAL,
                              "predicted": self.predicted(plan), **run,
                              "report_cost": _ratio(run["steps"]["armed"],
                                                    run["steps"]["unarmed"])}
        return run["ok"]


def _device_type(info: dict) -> str:
    """The catalog's name of the card torch sees (the profile's own lookup)."""
    from megatron_hetero.hardware.catalog import load_catalog

    return load_catalog().resolve(info["gpu"]) or "H200-SXM-141GB"


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ratio(a: list[float], b: list[float]) -> float | None:
    return round(_median(a) / _median(b), 4) if a and b else None


def overhead(runs: list[dict]) -> dict:
    """The side-by-side figures: median step times without telemetry, of unarmed and of armed
    steps with it, and their ratios (one run's armed over its unarmed steps, pooled over runs)."""
    off = [t for r in runs if r["kind"] == "off" for t in r["steps"]["unarmed"] +
           r["steps"]["armed"]]
    unarmed = [t for r in runs if r["kind"] == "on" for t in r["steps"]["unarmed"]]
    armed = [t for r in runs if r["kind"] == "on" for t in r["steps"]["armed"]]
    out = {"off_median_s": _median(off), "unarmed_median_s": _median(unarmed),
           "armed_median_s": _median(armed), "armed_over_unarmed": _ratio(armed, unarmed),
           "unarmed_over_off": _ratio(unarmed, off),
           "per_run_armed_over_unarmed": [_ratio(r["steps"]["armed"], r["steps"]["unarmed"])
                                          for r in runs if r["kind"] == "on"]}
    if off and armed and unarmed:
        out["interval10_over_off"] = round((_median(armed) + 9 * _median(unarmed))
                                           / 10 / _median(off), 4)
    return out


def print_summary(data: dict) -> None:
    s = (data.get("telemetry") or {}).get("summary")
    if s:
        print(f"\ntelemetry: step off {s['off_median_s']} s | unarmed {s['unarmed_median_s']} s "
              f"| armed {s['armed_median_s']} s | armed/unarmed {s['armed_over_unarmed']} "
              f"(per run {s['per_run_armed_over_unarmed']}) | unarmed/off "
              f"{s['unarmed_over_off']} | at interval 10 over off {s.get('interval10_over_off')}")
    for name, rec in (("telemetry", (data.get("telemetry") or {}).get("runs", [{}])[1:2]),
                      ("moe_run", [data.get("moe_run") or {}])):
        for r in rec:
            t = r.get("telemetry")
            if not t:
                continue
            print(f"{name}: step measured {t['step_time_s']:.4f} s, predicted "
                  f"{t['predicted_step_time_s']} s ({t['prediction']})")
            for path, f in t["stages"].items():
                print(f"  {path}: measured {f['measured']} | predicted {f['predicted']}")
    for name in ("telemetry", "moe_run"):
        rec = data.get(name) or {}
        p, runs = rec.get("predicted") or {}, rec.get("runs") or [rec]
        alloc = max((r.get("max_allocated_mb") or 0 for r in runs), default=0)
        if p and alloc:
            print(f"{name}: memory max allocated {alloc * 2**20 / 1e9:.2f} GB, predicted "
                  f"{p['memory_bytes'] / 1e9:.2f} GB; step predicted {p['step_time_s']:.4f} s")
    print("parts: " + ", ".join(f"{k} {'ok' if v['ok'] else 'FAILED'} ({v['wall_s']} s)"
                                for k, v in data["parts"].items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"of {','.join(PARTS)}")
    ap.add_argument("--megatron-lm-019", required=True, type=Path,
                    help="Megatron-LM core_v0.19.0's scripts")
    ap.add_argument("--mcore019", required=True,
                    help="megatron-core 0.19.2's wheel, or a directory with it")
    ap.add_argument("--order", type=lambda t: t.split(","), default=list(ORDER),
                    help="the telemetry part's runs, off or on (default: off,on,on,off)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=14)
    ap.add_argument("--run-timeout", type=float, default=100,
                    help="seconds one training run may take")
    ap.add_argument("--deadline", type=float, default=400,
                    help="seconds for the whole script: no part starts past it")
    for part, seconds in BUDGETS.items():
        ap.add_argument(f"--budget-{part.replace('_', '-')}", type=float, default=seconds,
                        help=f"seconds for the {part} part (default {seconds})")
    ap.add_argument("--cpu", action="store_true", help="rehearse the script on CPU, tiny shapes")
    a = ap.parse_args()
    a.megatron_lm = a.megatron_lm_019  # what gpu_evidence.Run reads
    a.out.mkdir(parents=True, exist_ok=True)
    info = ge.environment(a.out, a.cpu)
    ge.log(f"environment: {info}")
    ev = ge.Evidence(a.out.resolve(), a.deadline, info)
    ev.data = {"environment": info, "parts": {}, "telemetry": None, "moe_run": None}
    runs = TelemetryRuns(a, info)
    for part in [p for p in a.parts.split(",") if p]:
        fn = {"telemetry": runs.telemetry_part, "moe_run": runs.moe_run_part}[part]
        ev.part(part, getattr(a, f"budget_{part}"), lambda until, fn=fn: fn(ev, until))
    (a.out / "evidence.json").write_text(json.dumps(ev.data, indent=1))
    print_summary(ev.data)
    return 0 if all(p["ok"] for p in ev.data["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
