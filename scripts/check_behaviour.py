#!/usr/bin/env python
"""Print a fingerprint of the tuner's and the simulator's behaviour, to diff across a change.

For every scenario in examples/scenarios/ (``tune`` with the default options) and every
Llama-2 example (``tune`` with the command its README gives), it prints the tuned plan (every
field but ``prediction``), its simulated step, each stage's timings and memory, the same
for the baseline plan, and the search's counts (structures evaluated, simulations of the local
search). For every example's committed plan.yaml it prints what ``megatron-hetero simulate``
computes. Identical pipelines are printed once with their indices. Floats are printed with 9
significant digits, stage times below a billionth of the step as 0 (``--exact``: Python's
repr of every float). Wall-clock times never appear in the output
(progress goes to stderr), so two runs of one tree print the same text.

    python scripts/check_behaviour.py --quick                 # quick scenarios + examples
    python scripts/check_behaviour.py --against HEAD~1        # this tree vs a revision: a diff
    python scripts/check_behaviour.py --quick --reference tests/data/behaviour_quick.txt
    python scripts/check_behaviour.py --quick --write-reference tests/data/behaviour_quick.txt

``--against REV`` checks REV out into a temporary git worktree and runs this script there
and here, each in a subprocess that imports megatron_hetero from its tree (scripts/_trees.py);
both read the scenarios and examples of this tree. Exit status 1 when the outputs differ.
Only the public API is used (tune, TuneOptions, simulate, CostModel(...).stage_memory,
load_plan, load_inventory, inventory_from_data, load_model, read_yaml) so the script runs
unchanged against other revisions.
"""

from __future__ import annotations

import argparse
import difflib
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _trees  # noqa: E402

REPO = _trees.REPO
SCENARIOS = REPO / "examples" / "scenarios"
EXAMPLES = REPO / "examples" / "llama2"
MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "workspace", "total", "capacity")

EXACT = False


def g(x) -> str:
    """A number as printed: floats with 9 significant digits (repr with ``--exact``)."""
    if x is None or isinstance(x, (bool, int, str)):
        return str(x)
    x = float(x)
    return repr(x) if EXACT else f"{x:.9g}"


def t(x, step: float) -> str:
    """Seconds inside a step of ``step`` seconds: as :func:`g`, with what is below a billionth
    of the step printed as 0 (a bubble or idle time that is a difference of two equal sums is
    rounding noise, -4e-14 or 1e-15, whose digits any change of summation order changes)."""
    if not EXACT and abs(x) < 1e-9 * step:
        x = 0.0
    return g(x)


def dumps(data) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)


def ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    out, start = [], None
    for k, i in enumerate(indices):
        if start is None:
            start = i
        if k + 1 == len(indices) or indices[k + 1] != i + 1:
            out.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ",".join(out)


def grouped(items: list) -> list[tuple[list[int], object]]:
    """(indices, item) for each distinct item, in order of first appearance."""
    seen: dict[str, tuple[list[int], object]] = {}
    for i, item in enumerate(items):
        seen.setdefault(dumps(item), ([], item))[0].append(i)
    return list(seen.values())


# -- rendering -------------------------------------------------------------------------------------
def plan_lines(plan) -> list[str]:
    """Every field of the plan file but ``prediction``; identical pipelines once."""
    data = plan.to_data()
    data.pop("prediction", None)
    pipes = data.pop("pipelines")
    model = data.pop("model")
    out = [f"TP{plan.tensor_model_parallel_size} PP{plan.pipeline_model_parallel_size} "
           f"VP{getattr(plan, 'virtual_pipeline_size', 1)} DP{plan.data_parallel_size}",
           f"fields {dumps(data)}", f"model {dumps(model)}"]
    for idx, pipe in grouped(pipes):
        head = {k: v for k, v in pipe.items() if k != "stages"}
        out.append(f"pipelines {ranges(idx)} ({len(idx)}x) {dumps(head)}")
        out += [f"  stage {s} {dumps(st)}" for s, st in enumerate(pipe["stages"])]
    return out


