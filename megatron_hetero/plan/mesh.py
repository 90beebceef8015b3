"""A mesh of the one in-memory plan (:mod:`.types`): a run of consecutive pipeline stages that
share a tensor-parallel size and a data-parallel size, one :class:`.stages.Pipeline` per
replica, with its expert parallelism; and :class:`PlanShapeError`, what a view asked of a shape
that cannot answer raises."""

from __future__ import annotations

from dataclasses import dataclass

from .experts import expert_blocks
from .stages import Pipeline, Replica, Stage

__all__ = ["Mesh", "PlanShapeError"]


class PlanShapeError(AttributeError):
    """A view asked of a plan whose shape cannot answer it (an internal error)."""


@dataclass(kw_only=True, slots=True)
class Mesh:
    """A run of consecutive pipeline stages with one tensor- and one data-parallel size."""

    tensor_model_parallel_size: int
    """Tensor ranks per stage of this mesh."""
    pipelines: list[Pipeline]
    """The mesh's data-parallel replicas in data-parallel rank order (``D`` is their number),
    each with this mesh's stages of its path."""
    expert_model_parallel_size: int = 1
    """Ranks of a stage that split an MoE layer's routed experts (EP), carved out of the
    stage's ``T x D`` ranks (Megatron's expert grid: ``ETP x EP`` consecutive ranks, then
    expert data parallelism)."""
    expert_tensor_parallel_size: int | None = None
    """Tensor ranks of one expert (ETP; None: ``tensor_model_parallel_size``, Megatron's
    default)."""

    def __post_init__(self) -> None:
        if self.tensor_model_parallel_size < 1:
            raise ValueError(f"tensor_model_parallel_size {self.tensor_model_parallel_size} < 1")
        if self.expert_model_parallel_size < 1:
            raise ValueError(f"expert_model_parallel_size {self.expert_model_parallel_size} < 1")
        if not self.pipelines:
            raise ValueError("a mesh needs at least one pipeline")
        first = self.pipelines[0].stages
        for pipe in self.pipelines[1:]:
            if pipe.stages is not first and [s.num_layers for s in pipe.stages] != \
                    [s.num_layers for s in first]:
                raise ValueError("a mesh's pipelines need the same layers per stage")

    @property
    def data_parallel_size(self) -> int:
        return len(self.pipelines)

    @property
    def num_stages(self) -> int:
        return len(self.pipelines[0].stages)

    @property
    def world_size(self) -> int:
        return self.tensor_model_parallel_size * self.data_parallel_size * self.num_stages

    @property
    def layer_split(self) -> list[int]:
        return [s.num_layers for s in self.pipelines[0].stages]

    @property
    def expert_tensor_size(self) -> int:
        """ETP in effect (``expert_tensor_parallel_size``, or the mesh's TP)."""
        etp = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if etp is None else etp

    @property
    def expert_data_parallel_size(self) -> int:
        """Replicas of each expert shard per stage: ``T D / (ETP EP)`` (whole where the plan
        is valid)."""
        return (self.tensor_model_parallel_size * self.data_parallel_size
                // (self.expert_tensor_size * self.expert_model_parallel_size))

    @property
    def expert_text(self) -> str:
        """`` EP=.. ETP=..`` where the mesh has expert parallelism or its own expert TP, else
        empty (dense plans read as before)."""
        etp = self.expert_tensor_parallel_size
        return ((f" EP={self.expert_model_parallel_size}"
                 if self.expert_model_parallel_size != 1 else "")
                + (f" ETP={etp}" if etp is not None else ""))

    def expert_blocks(self) -> list[range]:
        """The replicas each expert block of a stage spans: its ``ETP x EP`` consecutive ranks
        in ``tp-dp`` order (one block per EP group and its expert-TP peers; one replica where
        the block fits in a tensor group)."""
        return expert_blocks(len(self.pipelines), self.tensor_model_parallel_size,
                             self.expert_tensor_size * self.expert_model_parallel_size)

    @property
    def alike(self) -> bool:
        """Every replica runs the same stages (device types, layers, policies)."""
        first = self.pipelines[0].stages
        return all(p.stages is first or p.stages == first for p in self.pipelines[1:])

    @property
    def even(self) -> bool:
        """Every replica runs the same micro-batch size and count."""
        first = self.pipelines[0]
        return all(p.micro_batch_size == first.micro_batch_size
                   and p.num_microbatches == first.num_microbatches for p in self.pipelines)

    @property
    def stages(self) -> list[Stage]:
        """The stage list every replica runs (format 2's view)."""
        if not self.alike:
            raise PlanShapeError("this mesh's replicas run different stages; read "
                                 "mesh.pipelines[r].stages")
        return self.pipelines[0].stages

    @property
    def device_type(self) -> str:
        """The one device type of the mesh (format 2's view)."""
        types = self.device_types
        if len(types) != 1:
            raise PlanShapeError(f"this mesh runs on {len(types)} device types {types}; read "
                                 "the stages' device_type")
        return types[0]

    @property
    def device_types(self) -> list[str]:
        """The mesh's device types, in order of first use."""
        return list(dict.fromkeys(s.device_type for p in self.pipelines for s in p.stages))

    @property
    def replicas(self) -> list[Replica]:
        """Each replica's batch (micro-batch size and count), in data-parallel rank order."""
        return [Replica(micro_batch_size=p.micro_batch_size, num_microbatches=p.num_microbatches)
                for p in self.pipelines]
