"""A plan against an inventory, one check for every plan shape: does the pool have the GPUs it
asks for, in whole tensor-parallel groups inside a node, with the figures the plan was tuned
with? And can the runtime carry a plan across vendors?"""

from __future__ import annotations

import dataclasses

from ..errors import Described, InfeasibleError, SchemaError
from ..hardware.catalog import Catalog, GPUSpec, load_catalog
from ..plan import Plan
from ..plan.checks import plan_stages
from .nodes import place

__all__ = ["check_against_inventory", "check_gpu_count", "check_plan_gpus", "embedded_gpus",
           "check_plan_vendors", "GLOO_DEVICES"]

_COMPARED = [f.name for f in dataclasses.fields(GPUSpec) if f.name not in ("name", "notes")]


def check_plan_gpus(plan: Plan, inventory, *, source: str = "<plan>") -> None:
    """Raise :class:`SchemaError` if an entry of the plan's ``gpus`` differs from the inventory's
    catalog entry of that name (the plan was tuned with other figures); ``notes`` may differ."""
    for name, ours in plan.gpus.items():
        canonical = inventory.catalog.resolve(name)
        if canonical is None:
            continue  # a type the inventory does not have: check_against_inventory says so
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


def check_gpu_count(gpu: str, need: int, inventory, *, source: str, path: str) -> None:
    """Raise :class:`SchemaError` at ``path`` if a plan needs more GPUs of type ``gpu`` than
    the inventory has."""
    have = inventory.gpu_counts()
    if need > have.get(gpu, 0):
        raise SchemaError(source, path, Described(f"{need} GPUs of type {gpu}"),
                          f"at most {have.get(gpu, 0)} (what {inventory.source} has; it has "
                          + ", ".join(f"{n}x {g}" for g, n in sorted(have.items())) + ")")