def memory_text(mem) -> str:
    return " ".join(f"{k} {g(getattr(mem, k))}" for k in MEMORY_KINDS if hasattr(mem, k))


def sim_lines(sim) -> list[str]:
    """The simulated step: totals, then each stage's timings and memory, identical pipelines
    once."""
    out = [f"step_time_s {g(sim.step_time_s)} tokens_per_s {g(sim.tokens_per_s)} "
           f"mfu {g(sim.mfu)} model_flops {g(sim.model_flops)} fits_memory {sim.fits_memory}"]
    by_pipe: dict[int, list[str]] = {}
    step = sim.step_time_s
    for st in sim.stages:
        by_pipe.setdefault(st.pipeline, []).append(
            f"stage {st.stage} {st.device_type} layers {st.num_layers} fwd {g(st.forward_s)} "
            f"bwd {g(st.backward_s)} busy {t(st.busy_s, step)} bubble {t(st.bubble_s, step)} "
            f"sync {t(st.sync_s, step)} idle {t(st.idle_s, step)} | memory {memory_text(st.memory)} "
            f"fits {st.memory.fits}")
    for idx, lines in grouped([by_pipe[d] for d in sorted(by_pipe)]):
        out.append(f"pipelines {ranges(idx)} ({len(idx)}x)")
        out += [f"  {line}" for line in lines]
    for h in getattr(sim, "host_nodes", None) or []:
        out.append(f"host node {h.node} group {h.group} index {h.index} used {g(h.used_bytes)} "
                   f"capacity {g(h.capacity_bytes)}")
    return out


def _simulator():
    """The simulator's entry: ``megatron_hetero.sim.step.simulate``, or where trees before the
    package's layout by role kept it (``megatron_hetero.simulate``)."""
    try:
        from megatron_hetero.sim.step import simulate
    except ModuleNotFoundError:
        from megatron_hetero.simulate import simulate
    return simulate


def cli_simulate(plan, inventory):
    """Simulate ``plan`` as ``megatron-hetero simulate`` does (no profiles)."""
    from megatron_hetero.cost.model import CostModel
    simulate = _simulator()
    cost = CostModel(plan.model, inventory, precision=plan.precision,
                     use_distributed_optimizer=plan.use_distributed_optimizer)
    return cost, simulate(plan, cost, record_events=False)


def stage_memory_check(plan, cost, sim) -> str:
    """Whether ``cost.stage_memory(plan, d, s)`` gives the memory the simulation reports for
    every (pipeline, stage)."""
    bad = []
    for st in sim.stages:
        mem = cost.stage_memory(plan, st.pipeline, st.stage)
        if memory_text(mem) != memory_text(st.memory):
            bad.append(f"({st.pipeline}, {st.stage})")
    return (f"stage_memory agrees with the simulation on all {len(sim.stages)} stages" if not bad
            else f"stage_memory differs from the simulation at {len(bad)} stages: {' '.join(bad[:8])}")


def tune_lines(model, inventory, gbs: int, options) -> tuple[list[str], object]:
    from megatron_hetero.tuner import tune
    r = tune(model, inventory, gbs, options=options)
    out = ["tuned plan:"] + [f"  {line}" for line in plan_lines(r.plan)]
    out += ["tuned simulation:"] + [f"  {line}" for line in sim_lines(r.sim)]
    cost, again = cli_simulate(r.plan, inventory)
    same = sim_lines(again) == sim_lines(r.sim)
    out.append(f"tuned plan simulated as the CLI does: step_time_s {g(again.step_time_s)}, "
               f"{'same' if same else 'NOT the same'} stage lines as the tuner's simulation")
    out.append(stage_memory_check(r.plan, cost, again))
    if r.baseline_plan is None:
        out.append("baseline: none")
    else:
        out += ["baseline plan:"] + [f"  {line}" for line in plan_lines(r.baseline_plan)]
        out += ["baseline simulation:"] + [f"  {line}" for line in sim_lines(r.baseline_sim)]
    fields = ("structures_evaluated", "refine_simulations", "searched_step_time_s",
              "upper_bound_step_time_s", "fell_back_to_baseline")
    out.append("search: " + " ".join(f"{k} {g(getattr(r, k, 'n/a'))}" for k in fields))
    return out, r


