"""What a launcher needs from a plan: Slurm heterogeneous-job components and host-file checks.

The Slurm batch script (``scripts/slurm/``) asks for nodes per GPU type with one heterogeneous
job component per device type of the plan. Each component selects its nodes by partition
and/or ``--constraint`` feature, taken from ``--partition TYPE=NAME`` / ``--constraint
TYPE=FEATURE`` or else from the inventory group's ``partition`` / ``constraint`` fields.
Components come in the order of the plan's ranks (the type of rank 0 first), so that Slurm's
task numbering of a heterogeneous step already follows the plan where it can; the runtime
places ranks on slots by their detected device type in any case. Mesh plans (format 2) are
taken too (their GPUs per type, the meshes' types in rank order), though the runtime does not
run them yet.

Run as ``python -m megatron_hetero.launch.jobspec PLAN [...] --print sbatch-args`` (one argument a
line, components separated by ``:``), ``--print device-types`` (comma-separated, one per
component) or ``--hostfile FILE --print hosts`` (checks a torchrun host file against the plan
and prints the hosts it uses: a host file may offer more GPUs than the plan needs, and the
first hosts of each type in file order are taken, :func:`check_hosts`).
No torch import: this runs on login nodes.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from ..errors import HeteroError, SchemaError
from ..hardware.catalog import Catalog, load_catalog
from ..hardware.inventory import Inventory, load_inventory
from ..plan import Plan, load_any_plan

__all__ = ["SlurmComponent", "HostEntry", "slurm_components", "sbatch_args", "parse_mapping",
           "read_hostfile", "check_hosts", "left_out", "main"]


@dataclass(kw_only=True, slots=True)
class SlurmComponent:
    """One heterogeneous job component: the nodes of one GPU type."""

    device_type: str
    """Canonical catalog name of the GPUs of these nodes."""
    num_gpus: int
    """GPUs (= tasks, one per GPU) the plan needs of this type."""
    gpus_per_node: int
    partition: str | None = None
    """Slurm partition holding nodes of this type."""
    constraint: str | None = None
    """Slurm node feature (``--constraint``) selecting nodes of this type."""

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"{self.device_type}: num_gpus and gpus_per_node must be positive")

    @property
    def nodes(self) -> int:
        return math.ceil(self.num_gpus / self.gpus_per_node)

    def sbatch_args(self, *, gres: bool = True) -> list[str]:
        per_node = min(self.gpus_per_node, self.num_gpus)
        args = [f"--nodes={self.nodes}", f"--ntasks={self.num_gpus}", f"--ntasks-per-node={per_node}"]
        if self.partition:
            args.append(f"--partition={self.partition}")
        if self.constraint:
            args.append(f"--constraint={self.constraint}")
        if gres:
            args.append(f"--gpus-per-node={per_node}")
        return args


@dataclass(frozen=True, slots=True)
class HostEntry:
    """One line of a torchrun host file: ``HOST GPU_TYPE [NUM_GPUS]``."""

    host: str
    device_type: str
    num_gpus: int


def parse_mapping(items: Sequence[str], catalog: Catalog, *, option: str) -> dict[str, str]:
    """``["A100=a100", ...]`` -> ``{canonical type: value}``; GPU names go through the aliases."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise HeteroError(f"{option} {item!r}: expected GPU_TYPE=NAME, e.g. A100-SXM-80GB=a100")
        canonical = catalog.resolve(key)
        if canonical is None:
            catalog.get(key, source=option)  # raises the catalog's message (known names)
        out[canonical] = value
    return out


