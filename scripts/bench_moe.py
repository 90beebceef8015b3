#!/usr/bin/env python
"""Benchmark the tuner on mixtures of experts (issue 30).

Two pools of the issue, and one of 1024 GPUs for the search time:

* Mixtral 8x7B on 16 H100 + 16 A100-80GB (two 8-GPU nodes of each);
* Qwen3-30B-A3B on 8 H100 + 16 A100-40GB (one node of H100, two of A100);
* ``--large``: Qwen3-30B-A3B on 512 H100 + 512 A100-80GB (64 nodes each).

For each it prints the tuned plan's sizes (TP, PP, EP, DP), its predicted step, plain
Megatron's best plan's (the baseline: one TP, even layers and data parallelism, EP chosen from
the same sizes), the speedup, the efficiency (the upper bound over the predicted step), the
share of the step in all-to-all (the most, over the plan's ranks, of the seconds its stage spends
in dispatch and combine per step, over the step) and the search's wall and CPU seconds. Figures
are the cost model's predictions (catalog efficiencies, no profile); inter-node links 50 GB/s
per node for the H100s, 25 GB/s for the A100s, as in examples/scenarios.

``--before REF`` also times the search of the tree at git revision ``REF`` (``git archive``
into a temporary folder) beside this tree's, each in a fresh process, scenario by scenario in
one run (the same machine load for both), and prints their CPU seconds, structure counts,
predicted steps and the ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_hetero import models as M  # noqa: E402
from megatron_hetero.cost.experts import placed_expert_link  # noqa: E402
from megatron_hetero.cost.stage import StageShape  # noqa: E402
from megatron_hetero.hardware.inventory import inventory_from_data  # noqa: E402
from megatron_hetero.tuner import TuneOptions, tune  # noqa: E402
from megatron_hetero.tuner.problem import Problem  # noqa: E402

H100 = {"gpu": "H100-SXM-80GB", "gpus_per_node": 8, "inter_node_bandwidth_gb_s": 50}
A100_80 = {"gpu": "A100-SXM-80GB", "gpus_per_node": 8, "inter_node_bandwidth_gb_s": 25}
A100_40 = {"gpu": "A100-SXM-40GB", "gpus_per_node": 8, "inter_node_bandwidth_gb_s": 25}

SCENARIOS = {
    "mixtral-8x7b 16xH100+16xA100-80GB": ("mixtral-8x7b", [H100 | {"nodes": 2},
                                                          A100_80 | {"nodes": 2}], 256),
    "qwen3-30b-a3b 8xH100+16xA100-40GB": ("qwen3-30b-a3b", [H100 | {"nodes": 1},
                                                           A100_40 | {"nodes": 2}], 256),
}
LARGE = {"qwen3-30b-a3b 512xH100+512xA100-80GB": ("qwen3-30b-a3b", [H100 | {"nodes": 64},
                                                                    A100_80 | {"nodes": 64}],
                                                  4096)}


def alltoall_share(plan, sim, cost) -> float:
    """The most seconds per step any rank's stage spends in dispatch and combine, over the
    step (forward and backward each run both per layer and micro-batch)."""
    most = 0.0
    placement = cost.placement(plan)
    for k, mesh in enumerate(plan.meshes):
        for r, pipe in enumerate(mesh.pipelines):
            for j in range(mesh.num_stages):
                shape = placed_expert_link(StageShape.at(plan, k, j, r), mesh, placement, k, j, r)
                a2a = 2 * shape.num_layers * cost.alltoall_seconds(shape) * pipe.num_microbatches
                most = max(most, a2a)
    return most / sim.step_time_s


def sizes(plan) -> str:
    return "; ".join(f"TP={m.tensor_model_parallel_size} PP={m.num_stages} "
                     f"EP={m.expert_model_parallel_size} DP={m.data_parallel_size}"
                     for m in plan.meshes)


def run(name: str, model_name: str, groups: list[dict], gbs: int) -> None:
    model = M.model_preset(model_name)
    inv = inventory_from_data({"groups": groups})
    wall, cpu = time.perf_counter(), time.process_time()
    got = tune(model, inv, gbs, options=TuneOptions())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    cost = cost_of(got, model, inv)
    base = got.baseline_sim
    print(f"\n{name}, global batch {gbs} x {model.seq_length} tokens")
    print(f"  tuned:    {sizes(got.plan)}  layers {got.plan.layer_split}  "
          f"step {got.sim.step_time_s:.3f} s")
    if base is not None:
        print(f"  baseline: {sizes(got.baseline_plan)}  step {base.step_time_s:.3f} s")
        print(f"  speedup over plain Megatron: {base.step_time_s / got.sim.step_time_s:.2f}x")
    else:
        print("  baseline: no plain-Megatron plan fits")
    print(f"  efficiency (upper bound / step): {got.upper_bound_step_time_s / got.sim.step_time_s:.3f}")
    print(f"  all-to-all share of the step: {alltoall_share(got.plan, got.sim, cost):.3f}")
    print(f"  search: {wall:.2f} s wall, {cpu:.2f} s CPU ({got.structures_evaluated} structures)")


def cost_of(got, model, inv):
    """The cost model the tuner priced the plan with (its precision, default options)."""
    problem = Problem(model, inv, got.plan.global_batch_size, {}, TuneOptions())
    return problem.cost(got.plan.precision)


REPO = Path(__file__).resolve().parent.parent

_SEARCH = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from megatron_hetero import models as M
from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.tuner import TuneOptions, tune
model, inv = M.model_preset(sys.argv[2]), inventory_from_data({"groups": json.loads(sys.argv[3])})
wall, cpu = time.perf_counter(), time.process_time()
got = tune(model, inv, int(sys.argv[4]), options=TuneOptions())
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
m = got.plan.meshes[0]
print(json.dumps({"wall": wall, "cpu": cpu, "structures": got.structures_evaluated,
                  "step": got.sim.step_time_s, "etp": [x.expert_tensor_parallel_size
                                                       for x in got.plan.meshes]}))
"""


