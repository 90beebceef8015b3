#!/usr/bin/env python
"""Benchmark the tuner on pools of two vendors (examples/scenarios/*mi300x*.yaml).

For each scenario, with its RDMA NICs and again with every group's ``rdma: false`` (TCP), it
tunes the whole pool and each vendor's groups alone, and prints side by side: the tuned step,
the best single-vendor step and the speedup over it, the upper bound and the efficiency (upper
bound over tuned step), and the share of the step the busiest host-staged links are busy
(:func:`megatron_hetero.cost.crossings.host_staged_seconds`), with where the plan crosses
vendors. Every figure is the cost model's prediction; nothing here has run on AMD hardware,
and the runtime cannot yet carry a plan across vendors (docs/vendors.md).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_hetero._schema import read_yaml  # noqa: E402
from megatron_hetero.cost import CostModel  # noqa: E402
from megatron_hetero.cost.crossings import host_staged_seconds, vendor_crossings  # noqa: E402
from megatron_hetero.hardware.inventory import inventory_from_data  # noqa: E402
from megatron_hetero.models import load_model  # noqa: E402
from megatron_hetero.tuner import tune  # noqa: E402

SCENARIOS = sorted((REPO / "examples" / "scenarios").glob("*mi300x*.yaml"))


def _plan_text(plan) -> str:
    counts = "+".join(f"{n}x{g.split('-')[0]}" for g, n in sorted(plan.device_counts().items()))
    vp = plan.virtual_pipeline_size
    return (f"TP{plan.tensor_model_parallel_size} PP{plan.pipeline_model_parallel_size} "
            + (f"VP{vp} " if vp > 1 else "") + f"DP{plan.data_parallel_size} {counts}")


def run(path: Path, *, rdma: bool) -> dict:
    data = read_yaml(path)
    inv_data = copy.deepcopy(data["inventory"])
    for g in inv_data["groups"]:
        g["rdma"] = rdma
    inventory = inventory_from_data(inv_data, source=str(path))
    model = load_model(data["model"], seq_length=data.get("seq_length"))
    gbs = int(data["global_batch_size"])
    mixed = tune(model, inventory, gbs)
    singles = {}
    for vendor in sorted({inventory.vendor(i) for i in range(len(inventory.groups))}):
        sub = dict(inv_data, groups=[g for i, g in enumerate(inv_data["groups"])
                                     if inventory.vendor(i) == vendor])
        try:
            singles[vendor] = tune(model, inventory_from_data(sub, source=str(path)), gbs)
        except Exception as exc:  # e.g. the model does not fit one vendor's GPUs
            print(f"  ({vendor} alone: {exc})", file=sys.stderr)
    # the same pool as one fabric (every group given the first group's vendor): what the
    # planner predicted before links across vendors were host-staged
    first = inventory.vendor(0)
    fabric = dict(inv_data, gpus={g["gpu"]: {"vendor": first} for g in inv_data["groups"]})
    one_fabric = tune(model, inventory_from_data(fabric, source=str(path)), gbs)
    best_vendor = min(singles, key=lambda v: singles[v].sim.step_time_s)
    cost = CostModel(model, inventory, precision=mixed.plan.precision)
    crossings = vendor_crossings(mixed.plan, cost)
    step = mixed.sim.step_time_s
    return {"scenario": path.stem, "nic": "RDMA" if rdma else "TCP", "step": step,
            "fabric": one_fabric.sim.step_time_s,
            "single": singles[best_vendor].sim.step_time_s, "single_vendor": best_vendor,
            "single_plan": _plan_text(singles[best_vendor].plan),
            "bound": mixed.upper_bound_step_time_s, "plan": _plan_text(mixed.plan),
            "share": host_staged_seconds(crossings) / step,
            "crossings": sorted({c.kind for c in crossings}), "count": len(crossings)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rdma-only", action="store_true", help="skip the TCP runs")
    ap.add_argument("scenarios", nargs="*", help="scenario files (default: the two-vendor ones)")
    args = ap.parse_args(argv)
    paths = [Path(p) for p in args.scenarios] or SCENARIOS
    header = (f"{'scenario':26s} {'NIC':4s} {'tuned s':>8s} {'1-fabric s':>10s} "
              f"{'1-vendor s':>10s} {'speedup':>7s} "
              f"{'bound s':>8s} {'effic.':>6s} {'host':>6s}  plan | best single-vendor plan")
    print(header)
    print("-" * len(header))
    for path in paths:
        for rdma in ((True,) if args.rdma_only else (True, False)):
            r = run(path, rdma=rdma)
            print(f"{r['scenario']:26s} {r['nic']:4s} {r['step']:8.2f} {r['fabric']:10.2f} "
                  f"{r['single']:10.2f} "
                  f"{r['single'] / r['step']:7.3f} {r['bound']:8.2f} {r['bound'] / r['step']:6.3f} "
                  f"{r['share']:6.1%}  {r['plan']}; crosses vendors on {r['count']} "
                  f"{' and '.join(r['crossings']) or 'nothing'} | {r['single_plan']}")
            sys.stdout.flush()
    print("\n1-fabric s: the same pool tuned as if one collective library spanned it (no host "
          "staging; what the planner predicted before: such plans cannot run); "
          "speedup = best single-vendor step / tuned step (both tuned by this tree); effic. = "
          "upper bound / tuned step (target: >= 0.95 with RDMA, >= 0.90 over TCP); host = the "
          "busiest host-staged links' seconds per step over the step (they may overlap compute). "
          "Predictions of the cost model; not measured on AMD hardware.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
