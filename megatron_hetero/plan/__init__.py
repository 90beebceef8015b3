"""The plan: the one contract between the tuner, the runtime, the launch scripts and the user.

- :mod:`.types`: the one in-memory plan, a chain of meshes (:class:`Plan`, :class:`Mesh`), and
  the questions about its shape;
- :mod:`.stages`: its parts (the model, a stage, a replica's pipeline, a replica's batch);
- :mod:`.format1`: ``format_version: 1`` files, one mesh;
- :mod:`.format2`: ``format_version: 2`` files, meshes with their own tensor- and data-parallel
  sizes;
- :mod:`.policy`: a stage's recompute and offload;
- :mod:`.checks`: what megatron-core would refuse, checked from the plan alone;
- :mod:`.megatron_args`: the Megatron-LM arguments a plan implies.

Checks against an inventory live in :mod:`megatron_hetero.placement` (they place the plan's
ranks on the pool's nodes). Nothing here imports torch.
"""

from ..schedule.rules import group_fits
from .format1 import (FORMAT_VERSION, Format1Plan, load_plan, plan_from_data, replace_grid,
                      save_plan, uniform_plan)
from .format2 import (MESH_FORMAT_VERSION, Format2Mesh, Format2Plan, MeshStage, any_plan_from_data,
                      load_any_plan, mesh_plan, mesh_plan_from_data, meshes_of, save_any_plan)
from .policy import Offload, Recompute, chunk_recompute
from .stages import ModelSpec, Pipeline, Replica, Stage
from .types import Mesh, Plan, PlanShapeError, Slot

__all__ = ["Plan", "Mesh", "Slot", "PlanShapeError", "ModelSpec", "Stage", "Pipeline", "Replica",
           "Offload", "Recompute", "chunk_recompute", "group_fits",
           "FORMAT_VERSION", "Format1Plan", "uniform_plan", "replace_grid", "load_plan", "plan_from_data",
           "save_plan", "MESH_FORMAT_VERSION", "Format2Mesh", "Format2Plan", "MeshStage",
           "mesh_plan", "any_plan_from_data", "load_any_plan", "mesh_plan_from_data",
           "meshes_of", "save_any_plan"]
