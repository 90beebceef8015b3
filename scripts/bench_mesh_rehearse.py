#!/usr/bin/env python
"""Benchmark: rehearse mesh plans on CPU ranks and compare the measured step with the
simulator's prediction, side by side (issue 28 item 5: an interleaved mesh plan within 10% of
its prediction, median of 3; issue 15 for the plan without chunks).

Plans (4 CPU ranks each, Llama-2 7B's 32 layers shrunk in width):

- ``fan-in``: ``examples/meshes/rehearse-plan.yaml``, 14 layers on RTX3090 TP1 x DP2, 18 on
  T4 TP2 x DP1 (the bridge joins two micro-batches and broadcasts in the T4s' TP group);
- ``fan-in-chunked``: the same plan interleaved, chunks ``[7, 7]`` on the 3090s and ``[9, 9]``
  on the T4s (4 bridge crossings a micro-batch, the wrap-around included);
- ``fan-out`` (``--plans``): the same meshes in the other order, 14 layers on the T4s, 18 on
  the 3090s;
- ``moe-h100-a100`` (``--plans``): the mixture-of-experts example,
  ``examples/rehearse/moe-h100-a100/plan.yaml`` (PP2 x DP2 x EP2, 8 experts, uneven 5:3
  layers on H100 and A100; issue 30: within 10%, median of 3);
- ``a100-mi300x-tcp``, ``a100-mi300x-rdma`` (``--plans``): a format-1 plan across two vendors,
  ``examples/rehearse/a100-mi300x/plan.yaml`` (A100 1 layer -> MI300X 3 layers, 4 micro-batches)
  with its pipeline edge emulated as the host path over TCP or RDMA NICs (``--emulate-links``,
  time scale 3 unless ``--time-scale``; issue 14: within 10%, median of 3).

The mesh plans do not fit their cards' memory (Llama-2 7B on four 16-24 GB cards without the
distributed optimizer): memory is metered, not capped.

Each round rehearses every plan once, one after the other, so that the machine's load falls on
all plans alike; ``--runs`` rounds. For each plan it prints the predicted step of each run (the
cost model and the simulator on the emulated cluster, compute rescaled by the CPU time the ranks
measured), the measured mean of the reported steps and measured/predicted of each run, then the
median ratio. It exits 1 where a median misses ``--target`` (default 10%), so that it can gate a
change; the load average at the start and end is part of the figure (a shared machine's load
stretches the ranks' messages and compute past what the prediction prices). Needs
megatron-core 0.19 for the chunked plan (the venv's 0.19.2):

    .venv/bin/python scripts/bench_mesh_rehearse.py [--runs 3] [--steps 4] \
        [--plans fan-in,fan-in-chunked] [--time-scale T] [--hidden-size 64] [--nice -10] \
        [--verbose]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

os.environ.setdefault("PYTHONWARNINGS", "ignore")

from megatron_hetero._schema import read_yaml  # noqa: E402
from megatron_hetero.emulate.rehearse import (RehearsalConfig, format_report,  # noqa: E402
                                              rehearse)
from megatron_hetero.hardware.inventory import load_inventory  # noqa: E402
from megatron_hetero.plan import load_plan, mesh_plan_from_data  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
PLAN = os.path.join(EXAMPLES, "meshes", "rehearse-plan.yaml")
VENDORS = os.path.join(EXAMPLES, "rehearse", "a100-mi300x")
MOE = os.path.join(EXAMPLES, "rehearse", "moe-h100-a100")
DEFAULT_PLANS = ("fan-in", "fan-in-chunked")


def two_vendor(nic: str) -> tuple:
    """(plan, inventory) of the A100 -> MI300X plan over ``nic`` (``tcp`` or ``rdma``)."""
    inventory = load_inventory(os.path.join(VENDORS, f"{nic}.yaml"))
    return load_plan(os.path.join(VENDORS, "plan.yaml"), catalog=inventory.catalog), inventory


def plans() -> dict:
    """Every mesh plan the benchmark knows, by name (the two-vendor ones: :func:`two_vendor`)."""
    data = read_yaml(PLAN)
    chunked = copy.deepcopy(data)
    for mesh, chunks in zip(chunked["meshes"], ([7, 7], [9, 9])):
        mesh["stages"][0]["chunk_layers"] = chunks
    reverse = copy.deepcopy(data)
    reverse["meshes"] = list(reversed(reverse["meshes"]))
    reverse["meshes"][0]["stages"][0]["num_layers"] = 14
    reverse["meshes"][1]["stages"][0]["num_layers"] = 18
    return {"fan-in": mesh_plan_from_data(data, source=PLAN),
            "fan-in-chunked": mesh_plan_from_data(chunked, source="<fan-in-chunked>"),
            "fan-out": mesh_plan_from_data(reverse, source="<fan-out>")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3, help="rehearsals of each plan (the median)")
    ap.add_argument("--steps", type=int, default=4, help="steps; the first is a warm-up")
    ap.add_argument("--plans", default=",".join(DEFAULT_PLANS),
                    help="comma-separated: fan-in, fan-in-chunked, fan-out, a100-mi300x-tcp, "
                         "a100-mi300x-rdma")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="extra slowdown of every device (default: the rehearsal's automatic)")
    ap.add_argument("--hidden-size", type=int, default=64, help="hidden size of the shrunk model")
    ap.add_argument("--nice", type=int, default=0,
                    help="os.nice increment of the ranks (negative, as root, shields them from "
                         "other load)")
    ap.add_argument("--target", type=float, default=0.10,
                    help="the largest |median measured/predicted - 1| that passes")
    ap.add_argument("--verbose", action="store_true", help="print each rehearsal's table")
    args = ap.parse_args()
    known = {name: (plan, None, False) for name, plan in plans().items()}
    known |= {f"a100-mi300x-{nic}": (*two_vendor(nic), True) for nic in ("tcp", "rdma")}
    moe_inventory = load_inventory(os.path.join(MOE, "inventory.yaml"))
    known["moe-h100-a100"] = (load_plan(os.path.join(MOE, "plan.yaml"),
                                        catalog=moe_inventory.catalog), moe_inventory, False)
    names = [n.strip() for n in args.plans.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names or args.runs < 1:
        ap.error(f"--plans: expected some of {', '.join(known)}; --runs at least 1")
    results: dict[str, list] = {n: [] for n in names}
    start = (time.strftime('%H:%M', time.gmtime()), os.getloadavg()[0])
    for _ in range(args.runs):
        for name in names:
            plan, inventory, links = known[name]
            config = RehearsalConfig(steps=args.steps, hidden_size=args.hidden_size,
                                     time_scale=args.time_scale or (3.0 if links else None),
                                     memory_cap=False, emulate_links=links, nice=args.nice)
            res = rehearse(plan, config, source=name, inventory=inventory)
            if args.verbose:
                print(format_report(res, source=name, real=plan.model), flush=True)
            results[name].append(res)
    load = os.getloadavg()[0]
    print(f"\n{time.strftime('%Y-%m-%d', time.gmtime())} {start[0]} -> "
          f"{time.strftime('%H:%M UTC', time.gmtime())}, load average {start[1]:.1f} -> {load:.1f}")
    print(f"{'plan':<16} {'predicted s':>11} {'a priori s':>10} {'measured s':>10} {'ratio':>6}"
          "  (medians; each run: predicted / measured = ratio)")
    missed = []
    for name, runs in results.items():
        ratio = statistics.median(r.ratio for r in runs)
        print(f"{name:<16} {statistics.median(r.predicted_step_s for r in runs):>11.3f} "
              f"{statistics.median(r.a_priori_step_s for r in runs):>10.3f} "
              f"{statistics.median(r.step_s for r in runs):>10.3f} {ratio:>6.2f}  "
              + ", ".join(f"{r.predicted_step_s:.3f} / {r.step_s:.3f} = {r.ratio:.2f}"
                          for r in runs))
        if abs(ratio - 1) > args.target:
            missed.append(f"{name} {ratio:.2f}")
    verdict = (f"target: median measured/predicted within {args.target:.0%}: "
               + ("met by every plan" if not missed else "MISSED by " + ", ".join(missed)))
    print(verdict)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
