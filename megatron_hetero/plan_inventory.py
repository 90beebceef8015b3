"""A plan against an inventory: does the pool have the GPUs it asks for, in whole
tensor-parallel groups inside a node, with the figures the plan was tuned with?"""

from __future__ import annotations

import dataclasses

from .errors import Described, SchemaError
from .hardware.catalog import Catalog, GPUSpec, load_catalog
from .plan import Plan

__all__ = ["check_plan_against_inventory", "check_plan_gpus", "embedded_gpus",
           "check_plan_vendors"]

_COMPARED = [f.name for f in dataclasses.fields(GPUSpec) if f.name not in ("name", "notes")]


def check_plan_gpus(plan: Plan, inventory, *, source: str = "<plan>") -> None:
    """Raise :class:`SchemaError` if an entry of the plan's ``gpus`` differs from the inventory's
    catalog entry of that name (the plan was tuned with other figures); ``notes`` may differ."""
    for name, ours in plan.gpus.items():
        canonical = inventory.catalog.resolve(name)
        if canonical is None:
            continue  # a type the inventory does not have: check_plan_against_inventory says so
        theirs = inventory.catalog.get(canonical)
        diff = [k for k in _COMPARED if getattr(ours, k) != getattr(theirs, k)]
        if diff:
            key = diff[0]
            raise SchemaError(source, f"gpus.{name}.{key}", getattr(ours, key),
                              f"{getattr(theirs, key)!r}, as in {inventory.source}'s catalog "
                              f"entry for {canonical} (the plan was tuned with other figures: "
                              f"tune again, or make the entries agree)")


def embedded_gpus(plan: Plan, catalog: Catalog) -> dict[str, GPUSpec]:
    """The entries of ``catalog`` (an inventory's) for the plan's device types that differ from
    the built-in catalog or that it lacks: what a tuned plan carries in ``gpus``."""
    builtin = load_catalog()
    out = {}
    for name in sorted(plan.device_counts()):
        spec = catalog.get(name)
        canonical = builtin.resolve(name)
        if canonical != name or builtin.get(name) != spec:
            out[name] = spec
    return out


def check_plan_against_inventory(plan: Plan, inventory, *, source: str = "<plan>") -> None:
    """Raise :class:`SchemaError` if the plan's ``gpus`` entries differ from the inventory's
    (:func:`check_plan_gpus`), if it needs more GPUs of a type than the inventory has, or a
    tensor-parallel group larger than a node of that type."""
    check_plan_gpus(plan, inventory, source=source)
    have = inventory.gpu_counts()
    for gpu, need in sorted(plan.device_counts().items()):
        if need > have.get(gpu, 0):
            raise SchemaError(source, "pipelines", Described(f"{need} GPUs of type {gpu}"),
                              f"at most {have.get(gpu, 0)} (what {inventory.source} has; it has "
                              + ", ".join(f"{n}x {g}" for g, n in sorted(have.items())) + ")")
        tp = plan.tensor_model_parallel_size
        widest = max(g.gpus_per_node for g in inventory.groups if g.gpu == gpu)
        if tp > widest:
            raise SchemaError(source, "tensor_model_parallel_size", tp,
                              f"at most {widest}, the GPUs per node of type {gpu} in "
                              f"{inventory.source} (a tensor-parallel group stays inside a node)")
        whole = tp * sum(g.nodes * (g.gpus_per_node // tp) for g in inventory.groups if g.gpu == gpu)
        if need > whole:
            raise SchemaError(source, "pipelines", Described(f"{need} GPUs of type {gpu}"),
                              f"at most {whole}: {inventory.source} holds that many in whole "
                              f"tensor-parallel groups of {tp} inside a node")


def check_plan_vendors(plan: Plan, catalog: Catalog, *, source: str = "<plan>") -> None:
    """Raise :class:`SchemaError` if the plan needs a process group on a device backend whose
    ranks are GPUs of two vendors (NCCL, RCCL and HCCL cannot join one communicator).

    A tensor-parallel group is one stage's ranks, of one device type, inside one node: it never
    spans vendors. The runtime builds every other group (the world group, each pipeline's, each
    stage's data-parallel group, the embedding group) on the device backend; host (gloo) groups
    across vendors are not built yet (docs/vendors.md), so a plan on two vendors' GPUs is
    refused, at the first stage whose vendor differs from the first stage's, naming the groups
    that would span vendors."""
    def vendor(device_type: str) -> str:
        return catalog.get(device_type, source=source).vendor

    first = vendor(plan.pipelines[0].stages[0].device_type)
    for d, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            other = vendor(stage.device_type)
            if other == first:
                continue
            groups = ["the world group"]
            if any(vendor(st.device_type) != other for st in pipe.stages):
                groups.append(f"pipelines[{d}]'s pipeline group")
            if any(vendor(p.stages[s].device_type) != other for p in plan.pipelines):
                groups.append(f"stage {s}'s data-parallel group")
            stacks = " and ".join(sorted({catalog.get(t).stack.library
                                          for t in plan.device_counts()}))
            raise SchemaError(source, f"pipelines[{d}].stages[{s}].device_type",
                              Described(f"{stage.device_type} ({other}) beside "
                                        f"{plan.pipelines[0].stages[0].device_type} ({first})"),
                              f"GPUs of one vendor: {', '.join(groups)} would span vendors on "
                              f"a device backend ({stacks} cannot join one communicator), and "
                              "the runtime builds no host (gloo) groups across vendors yet "
                              "(docs/vendors.md); tune on one vendor's GPUs")
