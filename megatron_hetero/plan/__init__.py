"""The plan: the one contract between the tuner, the runtime, the launch scripts and the user.

- :mod:`.format1`: ``format_version: 1``, one tensor-parallel size and one pipeline per replica;
- :mod:`.format2`: ``format_version: 2``, meshes with their own tensor- and data-parallel sizes;
- :mod:`.policy`: a stage's recompute and offload;
- :mod:`.checks`: what megatron-core would refuse, checked from the plan alone;
- :mod:`.megatron_args`: the Megatron-LM arguments a plan implies.

Checks against an inventory live in :mod:`megatron_hetero.placement` (they place the plan's
ranks on the pool's nodes). Nothing here imports torch.
"""

from .format1 import (FORMAT_VERSION, ModelSpec, Offload, Pipeline, Plan, Recompute, Slot, Stage,
                      chunk_recompute, group_fits, load_plan, plan_from_data, save_plan)
from .format2 import (MESH_FORMAT_VERSION, Mesh, MeshPlan, MeshSlot, MeshStage, Replica,
                      any_plan_from_data, load_any_plan, meshes_of, mesh_plan_from_data,
                      save_any_plan)

__all__ = ["FORMAT_VERSION", "ModelSpec", "Offload", "Pipeline", "Plan", "Recompute", "Slot",
           "Stage", "chunk_recompute", "group_fits", "load_plan", "plan_from_data", "save_plan",
           "MESH_FORMAT_VERSION", "Mesh", "MeshPlan", "MeshSlot", "MeshStage", "Replica",
           "any_plan_from_data", "load_any_plan", "meshes_of", "mesh_plan_from_data",
           "save_any_plan"]