def slurm_components(plan: Plan, inventory: Inventory | None = None, *,
                     gpus_per_node: int | None = None,
                     partitions: Mapping[str, str] | None = None,
                     constraints: Mapping[str, str] | None = None,
                     source: str = "<plan>") -> list[SlurmComponent]:
    """One component per device type of ``plan``, in the order of the plan's ranks.

    GPUs per node come from ``gpus_per_node`` or else the inventory's group of that type.
    With more than one type, every type needs a partition or a constraint to select its nodes.
    """
    partitions = dict(partitions or {})
    constraints = dict(constraints or {})
    counts = plan.device_counts()
    types = plan.device_types_in_rank_order()
    components = []
    for gpu in types:
        group = None
        if inventory is not None:
            group = next((g for g in inventory.groups if g.gpu == gpu), None)
            if group is None:
                where = "pipelines" if plan.one_grid else "meshes"
                raise SchemaError(source, where, f"device type {gpu}",
                                  f"a type that {inventory.source} has ("
                                  + ", ".join(sorted({g.gpu for g in inventory.groups})) + ")")
        gpn = gpus_per_node or (group.gpus_per_node if group else None)
        if gpn is None:
            raise HeteroError(f"GPUs per node of {gpu} unknown: pass --gpus-per-node N or "
                              "--inventory INV (its group of that type gives gpus_per_node)")
        components.append(SlurmComponent(
            device_type=gpu, num_gpus=counts[gpu], gpus_per_node=gpn,
            partition=partitions.get(gpu) or (group.partition if group else None),
            constraint=constraints.get(gpu) or (group.constraint if group else None)))
    if len(components) > 1:
        unselected = [c.device_type for c in components if not (c.partition or c.constraint)]
        if unselected:
            raise HeteroError(
                f"{source}: the plan mixes {len(components)} GPU types, but nothing selects the "
                f"nodes of {', '.join(unselected)}: pass --partition TYPE=PARTITION or "
                "--constraint TYPE=FEATURE for each type, or set partition/constraint on its "
                "inventory group")
    for key, mapping in (("--partition", partitions), ("--constraint", constraints)):
        extra = sorted(set(mapping) - set(types))
        if extra:
            raise HeteroError(f"{key} names {', '.join(extra)}, which {source} does not use "
                              f"(it uses {', '.join(types)})")
    return components


def sbatch_args(components: Sequence[SlurmComponent], *, gres: bool = True,
                common: Sequence[str] = ()) -> list[str]:
    """sbatch's heterogeneous-job arguments: components separated by ``":"``; ``common`` options
    (``--time``, ``--account`` ...) are repeated in every component."""
    out: list[str] = []
    for i, comp in enumerate(components):
        if i:
            out.append(":")
        out += list(common) + comp.sbatch_args(gres=gres)
    return out


def read_hostfile(path: str | Path, catalog: Catalog, *, default_gpus: int | None = None
                  ) -> list[HostEntry]:
    """Read ``HOST GPU_TYPE [NUM_GPUS]`` lines (``#`` comments and blank lines ignored)."""
    entries = []
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise HeteroError(f"{path}: {exc.strerror}; expected a readable hostfile") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeteroError(f"{path}: byte {exc.start}: found the byte 0x{data[exc.start]:02x}, "
                          "which is not UTF-8; expected a UTF-8 text file") from None
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        where = f"{path}:{lineno}"
        if len(fields) not in (2, 3):
            raise HeteroError(f"{where}: expected 'HOST GPU_TYPE [NUM_GPUS]', found {raw.strip()!r}")
        host, gpu = fields[0], fields[1]
        if host in first_line:  # torchrun would start two node agents on one host
            raise HeteroError(f"{where}: found the host {host!r} a second time (first on line "
                              f"{first_line[host]}); expected each host once, with all its GPUs")
        first_line[host] = lineno
        canonical = catalog.resolve(gpu)
        if canonical is None:
            catalog.get(gpu, source=where)
        if len(fields) == 3:
            if not (fields[2].isascii() and fields[2].isdigit()) or int(fields[2]) < 1:
                raise HeteroError(f"{where}: NUM_GPUS {fields[2]!r}: expected a positive integer")
            num = int(fields[2])
        elif default_gpus is not None:
            num = default_gpus
        else:
            raise HeteroError(f"{where}: no NUM_GPUS on this line and no default "
                              "(set MH_GPUS_PER_NODE)")
        entries.append(HostEntry(host=host, device_type=canonical, num_gpus=num))
    if not entries:
        raise HeteroError(f"{path}: no hosts (expected lines 'HOST GPU_TYPE [NUM_GPUS]')")
    return entries


def check_hosts(plan: Plan, entries: Sequence[HostEntry], *, source: str = "<plan>",
                hostfile: str = "<hostfile>") -> list[HostEntry]:
    """The hosts the plan runs on: of each GPU type, the first hosts in file order until the
    plan's GPUs of that type are reached (the last one taken may give fewer GPUs than it has).
    The hosts left out stay idle. Raise :class:`HeteroError` where the hosts offer too few GPUs
    of a type, or a host taken would split a tensor-parallel group."""
    have: Counter[str] = Counter()
    for e in entries:
        have[e.device_type] += e.num_gpus
    need = plan.device_counts()
    if any(have[g] < n for g, n in need.items()):
        def show(c: Counter[str]) -> str:
            return ", ".join(f"{n}x {g}" for g, n in sorted(c.items()) if n) or "nothing"
        short = ", ".join(f"{need[g] - have[g]} more {g}" for g in sorted(need)
                          if have[g] < need[g])
        raise HeteroError(f"{hostfile} offers {show(have)}; {source} needs {show(need)} "
                          f"(world size {plan.world_size}): {short}")
    taken: Counter[str] = Counter()
    picked = []
    for e in entries:
        use = min(e.num_gpus, need.get(e.device_type, 0) - taken[e.device_type])
        if use > 0:
            taken[e.device_type] += use
            picked.append(HostEntry(host=e.host, device_type=e.device_type, num_gpus=use))
    tp = _tp_sizes(plan)
    for e in picked:
        unit = math.lcm(*tp.get(e.device_type, {1}))
        if e.num_gpus % unit:
            raise HeteroError(f"{hostfile}: host {e.host}: found {e.num_gpus} {e.device_type} "
                              f"GPUs; expected a multiple of {unit}, the tensor-parallel size of "
                              f"{source}'s groups on {e.device_type} (a group must sit in one "
                              "node; its NVLink is what TP is priced on)")
    return picked


