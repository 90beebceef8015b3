"""A chain of meshes against an inventory: the GPUs it asks for, each mesh's
tensor-parallel group inside one node of its type, and every group placed
(:func:`.cost.mesh.place_meshes`, the placement the simulator and the runtime use)."""

from __future__ import annotations

from .meshes import place_meshes
from ..errors import Described, InfeasibleError, SchemaError
from .inventory import check_gpu_count, check_plan_against_inventory, check_plan_gpus
from ..plan import Plan

__all__ = ["check_mesh_plan_against_inventory", "check_against_inventory"]


def check_against_inventory(plan: Plan, inventory, *, source: str = "<plan>") -> None:
    """The check of ``plan`` against ``inventory`` its shape takes
    (:attr:`megatron_hetero.plan.Plan.one_grid`): :func:`.inventory.check_plan_against_inventory`
    for one grid, :func:`check_mesh_plan_against_inventory` for a chain of meshes."""
    check = check_plan_against_inventory if plan.one_grid else check_mesh_plan_against_inventory
    check(plan, inventory, source=source)


def check_mesh_plan_against_inventory(plan: Plan, inventory, *, source: str = "<plan>") -> None:
    """Raise :class:`SchemaError` naming the field where ``plan`` asks more of ``inventory``
    than it has: a ``gpus`` entry that differs, more GPUs of a type, a mesh whose TP group is
    wider than every node of its type (4-GPU and 8-GPU nodes differ), or groups that do not
    all fit whole inside nodes."""
    check_plan_gpus(plan, inventory, source=source)
    for gpu, need in sorted(plan.device_counts().items()):
        check_gpu_count(gpu, need, inventory, source=source, path="meshes")
    for k, mesh in enumerate(plan.meshes):
        tp = mesh.tensor_model_parallel_size
        widest = max(g.gpus_per_node for g in inventory.groups if g.gpu == mesh.device_type)
        if tp > widest:
            raise SchemaError(source, f"meshes[{k}].tensor_model_parallel_size", tp,
                              f"at most {widest}, the GPUs per node of type {mesh.device_type} "
                              f"in {inventory.source} (a tensor-parallel group stays inside a "
                              "node)")
    try:
        place_meshes(plan, inventory)
    except InfeasibleError as exc:
        raise SchemaError(source, "meshes", Described("tensor-parallel groups that do not all "
                                                      "fit whole inside nodes"), str(exc)) from None
