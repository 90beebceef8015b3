#!/usr/bin/env python
"""Search time against the global batch size, measured side by side in one run.

For each scenario (default: the 16- and 32-GPU ones in examples/scenarios/) it tunes the pool at
the scenario's global batch size, at 16384, at 10^6 and at 10^9, and prints each search's CPU seconds, its
ratio to the scenario's, the structures evaluated and the simulations of the local search.
Then, for the plan tuned at 16384, it simulates every pipeline of it both ways: op by op
(simulate_pipeline.interleaved_1f1b) and from the periodic steady state
(simulate_pipeline.pipeline_run), and prints their seconds and the largest relative difference
of the figures.

``--against REV`` runs each search in a fresh process under this tree and under git revision
REV's package (a temporary worktree, scripts/_trees.py), alternating which runs first, and
prints both trees' CPU seconds and ratios side by side (the op-by-op comparison is left out);
``--repeat N`` runs each N times per tree and prints the least. Both modes print the UTC time
and the load average when they start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _trees  # noqa: E402

_trees.use_tree()

from bench_tuner import SCENARIOS, load_scenario  # noqa: E402
from megatron_hetero.sim import pipeline as simulate_pipeline
from megatron_hetero.sim.pipeline import interleaved_1f1b, pipeline_run  # noqa: E402
from megatron_hetero.tuner import TuneOptions, tune  # noqa: E402

DEFAULT = ("a100-v100-llama2-7b", "4090-3090-a100-llama2-7b", "h100-a100-llama2-13b")
SIZES = (128, 16384, 10**6, 10**9)


def _when() -> str:
    """The UTC time and the load averages (1, 5, 15 min), for the figures' conditions."""
    return (time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()) + ", load average "
            + " ".join(f"{x:.2f}" for x in os.getloadavg()))


def _one(path: Path, g: int) -> dict:
    """One search of scenario ``path`` at GBS ``g`` in this process."""
    inventory, model, _, _ = load_scenario(path)
    t = time.process_time()
    r = tune(model, inventory, g, options=TuneOptions())
    return {"gpus": inventory.num_gpus, "cpu": time.process_time() - t,
            "structures": r.structures_evaluated, "step": r.sim.step_time_s}


