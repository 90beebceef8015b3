#!/usr/bin/env python
"""What separates each scenario's tuned plan from the upper bound, in shares of the step.

The upper bound (``tuner.space.upper_bound_step_time``) is the model's FLOPs over the pool's
summed achievable FLOP/s: every GPU busy with model FLOPs only. For the tuned plan (the best
plan ``tune`` writes; mesh plans are left out: the runtime refuses them), each stage's
simulated step is weighted by its GPUs' summed rate (TP x the type's achievable FLOP/s) and
split into

* ``unused``: GPUs of the pool the plan leaves out;
* ``busy+``: busy time beyond the stage's model FLOPs at its rate (tensor-parallel traffic,
  recompute, offload transfers, the padded vocabulary);
* ``bubble``: waiting inside the schedule (fill and drain, and waits on a slower neighbour);
* ``sync``: gradient sync and optimizer step after the last backward;
* ``idle``: the rest of the step (waiting for slower replicas and stages).

They add up to ``1 - efficiency`` (efficiency = bound / step). ``free TP``: the efficiency of
the same plan simulated with every link inside a node free (the tensor-parallel traffic, and
sends between stages in one node, cost nothing): what that traffic costs. ``--per-tp`` also tunes the
pool at each tensor-parallel size alone (``TuneOptions.tensor_parallel_sizes``) and prints that
size's best efficiency and shares: what the memory and the links force at each size.

    python scripts/bench_efficiency.py                        # every mixed scenario
    python scripts/bench_efficiency.py --per-tp examples/scenarios/3090-t4-llama2-7b.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tuner import SCENARIOS, load_scenario  # noqa: E402

from megatron_hetero import models as M  # noqa: E402
from megatron_hetero.errors import InfeasibleError  # noqa: E402
from megatron_hetero.sim.step import simulate  # noqa: E402
from megatron_hetero.tuner import TuneOptions, tune  # noqa: E402
from megatron_hetero.tuner.problem import Problem  # noqa: E402
from megatron_hetero.tuner.space import tp_sizes  # noqa: E402

SHARES = ("unused", "busy+", "bubble", "sync", "idle")


def shares(plan, sim, inventory, rate) -> dict[str, float]:
    """Rate-weighted shares of ``sim``'s step (see the module docstring); ``rate(type)``: one
    GPU's achievable FLOP/s, as the upper bound counts it."""
    model, step = plan.model, sim.step_time_s
    total = sum(n * rate(g) for g, n in inventory.gpu_counts().items())
    out = dict.fromkeys(SHARES, 0.0)
    used = 0.0
    head = 2.0 * model.seq_length * model.hidden_size * model.vocab_size  # output layer, unpadded
    last = plan.pipeline_model_parallel_size - 1
    for res in sim.stages:  # every (replica, stage) of any plan shape
        k, j = plan.stage_index[res.stage]
        mesh = plan.meshes[k]
        pipe = mesh.pipelines[res.pipeline]
        b = pipe.micro_batch_size
        w = mesh.tensor_model_parallel_size * rate(res.device_type)
        flops = res.num_layers * M.layer_forward_flops(model, b)
        if res.stage == last:
            flops += b * head
        used += w
        out["busy+"] += w * (res.busy_s - 3.0 * flops * pipe.num_microbatches / w)
        out["bubble"] += w * res.bubble_s
        out["sync"] += w * res.sync_s
        out["idle"] += w * res.idle_s
    out = {k: v / (total * step) for k, v in out.items()}
    out["unused"] = (total - used) / total
    return out


def row(label: str, r, inventory) -> str:
    plan, sim = r.plan, r.sim
    rate = Problem(plan.model, inventory, plan.global_batch_size, {}, TuneOptions()) \
        .cost(plan.precision).flops_rate
    sh = shares(plan, sim, inventory, rate)
    eff = r.upper_bound_step_time_s / sim.step_time_s
    free = dataclasses.replace(inventory, groups=[
        dataclasses.replace(g, intra_node_bandwidth_gb_s=1e9) for g in inventory.groups])
    free_step = simulate(plan, Problem(plan.model, free, plan.global_batch_size, {},
                                       TuneOptions()).cost(plan.precision),
                         record_events=False).step_time_s
    shape = (f"TP{plan.tensor_model_parallel_size} PP{plan.pipeline_model_parallel_size} "
             f"VP{plan.virtual_pipeline_size} DP{plan.data_parallel_size}"
             + (f" groups of {plan.microbatch_group_size}" if plan.microbatch_group_size else ""))
    return (f"{label:34} {sim.step_time_s:9.3f} {r.upper_bound_step_time_s:9.3f} {eff:6.3f} "
            f"{r.upper_bound_step_time_s / free_step:7.3f} "
            + " ".join(f"{100 * sh[k]:6.2f}" for k in SHARES) + f"  {shape}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-tp", action="store_true",
                    help="also the best plan at each tensor-parallel size alone")
    ap.add_argument("scenarios", nargs="*", help="scenario files (default: every mixed one)")
    args = ap.parse_args(argv)
    paths = [Path(p) for p in args.scenarios] or sorted(SCENARIOS.glob("*.yaml"))
    print(f"{'scenario':34} {'step s':>9} {'bound s':>9} {'effic.':>6} {'free TP':>7} "
          + " ".join(f"{k:>6}" for k in SHARES) + "  plan")
    for path in paths:
        inventory, model, gbs, _ = load_scenario(path)
        if len(inventory.gpu_counts()) < 2 and not args.scenarios:
            continue
        print(row(path.stem, tune(model, inventory, gbs), inventory), flush=True)
        if args.per_tp:
            for t in tp_sizes(Problem(model, inventory, gbs, {}, TuneOptions())):
                try:
                    r = tune(model, inventory, gbs, options=TuneOptions(tensor_parallel_sizes=(t,)))
                except InfeasibleError as exc:  # no plan of this size fits
                    print(f"{'  TP' + str(t) + ' only':34} no plan: {str(exc).splitlines()[0][:80]}")
                    continue
                print(row(f"  TP{t} only", r, inventory), flush=True)
    print("\nshares in % of the step, weighted by each GPU's achievable FLOP/s; they add up to "
          "1 - efficiency. busy+: busy beyond model FLOPs (TP traffic, recompute, offload, "
          "padded vocabulary); bubble: waits inside the schedule; sync: gradient sync and "
          "optimizer; idle: the rest (slower replicas and stages).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
