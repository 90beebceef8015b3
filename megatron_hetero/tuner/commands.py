"""Handlers of ``megatron-hetero tune`` and ``megatron-hetero simulate``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cost.model import DEFAULT_MEMORY_HEADROOM, check_memory_headroom, usable_memory_text
from ..errors import HeteroError
from ..hardware.inventory import load_inventory
from ..models import load_model
from ..outputs import Outputs
from ..cost.profile_file import run_profile_name as profile_name
from ..plan import ModelSpec, Plan, load_any_plan, save_plan
from ..placement.inventory import check_against_inventory

__all__ = ["tune_main", "simulate_main", "add_tune_arguments", "add_simulate_arguments",
           "add_search_space_arguments", "add_memory_headroom_argument", "memory_headroom",
           "headroom_line", "parse_sizes"]


def add_memory_headroom_argument(p: argparse.ArgumentParser) -> None:
    """``--memory-headroom F`` (``tune``, ``replan``, ``simulate``, ``validate``); read it with
    :func:`memory_headroom`."""
    p.add_argument("--memory-headroom", type=float, default=None, metavar="F",
                   help="fraction of each card's memory (as the device reports it) that no "
                        f"stage's predicted peak may use (default {DEFAULT_MEMORY_HEADROOM:g}: "
                        "the allocator's gap and the model's error, docs/tuner.md)")


def memory_headroom(args: argparse.Namespace) -> float:
    """The ``--memory-headroom`` given (checked), else the default."""
    given = getattr(args, "memory_headroom", None)
    return DEFAULT_MEMORY_HEADROOM if given is None else check_memory_headroom(given)


def headroom_line(headroom: float) -> str:
    """One line saying what the memory figures are out of."""
    return f"memory: each card's {usable_memory_text(headroom)}"


def add_search_space_arguments(p: argparse.ArgumentParser, *, tp_default: str) -> None:
    """The options of what the search measures and tries (``tune`` and ``replan``); read them
    with :func:`parse_sizes`. ``tp_default`` says which tensor-parallel sizes are tried without
    ``--tensor-parallel-sizes``."""
    p.add_argument("--profile", action="append", default=[], metavar="FILE",
                   help="measured profile.yaml of a device type (repeatable)")
    p.add_argument("--micro-batch-sizes", default="1,2,4,8", metavar="LIST",
                   help="micro-batch sizes to try (default 1,2,4,8)")
    p.add_argument("--tensor-parallel-sizes", metavar="LIST",
                   help=f"tensor-parallel sizes to try (default: {tp_default})")
    add_memory_headroom_argument(p)


def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inventory", metavar="INVENTORY", help="inventory.yaml of the GPU pool")
    p.add_argument("--model", metavar="M",
                   help="model preset (llama2-7b, llama2-13b, llama2-70b, llama3-8b, llama3-70b) "
                        "or a YAML file with the model fields (required without --from-run)")
    p.add_argument("--global-batch-size", type=int, metavar="N",
                   help="samples per step (required without --from-run)")
    p.add_argument("--from-run", metavar="DIR",
                   help="re-plan a run's own model and global batch (DIR/plan.yaml) with the "
                        "per-layer costs it measured (DIR/profile.*.yaml), from the folder its "
                        "--hetero-telemetry wrote")
    p.add_argument("--seq-length", type=int, metavar="S", help="sequence length (default: the model's)")
    p.add_argument("-o", "--output", default="plan.yaml", metavar="PLAN",
                   help="where to write the plan (default plan.yaml)")
    p.add_argument("--report", metavar="JSON", help="write the JSON report here")
    p.add_argument("--timeline", metavar="PNG", help="write a Gantt chart of the predicted step")
    add_search_space_arguments(p, tp_default="every size that divides the attention heads and "
                                              "query groups and fits in a node")
    p.add_argument("--no-optimizer-offload", action="store_true",
                   help="fit memory with recompute only (optimizer offload needs megatron-core's "
                        "CPU-offload optimizer and --use-precision-aware-optimizer)")
    p.add_argument("--no-activation-offload", action="store_true",
                   help="never offload the layers' module inputs to the host (megatron-core's "
                        "fine-grained activation offloading, which needs megatron-core 0.17 or "
                        "later, with Transformer Engine's layers or the local ones)")
    p.add_argument("--meshes", action="store_true",
                   help="search mesh plans too (TP and DP per device type) and write one where "
                        "it is faster; the runtime runs mesh plans from megatron-core 0.17 "
                        "(docs/meshes.md), so without it tune writes only plans that run on "
                        "every supported release")
    p.add_argument("--mesh-chunks", action="store_true",
                   help="with --meshes, search mesh plans whose stages run model chunks too "
                        "(interleaved 1F1B across meshes), which rehearse, the CPU trainer and "
                        "pretrain_gpt.py --hetero-plan run wherever mesh plans run; off by "
                        "default, as it costs search time and wins on few pools "
                        "(docs/meshes.md)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no table")


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", metavar="PLAN", help="plan.yaml (tuned or hand-written)")
    p.add_argument("--inventory", required=True, metavar="INV", help="inventory.yaml the plan runs on")
    p.add_argument("--timeline", metavar="PNG", help="write a Gantt chart of the step")
    p.add_argument("--profile", action="append", default=[], metavar="FILE",
                   help="measured profile.yaml of a device type (repeatable)")
    p.add_argument("--json", metavar="FILE", help="write the per-stage breakdown as JSON")
    p.add_argument("--warn-only", action="store_true",
                   help="a plan whose stage does not fit its card's memory (or a node its host "
                        "memory) is simulated and printed with a warning, exit 0; without it, "
                        "such a plan is one error, exit 1, and nothing is written")
    add_memory_headroom_argument(p)
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no table and no per-stage lines: the predicted step, warnings and "
                        "what was written")


def _profiles(paths, inventory):
    if not paths:
        return {}
    from ..cost.profile_file import load_profiles
    return load_profiles(paths, catalog=inventory.catalog)


def _figure_sources(plan, inventory, profiles):
    """Which figures of ``plan``'s prediction were measured (from ``profiles``) and which were
    estimated: a :class:`~megatron_hetero.cost.profile_file.ProfileUsage` after simulating it."""
    from ..cost import CostModel
    from ..cost.profile_file import ProfileUsage
    from ..sim.step import simulate

    usage = ProfileUsage(profiles)
    cost = CostModel(plan.model, inventory, profiles=usage.wrap(), precision=plan.precision,
                     use_distributed_optimizer=plan.use_distributed_optimizer)
    simulate(plan, cost, record_events=False)
    return usage


def _short(path: str) -> str:
    """The last two parts of a path, for table titles."""
    from pathlib import Path
    return "/".join(Path(path).parts[-2:])


def parse_sizes(text: str, flag: str = "--micro-batch-sizes") -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``; an empty item (``1,,2``), a non-integer or a size below 1
    is the user's mistake, named with ``flag``."""
    try:
        values = tuple(sorted({int(v) for v in text.split(",")}))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise HeteroError(f"{flag}: {text!r}; expected positive integers such as 1,2,4")
    return values