def _fresh(tree: Path, path: Path, g: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json-one", str(path), str(g)]
    proc = subprocess.run(cmd, env=_trees.tree_env(tree), capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"{path.stem} at GBS {g}: the run under {tree} failed")
    return json.loads(proc.stdout.splitlines()[-1])


def against(paths: list[Path], rev: str, repeat: int = 1) -> int:
    """Both trees' searches side by side, each in a fresh process, the least CPU time of
    ``repeat`` such pairs."""
    print(f"old: {rev} ({_trees.describe(rev)})\nnew: this tree ({_trees.REPO})\n"
          f"start: {_when()}\n")
    print(f"{'scenario':28s} {'GPUs':>5s} {'GBS':>10s} {'old cpu':>8s} {'x base':>7s} "
          f"{'new cpu':>8s} {'x base':>7s} {'structures':>10s}  step new/old - 1")
    with _trees.rev_tree(rev) as old:
        for i, path in enumerate(paths):
            base: dict[str, float] = {}
            for k, g in enumerate(SIZES):
                got: dict[str, dict] = {}
                for r in range(repeat):
                    for which in (("old", "new") if (i + k + r) % 2 == 0 else ("new", "old")):
                        one = _fresh(old if which == "old" else _trees.REPO, path, g)
                        if which not in got or one["cpu"] < got[which]["cpu"]:
                            got[which] = one
                for which in got:
                    base.setdefault(which, got[which]["cpu"])
                o, n = got["old"], got["new"]
                print(f"{path.stem:28s} {n['gpus']:5d} {g:10d} {o['cpu']:8.2f} "
                      f"{o['cpu'] / base['old']:7.2f} {n['cpu']:8.2f} {n['cpu'] / base['new']:7.2f} "
                      f"{n['structures']:10d}  {n['step'] / o['step'] - 1:.1e}")
                sys.stdout.flush()
    print(f"\nend: {_when()}")
    print(f"\ncpu: the search's CPU seconds in a fresh process (the least of {repeat}); x base: "
          "over the same tree's search at GBS 128; structures: the new tree's structures evaluated; step: the relative "
          "difference of the tuned plans' step times.")
    return 0


def _pipelines(plan, cost):
    """(fwd, bwd, sends, m, group) of every distinct pipeline of ``plan``."""
    from megatron_hetero.cost.stage import StageShape
    placement = cost.placement(plan)
    out = {}
    for d, pipe in enumerate(plan.pipelines):
        times = [cost.chunk_times(StageShape.of(plan, d, s))
                 for s in range(plan.pipeline_model_parallel_size)]
        bws = placement.path_links(0, d, plan.virtual_pipeline_size > 1)
        sends = [cost.p2p_seconds(pipe.micro_batch_size, bw, tp=plan.tensor_model_parallel_size,
                                  sp=plan.sequence_parallel) for bw in bws]
        key = (tuple(tuple((c.forward_s, c.backward_s) for c in t) for t in times), tuple(sends),
               pipe.num_microbatches)
        out[key] = ([[c.forward_s for c in t] for t in times],
                    [[c.backward_s for c in t] for t in times], sends, pipe.num_microbatches,
                    plan.microbatch_group_size)
    return list(out.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenarios", nargs="*", help="scenario files (default: %s)" % ", ".join(DEFAULT))
    ap.add_argument("--against", metavar="REV",
                    help="side by side with git revision REV's package, fresh processes")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="with --against: run each search N times per tree, print the least")
    ap.add_argument("--json-one", nargs=2, metavar=("SCENARIO", "GBS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.json_one:
        print(json.dumps(_one(Path(args.json_one[0]), int(args.json_one[1]))))
        return 0
    paths = [Path(p) for p in args.scenarios] or [SCENARIOS / f"{n}.yaml" for n in DEFAULT]
    if args.against:
        return against(paths, args.against, max(1, args.repeat))
    print(f"start: {_when()}\n")
    print(f"{'scenario':28s} {'GPUs':>5s} {'GBS':>10s} {'cpu s':>7s} {'x base':>7s} "
          f"{'structures':>10s} {'sims':>5s} {'step s':>12s}")
    for path in paths:
        inventory, model, gbs, _ = load_scenario(path)
        base = None
        for g in sorted({128, gbs, 16384, 10**6, 10**9}):
            t = time.process_time()
            r = tune(model, inventory, g, options=TuneOptions())
            cpu = time.process_time() - t
            base = base or cpu
            print(f"{path.stem:28s} {inventory.num_gpus:5d} {g:10d} {cpu:7.2f} {cpu / base:7.2f} "
                  f"{r.structures_evaluated:10d} {getattr(r, 'refine_simulations', 0):5d} "
                  f"{r.sim.step_time_s:12.2f}")
            sys.stdout.flush()
            if g == 16384:
                plan16k, cost = r.plan, r.cost if hasattr(r, "cost") else None
        if cost is None:
            from megatron_hetero.tuner.problem import Problem
            cost = Problem(model, inventory, 16384, {}, TuneOptions()).cost(plan16k.precision)
        for fwd, bwd, sends, m, group in _pipelines(plan16k, cost):
            simulate_pipeline._RUNS.clear()  # time the run itself, not the search's cache of it
            t0 = time.process_time()
            exact = interleaved_1f1b(fwd, bwd, sends, sends, m, group=group)
            t1 = time.process_time()
            fast = pipeline_run(fwd, bwd, sends, sends, m, group=group)
            t2 = time.process_time()
            a = list(exact[0]) + [x for row in exact[2] for x in row]
            b = list(fast[0]) + [x for row in fast[2] for x in row]
            err = max(abs(x - y) / abs(x) for x, y in zip(a, b) if x)
            print(f"  16384 plan, pipeline of {len(fwd)} stages x {len(fwd[0])} chunks, {m} "
                  f"micro-batches: op by op {t1 - t0:.4f} s, steady state {t2 - t1:.4f} s "
                  f"({(t1 - t0) / max(t2 - t1, 1e-9):.0f}x), largest relative difference {err:.1e}")
    print(f"\nend: {_when()}")
    print("\ncpu s: the search's CPU seconds in this process; x base: over the search at GBS 128; "
          "sims: simulations of the local search.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
