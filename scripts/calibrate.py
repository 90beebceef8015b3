"""Calibration: measured against predicted step time, with and without a profile of this machine.

1. Profile this machine (``megatron-hetero profile`` on the CPU backend, one torch thread, the
   calibration model, with its 2-stage pipeline measurement) unless ``--profile`` gives one;
   and, for each emulated device, one more with ``--idle-factor`` = the device's factor - 1,
   which also measures what a step costs more after an idle gap of that length (every step of
   that device's rehearsal rank follows such a gap: its stretch sleep) than back to back.
2. Rehearse each calibration plan (:func:`megatron_hetero.emulate.rehearse.rehearse`: one CPU
   process per rank running megatron-core, each rank's forward and backward steps stretched to
   its GPU type's speed relative to the plan's fastest type, times ``--time-scale``). Measured
   step time: the slowest rank's wall time of the fastest step after the first (other processes
   on the shared cores only ever add time; the median is kept in the JSON too).
   The memory cap and its saved-tensor accounting are off (``meter_memory=False``): the
   accounting costs CPU time inside every stretched step that the profile does not see.
3. Predict each rehearsal with the tuner's cost model and simulator on the emulated cluster
   (:func:`megatron_hetero.emulate.prediction.predict`), five ways:
   - ``profile``: the profile's measured per-part times (x each device's factor), its pipeline
     overhead on pipeline stages and its p2p latency;
   - ``profile + idle penalty``: the same from each device's own profile, plus its measured
     idle penalty once per forward and backward step of every stage;
   - ``rehearsal``: the rehearsal's own start-up calibration (what ``rehearse`` prints as the
     prediction from that calibration alone);
   - ``efficiency only``: the analytic FLOP model at the CPU's measured matmul peak x the
     profile's measured layer efficiency (the tuner's fallback for shapes a profile lacks);
   - ``no profile``: the analytic FLOP model at the measured matmul peak x 0.5, a typical catalog
     default efficiency (datasheet figures alone).
4. Print the table, and with ``--write-docs`` put it in docs/calibration.md between the
   ``calibration-table`` markers.

Run: ``.venv/bin/python scripts/calibrate.py --write-docs`` (about 10 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_hetero.cost.profile_file import MeasuredProfile, load_profile  # noqa: E402
from megatron_hetero.plan import ModelSpec, Pipeline, Plan, Stage, uniform_plan  # noqa: E402

DOC = REPO / "docs" / "calibration.md"
BEGIN, END = "<!-- calibration-table:begin -->", "<!-- calibration-table:end -->"
FAST, SLOW = "A100-SXM-80GB", "A40-48GB"
NO_PROFILE_EFFICIENCY = 0.5
MODES = ("profile", "profile + idle penalty", "rehearsal", "efficiency only", "no profile")
PROFILE_MODES = ("profile", "profile + idle penalty")
"""The modes that read a profile's per-part times; the second one reads, for each emulated
device, the profile taken with that device's ``--idle-factor`` and adds its idle penalty."""

MODEL = ModelSpec(name="calib-llama", num_layers=6, hidden_size=256, ffn_hidden_size=704,
                  num_attention_heads=8, num_query_groups=8, vocab_size=2048, seq_length=128)
"""Narrow enough to rehearse on 2 cores, wide enough that compute outweighs Python overheads;
``rehearse`` does not shrink it (its hidden size is the rehearsal's)."""


def _plan(name: str, pipelines: list[tuple[int, int, list[tuple[str, int]]]]) -> tuple[str, Plan]:
    pipes = [Pipeline(micro_batch_size=mbs, num_microbatches=n,
                      stages=[Stage(device_type=d, num_layers=k) for d, k in stages])
             for mbs, n, stages in pipelines]
    gbs = sum(p.samples for p in pipes)
    return name, uniform_plan(model=MODEL, global_batch_size=gbs,
                      tensor_model_parallel_size=1, pipelines=pipes, use_distributed_optimizer=False)


def plans(quick: bool) -> list[tuple[str, Plan]]:
    out = [
        _plan(f"1x {FAST}, 6 layers, mbs 2 x 4", [(2, 4, [(FAST, 6)])]),
        _plan(f"PP=2 {FAST} 4 layers + {SLOW} 2 layers, mbs 1 x 6",
              [(1, 6, [(FAST, 4), (SLOW, 2)])]),
        _plan(f"DP=2 {FAST} 3 + {SLOW} 1 micro-batches of 2",
              [(2, 3, [(FAST, 6)]), (2, 1, [(SLOW, 6)])]),
        _plan(f"PP=2 x DP=2, split 3:3, {FAST} pipeline 5 / {SLOW} pipeline 2 micro-batches of 1",
              [(1, 5, [(FAST, 3), (FAST, 3)]), (1, 2, [(SLOW, 3), (SLOW, 3)])]),
    ]
    return out[:2] if quick else out


