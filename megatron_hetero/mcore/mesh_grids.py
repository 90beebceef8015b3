"""megatron-core's grids and communicator of a mesh plan (:mod:`megatron_hetero.plan.format2`).

One ``HyperCommGrid`` per mesh, shape ``[T, 1, D, P]`` over ``["tp", "cp", "dp", "pp"]`` at
the mesh's ``rank_offset`` (the plan's rank numbering), with its groups created on every rank
(``create_pg`` is collective); and megatron-core's ``MultiModulePipelineCommunicator`` over
them, the meshes chained in plan order (``mesh0 -> mesh1 -> ...``), which builds a
``BridgeCommunicator`` per boundary. Activations are Megatron's ``[s, b, h]``, so the bridges
join and split on dimension 1 (``BridgeCommunicator`` defaults to dimension 0).

On the CPU backend (gloo) the bridges' broadcast groups (and from megatron-core 0.19 their
leader group) are made with the default backend: ``BridgeCommunicator`` asks for ``nccl`` by
name (:func:`gloo_bridges`, :mod:`.bridge_groups`).
"""

from __future__ import annotations

from ..plan import Plan
from ..plan.checks import host_bridges
from .bridge_groups import bridge_dist, chain_bridge_classes

__all__ = ["mesh_grids", "mesh_expert_grids", "mesh_communicator", "module_name", "DIM_MAPPING",
           "GRID_DIMS", "EXPERT_DIMS", "gloo_bridges"]

GRID_DIMS = ["tp", "cp", "dp", "pp"]
"""The grid's dimensions, fastest first: Megatron's ``tp-cp-dp-pp`` order inside a mesh."""
DIM_MAPPING = {"s": 0, "b": 1, "h": 2}
"""Megatron's hidden states are ``[s, b, h]``: the bridges join and split on ``b``."""
_GROUPS = ("tp", "cp", "dp", "pp", ["tp", "pp"], ["dp", "cp"], ["tp", "cp"])
EXPERT_DIMS = ["etp", "ep", "edp", "pp"]
"""An MoE model's expert grid, fastest first: megatron-core's expert order inside a mesh (the
stage's ``T x D`` ranks cut into blocks of ``ETP x EP``, the blocks its expert data parallelism,
:meth:`megatron_hetero.plan.Mesh.expert_blocks`)."""
_EXPERT_GROUPS = ("etp", "ep", "edp", ["etp", "ep"], ["etp", "ep", "pp"])


def module_name(mesh: int) -> str:
    """The multimodule communicator's name of mesh ``mesh``."""
    return f"mesh{mesh}"


def mesh_grids(plan: Plan, *, backend: str | None = None,
               backends: list[str | None] | None = None) -> list:
    """The grid of every mesh, each with its groups created (call on every rank), on
    ``backend``, or mesh ``k``'s on ``backends[k]`` (a plan across vendors on devices)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    grids = []
    for k, mesh in enumerate(plan.meshes):
        grid = HyperCommGrid([mesh.tensor_model_parallel_size, 1, mesh.data_parallel_size,
                              len(mesh.stages)], list(GRID_DIMS),
                             rank_offset=plan.rank_offset(k),
                             backend=backends[k] if backends is not None else backend)
        for dims in _GROUPS:
            grid.create_pg(dims)
        grids.append(grid)
    return grids


def mesh_expert_grids(plan: Plan, *, backend: str | None = None) -> list:
    """The expert grid of every mesh of an MoE model, shape ``[ETP, EP, EDP, P]`` over
    :data:`EXPERT_DIMS` on the mesh's ranks, each with its groups created (call on every rank,
    after :func:`mesh_grids`); ``None`` per mesh for a dense model."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    if not plan.model.is_moe:
        return [None] * len(plan.meshes)
    grids = []
    for k, mesh in enumerate(plan.meshes):
        grid = HyperCommGrid([mesh.expert_tensor_size, mesh.expert_model_parallel_size,
                              mesh.expert_data_parallel_size, len(mesh.stages)],
                             list(EXPERT_DIMS), rank_offset=plan.rank_offset(k), backend=backend)
        for dims in _EXPERT_GROUPS:
            grid.create_pg(dims)
        grids.append(grid)
    return grids


def mesh_communicator(plan: Plan, grids: list, config):
    """megatron-core's ``MultiModulePipelineCommunicator`` chaining the meshes' ``grids`` (call
    on every rank: each bridge is built collectively), a bridge between two collective
    libraries host-staged (:mod:`.bridge_groups`)."""
    from megatron.core.pipeline_parallel.multimodule_communicator import (
        MultiModulePipelineCommunicator,
    )

    from megatron.core.pipeline_parallel import multimodule_communicator as module

    n = len(grids)
    classes = {module_name(k): cls for k, cls in enumerate(
        chain_bridge_classes(host_bridges(plan)[:n - 1], wrap_around=False))}

    def bridge(*a, src_module_name, **kw):  # the class of the bridge out of that mesh
        return classes[src_module_name](*a, src_module_name=src_module_name, **kw)

    megatron_class, module.BridgeCommunicator = module.BridgeCommunicator, bridge
    try:  # megatron-core builds the bridges by that name, here only
        return MultiModulePipelineCommunicator(
            {module_name(k): g for k, g in enumerate(grids)},
            {module_name(k): [module_name(k + 1)] if k + 1 < n else [] for k in range(n)},
            config, dim_mapping=dict(DIM_MAPPING))
    finally:
        module.BridgeCommunicator = megatron_class


def gloo_bridges() -> None:
    """Let ``BridgeCommunicator`` build its broadcast groups (and from megatron-core 0.19 its
    leader group) on a gloo world (CPU ranks): :func:`~.bridge_groups.bridge_dist`."""
    bridge_dist(gloo=True)
