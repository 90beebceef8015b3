"""Node loss on Slurm: which nodes of a job were lost, the pool without them, and the sbatch
arguments that resubmit the run under plan B without them.

The batch script (``scripts/slurm/megatron_hetero.sbatch`` with ``MH_ON_NODE_LOSS=replan``)
runs this after a failed job step, then ``megatron-hetero replan`` on what it wrote, then
``sbatch`` with what it prints. Subcommands (``python -m megatron_hetero.launch.node_loss ...``):

- ``checkpoint -- ARGS``: the checkpoint folder of the run (``$MH_CHECKPOINT``, else the
  ``--save`` of the Megatron arguments ARGS);
- ``restart-args -- ARGS``: ARGS with ``--load`` added where they have none (Megatron resumes
  from the last complete save in it);
- ``lost --plan PLAN --inventory INV --checkpoint DIR -o NEW_INV``: the job's nodes that Slurm
  now reports drained, down, failing or not responding (printed comma-separated), and the pool
  of INV without them (written to NEW_INV); refuses when no node of the job is lost (the step
  failed for another reason: re-planning would not help), when the checkpoint folder holds no
  complete save yet, and when no node is left;
- ``resubmit --plan PLAN_B --inventory NEW_INV --exclude NODES [jobspec options]``: the sbatch
  arguments of the restarted job, one a line (``--print device-types``: its components' types).

No torch import: this runs in the batch step.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Mapping, Sequence

from .._schema import to_data, write_yaml
from .checkpoint import TRACKER
from ..errors import HeteroError
from ..hardware.inventory import Inventory, inventory_from_data, load_inventory
from .jobspec import parse_mapping, sbatch_args, slurm_components
from ..plan import load_plan

__all__ = ["LOST_STATES", "is_lost", "checkpoint_folder", "restart_args", "job_nodes",
           "node_states", "remaining_inventory", "main"]

LOST_STATES = ("down", "drain", "fail", "maint", "reboot", "power", "unknown", "no_respond",
               "not_responding", "future")
"""Words of a Slurm node state (``sinfo %T``, ``scontrol`` State=) that take the node out of
the pool: ``draining``, ``drained``, ``down``, ``failing``, ``maint``, ``reboot_requested``..."""


def is_lost(state: str) -> bool:
    """Whether a node in Slurm ``state`` (``idle``, ``mixed+drain``, ``down*``...) is lost.
    A trailing ``*`` means that the node does not respond."""
    state = state.lower()
    return state.endswith("*") or any(word in state for word in LOST_STATES)


def _option_value(args: Sequence[str], option: str) -> str | None:
    """The last value of ``option`` in Megatron arguments (``--opt V`` or ``--opt=V``)."""
    value = None
    for i, arg in enumerate(args):
        if arg == option and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(option + "="):
            value = arg.split("=", 1)[1]
    return value


def checkpoint_folder(args: Sequence[str], *, override: str | None = None) -> Path:
    """The run's checkpoint folder: ``override`` ($MH_CHECKPOINT), else the Megatron ``--save``."""
    folder = override or _option_value(args, "--save")
    if not folder:
        raise HeteroError("MH_ON_NODE_LOSS=replan needs the run's checkpoint folder: pass "
                          "--save DIR (and --save-interval N) among the Megatron arguments, or "
                          "export MH_CHECKPOINT=DIR")
    return Path(folder)


def restart_args(args: Sequence[str], folder: Path) -> list[str]:
    """``args`` with ``--load folder`` added where no ``--load`` is given."""
    out = list(args)
    if _option_value(out, "--load") is None:
        out += ["--load", str(folder)]
    return out