def calibration_from(profile: MeasuredProfile | None, shrunk: Plan, base, mode: str):
    """A rehearsal ``Calibration`` (what ``predict`` stretches per device) built from ``mode``."""
    from megatron_hetero.models import layer_forward_flops

    if mode == "rehearsal":
        return base
    # Only the compute figures differ between the modes; links and the optimizer's rate stay
    # what the rehearsal measured at start.
    out = dataclasses.replace(base, parts={}, layer_flops_per_s=0.0, pipeline_overhead={},
                              step_overhead={})
    peak = profile.data.device.peak_matmul_tflops * 1e12
    if mode == "no profile":
        out.layer_flops_per_s = peak * NO_PROFILE_EFFICIENCY
    elif mode == "efficiency only":
        out.layer_flops_per_s = peak * profile.efficiency
    else:
        m = shrunk.model
        for b in sorted({p.micro_batch_size for p in shrunk.pipelines}):
            for part in ("layer", "embedding", "output"):
                got = profile.times(part, model=m, micro_batch_size=b, tensor_parallel_size=1)
                if got is None:
                    raise SystemExit(f"{profile.source} has no {part} at micro-batch {b} for "
                                     f"the shape of {m.name}; re-profile")
                out.parts[(part, b)] = got
            over = profile.pipeline_overhead(model=m, micro_batch_size=b, tensor_parallel_size=1)
            if over is not None:
                out.pipeline_overhead[b] = over
            pen = _idle_penalty(profile, b)
            if pen is not None:
                out.step_overhead[b] = pen
            lf, lb = out.parts[("layer", b)]
            out.layer_flops_per_s = 3 * layer_forward_flops(m, b) / (lf + lb)
        comm = profile.data.communication
        if comm is not None and comm.p2p_latency_s is not None:
            out.p2p_latency_s = comm.p2p_latency_s
    return out


def idle_factors(plan: Plan, time_scale: float) -> dict[str, float]:
    """Per device type of ``plan``: how many times each step the rehearsal's rank sleeps after
    it (factor - 1, factor = slowdown x time scale)."""
    from megatron_hetero.emulate.speed import device_slowdowns

    return {d: round(max(0.0, s * time_scale - 1.0), 3)
            for d, s in device_slowdowns(plan).items()}


def run_plan(plan: Plan, profile: MeasuredProfile, idle_profiles: dict[float, MeasuredProfile],
             args) -> dict:
    from megatron_hetero.emulate.prediction import predict
    from megatron_hetero.emulate.rehearse import RehearsalConfig, rehearse
    from megatron_hetero.emulate.speed import device_slowdowns

    config = RehearsalConfig(steps=args.steps, hidden_size=MODEL.hidden_size,
                             time_scale=args.time_scale, memory_cap=False, meter_memory=False)
    result = rehearse(plan, config)
    factors = {d: s * args.time_scale for d, s in device_slowdowns(plan).items()}
    base = result.calibration
    predicted = {}
    for mode in MODES:
        if mode == "rehearsal":  # what rehearse prints from its start-up calibration alone
            predicted[mode] = result.a_priori_step_s
        elif mode == "profile + idle penalty":
            if idle_profiles:
                per_device = {d: calibration_from(idle_profiles[k], result.plan, base, "profile")
                              for d, k in idle_factors(plan, args.time_scale).items()}
                predicted[mode] = predict(result.plan, per_device, factors).step_time_s
        else:
            predicted[mode] = predict(result.plan, calibration_from(profile, result.plan, base,
                                                                    mode), factors).step_time_s
    # The least-disturbed step: other processes share this machine's cores, and their
    # interference only ever adds time.
    return {"measured_s": min(result.step_times), "median_s": result.step_s,
            "step_times_s": result.step_times,
            "predicted_s": predicted, "ranks": result.plan.world_size,
            "rehearsal_predicted_s": result.predicted_step_s}


# -- main -------------------------------------------------------------------------------------