_NEEDS_TOOL = {"pgf": ("LaTeX", ("lualatex", "xelatex", "pdflatex"))}
"""Picture types matplotlib writes only with an external program, and the programs."""


def _check_timeline(path: str | None) -> None:
    """Refuse, before any work, a --timeline file type matplotlib cannot write here."""
    if not path:
        return
    import shutil

    from matplotlib.backend_bases import FigureCanvasBase
    kinds = FigureCanvasBase.get_supported_filetypes()
    kind = Path(path).suffix.lstrip(".").lower()
    usable = sorted(k for k in kinds if k not in _NEEDS_TOOL
                    or any(shutil.which(t) for t in _NEEDS_TOOL[k][1]))
    if kind not in usable:
        why = (f" (.{kind} needs {_NEEDS_TOOL[kind][0]}, which is not installed)"
               if kind in _NEEDS_TOOL else "")
        raise HeteroError(f"--timeline: {path!r}{why}; expected a file name ending in one of "
                          + ", ".join(f".{k}" for k in usable) + " (e.g. timeline.png)")


def _from_run(args: argparse.Namespace) -> ModelSpec | None:
    """With ``--from-run DIR``: the run's model, its global batch and measured profiles put in
    ``args``; without it, None after checking that ``--model`` and ``--global-batch-size``
    are given."""
    if not args.from_run:
        missing = [f for f, v in (("--model", args.model), ("--global-batch-size",
                                                            args.global_batch_size)) if v is None]
        if missing:
            raise HeteroError(f"{' and '.join(missing)}: missing; expected "
                              f"{'them' if len(missing) > 1 else 'it'}, or --from-run DIR")
        return None
    folder = Path(args.from_run)
    given = [f for f, v in (("--model", args.model), ("--global-batch-size",
                                                      args.global_batch_size),
                            ("--seq-length", args.seq_length)) if v is not None]
    if given:
        raise HeteroError(f"{', '.join(given)}: given with --from-run, which re-plans the run's "
                          f"own model and global batch ({folder / 'plan.yaml'}); drop "
                          f"{'them' if len(given) > 1 else 'it'}")
    plan_path = folder / "plan.yaml"
    if not plan_path.is_file():
        raise HeteroError(f"--from-run {folder}: no plan.yaml there; expected the folder a run's "
                          "--hetero-telemetry wrote")
    plan = load_any_plan(str(plan_path))
    profiles = sorted(str(p) for p in folder.glob(profile_name("*")))
    if not profiles:
        raise HeteroError(f"--from-run {folder}: no {profile_name('<device type>')} there; "
                          "expected a run that reported at least one step")
    args.global_batch_size = plan.global_batch_size
    args.profile = [*args.profile, *profiles]
    return plan.model


