#!/usr/bin/env python
"""Benchmark: rehearse mesh plans on CPU ranks and compare the measured step with the
simulator's prediction (issue 15: within 10%).

Plans (4 CPU ranks each, Llama-2 7B's 32 layers shrunk in width):

- ``fan-in``: ``examples/meshes/rehearse-plan.yaml``, 14 layers on RTX3090 TP1 x DP2, 18 on
  T4 TP2 x DP1 (the bridge joins two micro-batches and broadcasts in the T4s' TP group);
- ``fan-out``: the same meshes in the other order, 14 layers on the T4s, 18 on the 3090s.

Neither fits its cards' memory (Llama-2 7B on four 16-24 GB cards without the distributed
optimizer): memory is metered, not capped.

For each it prints the predicted step (the cost model and the simulator on the emulated
cluster, compute rescaled by the CPU time the ranks measured), the prediction from the
start-up calibration alone, the measured mean of the reported steps and measured/predicted.
Needs megatron-core 0.17 or later (the venv's 0.19.2):

    .venv/bin/python scripts/bench_mesh_rehearse.py [--steps 4] \
        [--time-scale T] [--hidden-size 64] [--verbose]
"""

from __future__ import annotations

import argparse
import copy
import os
import time

os.environ.setdefault("PYTHONWARNINGS", "ignore")

from megatron_hetero._schema import read_yaml  # noqa: E402
from megatron_hetero.emulate.rehearse import (RehearsalConfig, format_report,  # noqa: E402
                                              rehearse)
from megatron_hetero.plan import mesh_plan_from_data  # noqa: E402

PLAN = os.path.join(os.path.dirname(__file__), "..", "examples", "meshes", "rehearse-plan.yaml")


def plans() -> dict:
    data = read_yaml(PLAN)
    reverse = copy.deepcopy(data)
    reverse["meshes"] = list(reversed(reverse["meshes"]))
    reverse["meshes"][0]["stages"][0]["num_layers"] = 14
    reverse["meshes"][1]["stages"][0]["num_layers"] = 18
    return {"fan-in": mesh_plan_from_data(data, source=PLAN),
            "fan-out": mesh_plan_from_data(reverse, source="<fan-out>")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4, help="steps; the first is a warm-up")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="extra slowdown of every device (default: the rehearsal's automatic)")
    ap.add_argument("--hidden-size", type=int, default=64, help="hidden size of the shrunk model")
    ap.add_argument("--verbose", action="store_true", help="print each rehearsal's table")
    args = ap.parse_args()
    rows = []
    start = (time.strftime('%H:%M', time.gmtime()), os.getloadavg()[0])
    for name, plan in plans().items():
        config = RehearsalConfig(steps=args.steps, time_scale=args.time_scale,
                                 hidden_size=args.hidden_size, memory_cap=False)
        res = rehearse(plan, config, source=name)
        if args.verbose:
            print(format_report(res, source=name, real=plan.model), flush=True)
        rows.append((name, res))
    load = os.getloadavg()[0]
    print(f"\n{time.strftime('%Y-%m-%d', time.gmtime())} {start[0]} -> "
          f"{time.strftime('%H:%M UTC', time.gmtime())}, load average {start[1]:.1f} -> {load:.1f}")
    print(f"{'plan':<8} {'predicted s':>11} {'a priori s':>10} {'measured s':>10} "
          f"{'ratio':>6}  steps measured")
    for name, res in rows:
        print(f"{name:<8} {res.predicted_step_s:>11.3f} {res.a_priori_step_s:>10.3f} "
              f"{res.step_s:>10.3f} {res.ratio:>6.2f}  "
              + ", ".join(f"{t:.3f}" for t in res.step_times))


if __name__ == "__main__":
    main()