def _run(cmd: list[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HeteroError(f"{' '.join(cmd)}: {exc}") from None
    if proc.returncode:
        raise HeteroError(f"{' '.join(cmd)} failed: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def job_nodes(env: Mapping[str, str], *, expand: Callable[[str], list[str]]) -> list[list[str]]:
    """The node names of each component of this job (one list for a job of one component), from
    Slurm's environment; ``expand`` turns a node list (``mh-[1-3]``) into names."""
    components = int(env.get("SLURM_HET_SIZE", "1") or "1")
    keys = ([f"SLURM_JOB_NODELIST_HET_GROUP_{i}" for i in range(components)] if components > 1
            else ["SLURM_JOB_NODELIST"])
    missing = [k for k in keys if not env.get(k)]
    if missing:
        raise HeteroError(f"{', '.join(missing)} unset: not inside a Slurm job's batch step")
    return [expand(env[k]) for k in keys]


def _expand(nodelist: str) -> list[str]:
    return _run(["scontrol", "show", "hostnames", nodelist]).split()


def node_states(nodes: Sequence[str]) -> dict[str, str]:
    """Slurm's state of each node (``sinfo -N``; a node in two partitions is listed twice)."""
    out = _run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T"])
    states = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 2:
            states[fields[0]] = fields[1]
    return states


def remaining_inventory(inventory: Inventory, lost: Mapping[str, Sequence[str]]) -> dict:
    """The inventory's data without the ``lost`` nodes (device type -> node names). A group that
    names its ``hosts`` loses those hosts; else it loses as many nodes. A group with no node
    left is dropped; no group left is refused."""
    data = to_data(inventory)
    pending = {gpu: list(names) for gpu, names in lost.items()}
    groups = []
    for group in data["groups"]:
        names = pending.get(group["gpu"], [])
        if group.get("hosts"):
            taken = [h for h in group["hosts"] if h in names]
            group["hosts"] = [h for h in group["hosts"] if h not in names]
        else:
            taken = names[:group["nodes"]]
        pending[group["gpu"]] = [n for n in names if n not in taken]
        group["nodes"] -= len(taken)
        if group["nodes"] > 0:
            groups.append(group)
    if not groups:
        raise HeteroError(f"{inventory.source}: no nodes left once the lost nodes are taken out "
                          f"(the pool had {inventory.num_gpus} GPUs); the job stops: resume the "
                          "nodes or submit to a larger pool")
    data["groups"] = groups
    return data


def _lost(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    inventory = load_inventory(args.inventory)
    plan = load_plan(args.plan, catalog=inventory.catalog)
    # the job's components are the plan's GPU types in the order of its ranks (jobspec)
    types = list(dict.fromkeys(plan.device_type_of_rank(r) for r in range(plan.world_size)))
    per_component = job_nodes(env, expand=_expand)
    if len(per_component) != len(types):
        raise HeteroError(f"the job has {len(per_component)} component(s) but {args.plan} "
                          f"uses {len(types)} GPU type(s) ({', '.join(types)})")
    every = sorted({n for nodes in per_component for n in nodes})
    deadline = time.monotonic() + args.wait
    while True:  # Slurm marks a dead node only once it stops answering: wait a little for it
        states = node_states(every)
        lost_nodes = [n for n in every if is_lost(states.get(n, "unknown"))]
        if lost_nodes or time.monotonic() >= deadline:
            break
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
    shown = ", ".join(f"{n} {states.get(n, 'unknown')}" for n in every)
    if not lost_nodes:
        raise HeteroError(f"the job step failed (exit {args.step_exit}) but no node of the job is "
                          f"drained, down or not responding ({shown}; waited {args.wait:g} s): "
                          "not a node loss, so no re-plan; the job stops (see the step's output)")
    tracker = Path(args.checkpoint) / TRACKER
    if not tracker.is_file():
        raise HeteroError(f"lost {', '.join(lost_nodes)} but {args.checkpoint} holds no "
                          f"complete checkpoint yet (no {TRACKER}): nothing to resume from; the "
                          "job stops (save more often with --save-interval)")
    lost_by_type: dict[str, list[str]] = defaultdict(list)
    for gpu, nodes in zip(types, per_component):
        lost_by_type[gpu] += [n for n in nodes if n in lost_nodes]
    data = remaining_inventory(inventory, lost_by_type)
    inventory_from_data(data, source=args.output)  # the pool left still validates
    write_yaml(data, args.output)
    print(",".join(lost_nodes))
    gone = ", ".join(f"{n} ({states.get(n, 'unknown')})" for n in lost_nodes)
    print(f"megatron-hetero node-loss: lost {gone} of the job's nodes ({shown}); the pool left "
          f"is in {args.output}",
          file=sys.stderr)
    return 0


def _resubmit(args: argparse.Namespace) -> int:
    inventory = load_inventory(args.inventory)
    plan = load_plan(args.plan, catalog=inventory.catalog)
    used = set(plan.device_counts())
    partitions = parse_mapping(args.partition, plan.catalog, option="--partition")
    constraints = parse_mapping(args.constraint, plan.catalog, option="--constraint")
    comps = slurm_components(  # the first submission's selectors of GPU types plan B still uses
        plan, inventory, gpus_per_node=args.gpus_per_node,
        partitions={k: v for k, v in partitions.items() if k in used},
        constraints={k: v for k, v in constraints.items() if k in used}, source=args.plan)
    if args.what == "device-types":
        print(",".join(c.device_type for c in comps))
        return 0
    # --wait would hold this job until the next one ends
    common = [a for a in args.common if a not in ("--wait", "-W")]
    common += [f"--exclude={args.exclude}", *args.keep]
    print("\n".join(sbatch_args(comps, gres=not args.no_gres, common=common)))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_hetero.launch.node_loss",
                                description="Node loss on Slurm: lost nodes, the pool left, "
                                            "the resubmission's sbatch arguments.")
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("checkpoint", "restart-args"):
        s = sub.add_parser(name)
        s.add_argument("--checkpoint", metavar="DIR", help="the folder ($MH_CHECKPOINT)")
        s.add_argument("megatron", nargs=argparse.REMAINDER, metavar="-- ARGS")
    s = sub.add_parser("lost")
    s.add_argument("--plan", required=True)
    s.add_argument("--inventory", required=True)
    s.add_argument("--checkpoint", required=True, metavar="DIR")
    s.add_argument("-o", "--output", required=True, metavar="NEW_INV")
    s.add_argument("--step-exit", default="?", metavar="CODE", help="the failed step's exit")
    s.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="seconds to wait for Slurm to mark a node lost (default 0)")
    s = sub.add_parser("resubmit")
    s.add_argument("--plan", required=True)
    s.add_argument("--inventory", required=True)
    s.add_argument("--exclude", required=True, metavar="NODES")
    s.add_argument("--partition", action="append", default=[], metavar="TYPE=NAME")
    s.add_argument("--constraint", action="append", default=[], metavar="TYPE=FEATURE")
    s.add_argument("--gpus-per-node", type=int, metavar="N")
    s.add_argument("--no-gres", action="store_true")
    s.add_argument("--common", action="append", default=[], metavar="ARG")
    s.add_argument("--keep", action="append", default=[], metavar="ARG",
                   help="sbatch argument after --common's (output file, open mode, job name)")
    s.add_argument("--print", dest="what", default="sbatch-args",
                   choices=["sbatch-args", "device-types"])
    return p


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    args = _parser().parse_args(argv)
    try:
        if args.command in ("checkpoint", "restart-args"):
            megatron = args.megatron[1:] if args.megatron[:1] == ["--"] else args.megatron
            folder = checkpoint_folder(megatron, override=args.checkpoint or None)
            if args.command == "checkpoint":
                print(folder)
            else:
                print("\n".join(restart_args(megatron, folder)))
            return 0
        return _lost(args, env) if args.command == "lost" else _resubmit(args)
    except (HeteroError, OSError) as exc:
        print(f"megatron-hetero node-loss: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