def make_profile(path: Path, mbs: list[int], tps: str = "1,2",
                 idle_factor: float = 0.0) -> MeasuredProfile:
    model_file = path.with_name("calib-model.yaml")
    model_file.write_text(yaml.safe_dump(dataclasses.asdict(MODEL), sort_keys=False))
    cmd = [sys.executable, "-m", "megatron_hetero.cli", "profile", "--model", str(model_file),
           "--micro-batch-sizes", ",".join(map(str, mbs)), "--tensor-parallel-sizes", tps,
           "--repeats", "7", "--cpu-threads", "1", "--idle-factor", f"{idle_factor:g}",
           "-o", str(path)]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)
    return load_profile(path)


def _idle_penalty(profile: MeasuredProfile, b: int) -> tuple[float, float] | None:
    """The profile's per-step idle penalty at micro-batch size ``b`` (TP=1), if it measured one."""
    for e in profile.data.entries:
        if (e.micro_batch_size, e.tensor_parallel_size) == (b, 1) and e.idle_penalty:
            return e.idle_penalty.forward_s, e.idle_penalty.backward_s
    return None


def _overheads(profile: MeasuredProfile, plan: Plan) -> dict:
    """The profile's measured pipeline overhead and idle penalty per micro-batch size of
    ``plan`` (for the JSON)."""
    out = {}
    for b in sorted({p.micro_batch_size for p in plan.pipelines}):
        got = profile.pipeline_overhead(model=plan.model, micro_batch_size=b,
                                        tensor_parallel_size=1)
        pen = _idle_penalty(profile, b)
        out[b] = {"pipeline": None if got is None else list(got),
                  "idle_penalty": None if pen is None else list(pen)}
    return out


def _err(p: float, m: float) -> float:
    return (p - m) / m


def combine(runs: list[list[dict]]) -> list[dict]:
    """Per plan: the median over runs of the measured and of each predicted step time (an odd
    number of runs gives figures that some run produced), and each run's error with each
    profile."""
    out = []
    for per_plan in zip(*runs):
        first = per_plan[0]
        modes = [m for m in MODES if m in first["predicted_s"]]
        out.append({
            "plan": first["plan"], "ranks": first["ranks"],
            "measured_s": statistics.median(r["measured_s"] for r in per_plan),
            "predicted_s": {mode: statistics.median(r["predicted_s"][mode] for r in per_plan)
                            for mode in modes},
            "errors": {mode: [_err(r["predicted_s"][mode], r["measured_s"]) for r in per_plan]
                       for mode in PROFILE_MODES if mode in modes},
        })
    return out


HEADERS = {"profile": "profile", "profile + idle penalty": "profile + idle penalty",
           "rehearsal": "rehearsal's calibration", "efficiency only": "efficiency only",
           "no profile": "no profile"}


def render(rows: list[dict], profile: MeasuredProfile, args) -> str:
    d = profile.data
    modes = [m for m in MODES if m in rows[0]["predicted_s"]]
    per_run = [m for m in PROFILE_MODES if m in modes]
    over = d.pipeline.entries if d.pipeline else []
    lines = [
        f"Measured {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} on "
        f"{d.device.name} ({platform.machine()}, torch {d.software.torch}, megatron-core "
        f"{d.software.megatron_core}); model `{MODEL.name}` (h={MODEL.hidden_size}, "
        f"ffn={MODEL.ffn_hidden_size}, heads={MODEL.num_attention_heads}, "
        f"{MODEL.num_layers} layers, seq {MODEL.seq_length}, vocab {MODEL.vocab_size}, fp32); "
        f"{FAST} and {SLOW} emulated at their catalog speed ratio, time scale "
        f"{args.time_scale:g}; {args.steps} rehearsal steps, the fastest after the first "
        f"counted; {args.runs} run(s); load average {args.load} when it started; profile "
        f"efficiency {d.efficiency:.3f} of a measured {d.device.peak_matmul_tflops * 1e3:.1f} "
        f"GFLOP/s matmul peak"
        + (" (profiled again right before each plan)" if args.profile_each_plan
           else " (profiled once, before the first plan)")
        + ("; idle penalties measured after gaps of factor - 1 times the step "
           f"({max(0.0, args.time_scale - 1):g}x for {FAST}, "
           f"{idle_factors(plans(True)[1][1], args.time_scale)[SLOW]:g}x for {SLOW})"
           if "profile + idle penalty" in modes else "")
        + ("; last profile's pipeline overhead per micro-batch and stage (fwd/bwd): "
           + ", ".join(f"mbs {e.micro_batch_size} {e.forward_overhead_s * 1e3:+.2f}/"
                       f"{e.backward_overhead_s * 1e3:+.2f} ms" for e in over) if over else "")
        + ". Predicted columns are seconds per step; errors are (predicted - measured) / "
          "measured.",
        "",
        "| plan | ranks | measured s | "
        + " | ".join(f"{HEADERS[m]} | error" for m in modes)
        + "".join(f" | {HEADERS[m]} error per run" for m in per_run) + " |",
        "|---|---:|---:|" + "---:|---:|" * len(modes) + "---|" * len(per_run),
    ]
    for r in rows:
        cells = [r["plan"], str(r["ranks"]), f"{r['measured_s']:.3f}"]
        for mode in modes:
            p = r["predicted_s"][mode]
            cells += [f"{p:.3f}", f"{_err(p, r['measured_s']) * 100:+.1f}%"]
        for mode in per_run:
            cells.append(", ".join(f"{e * 100:+.1f}%" for e in r["errors"][mode]))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for mode in per_run:
        worst = max(abs(_err(r["predicted_s"][mode], r["measured_s"])) for r in rows)
        every = max(abs(e) for r in rows for e in r["errors"][mode])
        lines.append(f"Largest error with the {HEADERS[mode]}: {worst * 100:.1f}% on the "
                     f"medians over {args.runs} run(s), {every * 100:.1f}% in any single run "
                     "(target: within 10%).")
    return "\n".join(lines)


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "unknown"


