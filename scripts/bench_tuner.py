#!/usr/bin/env python
"""Benchmark the tuner on the scenarios in examples/scenarios/.

For each scenario it prints: GPUs, search seconds, predicted step time of the tuned plan, of
plain Megatron's best plan (the baseline), the speedup, the efficiency (upper bound over
predicted) and the room the upper bound leaves over the baseline. ``--quick`` runs the
scenarios marked ``quick: true`` (seconds; for CI). Figures are the cost model's predictions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_hetero._schema import read_yaml  # noqa: E402
from megatron_hetero.hardware.inventory import inventory_from_data  # noqa: E402
from megatron_hetero.models import load_model  # noqa: E402
from megatron_hetero.tuner import TuneOptions, tune  # noqa: E402

SCENARIOS = REPO / "examples" / "scenarios"


def load_scenario(path: Path):
    data = read_yaml(path)
    inventory = inventory_from_data(data["inventory"], source=str(path))
    model = load_model(data["model"], seq_length=data.get("seq_length"))
    return inventory, model, int(data["global_batch_size"]), bool(data.get("quick", False))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the scenarios marked quick")
    ap.add_argument("scenarios", nargs="*", help="scenario files (default: all in examples/scenarios)")
    args = ap.parse_args(argv)
    paths = [Path(p) for p in args.scenarios] or sorted(SCENARIOS.glob("*.yaml"))
    header = (f"{'scenario':34s} {'GPUs':>5s} {'search s':>8s} {'cpu s':>6s} {'tuned s':>9s} {'baseline s':>10s} "
              f"{'bound s':>9s} {'speedup':>7s} {'room':>6s} {'effic.':>6s}  plan")
    print(header)
    print("-" * len(header))
    for path in paths:
        inventory, model, gbs, quick = load_scenario(path)
        if args.quick and not quick:
            continue
        r = tune(model, inventory, gbs, options=TuneOptions())
        p = r.plan
        base = r.baseline_sim.step_time_s if r.baseline_sim else float("nan")
        pred, bound = r.sim.step_time_s, r.upper_bound_step_time_s
        print(f"{path.stem:34s} {inventory.num_gpus:5d} {r.search_time_s:8.2f} {r.search_cpu_s:6.2f} {pred:9.2f} "
              f"{base:10.2f} {bound:9.2f} {base / pred:7.2f} {base / bound:6.2f} {bound / pred:6.3f}  "
              f"TP{p.tensor_model_parallel_size} PP{p.pipeline_model_parallel_size} "
              f"DP{p.data_parallel_size} mbs{p.pipelines[0].micro_batch_size} "
              f"GPUs {sum(p.device_counts().values())}"
              + (" (baseline)" if r.fell_back_to_baseline else ""))
        sys.stdout.flush()
    print("\nsearch s: wall clock; cpu s: this process's CPU time (what the search costs when "
          "the machine is shared).")
    print("speedup = baseline / tuned; room = baseline / upper bound (the most any plan could "
          "gain); efficiency = upper bound / tuned.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