def check_against_inventory(plan: Plan, inventory, *, source: str = "<plan>") -> None:
    """Raise :class:`SchemaError` naming the field where ``plan`` (any shape) asks more of
    ``inventory`` than it has: a ``gpus`` entry that differs (:func:`check_plan_gpus`), more
    GPUs of a type, a mesh whose tensor-parallel group is wider than every node of a type it
    runs on (4-GPU and 8-GPU nodes differ), or groups that do not all fit whole inside nodes
    (every group placed: :func:`.nodes.place`, the placement the simulator and the runtime use).

    Field paths are the plan file's: ``pipelines`` and ``tensor_model_parallel_size`` for a plan
    of one grid (format 1), ``meshes`` and ``meshes[k].tensor_model_parallel_size`` for a chain.
    One grid has one TP size, so its whole groups per type are a count, checked type by type
    with the GPU count and the node width."""
    check_plan_gpus(plan, inventory, source=source)
    one = plan.one_grid
    field = "pipelines" if one else "meshes"
    for gpu, need in sorted(plan.device_counts().items()):
        check_gpu_count(gpu, need, inventory, source=source, path=field)
        if one:
            _check_width(plan, 0, gpu, inventory, source=source)
            tp = plan.meshes[0].tensor_model_parallel_size
            whole = tp * sum(g.nodes * (g.gpus_per_node // tp) for g in inventory.groups
                             if g.gpu == gpu)
            if need > whole:
                raise SchemaError(source, field, Described(f"{need} GPUs of type {gpu}"),
                                  f"at most {whole}: {inventory.source} holds that many in whole "
                                  f"tensor-parallel groups of {tp} inside a node")
    for k, mesh in enumerate(plan.meshes):
        for gpu in mesh.device_types:
            _check_width(plan, k, gpu, inventory, source=source)
    try:
        place(plan, inventory)
    except InfeasibleError as exc:
        raise SchemaError(source, field, Described("tensor-parallel groups that do not all "
                                                   "fit whole inside nodes"), str(exc)) from None


def _check_width(plan: Plan, mesh: int, gpu: str, inventory, *, source: str) -> None:
    """Raise :class:`SchemaError` if mesh ``mesh``'s tensor-parallel group is wider than every
    node of type ``gpu`` (a group stays inside a node)."""
    tp = plan.meshes[mesh].tensor_model_parallel_size
    widest = max(g.gpus_per_node for g in inventory.groups if g.gpu == gpu)
    if tp > widest:
        path = ("tensor_model_parallel_size" if plan.one_grid
                else f"meshes[{mesh}].tensor_model_parallel_size")
        raise SchemaError(source, path, tp,
                          f"at most {widest}, the GPUs per node of type {gpu} in "
                          f"{inventory.source} (a tensor-parallel group stays inside a node)")


GLOO_DEVICES = ("cuda",)
"""Accelerator device types whose tensors gloo's collectives take (it stages CUDA and ROCm
tensors through pinned host memory itself); an ``npu`` tensor it refuses."""


def check_plan_vendors(plan: Plan, catalog: Catalog, *, source: str = "<plan>") -> None:
    """Raise :class:`SchemaError` if the plan spans GPUs of several vendors in a way the
    runtime cannot carry (docs/vendors.md).

    NCCL, RCCL and HCCL cannot join one communicator, so on such a plan the runtime builds each
    process group on the backend its members share: the vendor's inside one vendor, gloo across
    vendors (the world group, pipeline groups, the embedding group), with pipeline messages
    staged through host buffers. What it refuses:

    * a data-parallel group across vendors (a stage whose replicas' GPUs are of two vendors):
      Megatron's DDP and distributed optimizer reduce-scatter and all-gather the gradient
      buffers on it every step; on gloo that is a full host round trip of every gradient, and
      the planner never picks it (put the vendor boundary on a pipeline edge);
    * a device type whose tensors gloo cannot take (Ascend ``npu``): Megatron's world-group
      collectives (loss, grad norm, timers) run on device tensors.

    A tensor-parallel group is one stage's ranks, of one device type: it never spans vendors;
    nor does any group of a mesh plan (each mesh is one device type), whose vendor boundaries
    are its bridges.
    """
    def vendor(device_type: str) -> str:
        return catalog.get(device_type, source=source).vendor

    if len({vendor(t) for t in plan.device_counts()}) < 2:
        return
    libraries = " and ".join(sorted({catalog.get(t).stack.library for t in plan.device_counts()}))
    if plan.one_grid:
        first_pipe = plan.pipelines[0]
        for d, pipe in enumerate(plan.pipelines):
            for s, stage in enumerate(pipe.stages):
                ours, theirs = vendor(stage.device_type), vendor(first_pipe.stages[s].device_type)
                if ours != theirs:
                    raise SchemaError(source, f"pipelines[{d}].stages[{s}].device_type",
                                      Described(f"{stage.device_type} ({ours}) beside "
                                                f"{first_pipe.stages[s].device_type} ({theirs})"),
                                      f"GPUs of one vendor in stage {s}'s data-parallel group: "
                                      f"{libraries} cannot join one communicator, and the "
                                      "runtime does not reduce gradients across vendors on gloo "
                                      "(every gradient through host memory each step: "
                                      "docs/vendors.md); put the vendor boundary on a pipeline "
                                      "edge (tune does)")
    for where, _, stage in plan_stages(plan):
        stack = catalog.get(stage.device_type).stack
        if stack.torch_device not in GLOO_DEVICES:
            raise SchemaError(source, f"{where}.device_type",
                              Described(f"{stage.device_type} ({stack.torch_device} "
                                        f"devices) in a plan across vendors"),
                              "GPUs whose tensors gloo takes (cuda: NVIDIA, AMD ROCm): "
                              "across vendors the world group is gloo, and Megatron runs "
                              "its loss, grad-norm and timer collectives on it with device "
                              f"tensors, which gloo refuses for {stack.torch_device} "
                              "(docs/vendors.md); tune on one vendor's GPUs")
