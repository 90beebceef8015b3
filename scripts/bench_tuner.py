#!/usr/bin/env python
"""Benchmark the tuner on the scenarios in examples/scenarios/.

For each scenario it prints: GPUs, search seconds, predicted step time of the tuned plan, of
plain Megatron's best plan (the baseline), the speedup, the efficiency (upper bound over
predicted) and the room the upper bound leaves over the baseline. ``--quick`` runs the
scenarios marked ``quick: true`` (seconds; for CI). Figures are the cost model's predictions.

``--against REV`` times the search of the current tree against git revision REV's in one run:
REV is checked out into a temporary git worktree, and every scenario is tuned ``--repeats``
times (default 3) by each tree in turn, alternating which goes first, each run a fresh
subprocess of this script (``--json-one``) that imports megatron_hetero from its tree
(scripts/_trees.py; both read this tree's scenarios). It prints each tree's median search time
(wall and CPU), the ratio new/old and whether both trees tuned the same plan and step time;
exit status 1 when they did not. ``--compare-tree PATH`` does the same against a source tree.
``--meshes`` searches mesh plans too (``TuneOptions.meshes``) in every run, and ``--mesh-chunks``
mesh plans with model chunks as well where the tree has that option (an older tree then runs
its search with meshes alone: today's search against the one with chunks); the result compared
is then the winner (``TuneResult.best``). ``--old-without-chunks`` with ``--mesh-chunks``: the
other tree searches mesh plans without chunks (today's search against this tree's with them;
the "same result" column then compares different searches).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _trees  # noqa: E402

REPO = _trees.REPO
_TREE = _trees.use_tree()  # this repository, or $MEGATRON_HETERO_TREE (--against's subprocesses)

from megatron_hetero._schema import read_yaml  # noqa: E402
from megatron_hetero.hardware.inventory import inventory_from_data  # noqa: E402
from megatron_hetero.models import load_model  # noqa: E402
from megatron_hetero.tuner import TuneOptions, tune  # noqa: E402

SCENARIOS = REPO / "examples" / "scenarios"


def one_f_one_b_estimate(model, inventory, gbs: int, chunks: int = 1) -> tuple[float, int]:
    """The best step time a plan of the searched kind can hope for, counting what the upper
    bound leaves out but such a plan must pay: tensor-parallel all-reduces (the forward's, and
    what the backward's weight-gradient GEMMs do not hide) and the fill and drain of 1F1B,
    divided by ``chunks`` (interleaved 1F1B with
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


def json_one(path: Path, max_vp: int | None, meshes: bool = False,
             mesh_chunks: bool = False) -> dict:
    """Tune one scenario: its search time and what it found (``--json-one``)."""
    import dataclasses

    import megatron_hetero
    inventory, model, gbs, _ = load_scenario(path)
    options = TuneOptions()
    if max_vp is not None:
        options.max_virtual_pipeline_size = max_vp
    chunks = mesh_chunks and "mesh_chunks" in {f.name for f in dataclasses.fields(TuneOptions)}
    if meshes or chunks:
        options = dataclasses.replace(options, meshes=True, **({"mesh_chunks": True} if chunks else {}))
    r = tune(model, inventory, gbs, options=options)
    best = getattr(r, "best", (r.plan, r.sim)) if meshes or chunks else (r.plan, r.sim)
    plan = best[0].to_data()
    plan.pop("prediction", None)
    return {"scenario": path.stem, "gpus": inventory.num_gpus,
            "search_time_s": r.search_time_s, "search_cpu_s": r.search_cpu_s,
            "step_time_s": best[1].step_time_s, "mesh_chunks": chunks,
            "baseline_step_time_s": r.baseline_sim.step_time_s if r.baseline_sim else None,
            "structures_evaluated": r.structures_evaluated,
            "refine_simulations": getattr(r, "refine_simulations", None),
            "plan_sha1": hashlib.sha1(json.dumps(plan, sort_keys=True, default=str).encode()).hexdigest(),
            "package": str(Path(megatron_hetero.__file__).resolve().parent)}


def _run_one(tree: Path, path: Path, max_vp: int | None, flags: tuple[str, ...] = ()) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json-one", str(path), *flags]
    if max_vp is not None:
        cmd += ["--max-virtual-pipeline-size", str(max_vp)]
    proc = subprocess.run(cmd, env=_trees.tree_env(tree), capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"{path.stem}: the run with megatron_hetero from {tree} failed "
                         f"(exit status {proc.returncode})")
    return json.loads(proc.stdout.splitlines()[-1])


def against(paths: list[Path], old_tree: Path, old_name: str, repeats: int, quick: bool,
            max_vp: int | None, flags: tuple[str, ...] = (),
            old_flags: tuple[str, ...] | None = None) -> int:
    """Time each scenario's search under ``old_tree`` and this tree, ``repeats`` times each,
    alternating which runs first; print the medians and their ratio. ``old_flags``: the old
    tree's flags where they differ from ``flags``."""
    old_flags = flags if old_flags is None else old_flags
    header = (f"{'scenario':34s} {'GPUs':>5s} {'old s':>7s} {'new s':>7s} {'new/old':>7s} "
              f"{'old cpu':>7s} {'new cpu':>7s} {'new/old':>7s}  same result")
    print(f"old: {old_name} ({old_tree})\nnew: this tree ({REPO})\n"
          + (f"options: {' '.join(flags)}\n" if flags else "")
          + (f"old tree's options: {' '.join(old_flags)}\n" if old_flags != flags else "") +
          f"search time: median of {repeats} run(s) per tree, each a fresh process, the tree "
          f"that runs first alternating\n")
    print(header)
    print("-" * len(header))
    differ = 0
    totals = {"old": [0.0, 0.0], "new": [0.0, 0.0]}
    trees = {"old": old_tree, "new": REPO}
    for i, path in enumerate(paths):
        if quick and not load_scenario(path)[3]:
            continue
        runs: dict[str, list[dict]] = {"old": [], "new": []}
        for k in range(repeats):
            for which in (("old", "new") if (i + k) % 2 == 0 else ("new", "old")):
                got = _run_one(trees[which], path, max_vp, old_flags if which == "old" else flags)
                if Path(got["package"]).resolve().parent != trees[which]:
                    raise SystemExit(f"{path.stem}: the {which} run imported {got['package']}")
                runs[which].append(got)
        med = {w: (statistics.median(r["search_time_s"] for r in runs[w]),
                   statistics.median(r["search_cpu_s"] for r in runs[w])) for w in runs}
        for w in totals:
            totals[w][0] += med[w][0]
            totals[w][1] += med[w][1]
        keys = ("step_time_s", "baseline_step_time_s", "plan_sha1")
        found = {tuple(r[k] for k in keys) for w in runs for r in runs[w]}
        if len(found) == 1:
            same = "yes"
        else:
            differ += 1
            o, n = runs["old"][0], runs["new"][0]
            same = (f"NO: step {o['step_time_s']!r} -> {n['step_time_s']!r}, baseline "
                    f"{o['baseline_step_time_s']!r} -> {n['baseline_step_time_s']!r}, plan "
                    f"{'same' if o['plan_sha1'] == n['plan_sha1'] else 'different'}")
        print(f"{path.stem:34s} {runs['new'][0]['gpus']:5d} {med['old'][0]:7.3f} {med['new'][0]:7.3f} "
              f"{med['new'][0] / med['old'][0]:7.3f} {med['old'][1]:7.3f} {med['new'][1]:7.3f} "
              f"{med['new'][1] / med['old'][1]:7.3f}  {same}")
        sys.stdout.flush()
    (ow, oc), (nw, nc) = totals["old"], totals["new"]
    if ow:
        print("-" * len(header))
        print(f"{'all (sum of medians)':34s} {'':5s} {ow:7.3f} {nw:7.3f} {nw / ow:7.3f} "
              f"{oc:7.3f} {nc:7.3f} {nc / oc:7.3f}")
    print("\nold s / new s: the search's wall-clock seconds (TuneResult.search_time_s); cpu: its "
          "CPU seconds (search_cpu_s); same result: both trees tuned the same plan, step time and "
          "baseline step time in every run.")
    return 1 if differ else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the scenarios marked quick")
    ap.add_argument("--max-virtual-pipeline-size", type=int, default=None, metavar="V",
                    help="most model chunks per stage searched (1: no interleaving; default: "
                         "TuneOptions' default)")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--against", metavar="REV",
                       help="time the search of this tree against git revision REV's")
    which.add_argument("--compare-tree", metavar="PATH",
                       help="time the search of this tree against the source tree at PATH's")
    which.add_argument("--json-one", metavar="SCENARIO",
                       help="tune one scenario file and print its search time and result as JSON")
    ap.add_argument("--meshes", action="store_true", help="search mesh plans too")
    ap.add_argument("--mesh-chunks", action="store_true",
                    help="search mesh plans with model chunks too (where the tree has them)")
    ap.add_argument("--old-without-chunks", action="store_true",
                    help="with --mesh-chunks: the other tree searches without model chunks "
                         "(today's mesh search against this tree's with chunks)")
    ap.add_argument("--repeats", type=int, default=3, metavar="N",
                    help="with --against: runs per scenario and tree, median taken (default 3)")
    ap.add_argument("scenarios", nargs="*", help="scenario files (default: all in examples/scenarios)")
    args = ap.parse_args(argv)
    if args.json_one:
        _trees.check_imported(_TREE)
        print(json.dumps(json_one(Path(args.json_one), args.max_virtual_pipeline_size,
                                  args.meshes, args.mesh_chunks)))
        return 0
    paths = [Path(p) for p in args.scenarios] or sorted(SCENARIOS.glob("*.yaml"))
    if args.against or args.compare_tree:
        if args.repeats < 1:
            ap.error("--repeats: expected a positive integer")
        with _trees.other_tree(args.against, args.compare_tree) as tree:
            name = (f"{args.against} ({_trees.describe(args.against)})" if args.against
                    else args.compare_tree)
            flags = tuple(f for f, on in (("--meshes", args.meshes),
                                          ("--mesh-chunks", args.mesh_chunks)) if on)
            old = tuple(f for f in flags if f != "--mesh-chunks") if args.old_without_chunks \
                else flags
            return against(paths, tree, name, args.repeats, args.quick,
                           args.max_virtual_pipeline_size, flags, old)
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
