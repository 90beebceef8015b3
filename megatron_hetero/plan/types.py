"""The one in-memory plan: a chain of meshes.

A :class:`Mesh` is a run of consecutive pipeline stages that share a tensor-parallel size
``T`` and a data-parallel size ``D``; its ``D`` :class:`.stages.Pipeline` objects are its
replicas, each with its own micro-batch size and count and its own device type and policies per
stage (as format-1 pipelines). The model's layers run through mesh 0's stages, then mesh 1's, and
so on. A format-1 file (:mod:`.format1`) is one mesh; a format-2 file (:mod:`.format2`) gives
its meshes as they are (no merging), every replica of a mesh on the mesh's device type and
stage list.

Questions about the plan's shape are answered here, once:

- :attr:`Plan.one_grid`: the plan is one mesh, so one tensor- and one data-parallel size over
  every stage and each replica one pipeline through all of them: megatron-core's own schedules
  run it (the format-1 implementations). A chain of several meshes runs through the mesh
  implementations, also where its meshes share TP and DP (:attr:`Plan.shares_tp_dp`).
- :attr:`Plan.replicas_differ`: uneven data parallelism (some mesh's replicas differ in
  micro-batch size or count).
- :attr:`Plan.interleaved_chain`: a chain of several meshes whose stages run model chunks
  (``chunk_layers``): the cost model, the simulator, the CPU trainer, ``rehearse`` and
  Megatron-LM's training run it (megatron-core 0.17.1+).

Rank numbering: mesh ``k``'s ranks are ``offset_k .. offset_k + T_k D_k P_k - 1`` (megatron-core's
``HyperCommGrid`` with ``rank_offset``), and slot (mesh ``k``, stage ``j`` of the mesh, replica
``r``, tensor rank ``t``) is rank ``offset_k + t + T_k (r + D_k j)``: Megatron's ``tp-dp-pp``
order inside each mesh, which for one mesh is Megatron's own numbering.

Views: on a plan of one mesh, :attr:`Plan.pipelines`, :attr:`Plan.tensor_model_parallel_size`,
:meth:`Plan.stage` and the rest read as format 1 did; a mesh whose replicas run one stage list
gives :attr:`Mesh.device_type`, :attr:`Mesh.stages` and :attr:`Mesh.replicas` as format 2 did.
Asked of a shape that cannot answer, a view raises :class:`PlanShapeError` (a bug in the caller,
never a user's mistake).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from .._schema import to_data
from ..hardware.catalog import Catalog, GPUSpec
from ..schedule.rules import has_extra_warmup
from .experts import expert_data
from .mesh import Mesh, PlanShapeError
from .stages import ModelSpec, Pipeline, Stage

__all__ = ["Mesh", "Plan", "Slot", "PlanShapeError"]


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one rank sits in a plan."""

    mesh: int
    """The mesh, in pipeline order."""
    stage: int
    """Stage index inside the mesh (the global stage index where the plan is one mesh)."""
    replica: int
    """The data-parallel replica (pipeline) of the mesh."""
    tensor_rank: int
    """The rank inside its tensor-parallel group."""

    @property
    def pipeline(self) -> int:
        """The replica (format 1's pipeline index)."""
        return self.replica