def left_out(entries: Sequence[HostEntry], picked: Sequence[HostEntry]) -> list[str]:
    """What the plan leaves idle of a host file: hosts not taken, and hosts taken in part."""
    used = {e.host: e.num_gpus for e in picked}
    out = []
    for e in entries:
        if e.host not in used:
            out.append(f"{e.host} ({e.num_gpus} {e.device_type})")
        elif used[e.host] < e.num_gpus:
            out.append(f"{e.num_gpus - used[e.host]} of {e.host}'s {e.num_gpus} {e.device_type}")
    return out


def _tp_sizes(plan: Plan) -> dict[str, set[int]]:
    """The tensor-parallel sizes of the plan's groups on each device type."""
    out: dict[str, set[int]] = {}
    for mesh in plan.meshes:
        for pipe in mesh.pipelines:
            for stage in pipe.stages:
                out.setdefault(stage.device_type, set()).add(mesh.tensor_model_parallel_size)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_hetero.launch.jobspec",
                                description="Print what a Slurm or torchrun launch of PLAN needs.")
    p.add_argument("plan", metavar="PLAN")
    p.add_argument("--inventory", metavar="INV", help="inventory.yaml (GPUs per node, partitions)")
    p.add_argument("--partition", action="append", default=[], metavar="TYPE=NAME",
                   help="Slurm partition of the nodes of GPU TYPE (repeatable)")
    p.add_argument("--constraint", action="append", default=[], metavar="TYPE=FEATURE",
                   help="Slurm --constraint feature of the nodes of GPU TYPE (repeatable)")
    p.add_argument("--gpus-per-node", type=int, metavar="N", help="GPUs per node, all types")
    p.add_argument("--no-gres", action="store_true",
                   help="do not ask for --gpus-per-node (clusters without GPU GRES; CPU tests)")
    p.add_argument("--common", action="append", default=[], metavar="ARG",
                   help="sbatch argument repeated in every component, e.g. --common=--time=1:00:00")
    p.add_argument("--hostfile", metavar="FILE", help="torchrun host file to check (--print hosts)")
    p.add_argument("--print", dest="what", default="sbatch-args",
                   choices=["sbatch-args", "device-types", "world-size", "hosts"])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        inventory = load_inventory(args.inventory) if args.inventory else None
        plan = load_any_plan(args.plan,
                             catalog=inventory.catalog if inventory else load_catalog())
        catalog = plan.catalog  # with the plan's own gpus entries
        if args.what == "world-size":
            print(plan.world_size)
            return 0
        if args.what == "hosts":
            if not args.hostfile:
                raise HeteroError("--print hosts needs --hostfile FILE")
            entries = read_hostfile(args.hostfile, catalog, default_gpus=args.gpus_per_node)
            picked = check_hosts(plan, entries, source=args.plan, hostfile=args.hostfile)
            idle = left_out(entries, picked)
            if idle:
                print(f"{args.hostfile}: {args.plan} runs on {len(picked)} of its "
                      f"{len(entries)} hosts ({', '.join(e.host for e in picked)}); left idle: "
                      + ", ".join(idle), file=sys.stderr)
            for e in picked:
                print(e.host, e.device_type, e.num_gpus)
            return 0
        comps = slurm_components(
            plan, inventory, gpus_per_node=args.gpus_per_node,
            partitions=parse_mapping(args.partition, catalog, option="--partition"),
            constraints=parse_mapping(args.constraint, catalog, option="--constraint"),
            source=args.plan)
        if args.what == "device-types":
            print(",".join(c.device_type for c in comps))
        else:
            print("\n".join(sbatch_args(comps, gres=not args.no_gres, common=args.common)))
        return 0
    except (HeteroError, OSError) as exc:
        print(f"megatron-hetero jobspec: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
