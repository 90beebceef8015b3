#!/usr/bin/env python
"""Mesh plans against uniform-TP plans on the scenarios in examples/scenarios/.

For each scenario it tunes the pool once with mesh plans in the search (``TuneOptions.meshes``)
and prints, side by side, the best uniform-TP plan (what ``tune`` found before meshes), the
best mesh plan (one mesh per device type, each its own TP and DP), the speedup of the mesh plan,
the efficiency of each against the upper bound, and the search's CPU seconds (this process's,
so other load on the machine does not count) with the mesh search and without it (a tune of the
same scenario with ``meshes=False``, run first). Figures are the cost model's predictions. Pools of one device type have no mesh search (one mesh is a uniform plan).

    python scripts/bench_meshes.py            # every scenario
    python scripts/bench_meshes.py --quick    # the scenarios marked quick, and 3090 + T4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_tuner import SCENARIOS, load_scenario  # noqa: E402
from megatron_hetero.tuner import TuneOptions, tune  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("scenarios", nargs="*")
    args = ap.parse_args(argv)
    paths = [Path(p) for p in args.scenarios] or sorted(SCENARIOS.glob("*.yaml"))
    print(f"{'scenario':34} {'GPUs':>5} {'uniform s':>10} {'mesh s':>10} {'speedup':>8} "
          f"{'eff uni':>8} {'eff best':>8} {'CPU s':>9} {'w/o mesh':>9}  mesh plan")
    for path in paths:
        inventory, model, gbs, quick = load_scenario(path)
        if args.quick and not quick and "3090-t4" not in path.stem:
            continue
        without = tune(model, inventory, gbs, options=TuneOptions(meshes=False)).search_cpu_s
        r = tune(model, inventory, gbs, options=TuneOptions(meshes=True))
        with_mesh = r.search_cpu_s
        ub, uni = r.upper_bound_step_time_s, r.sim.step_time_s
        best = r.best[1].step_time_s
        mesh = r.mesh_sim.step_time_s if r.mesh_sim else None
        shape = (" | ".join(f"{m.device_type} TP{m.tensor_model_parallel_size} "
                            f"DP{m.data_parallel_size} PP{len(m.stages)}"
                            for m in r.mesh_plan.meshes) if r.mesh_plan else "-")
        print(f"{path.stem:34} {inventory.num_gpus:5d} {uni:10.3f} "
              f"{(f'{mesh:10.3f}' if mesh else '         -')} {uni / best:7.3f}x "
              f"{ub / uni:8.3f} {ub / best:8.3f} {with_mesh:9.2f} {without:9.2f}  {shape}"
              + ("  (wins)" if r.mesh_wins else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