# -- what is fingerprinted -------------------------------------------------------------------------
def scenario_block(path: Path, quick: bool) -> list[str] | None:
    from megatron_hetero._schema import read_yaml
    from megatron_hetero.hardware.inventory import inventory_from_data
    from megatron_hetero.models import load_model
    from megatron_hetero.tuner import TuneOptions
    data = read_yaml(path)
    if quick and not data.get("quick", False):
        return None
    inventory = inventory_from_data(data["inventory"], source=str(path))
    model = load_model(data["model"], seq_length=data.get("seq_length"))
    gbs = int(data["global_batch_size"])
    lines, _ = tune_lines(model, inventory, gbs, TuneOptions())
    head = (f"== scenario {path.stem}: {model.name} seq {model.seq_length} GBS {gbs} on "
            f"{inventory.num_gpus} GPUs")
    return [head] + lines


def readme_tune_command(example: Path) -> dict:
    """The options of the ``megatron-hetero tune`` command in the example's README."""
    for line in (example / "README.md").read_text().splitlines():
        if line.startswith("megatron-hetero tune "):
            words = shlex.split(line)
            ap = argparse.ArgumentParser(add_help=False)
            ap.add_argument("inventory")
            ap.add_argument("--model", required=True)
            ap.add_argument("--global-batch-size", type=int, required=True)
            ap.add_argument("--seq-length", type=int)
            ap.add_argument("-o", "--output")
            ap.add_argument("--report")
            ap.add_argument("--micro-batch-sizes")
            ap.add_argument("--tensor-parallel-sizes")
            ap.add_argument("--no-optimizer-offload", action="store_true")
            ap.add_argument("--no-activation-offload", action="store_true")
            return vars(ap.parse_args(words[2:])) | {"line": line.strip()}
    raise SystemExit(f"{example}/README.md: no `megatron-hetero tune` command")


def example_blocks(example: Path) -> list[str]:
    """The committed plan simulated, then the example tuned again by its README's command."""
    from megatron_hetero.hardware.inventory import load_inventory
    from megatron_hetero.models import load_model
    from megatron_hetero.plan import load_plan
    from megatron_hetero.tuner import TuneOptions
    rel = example.relative_to(REPO)
    inventory = load_inventory(example / "inventory.yaml")
    plan = load_plan(example / "plan.yaml", catalog=inventory.catalog)
    _, sim = cli_simulate(plan, inventory)
    out = [f"== example {rel}/plan.yaml on {rel}/inventory.yaml (megatron-hetero simulate)"]
    out += sim_lines(sim)
    cmd = readme_tune_command(example)
    model = load_model(cmd["model"], seq_length=cmd["seq_length"])
    options = TuneOptions(progress=False)
    if cmd["micro_batch_sizes"]:
        options.micro_batch_sizes = tuple(sorted({int(v) for v in cmd["micro_batch_sizes"].split(",")}))
    if cmd["tensor_parallel_sizes"]:
        options.tensor_parallel_sizes = tuple(sorted({int(v) for v in cmd["tensor_parallel_sizes"].split(",")}))
    options.optimizer_offload = not cmd["no_optimizer_offload"]
    options.activation_offload = not cmd["no_activation_offload"]
    lines, r = tune_lines(model, load_inventory(REPO / cmd["inventory"]),
                          cmd["global_batch_size"], options)
    committed = plan.to_data()
    tuned = r.plan.to_data()
    for d in (committed, tuned):
        d.pop("prediction", None)
    out.append(f"== example {rel} tuned again: {cmd['line']}")
    out += lines
    out.append(f"tuned plan {'equals' if dumps(tuned) == dumps(committed) else 'DIFFERS from'} "
               f"{rel}/plan.yaml")
    return out