def timed_search(root: Path, model: str, groups: list[dict], gbs: int) -> dict:
    """The search of the tree at ``root`` in a fresh process: its wall and CPU seconds, the
    structures it evaluated, the tuned plan's predicted step and expert TP."""
    out = subprocess.run([sys.executable, "-c", _SEARCH, str(root), model, json.dumps(groups),
                          str(gbs)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(name: str, model: str, groups: list[dict], gbs: int, before: Path, ref: str) -> None:
    """The search before (``ref``) and now, one after the other, on this scenario."""
    old = timed_search(before, model, groups, gbs)
    new = timed_search(REPO, model, groups, gbs)
    print(f"  search before ({ref}): {old['cpu']:.2f} s CPU ({old['wall']:.2f} wall, "
          f"{old['structures']} structures, step {old['step']:.3f} s, ETP {old['etp']}); "
          f"now: {new['cpu']:.2f} s CPU ({new['wall']:.2f} wall, {new['structures']} "
          f"structures, step {new['step']:.3f} s, ETP {new['etp']}); CPU now / before "
          f"{new['cpu'] / old['cpu']:.2f}, step now / before {new['step'] / old['step']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--large", action="store_true", help="also time the search at 1024 GPUs")
    ap.add_argument("--before", metavar="REF", help="also time the search of git revision REF")
    args = ap.parse_args()
    todo = list(SCENARIOS.items()) + (list(LARGE.items()) if args.large else [])
    with tempfile.TemporaryDirectory() as tmp:
        if args.before:
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.before,
                                      "megatron_hetero"], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        for name, (model, groups, gbs) in todo:
            run(name, model, groups, gbs)
            if args.before:
                compare(name, model, groups, gbs, Path(tmp), args.before)


if __name__ == "__main__":
    main()
