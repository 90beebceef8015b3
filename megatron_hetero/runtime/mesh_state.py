"""What the hooks decided for one rank of a mesh plan (:mod:`.mesh_run`, :mod:`.mesh_model`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan, Slot

__all__ = ["MeshRankState", "even_plan"]


@dataclass(kw_only=True, slots=True)
class MeshRankState:
    """What the hooks decided for one rank of a mesh plan."""

    plan: Plan
    """The plan (``--hetero-plan``)."""
    plan_path: str
    """Where it was read from (the start of every message about it)."""
    rank: int
    """This process's rank in the plan's numbering (its Megatron rank)."""
    launcher_rank: int
    """This process's rank in the launcher's numbering."""
    device_type: str
    """Its device type, a catalog name (``unknown: NAME`` where the catalog lacks it)."""
    slot: Slot
    """Its mesh, stage, replica and tensor rank in the plan."""
    grids: list | None = None
    """megatron-core's ``HyperCommGrid`` of every mesh (after ``initialize_model_parallel``)."""
    communicator: object = None
    """megatron-core's ``MultiModulePipelineCommunicator`` (after ``get_model``)."""
    config: object = None
    """The model's ``TransformerConfig`` (the communicator's config)."""
    args: object = None
    """Megatron's ``args`` of this rank."""
    server: object = None
    """The rendezvous store this process hosts, kept for the job's life (:class:`.placement.Placed`)."""

    @property
    def mesh(self):
        return self.plan.meshes[self.slot.mesh]

    @property
    def stage(self):
        """The plan stage this rank runs (its recompute and offload)."""
        return self.plan.stage_of_slot(self.slot)

    @property
    def last_mesh(self) -> bool:
        return self.slot.mesh == len(self.plan.meshes) - 1

    @property
    def first_stage(self) -> int:
        """The global pipeline index of this mesh's first stage."""
        return sum(len(m.stages) for m in self.plan.meshes[:self.slot.mesh])

    @property
    def global_stage(self) -> int:
        return self.first_stage + self.slot.stage

    def describe(self) -> str:
        m, r = self.mesh, self.mesh.replicas[self.slot.replica]
        return (f"megatron-hetero: launcher rank {self.launcher_rank} ({self.device_type}) -> "
                f"rank {self.rank}: mesh {self.slot.mesh} "
                f"(TP {m.tensor_model_parallel_size}, DP {m.data_parallel_size}, PP "
                f"{len(m.stages)}) stage {self.slot.stage} replica {self.slot.replica} tp "
                f"{self.slot.tensor_rank}; global stage {self.global_stage} of "
                f"{self.plan.pipeline_model_parallel_size}; "
                f"{self.stage.num_layers} layers; {r.num_microbatches} "
                f"micro-batches of {r.micro_batch_size}; recompute "
                f"{self.stage.recompute.granularity}; optimizer offload "
                f"{self.stage.offload.optimizer_fraction:g}"
                + ("; module inputs offloaded to host" if self.stage.offload.module_inputs
                   else ""))


def even_plan(plan: Plan) -> bool:
    """Every replica of every mesh alike (no per-token loss)."""
    return not plan.per_token_loss
