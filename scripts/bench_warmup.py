#!/usr/bin/env python
"""The heterogeneity-aware 1F1B (per-stage warm-up) against Megatron's 1F1B, side by side.

On the two slow-link scenarios (two sites joined by 1 Gb/s and by 10 Gb/s) it tunes the pool
three ways in one run and prints the predicted step of each: non-interleaved under Megatron's
1F1B, the same search with per-stage warm-ups (the gain is the simulator's, on the same plan),
and the full search (interleaving allowed). ``--timeline DIR`` also draws the first pipeline
of the 1 Gb/s plan under both schedules (DIR/warmup-<scenario>-megatron.png and -warmup.png).
Figures are the cost model's predictions.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _trees  # noqa: E402

_trees.use_tree()

from bench_tuner import SCENARIOS, load_scenario  # noqa: E402
from megatron_hetero.cost.model import CostModel  # noqa: E402
from megatron_hetero.simulate import simulate  # noqa: E402
from megatron_hetero.tuner import TuneOptions, tune  # noqa: E402

DEFAULT = ("a100-v100-1gbps-llama2-13b", "a100-v100-10gbps-llama2-13b")


def _flat(warmup: bool) -> TuneOptions:
    return TuneOptions(per_stage_warmup=warmup, max_virtual_pipeline_size=1,
                       refine_max_virtual_pipeline_size=1)


def _describe(plan) -> str:
    w = [st.warmup_microbatches for st in plan.pipelines[0].stages]
    return (f"TP{plan.tensor_model_parallel_size} PP{plan.pipeline_model_parallel_size} "
            f"VP{plan.virtual_pipeline_size} DP{plan.data_parallel_size} warm-ups {w}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeline", metavar="DIR", help="draw both schedules' timelines here")
    ap.add_argument("scenarios", nargs="*")
    args = ap.parse_args(argv)
    paths = [Path(p) for p in args.scenarios] or [SCENARIOS / f"{n}.yaml" for n in DEFAULT]
    print(f"{'scenario':30s} {'1F1B s':>8s} {'warm-up s':>9s} {'gain':>6s} {'interleaved s':>13s}"
          f"  plan (warm-up search)")
    for path in paths:
        inventory, model, gbs, _ = load_scenario(path)
        warm = tune(model, inventory, gbs, options=_flat(True))
        plain = warm.sim.step_time_s * warm.warmup_gain  # the same plan, Megatron's counts
        full = tune(model, inventory, gbs, options=TuneOptions())
        print(f"{path.stem:30s} {plain:8.2f} {warm.sim.step_time_s:9.2f} {warm.warmup_gain:6.3f} "
              f"{full.sim.step_time_s:13.2f}  {_describe(warm.plan)}; full search: "
              f"{_describe(full.plan)}")
        if args.timeline and warm.warmup_gain > 1.0:
            cost = CostModel(model, inventory, precision=warm.plan.precision,
                             **TuneOptions().cost_options)
            megatron = dataclasses.replace(warm.plan, pipelines=[
                dataclasses.replace(pipe, stages=[dataclasses.replace(st, warmup_microbatches=None)
                                                  for st in pipe.stages])
                for pipe in warm.plan.pipelines])
            out = Path(args.timeline)
            for name, plan in (("megatron", megatron), ("warmup", warm.plan)):
                simulate(plan, cost).timeline_png(out / f"warmup-{path.stem}-{name}.png",
                                                  max_pipelines=1)
    print("\n1F1B s: the non-interleaved tuned plan under Megatron's 1F1B; warm-up s: the same "
          "plan with the per-stage warm-ups the tuner chose (gain = 1F1B / warm-up); "
          "interleaved s: the full search.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