def tune_main(args: argparse.Namespace) -> int:
    model = _from_run(args)
    if args.global_batch_size < 1:
        raise HeteroError(f"--global-batch-size: {args.global_batch_size}; expected a positive integer")
    if args.seq_length is not None and args.seq_length < 1:
        raise HeteroError(f"--seq-length: {args.seq_length}; expected a positive integer")
    memory_headroom(args)
    _check_timeline(args.timeline)
    if args.timeline:  # at least a forward and a backward of every micro-batch of the batch
        from ..sim.step import check_recordable
        check_recordable(2 * args.global_batch_size // max(parse_sizes(args.micro_batch_sizes)))
    with _outputs("tune", args, inputs={"INVENTORY": args.inventory},
                  outputs={"-o/--output": args.output, "--report": args.report,
                           "--timeline": args.timeline}) as out:
        return _tune(args, out, model=model)


def _outputs(command: str, args: argparse.Namespace, *, inputs: dict, outputs: dict) -> Outputs:
    """The command's :class:`~megatron_hetero.outputs.Outputs`, its inputs completed by the
    model file and profiles where the command takes them."""
    inputs = dict(inputs)
    model = getattr(args, "model", None)
    if model and Path(model).exists():
        inputs["--model"] = model
    for i, profile in enumerate(getattr(args, "profile", None) or []):
        inputs[f"--profile[{i}]"] = profile
    return Outputs(command, inputs=inputs, outputs=outputs)


def _tune(args: argparse.Namespace, out: Outputs, *, model: ModelSpec | None = None) -> int:
    from rich.console import Console

    from ..cost import CostModel
    from ..cost.crossings import vendor_crossings
    from .report import (host_memory_lines, optimizer_seconds, plan_table, report_dict,
                         summary_lines, unused_gpus, unused_line, vendor_dict, vendor_lines)
    from .problem import TuneOptions
    from .search import tune

    inventory = load_inventory(args.inventory)
    if model is None:
        model = load_model(args.model, seq_length=args.seq_length)
    tp_sizes = (None if args.tensor_parallel_sizes is None
                else parse_sizes(args.tensor_parallel_sizes, "--tensor-parallel-sizes"))
    options = TuneOptions(micro_batch_sizes=parse_sizes(args.micro_batch_sizes),
                          tensor_parallel_sizes=tp_sizes,
                          optimizer_offload=not args.no_optimizer_offload,
                          activation_offload=not args.no_activation_offload,
                          meshes=args.meshes or args.mesh_chunks,
                          mesh_chunks=args.mesh_chunks, memory_headroom=memory_headroom(args),
                          progress=not args.quiet and sys.stderr.isatty())
    profiles = _profiles(args.profile, inventory)
    result = tune(model, inventory, args.global_batch_size, profiles=profiles, options=options)
    if result.mesh_wins:
        return _tune_mesh_wins(args, result, inventory, profiles, out)
    save_plan(result.plan, out.staged(args.output))
    sources = _figure_sources(result.plan, inventory, profiles)
    used_types = sorted(result.plan.device_counts())
    cost = CostModel(model, inventory, profiles=profiles, precision=result.plan.precision,
                     use_distributed_optimizer=result.plan.use_distributed_optimizer,
                     memory_headroom=options.memory_headroom)
    crossings = vendor_crossings(result.plan, cost)
    optimizer = optimizer_seconds(result.plan, result.sim, cost)
    if args.report:
        report = report_dict(result, args.output, optimizer=optimizer)
        report["unused_gpus"] = unused_gpus(result.plan, inventory)
        report["figure_sources"] = sources.report(used_types)
        report["vendor_crossings"] = vendor_dict(crossings, result.sim)
        with open(out.staged(args.report), "w") as f:
            json.dump(report, f, indent=2)
    if args.timeline:
        from ..sim.step import simulate
        simulate(result.plan, cost).timeline_png(out.staged(args.timeline))
    console = Console(soft_wrap=True)  # summary lines stay whole in logs and pipes
    if not args.quiet:
        console.print(plan_table(result.plan, result.sim, f"{model.name} on {_short(args.inventory)}",
                                 optimizer), soft_wrap=False)
    console.print(summary_lines(result.plan, result.sim, "tuned   "), highlight=False)
    if unused_line(result.plan, inventory):
        console.print(unused_line(result.plan, inventory), highlight=False)
    if not args.quiet:
        console.print(headroom_line(options.memory_headroom), highlight=False)
    for line in host_memory_lines(result.sim):
        console.print(f"[bold red]warning[/]: {line}", highlight=False)
    for line in vendor_lines(crossings, result.sim):
        console.print(line, highlight=False)
    for line in sources.summary_lines(used_types):
        console.print(f"figures: {line}", highlight=False, soft_wrap=True)
    if result.baseline_sim is not None:
        console.print(summary_lines(result.baseline_plan, result.baseline_sim, "baseline"),
                      highlight=False)
        speedup = result.baseline_sim.step_time_s / result.sim.step_time_s
        versus = f"speedup over baseline {speedup:.2f}x"
    else:
        versus = "no baseline to compare with"
        console.print("baseline: plain Megatron has no plan that fits", highlight=False)
    eff = result.upper_bound_step_time_s / result.sim.step_time_s
    console.print(f"upper bound {result.upper_bound_step_time_s:.3f} s; efficiency {eff:.3f}; "
                  f"{versus}; searched in {result.search_time_s:.2f} s"
                  + (" (the baseline plan itself was best)" if result.fell_back_to_baseline else ""),
                  highlight=False)
    console.print(f"wrote {args.output}" + (f", {args.report}" if args.report else "")
                  + (f", {args.timeline}" if args.timeline else ""), highlight=False)
    return 0


def simulate_main(args: argparse.Namespace) -> int:
    memory_headroom(args)
    _check_timeline(args.timeline)
    with _outputs("simulate", args, inputs={"PLAN": args.plan, "--inventory": args.inventory},
                  outputs={"--json": args.json, "--timeline": args.timeline}) as out:
        return _simulate(args, out)


def _simulate(args: argparse.Namespace, out: Outputs) -> int:
    from rich.console import Console

    from ..cost import CostModel
    from ..cost.crossings import vendor_crossings
    from ..sim.step import simulate
    from .report import (host_memory_lines, optimizer_seconds, plan_table, stage_dicts,
                         summary_lines, unused_line, vendor_lines)

    inventory = load_inventory(args.inventory)
    plan = load_any_plan(args.plan, catalog=inventory.catalog)
    check_against_inventory(plan, inventory, source=args.plan)
    if not plan.one_grid:
        return _simulate_mesh_main(args, plan, inventory, out)
    profiles = _profiles(args.profile, inventory)
    cost = CostModel(plan.model, inventory, profiles=profiles,
                     precision=plan.precision, use_distributed_optimizer=plan.use_distributed_optimizer,
                     memory_headroom=memory_headroom(args))
    sim = simulate(plan, cost, record_events=bool(args.timeline))
    _check_fits(args, plan, sim)
    optimizer = optimizer_seconds(plan, sim, cost)
    console = Console(soft_wrap=True)
    if not args.quiet:
        console.print(plan_table(plan, sim, f"{_short(args.plan)} on {_short(args.inventory)}",
                                 optimizer), soft_wrap=False)
    console.print(summary_lines(plan, sim, "predicted"), highlight=False)
    if unused_line(plan, inventory):
        console.print(unused_line(plan, inventory), highlight=False)
    console.print(headroom_line(cost.memory_headroom), highlight=False)
    for line in _figure_sources(plan, inventory, profiles).summary_lines(sorted(plan.device_counts())):
        console.print(f"figures: {line}", highlight=False, soft_wrap=True)
    for s in [] if args.quiet else sim.stages:
        console.print(f"  pipeline {s.pipeline} stage {s.stage} ({s.device_type}): busy "
                      f"{s.busy_s:.3f} s, bubble {s.bubble_s:.3f} s, sync {s.sync_s:.3f} s "
                      f"(optimizer {optimizer[(s.pipeline, s.stage)]:.3f} s), "
                      f"idle {s.idle_s:.3f} s, memory {s.memory.total / 1e9:.1f}/"
                      f"{s.memory.capacity / 1e9:.1f} GB", highlight=False)
    over = [s for s in sim.stages if not s.memory.fits]
    if over:
        s = over[0]
        console.print(f"[bold red]warning[/]: {len(over)} stage(s) exceed device memory, e.g. "
                      f"pipeline {s.pipeline} stage {s.stage} ({s.device_type}) needs "
                      f"{s.memory.total / 1e9:.1f} GB of {s.memory.capacity / 1e9:.1f} GB")
    for line in host_memory_lines(sim):
        console.print(f"[bold red]warning[/]: {line}", highlight=False)
    for line in vendor_lines(vendor_crossings(plan, cost), sim):
        console.print(line, highlight=False)
    if args.json:
        with open(out.staged(args.json), "w") as f:
            json.dump({**sim.to_dict(), "stages": stage_dicts(sim, optimizer)}, f, indent=2)
    if args.timeline:
        sim.timeline_png(out.staged(args.timeline))
    written = [p for p in (args.json, args.timeline) if p]
    if written:
        console.print(f"wrote {', '.join(written)}", highlight=False)
    return 0


def _check_fits(args: argparse.Namespace, plan, sim) -> None:
    """A plan that does not fit memory is an error, unless ``--warn-only``."""
    if not args.warn_only:
        from ..sim.fits import check_fits
        check_fits(plan, sim, source=args.plan,
                   skip_hint=f"{usable_memory_text(memory_headroom(args))}; --warn-only "
                             "simulates it anyway, with a warning")


def _simulate_mesh_main(args: argparse.Namespace, plan: Plan, inventory, out: Outputs) -> int:
    """``simulate`` of a chain of meshes (checked against the inventory): its meshes, the
    predicted step and every stage."""
    from ..cost import CostModel
    from ..sim.step import check_recordable, recorded_ops, simulate

    if args.timeline:
        check_recordable(recorded_ops(plan))
    profiles = _profiles(args.profile, inventory)
    cost = CostModel(plan.model, inventory, profiles=profiles, precision=plan.precision,
                     use_distributed_optimizer=plan.use_distributed_optimizer,
                     memory_headroom=memory_headroom(args))
    sim = simulate(plan, cost, record_events=bool(args.timeline))
    _check_fits(args, plan, sim)
    print(f"{_short(args.plan)} on {_short(args.inventory)}"
          + ("" if args.quiet else f"\n{plan.describe()}"))
    print(f"predicted: step {sim.step_time_s:.3f} s, {sim.tokens_per_s:,.0f} tokens/s, "
          f"MFU {sim.mfu:.3f}; fits memory: {'yes' if sim.fits_memory else 'NO'}")
    print(headroom_line(cost.memory_headroom))
    for s in [] if args.quiet else sim.stages:
        print(f"  replica {s.pipeline} stage {s.stage} ({s.device_type}): busy {s.busy_s:.3f} s, "
              f"bubble {s.bubble_s:.3f} s, sync {s.sync_s:.3f} s, idle {s.idle_s:.3f} s, memory "
              f"{s.memory.total / 1e9:.1f}/{s.memory.capacity / 1e9:.1f} GB")
    if args.json:
        with open(out.staged(args.json), "w") as f:
            json.dump(sim.to_dict(), f, indent=2)
    if args.timeline:
        sim.timeline_png(out.staged(args.timeline))
    written = [p for p in (args.json, args.timeline) if p]
    if written:
        print(f"wrote {', '.join(written)}")
    return 0


def _tune_mesh_wins(args: argparse.Namespace, result, inventory, profiles, out: Outputs) -> int:
    """``tune`` where the best mesh plan beats every uniform-TP plan: write it, and print it
    beside the uniform plan it beat."""
    from ..cost import CostModel
    from ..plan.megatron_args import megatron_args_line
    from ..plan import save_any_plan
    from ..sim.step import simulate
    from .report import report_dict, summary_lines, unused_gpus, unused_line

    plan, sim = result.best
    save_any_plan(plan, out.staged(args.output))
    if args.report:
        report = report_dict(result, None)  # the uniform plan's figures, and the mesh plan's
        report["unused_gpus"] = unused_gpus(plan, inventory)
        report["mesh_plan"] = {"predicted_step_time_s": sim.step_time_s, "mfu": sim.mfu,
                               "efficiency": result.upper_bound_step_time_s / sim.step_time_s,
                               "speedup_over_uniform": result.sim.step_time_s / sim.step_time_s,
                               "megatron_args": megatron_args_line(plan, args.output),
                               "stages": [s.to_dict() for s in sim.stages]}
        with open(out.staged(args.report), "w") as f:
            json.dump(report, f, indent=2)
    if args.timeline:
        cost = CostModel(plan.model, inventory, profiles=profiles, precision=plan.precision,
                         memory_headroom=memory_headroom(args))
        simulate(plan, cost).timeline_png(out.staged(args.timeline))
    kind = "mesh plan"
    if plan.interleaved_chain:
        kind += (f" interleaved across the meshes, {plan.virtual_pipeline_size} model chunks a "
                 f"stage" + (f", micro-batch groups of {plan.microbatch_group_size}"
                             if plan.microbatch_group_size else ""))
    print(f"tuned   : {kind}, step {sim.step_time_s:.3f} s, {sim.tokens_per_s:,.0f} tokens/s, "
          f"MFU {sim.mfu:.3f}\n{plan.describe()}")
    if unused_line(plan, inventory):
        print(unused_line(plan, inventory))
    print(summary_lines(result.plan, result.sim, "uniform "))
    eff = result.upper_bound_step_time_s / sim.step_time_s
    print(f"upper bound {result.upper_bound_step_time_s:.3f} s; efficiency {eff:.3f}; speedup "
          f"over the uniform-TP plan {result.sim.step_time_s / sim.step_time_s:.3f}x; searched "
          f"in {result.search_time_s:.2f} s")
    print(f"wrote {args.output}" + (f", {args.report}" if args.report else "")
          + (f", {args.timeline}" if args.timeline else ""))
    print(megatron_args_line(plan, args.output))
    runs = "mesh plans, with model chunks or without, run on megatron-core 0.17"
    print(f"note: {runs} or later (docs/meshes.md); without --meshes tune gives the best "
          f"uniform-TP plan ({result.sim.step_time_s:.3f} s)")
    return 0
