#!/usr/bin/env python
"""Mesh plans against uniform-TP plans on the scenarios in examples/scenarios/.

For each scenario it tunes the pool once with mesh plans in the search, with and without model
chunks (``TuneOptions(meshes=True, mesh_chunks=True)``), and prints side by side the best
uniform-TP plan (what ``tune`` finds without meshes), the best mesh plan without chunks (one
mesh per device type, each its own TP and DP, Megatron's multimodule 1F1B) and the best mesh
plan with chunks (interleaved 1F1B across the meshes: run on CPU ranks, its Megatron-LM
runtime pending), each with
its efficiency against the upper bound (bound / step) and its speedup over the uniform plan;
then the search's CPU seconds (this process's, so other load on the machine does not count):
without meshes (run first), with meshes, and with meshes and chunks. Figures are the cost
model's predictions. Pools of one device type have no mesh search (one mesh is a uniform
plan); pools of two vendors none either (no runtime stages a bridge between vendors on devices).

Targets (issue 28): the winner never worse than the uniform plan; 3090 + T4 at least 0.95;
every pool of PCIe cards or 4-GPU nodes at least 0.93. Where the winner of such a pool misses
its target, a line under the table says what separates it from the bound: the winner's step in
rate-weighted shares (``busy+``, ``bubble``, ``sync``, ``idle``, ``unused``; as
``scripts/bench_efficiency.py``) and its efficiency with every link inside a node free
(``free TP``).

    python scripts/bench_meshes.py            # every scenario
    python scripts/bench_meshes.py --quick    # the scenarios marked quick, and 3090 + T4
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_efficiency import SHARES, shares  # noqa: E402
from bench_tuner import SCENARIOS, load_scenario  # noqa: E402
from megatron_hetero.sim.step import simulate  # noqa: E402
from megatron_hetero.tuner import TuneOptions, tune  # noqa: E402
from megatron_hetero.tuner.problem import Problem  # noqa: E402

PCIE_GB_S = 64.0
"""A node whose GPUs share at most this many GB/s is a PCIe node (NVLink nodes give 150+)."""


def target(path: Path, inventory) -> float | None:
    """The issue's efficiency target for the pool (None: no target)."""
    if "3090-t4" in path.stem:
        return 0.95
    if any(g.gpus_per_node <= 4 or inventory.intra_node_bandwidth(i) <= PCIE_GB_S
           for i, g in enumerate(inventory.groups)):
        return 0.93
    return None


def shape(plan) -> str:
    if plan is None:
        return "-"
    v = plan.virtual_pipeline_size
    return (" | ".join(f"{m.device_type} TP{m.tensor_model_parallel_size} DP{m.data_parallel_size} "
                       f"PP{m.num_stages}" for m in plan.meshes)
            + (f" VP{v}" if v > 1 else "")
            + (f" g{plan.microbatch_group_size}" if plan.microbatch_group_size else ""))


def separates(plan, sim, ub: float, inventory) -> str:
    """What separates ``plan`` from the bound (see the module docstring)."""
    problem = Problem(plan.model, inventory, plan.global_batch_size, {}, TuneOptions())
    sh = shares(plan, sim, inventory, problem.cost(plan.precision).flops_rate)
    free = dataclasses.replace(inventory, groups=[
        dataclasses.replace(g, intra_node_bandwidth_gb_s=1e9) for g in inventory.groups])
    free_step = simulate(plan, Problem(plan.model, free, plan.global_batch_size, {},
                                       TuneOptions()).cost(plan.precision),
                         record_events=False).step_time_s
    return (", ".join(f"{k} {100 * sh[k]:.2f} %" for k in SHARES)
            + f"; free TP {ub / free_step:.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("scenarios", nargs="*")
    args = ap.parse_args(argv)
    paths = [Path(p) for p in args.scenarios] or sorted(SCENARIOS.glob("*.yaml"))
    print(f"{'scenario':30} {'GPUs':>5} {'uniform s':>9} {'eff':>5} {'mesh s':>9} {'eff':>5} "
          f"{'spdup':>6} {'chunks s':>9} {'eff':>5} {'spdup':>6} {'best':>5} {'CPU s':>6} "
          f"{'+mesh':>6} {'+chunk':>6}  mesh plan / mesh plan with chunks")
    notes = []
    for path in paths:
        inventory, model, gbs, quick = load_scenario(path)
        if args.quick and not quick and "3090-t4" not in path.stem:
            continue
        without = tune(model, inventory, gbs, options=TuneOptions(meshes=False)).search_cpu_s
        with_mesh = tune(model, inventory, gbs, options=TuneOptions(meshes=True)).search_cpu_s
        r = tune(model, inventory, gbs, options=TuneOptions(meshes=True, mesh_chunks=True))
        ub, uni = r.upper_bound_step_time_s, r.sim.step_time_s

        def cols(sim) -> str:
            if sim is None:
                return f"{'-':>9} {'-':>5} {'-':>6}"
            return f"{sim.step_time_s:9.3f} {ub / sim.step_time_s:5.3f} {uni / sim.step_time_s:5.3f}x"

        plan, sim = r.best
        eff = ub / sim.step_time_s
        print(f"{path.stem[:30]:30} {inventory.num_gpus:5d} {uni:9.3f} {ub / uni:5.3f} "
              f"{cols(r.mesh_sim)} {cols(r.chunked_mesh_sim)} {eff:5.3f} {without:6.2f} "
              f"{with_mesh:6.2f} {r.search_cpu_s:6.2f}  {shape(r.mesh_plan)} / "
              f"{shape(r.chunked_mesh_plan)}", flush=True)
        goal = target(path, inventory)
        if goal is not None and eff < goal:
            which = ("uniform" if plan is r.plan else
                     "mesh with chunks" if plan.interleaved_chain else "mesh")
            notes.append(f"{path.stem}: best ({which}) {eff:.3f} < {goal:.2f}: "
                         + separates(plan, sim, ub, inventory))
    if notes:
        print("\nwhat separates the best plan from the bound where it misses its target "
              "(shares of the step weighted by each GPU's achievable FLOP/s; they add up to "
              "1 - efficiency):")
        print("\n".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