@dataclass(kw_only=True, slots=True)
class Plan:
    """A complete heterogeneous training plan: a chain of meshes."""

    model: ModelSpec
    """The transformer every mesh runs a part of."""
    global_batch_size: int
    """Samples per step; every mesh's replicas take them all between them."""
    meshes: list[Mesh]
    """In pipeline order: mesh 0 holds the embedding, the last mesh the output layer and loss."""
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    use_distributed_optimizer: bool = True
    """Shard optimizer state over each stage's data-parallel group."""
    sequence_parallel: bool = False
    """Megatron's ``--sequence-parallel`` in every mesh of TP > 1 (a mesh of TP 1 runs
    without)."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the last micro-batch's backward."""
    virtual_pipeline_size: int = 1
    """Model chunks per pipeline stage of every mesh (> 1: every stage lists ``chunk_layers``,
    and the model runs chunk 0 of every stage of every mesh, then chunk 1, ...)."""
    microbatch_group_size: int | None = None
    """With interleaving: micro-batches that run one model chunk in a row (None: the pipeline
    size)."""
    gpus: dict[str, GPUSpec] = field(default_factory=dict)
    """Catalog entries the plan carries (see :class:`.format1.Format1Plan`)."""
    prediction: dict[str, float] | None = None
    """Figures the tuner predicted for this plan (informational; never read back as input)."""
    catalog: Catalog | None = field(default=None, compare=False, repr=False,
                                    metadata={"internal": True})
    """The catalog the plan was checked against on load; None for a plan built in code."""

    def __post_init__(self) -> None:
        # the user-facing checks, with their field paths, are the file formats'
        # (:mod:`.format1`, :mod:`.format2`); here only what every plan is
        if not self.meshes:
            raise ValueError("a plan needs at least one mesh")
        if sum(self.layer_split) != self.model.num_layers:
            raise ValueError(f"stages hold {sum(self.layer_split)} layers, the model "
                             f"{self.model.num_layers}")
        v = self.virtual_pipeline_size
        if v > 1 and any(s.chunk_layers is None or len(s.chunk_layers) != v
                         for m in self.meshes for s in m.pipelines[0].stages):
            raise ValueError(f"virtual_pipeline_size {v}: every stage needs {v} chunk_layers")

    # -- shape -----------------------------------------------------------------------------------
    @property
    def one_grid(self) -> bool:
        """One mesh: megatron-core's own schedules run the plan as one grid (the format-1
        implementations); otherwise the mesh implementations."""
        return len(self.meshes) == 1

    @property
    def shares_tp_dp(self) -> bool:
        """Every stage has the same tensor- and data-parallel size, so every replica runs its
        own path through all meshes."""
        m0 = self.meshes[0]
        return all(m.tensor_model_parallel_size == m0.tensor_model_parallel_size
                   and m.data_parallel_size == m0.data_parallel_size for m in self.meshes)

    @property
    def replicas_differ(self) -> bool:
        """Uneven data parallelism: some mesh's replicas differ in micro-batch size or count."""
        return any(not m.even for m in self.meshes)

    @property
    def interleaved_chain(self) -> bool:
        """A chain of several meshes whose stages run ``virtual_pipeline_size`` > 1 model chunks
        (interleaved 1F1B across meshes: simulated, searched, run on CPU ranks and under
        Megatron-LM's training, megatron-core 0.17.1+)."""
        return self.virtual_pipeline_size > 1 and len(self.meshes) > 1

    def sequence_parallel_in(self, mesh: int) -> bool:
        """Whether mesh ``mesh`` runs sequence parallelism: the plan's ``sequence_parallel``
        where the mesh's TP is above 1 (Megatron turns it off at TP 1)."""
        return self.sequence_parallel and self.meshes[mesh].tensor_model_parallel_size > 1

    @property
    def own_chain_schedule(self) -> bool:
        """A chain of meshes that runs the chain's own schedule
        (:mod:`megatron_hetero.mcore.mesh_interleaved`) instead of megatron-core's multimodule
        1F1B: model chunks (:attr:`interleaved_chain`), or some replica's path warming a stage
        up beyond Megatron's ``P - s - 1`` (per-stage warm-up)."""
        if len(self.meshes) == 1:
            return False
        return self.virtual_pipeline_size > 1 or any(
            has_extra_warmup(self.path_pipeline(r))
            for r in range(self.meshes[0].data_parallel_size))

    def path_pipeline(self, replica: int) -> Pipeline:
        """Replica ``replica``'s path through every mesh as one pipeline: its micro-batches,
        every mesh's stages in order. Where the meshes' replicas differ in number every replica
        is alike (the plan's bridge rules), and a mesh with fewer stands in with its replica 0.
        One mesh: the replica's own pipeline."""
        meshes = self.meshes
        if len(meshes) == 1:
            return meshes[0].pipelines[replica]
        pipes = [m.pipelines[replica if replica < len(m.pipelines) else 0] for m in meshes]
        return Pipeline(micro_batch_size=pipes[0].micro_batch_size,
                        num_microbatches=pipes[0].num_microbatches,
                        stages=[st for x in pipes for st in x.stages])

    @property
    def uniform_data_parallel(self) -> bool:
        """True when every replica of every mesh runs the same micro-batch size and count."""
        return not self.replicas_differ

    @property
    def per_token_loss(self) -> bool:
        """The loss is summed over tokens and divided by the global batch's tokens (Megatron's
        ``--calculate-per-token-loss``) where replicas differ (mesh implementations)."""
        return self.replicas_differ

    @property
    def stage_index(self) -> list[tuple[int, int]]:
        """(mesh, stage inside the mesh) of every pipeline stage, in pipeline order."""
        return [(k, j) for k, mesh in enumerate(self.meshes) for j in range(mesh.num_stages)]

    @property
    def layer_split(self) -> list[int]:
        return [n for mesh in self.meshes for n in mesh.layer_split]

    @property
    def virtual_stage_layers(self) -> list[int]:
        """Layers per virtual pipeline stage in model order (chunk-major, over every stage of
        every mesh); the stage totals when ``virtual_pipeline_size`` is 1."""
        if self.virtual_pipeline_size == 1:
            return self.layer_split
        stages = [s for mesh in self.meshes for s in mesh.pipelines[0].stages]
        return [s.chunk_layers[c] for c in range(self.virtual_pipeline_size) for s in stages]

    @property
    def pipeline_model_parallel_size(self) -> int:
        """Pipeline stages of the whole model (all meshes)."""
        return sum(len(mesh.pipelines[0].stages) for mesh in self.meshes)

    @property
    def world_size(self) -> int:
        return sum(mesh.world_size for mesh in self.meshes)

    @property
    def offloads_module_inputs(self) -> bool:
        """Whether any stage offloads its layers' module inputs (:class:`.policy.Offload`)."""
        return any(s.offload.module_inputs for s in self.all_stages())

    @property
    def offloads_optimizer(self) -> bool:
        """True when some stage keeps part of its optimizer state on the host."""
        return any(s.offload.optimizer_fraction > 0 for s in self.all_stages())

    @property
    def microbatch_group(self) -> int:
        """The micro-batch group of the interleaved schedule (``microbatch_group_size``, by
        default the pipeline size)."""
        g = self.microbatch_group_size
        return self.pipeline_model_parallel_size if g is None else g

    def all_stages(self):
        """Every (replica, stage) of every mesh."""
        return (s for mesh in self.meshes for p in mesh.pipelines for s in p.stages)

    # -- format-1 views (one mesh) ---------------------------------------------------------------
    # (each view reads ``self.meshes`` itself: the tuner asks them millions of times)
    def _not_one_grid(self) -> PlanShapeError:
        return PlanShapeError(f"a plan of {len(self.meshes)} meshes has no single "
                              "tensor-parallel size or pipeline list; read plan.meshes")

    def _grid(self) -> Mesh:
        if len(self.meshes) != 1:
            raise self._not_one_grid()
        return self.meshes[0]

    @property
    def tensor_model_parallel_size(self) -> int:
        meshes = self.meshes
        if len(meshes) == 1:
            return meshes[0].tensor_model_parallel_size
        raise self._not_one_grid()

    @property
    def pipelines(self) -> list[Pipeline]:
        meshes = self.meshes
        if len(meshes) == 1:
            return meshes[0].pipelines
        raise self._not_one_grid()

    @property
    def data_parallel_size(self) -> int:
        meshes = self.meshes
        if len(meshes) == 1:
            return len(meshes[0].pipelines)
        raise self._not_one_grid()

    def stage(self, pipeline: int, stage: int) -> Stage:
        meshes = self.meshes
        if len(meshes) == 1:
            return meshes[0].pipelines[pipeline].stages[stage]
        raise self._not_one_grid()

    def replica_sample_range(self, pipeline: int) -> tuple[int, int]:
        """(offset, count) of the samples of every global batch that replica ``pipeline`` reads:
        replicas take consecutive shares in data-parallel rank order."""
        pipes = self._grid().pipelines
        return sum(p.samples for p in pipes[:pipeline]), pipes[pipeline].samples

    # -- ranks -----------------------------------------------------------------------------------
    def rank_offset(self, mesh: int) -> int:
        """The first rank of mesh ``mesh`` (its grid's ``rank_offset``)."""
        return sum(m.world_size for m in self.meshes[:mesh])

    def slot_of_rank(self, rank: int) -> Slot:
        """The slot rank ``rank`` plays (Megatron's ``tp-dp-pp`` inside its mesh)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        for k, mesh in enumerate(self.meshes):
            if rank < mesh.world_size:
                t, d = mesh.tensor_model_parallel_size, mesh.data_parallel_size
                return Slot(k, rank // (t * d), (rank // t) % d, rank % t)
            rank -= mesh.world_size
        raise AssertionError("unreachable")

    def rank_of_slot(self, slot: Slot) -> int:
        mesh = self.meshes[slot.mesh]
        t, d = mesh.tensor_model_parallel_size, mesh.data_parallel_size
        return self.rank_offset(slot.mesh) + slot.tensor_rank + t * (slot.replica + d * slot.stage)

    def stage_of_slot(self, slot: Slot) -> Stage:
        """The plan stage ``slot`` runs."""
        return self.meshes[slot.mesh].pipelines[slot.replica].stages[slot.stage]

    def global_stage(self, slot: Slot) -> int:
        """The pipeline stage of the whole model that ``slot`` runs."""
        return sum(m.num_stages for m in self.meshes[:slot.mesh]) + slot.stage

    def chunk_first_layers(self, slot: Slot) -> list[int]:
        """The model's index (from 0) of the first layer of each of ``slot``'s model chunks:
        chunk ``c`` of global stage ``s`` is virtual stage ``c P + s`` of ``P`` stages."""
        layers, s = self.virtual_stage_layers, self.global_stage(slot)
        p = self.pipeline_model_parallel_size
        return [sum(layers[:c * p + s]) for c in range(self.virtual_pipeline_size)]

    def device_type_of_rank(self, rank: int) -> str:
        return self.stage_of_slot(self.slot_of_rank(rank)).device_type

    def device_types_in_rank_order(self) -> list[str]:
        """The plan's device types in order of their first rank."""
        seen: dict[str, None] = {}
        for mesh in self.meshes:
            for j in range(mesh.num_stages):
                for p in mesh.pipelines:
                    seen.setdefault(p.stages[j].device_type, None)
        return list(seen)

    def tensor_groups(self) -> list[tuple[int, int]]:
        """(first rank, size) of every tensor-parallel group, in rank order."""
        return [(self.rank_offset(k) + i * m.tensor_model_parallel_size, m.tensor_model_parallel_size)
                for k, m in enumerate(self.meshes)
                for i in range(m.world_size // m.tensor_model_parallel_size)]

    def device_counts(self) -> Counter[str]:
        """GPUs the plan needs per device type."""
        counts: Counter[str] = Counter()
        for mesh in self.meshes:
            tp = mesh.tensor_model_parallel_size
            for pipe in mesh.pipelines:
                for stage in pipe.stages:
                    counts[stage.device_type] += tp
        return counts

    def layout(self) -> str:
        """Megatron's ``pipeline_model_parallel_layout``: one segment per virtual pipeline stage
        over all meshes, in model order."""
        parts = []
        split = self.virtual_stage_layers
        last = len(split) - 1
        for s, n in enumerate(split):
            body = "" if n == 0 else ("t" if n == 1 else f"t*{n}")
            parts.append(("E" if s == 0 else "") + body + ("L" if s == last else ""))
        return "|".join(parts)

    def sizes_text(self) -> str:
        """The parallel sizes in words: ``TP=.. x DP=.. x PP=..``, per mesh for a chain."""
        if self.one_grid:
            return (f"TP={self.tensor_model_parallel_size} x DP={self.data_parallel_size} x "
                    f"PP={self.pipeline_model_parallel_size}")
        return "; ".join(f"mesh {k}: TP={m.tensor_model_parallel_size} x "
                         f"DP={m.data_parallel_size} x PP={m.num_stages}"
                         for k, m in enumerate(self.meshes))

    def describe(self) -> str:
        """One line per mesh: its GPUs, parallel sizes, layers and batch."""
        lines = []
        for k, m in enumerate(self.meshes):
            reps = sorted({(p.micro_batch_size, p.num_microbatches) for p in m.pipelines})
            lines.append(f"mesh {k}: {m.world_size}x {'+'.join(m.device_types)} "
                         f"TP={m.tensor_model_parallel_size} DP={m.data_parallel_size} "
                         f"PP={m.num_stages}{m.expert_text} layers {m.layer_split}, micro-batches "
                         "(size, count) "
                         + " ".join(f"{b}x{n}" for b, n in reps)
                         + f"; ranks {self.rank_offset(k)}-{self.rank_offset(k) + m.world_size - 1}")
        return "\n".join(lines)

    # -- writing ---------------------------------------------------------------------------------
    @property
    def format_version(self) -> int:
        """The simplest file format that expresses the plan: 1 for one mesh; 2 where every
        mesh's replicas run one stage list on one device type (model chunks, per-stage
        warm-ups, the micro-batch group and sequence parallelism it takes as format 1 does). A
        chain of meshes beyond both has no file format yet: :class:`PlanShapeError`."""
        if self.one_grid:
            return 1
        if all(m.alike and len(m.device_types) == 1 for m in self.meshes):
            return 2
        raise PlanShapeError("a chain of meshes whose replicas differ in device types or stages "
                             "has no file format yet")

    def to_data(self) -> dict:
        """The plan as a file's plain data, in the simplest format that expresses it
        (:attr:`format_version`). Format 1 round-trips field for field; a format-2 file of one
        mesh is written as format 1 (its normal form: the same plan)."""
        version = self.format_version
        data: dict = {"format_version": version, "model": to_data(self.model),
                      "global_batch_size": self.global_batch_size}
        if version == 1:
            mesh = self.meshes[0]
            data |= {"tensor_model_parallel_size": mesh.tensor_model_parallel_size,
                     "pipelines": to_data(mesh.pipelines), "precision": self.precision,
                     "use_distributed_optimizer": self.use_distributed_optimizer,
                     "sequence_parallel": self.sequence_parallel,
                     "overlap_grad_reduce": self.overlap_grad_reduce,
                     "virtual_pipeline_size": self.virtual_pipeline_size}
            if self.microbatch_group_size is not None:
                data["microbatch_group_size"] = self.microbatch_group_size
            data |= expert_data(mesh)
        else:
            data |= {"meshes": [{"device_type": m.device_type,
                                 "tensor_model_parallel_size": m.tensor_model_parallel_size,
                                 "replicas": to_data(m.replicas),
                                 "stages": [_mesh_stage_data(s, self.virtual_pipeline_size)
                                            for s in m.stages]}
                                | expert_data(m) for m in self.meshes],
                     "precision": self.precision,
                     "use_distributed_optimizer": self.use_distributed_optimizer,
                     "sequence_parallel": self.sequence_parallel,
                     "overlap_grad_reduce": self.overlap_grad_reduce}
            if self.microbatch_group_size is not None:
                data["microbatch_group_size"] = self.microbatch_group_size
        if self.gpus:
            data["gpus"] = to_data(self.gpus)
        if self.prediction is not None:
            data["prediction"] = to_data(self.prediction)
        return data


def _mesh_stage_data(stage: Stage, v: int) -> dict:
    """A format-2 file's stage: its layers, policies and, interleaved, its chunks; its
    warm-up where it sets one."""
    data = {"num_layers": stage.num_layers, "recompute": to_data(stage.recompute),
            "offload": to_data(stage.offload)}
    if v > 1:
        data["chunk_layers"] = list(stage.chunk_layers)
    if stage.warmup_microbatches is not None:
        data["warmup_microbatches"] = stage.warmup_microbatches
    return data