def write_docs(table: str) -> None:
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC}: markers {BEGIN} / {END} not found")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", type=Path, help="use this CPU profile instead of measuring one")
    ap.add_argument("--keep-profile", type=Path, help="also write the measured profile here")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--time-scale", type=float, default=3.0,
                    help="slow every emulated device by this much more (keeps 2 cores idle enough)")
    ap.add_argument("--quick", action="store_true", help="two plans only")
    ap.add_argument("--profile-each-plan", action="store_true",
                    help="profile again right before each plan (same load on a shared machine)")
    ap.add_argument("--runs", type=int, default=1,
                    help="repeat the whole measurement; the table shows medians over the runs "
                         "and each run's error with the profile")
    ap.add_argument("--no-idle-profile", dest="idle_profile", action="store_false",
                    help="skip the idle-timed profiles (one per emulated device: --idle-factor "
                         "= its factor - 1, as its rehearsal rank sleeps)")
    ap.add_argument("--json", type=Path, help="write every run's rows as JSON here")
    ap.add_argument("--write-docs", action="store_true", help=f"put the table into {DOC}")
    args = ap.parse_args(argv)
    args.load = _load()

    todo = plans(args.quick)
    mbs = sorted({p.micro_batch_size for _, plan in todo for p in plan.pipelines})

    with tempfile.TemporaryDirectory(prefix="mh-calibrate-") as tmp:
        idle_profiles: dict[float, MeasuredProfile] = {}

        def idle_profiles_for(plan: Plan, tag: str) -> dict[float, MeasuredProfile]:
            if args.idle_profile:
                for k in sorted(set(idle_factors(plan, args.time_scale).values())):
                    if k not in idle_profiles:
                        idle_profiles[k] = make_profile(
                            Path(tmp) / f"cpu-profile-{tag}-idle{k:g}.yaml", mbs, "1", k)
            return idle_profiles

        if args.profile:
            profile = load_profile(args.profile)
        else:
            profile = make_profile(Path(tmp) / "cpu-profile-first.yaml", mbs, "1,2")
            if args.keep_profile:
                args.keep_profile.write_text(Path(profile.source).read_text())
        runs = []
        for run in range(args.runs):
            rows = []
            for i, (name, plan) in enumerate(todo):
                if args.profile_each_plan and (i > 0 or run > 0):
                    idle_profiles.clear()
                    if not args.profile:
                        profile = make_profile(Path(tmp) / f"cpu-profile-{run}-{i}.yaml", mbs,
                                               "1")
                idles = idle_profiles_for(plan, f"{run}-{i}")
                row = {"plan": name, "run": run, "profile_efficiency": profile.efficiency,
                       "pipeline_overhead_s": {
                           "profile": _overheads(profile, plan),
                           **{f"idle {k:g}": _overheads(p, plan) for k, p in idles.items()}},
                       **run_plan(plan, profile, idles, args)}
                rows.append(row)
                print(f"run {run}: {name}: measured {row['measured_s']:.3f} s; predicted "
                      + ", ".join(f"{k} {v:.3f} s" for k, v in row["predicted_s"].items()),
                      flush=True)
            runs.append(rows)
    rows = combine(runs)
    table = render(rows, profile, args)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    if args.write_docs:
        write_docs(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