def guarded(head: str, block, *args) -> list[str] | None:
    """``block(*args)``, or its error as a line (a tree that cannot read an input, for
    instance, shows in the diff instead of ending the run)."""
    try:
        return block(*args)
    except Exception as e:  # noqa: BLE001
        print(f"{head}: {type(e).__name__}", file=sys.stderr)
        return [head, f"ERROR {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]


def fingerprint(quick: bool, exact: bool) -> str:
    global EXACT
    EXACT = exact
    out = [f"# scripts/check_behaviour.py{' --quick' if quick else ''}"
           f"{' --exact' if exact else ''}: megatron-hetero behaviour fingerprint"]
    for path in sorted(SCENARIOS.glob("*.yaml")):
        t0 = time.perf_counter()
        block = guarded(f"== scenario {path.stem}", scenario_block, path, quick)
        if block is not None:
            out += block + [""]
            print(f"scenario {path.stem}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    for example in sorted(p.parent for p in EXAMPLES.glob("*/plan.yaml")):
        t0 = time.perf_counter()
        out += guarded(f"== example {example.relative_to(REPO)}", example_blocks, example) + [""]
        print(f"example {example.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    rehearse = sorted((REPO / "examples" / "rehearse").glob("*.yaml"))
    if rehearse:
        out.append("# not simulated (no inventory beside them): "
                   + ", ".join(str(p.relative_to(REPO)) for p in rehearse))
    return "\n".join(out) + "\n"


# -- comparing -------------------------------------------------------------------------------------
def diff_report(old: str, new: str, old_name: str, new_name: str) -> int:
    if old == new:
        print(f"identical: {len(new.splitlines())} lines")
        return 0
    sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                               old_name, new_name))
    print(f"\nDIFFERENT: {old_name} and {new_name}")
    return 1


def run_in(tree: Path, args) -> str:
    """This script's fingerprint with megatron_hetero imported from ``tree``."""
    cmd = [sys.executable, str(Path(__file__).resolve())]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--exact"] if args.exact else []
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=_trees.tree_env(tree), capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"the fingerprint failed with megatron_hetero from {tree} "
                         f"(exit status {proc.returncode})")
    print(f"fingerprint with megatron_hetero from {tree}: {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return proc.stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="only the scenarios marked quick (and the examples): seconds, for CI")
    ap.add_argument("--exact", action="store_true", help="print floats exactly (repr)")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--against", metavar="REV",
                       help="diff with the fingerprint of git revision REV (temporary worktree)")
    which.add_argument("--compare-tree", metavar="PATH",
                       help="diff with the fingerprint of the source tree at PATH")
    which.add_argument("--reference", metavar="FILE", help="diff with a stored fingerprint")
    which.add_argument("--write-reference", metavar="FILE", help="write the fingerprint to FILE")
    args = ap.parse_args(argv)
    if args.against or args.compare_tree:
        with _trees.other_tree(args.against, args.compare_tree) as tree:
            old = run_in(tree, args)
        new = run_in(REPO, args)
        name = args.against and f"{args.against} ({_trees.describe(args.against)})"
        return diff_report(old, new, name or str(tree), "this tree")
    _trees.check_imported(_trees.use_tree())
    text = fingerprint(args.quick, args.exact)
    if args.reference:
        return diff_report(Path(args.reference).read_text(), text, args.reference, "this tree")
    if args.write_reference:
        Path(args.write_reference).write_text(text)
        print(f"wrote {args.write_reference}: {len(text.splitlines())} lines", file=sys.stderr)
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
