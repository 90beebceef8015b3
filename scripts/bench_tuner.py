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


def one_f_one_b_estimate(model, inventory, gbs: int, chunks: int = 1) -> tuple[float, int]:
    """The best step time a plan of the searched kind can hope for, counting what the upper
    bound leaves out but such a plan must pay: tensor-parallel all-reduces (Megatron does not
    overlap them) and the fill and drain of 1F1B, divided by ``chunks`` (interleaved 1F1B with
    that many model chunks per stage; memory for it ignored). Per TP size ``t``: every
    TP group of every type at its own per-layer speed (compute plus TP traffic, from the cost
    model), stages perfectly balanced, micro-batch size 1; the model's 16-bit weights and
    fp32 gradients must fit in ``p`` stages of the largest card (optimizer state and
    activations ignored), so at most ``G / p_min`` pipelines over the ``G`` TP groups, each
    paying ``p - 1`` micro-batch slots of fill and drain. Memory beyond that, whole-layer
    splits, sends and the data-parallel sync are ignored: an optimistic estimate. Returns
    (seconds, the TP size that reaches them)."""
    from megatron_hetero import models as M
    from megatron_hetero.tuner import space
    from megatron_hetero.tuner.problem import Problem

    problem = Problem(model, inventory, gbs, {}, TuneOptions())
    cost = problem.cost(problem.precision_for(problem.types))
    L = model.num_layers
    out_flops = 3 * 2.0 * model.seq_length * model.hidden_size * model.vocab_size * gbs
    pure = sum(n * cost.flops_rate(g) for g, n in inventory.gpu_counts().items())
    weights = (L * M.layer_params(model) + M.embedding_params(model) + M.output_params(model)) * \
        (cost.param_bytes + cost.grad_bytes)
    room = max(cost.capacity(g) for g in inventory.gpu_counts()) - cost.workspace_bytes
    best = (float("inf"), 0)
    for t in space.tp_sizes(problem):
        slots = space.slots(inventory, t)
        groups = sum(slots.values())
        speed = sum(n / (L * sum(cost.layer_times(g, 1, t))) for g, n in slots.items())
        p_min = min(L, max(1, -(-int(weights) // int(t * room))))
        fill = (groups - groups // p_min) / chunks  # D (p - 1) / v with D = G / p pipelines
        step = (gbs + fill) / speed + out_flops / pure
        best = min(best, (step, t))
    return best


def load_scenario(path: Path):
    data = read_yaml(path)
    inventory = inventory_from_data(data["inventory"], source=str(path))
    model = load_model(data["model"], seq_length=data.get("seq_length"))
    return inventory, model, int(data["global_batch_size"]), bool(data.get("quick", False))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the scenarios marked quick")
    ap.add_argument("--max-virtual-pipeline-size", type=int, default=None, metavar="V",
                    help="most model chunks per stage searched (1: no interleaving; default: "
                         "TuneOptions' default)")
    ap.add_argument("scenarios", nargs="*", help="scenario files (default: all in examples/scenarios)")
    args = ap.parse_args(argv)
    paths = [Path(p) for p in args.scenarios] or sorted(SCENARIOS.glob("*.yaml"))
    header = (f"{'scenario':34s} {'GPUs':>5s} {'search s':>8s} {'cpu s':>6s} {'tuned s':>9s} {'searched':>8s} {'baseline s':>10s} "
              f"{'bound s':>9s} {'speedup':>7s} {'room':>6s} {'effic.':>6s} {'1F1B':>5s} {'VPP':>5s}  plan")
    print(header)
    print("-" * len(header))
    for path in paths:
        inventory, model, gbs, quick = load_scenario(path)
        if args.quick and not quick:
            continue
        options = TuneOptions()
        if args.max_virtual_pipeline_size is not None:
            options.max_virtual_pipeline_size = args.max_virtual_pipeline_size
        r = tune(model, inventory, gbs, options=options)
        b = r.baseline_plan
        p = r.plan
        base = r.baseline_sim.step_time_s if r.baseline_sim else float("nan")
        pred, bound = r.sim.step_time_s, r.upper_bound_step_time_s
        ceiling, _ = one_f_one_b_estimate(model, inventory, gbs)
        ceiling_v, _ = one_f_one_b_estimate(model, inventory, gbs, options.max_virtual_pipeline_size)
        print(f"{path.stem:34s} {inventory.num_gpus:5d} {r.search_time_s:8.2f} {r.search_cpu_s:6.2f} {pred:9.2f} "
              f"{r.searched_step_time_s or float('nan'):8.2f} {base:10.2f} {bound:9.2f} {base / pred:7.3f} {base / bound:6.3f} {bound / pred:6.3f} {bound / ceiling:5.2f} "
              f"{bound / ceiling_v:5.2f}  "
              f"TP{p.tensor_model_parallel_size} PP{p.pipeline_model_parallel_size} "
              f"VP{p.virtual_pipeline_size} DP{p.data_parallel_size} "
              f"mbs{p.pipelines[0].micro_batch_size} GPUs {sum(p.device_counts().values())}"
              + (" (baseline)" if r.fell_back_to_baseline else "")
              + (f"; baseline TP{b.tensor_model_parallel_size} PP{b.pipeline_model_parallel_size} "
                 f"VP{b.virtual_pipeline_size} DP{b.data_parallel_size}" if b else ""))
        sys.stdout.flush()
    print("\nsearch s: wall clock; cpu s: this process's CPU time (what the search costs when "
          "the machine is shared).")
    print("searched: the structured search's best plan before the local search on the "
          "simulator (tuned s is after it).")
    print("speedup = baseline / tuned; room = baseline / upper bound (the most any plan could "
          "gain); efficiency = upper bound / tuned; 1F1B = upper bound / the best step a "
          "non-interleaved 1F1B plan can hope for once TP traffic and fill/drain are paid "
          "(one_f_one_b_estimate); VPP = the same with the fill/drain divided by the largest "
          f"chunk count searched ({TuneOptions().max_virtual_pipeline_size}; memory ignored).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
