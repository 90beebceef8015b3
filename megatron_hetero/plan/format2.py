"""Mesh plans (``plan.yaml``, ``format_version: 2``): tensor- and data-parallel sizes per run
of pipeline stages.

A *mesh* is a run of consecutive pipeline stages that share a device type, a tensor-parallel
size ``T`` and a data-parallel size ``D`` (its ``replicas``). A mesh plan chains meshes; the
model's layers run through mesh 0's stages, then mesh 1's, and so on. Inside a mesh, stages
talk as in any Megatron pipeline; at a boundary between two meshes megatron-core's
``BridgeCommunicator`` moves the activations (forward) and their gradients (backward): one
leader rank per replica on each side, the side with more replicas joins (fan-in) or splits
(fan-out) the micro-batch on the batch dimension, and the receiving leader broadcasts the
tensor to the rest of its tensor-parallel group.

So every sample of a micro-batch crosses a boundary whole or split evenly:

* where two meshes have the same ``D``, replica ``r`` feeds replica ``r`` (a sample stays on one
  path), and replicas may differ in micro-batch size and count (uneven data parallelism), as
  long as replica ``r`` is the same in both meshes;
* where ``D`` changes, one of the two sizes divides the other (``BridgeCommunicator`` joins or
  splits ``D_a / D_b`` tensors), every replica of both meshes runs the same number of
  micro-batches, each mesh's replicas the same micro-batch size, and ``D_a x mbs_a = D_b x
  mbs_b`` (the micro-batch divides evenly across the boundary).

Sequence parallelism (``sequence_parallel``, issue 28) runs in every mesh of TP > 1; a bridge
carries the whole tensor, joined from the sending mesh's sequence shards and cut into the
receiving mesh's (:mod:`megatron_hetero.mcore.mesh_stage`).

Per-stage warm-up (issue 28): a stage's ``warmup_microbatches`` as format 1's, its rules over
each replica's path through the chain; such a chain runs the chain's own schedule
(:attr:`.types.Plan.own_chain_schedule`). With model chunks the count is of forward
chunk-steps, taken where the ranks' orders complete (:mod:`megatron_hetero.schedule.chain`); a
plan of one mesh with chunks runs Megatron's own interleaved schedule and takes none.

Interleaving (issue 28): a stage may list ``chunk_layers`` as a format-1 stage does; then every
stage of the chain lists the same number ``v`` of chunks (the plan's ``virtual_pipeline_size``,
read off them), and the model runs chunk 0 of every stage of every mesh, then chunk 1, and so
on. Every chunk boundary between meshes is a bridge, including the wrap-around from the last
mesh's chunk ``c`` to mesh 0's chunk ``c + 1``, so the last mesh's and mesh 0's data-parallel
sizes divide one another too. ``microbatch_group_size`` is format 1's. The simulator and the
search run such plans, and so do the CPU trainer, ``rehearse``
(:mod:`megatron_hetero.mcore.mesh_interleaved`) and Megatron-LM's training
(:mod:`megatron_hetero.runtime.mesh_chunks`, megatron-core 0.17.1+).

Rank numbering (the runtime builds one megatron-core ``HyperCommGrid`` per mesh, shape
``[T, 1, D, P]`` over ``["tp", "cp", "dp", "pp"]``, with ``rank_offset`` the ranks of the
meshes before it): mesh ``k``'s ranks are ``offset_k .. offset_k + T_k D_k P_k - 1``, and slot
(mesh ``k``, stage ``j`` of the mesh, replica ``r``, tensor rank ``t``) is rank
``offset_k + t + T_k (r + D_k j)``: Megatron's ``tp-dp-pp`` order inside each mesh
(:meth:`.types.Plan.slot_of_rank`). A format-2 file loads into the one in-memory plan
(:class:`.types.Plan`) with its meshes as given; a plan file picks its schema by
``format_version`` (:func:`load_any_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from .._schema import OMIT_DEFAULT, from_data, read_yaml, write_yaml
from ..errors import Described, SchemaError
from ..hardware.catalog import Catalog, GPUSpec
from ..schedule.rules import check_stage_warmups
from .experts import check_experts
from .format1 import (bind_catalog, check_device_type, check_microbatch_group,
                      check_no_empty_chunk, plan_from_data)
from .policy import Offload, Recompute
from .stages import ModelSpec, Pipeline, Replica, Stage
from .types import Mesh, Plan

__all__ = ["MeshStage", "Format2Mesh", "Format2Plan", "MESH_FORMAT_VERSION", "mesh_plan",
           "mesh_plan_from_data", "load_any_plan", "any_plan_from_data", "save_any_plan",
           "meshes_of"]

MESH_FORMAT_VERSION = 2


@dataclass(kw_only=True, slots=True)
class MeshStage:
    """One pipeline stage of a mesh: its layers and memory policy (every replica of the mesh
    runs it alike)."""

    num_layers: int
    recompute: Recompute = field(default_factory=Recompute)
    offload: Offload = field(default_factory=Offload)
    chunk_layers: list[int] | None = None
    """With interleaving: the layers of each of the stage's model chunks, in chunk order (at
    least 2; they add up to ``num_layers``). Every stage of the chain lists as many, or none."""
    warmup_microbatches: int | None = None
    """Warm-up forwards of this stage's 1F1B, as a format-1 stage's (None: Megatron's
    ``min(P - s - 1, m)`` at the stage's global index ``s`` of the chain's ``P``): at most the
    replicas' ``num_microbatches``, at least one more than the next stage of the chain's;
    without ``chunk_layers`` only (:mod:`megatron_hetero.schedule.rules`)."""

    def __post_init__(self) -> None:
        if self.num_layers < 0:
            raise SchemaError("", "num_layers", self.num_layers, "a non-negative integer")
        if self.chunk_layers is not None:
            if len(self.chunk_layers) < 2 or min(self.chunk_layers) < 0:
                raise SchemaError("", "chunk_layers", self.chunk_layers,
                                  "a list of at least 2 non-negative layer counts, one per model "
                                  "chunk (or absent: one chunk)")
            if sum(self.chunk_layers) != self.num_layers:
                raise SchemaError("", "chunk_layers", self.chunk_layers,
                                  f"counts adding up to num_layers ({self.num_layers})")
        if self.recompute.num_layers is not None and self.recompute.num_layers > max(self.num_layers, 1):
            raise SchemaError("", "recompute.num_layers", self.recompute.num_layers,
                              f"at most the stage's num_layers ({self.num_layers})")


@dataclass(kw_only=True, slots=True)
class Format2Mesh:
    """A format-2 file's mesh: a run of consecutive pipeline stages on one device type with one
    tensor- and one data-parallel size, every replica running its stages alike."""

    SCHEMA_NAME: ClassVar[str] = "Mesh"

    device_type: str
    """Canonical catalog name of the GPU type of every rank of the mesh."""
    tensor_model_parallel_size: int
    """Tensor ranks per stage of this mesh (a group inside one node of ``device_type``)."""
    replicas: list[Replica]
    """The mesh's data-parallel replicas, in data-parallel rank order (``D`` is their number)."""
    stages: list[MeshStage]
    """The mesh's pipeline stages, in pipeline order."""
    expert_model_parallel_size: int = field(default=1, metadata=OMIT_DEFAULT)
    """An MoE model's expert parallelism on this mesh (:mod:`.experts`): its EP groups lie
    inside the mesh, on its one device type."""
    expert_tensor_parallel_size: int | None = None
    """Tensor ranks of one expert on this mesh (None: the mesh's TP)."""

    def __post_init__(self) -> None:
        if self.tensor_model_parallel_size < 1:
            raise SchemaError("", "tensor_model_parallel_size", self.tensor_model_parallel_size,
                              "a positive integer")
        if not self.replicas:
            raise SchemaError("", "replicas", self.replicas, "at least one replica")
        if not self.stages:
            raise SchemaError("", "stages", self.stages, "at least one stage")

    @property
    def data_parallel_size(self) -> int:
        return len(self.replicas)

    @property
    def world_size(self) -> int:
        return self.tensor_model_parallel_size * self.data_parallel_size * len(self.stages)

    @property
    def even(self) -> bool:
        """Every replica runs the same micro-batch size and count."""
        return len(set(self.replicas)) == 1


@dataclass(kw_only=True, slots=True)
class Format2Plan:
    """A format-2 file's plan, checked field by field; :meth:`plan` gives the one in-memory
    :class:`.types.Plan` with these meshes."""

    SCHEMA_NAME: ClassVar[str] = "MeshPlan"

    format_version: Literal[2]
    model: ModelSpec
    global_batch_size: int
    meshes: list[Format2Mesh]
    """In pipeline order: mesh 0 holds the embedding, the last mesh the output layer and loss."""
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    use_distributed_optimizer: bool = True
    """Shard each stage's optimizer state over its mesh's replicas."""
    overlap_grad_reduce: bool = False
    """Overlap each mesh's gradient reduction with its last backward."""
    sequence_parallel: bool = False
    """Megatron's ``--sequence-parallel`` in every mesh of TP > 1 (a mesh of TP 1 runs without,
    as Megatron turns it off at TP 1); at least one mesh has TP > 1 and every such mesh's TP
    divides ``model.seq_length``. A bridge gathers the sending mesh's sequence shards into the
    whole ``[s, b, h]`` tensor and the receiving mesh takes its own shard of it."""
    microbatch_group_size: int | None = None
    """With interleaving (stages list ``chunk_layers``): micro-batches that run one model chunk
    in a row, as in format 1 (None: the pipeline size, all meshes' stages)."""
    gpus: dict[str, GPUSpec] = field(default_factory=dict)
    """As in format 1 (:class:`.format1.Format1Plan`): catalog entries the plan carries. Left out of the
    file when empty."""
    prediction: dict[str, float] | None = None
    """Figures the tuner predicted for this plan (informational; never read back as input)."""
    catalog: Catalog | None = field(default=None, compare=False, repr=False,
                                    metadata={"internal": True})
    """The catalog the plan was checked against on load; None for a plan built in code."""

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise SchemaError("", "global_batch_size", self.global_batch_size, "a positive integer")
        if not self.meshes:
            raise SchemaError("", "meshes", self.meshes, "at least one mesh")
        m = self.model
        if not m.untie_embeddings_and_output_weights and len(self.layer_split) > 1:
            raise SchemaError("", "model.untie_embeddings_and_output_weights", False,
                              "true in a mesh plan of more than one stage (its first and last "
                              "stage share no embedding group to tie the output layer to the "
                              "embedding)")
        for k, mesh in enumerate(self.meshes):
            tp = mesh.tensor_model_parallel_size
            if m.num_attention_heads % tp or m.num_query_groups % tp:
                raise SchemaError("", f"meshes[{k}].tensor_model_parallel_size", tp,
                                  f"a divisor of model.num_attention_heads ({m.num_attention_heads}) "
                                  f"and model.num_query_groups ({m.num_query_groups})")
            samples = sum(r.samples for r in mesh.replicas)
            if samples != self.global_batch_size:
                raise SchemaError("", f"meshes[{k}].replicas",
                                  Described(f"replicas taking {samples} samples per step"),
                                  f"micro_batch_size x num_microbatches adding up to "
                                  f"global_batch_size ({self.global_batch_size}) in every mesh")
            check_experts(m, tp=tp, ep=mesh.expert_model_parallel_size,
                          etp=mesh.expert_tensor_parallel_size,
                          pipelines=mesh.replicas, sequence_parallel=self.sequence_parallel,
                          where=f"meshes[{k}].", replicas=f"meshes[{k}].replicas")
        self._check_sequence_parallel()
        self._check_layers()
        for k in range(len(self.meshes) - 1):
            self._check_boundary(k)
        self._check_chunks()
        self._check_warmups()

    def _check_warmups(self) -> None:
        """Format 1's warm-up rules (with chunks over several meshes, the chain's:
        :mod:`megatron_hetero.schedule.chain`) over each replica's path through the chain:
        replica ``r`` of every mesh where the meshes' replicas match, else (a bridge that joins
        or splits: every replica alike) the one path of mesh 0's micro-batch count."""
        given = [self.meshes[k].stages[j].warmup_microbatches for k, j in self.stage_index]
        if all(w is None for w in given):
            return
        paths = {}  # a path's micro-batches -> the first replica with them
        for r, rep in enumerate(self.meshes[0].replicas):
            paths.setdefault(rep.num_microbatches, r)
        for m, r in paths.items():
            check_stage_warmups(given, m, self.virtual_pipeline_size,
                                lambda s: "meshes[{}].stages[{}].warmup_microbatches".format(
                                    *self.stage_index[s]), f"meshes[0].replicas[{r}]",
                                chain=len(self.meshes) > 1, group=self.microbatch_group_size)

    def _check_chunks(self) -> None:
        """Interleaving as format 1 checks it (:meth:`.format1.Format1Plan._check_chunks`), over
        every stage of the chain, plus the wrap-around bridge."""
        v, g, p = self.virtual_pipeline_size, self.microbatch_group_size, len(self.stage_index)
        if v == 1:
            for k, j in self.stage_index:
                got = self.meshes[k].stages[j].chunk_layers
                if got is not None:
                    raise SchemaError("", f"meshes[{k}].stages[{j}].chunk_layers", got,
                                      "absent, as in meshes[0].stages[0] (every stage of the "
                                      "chain runs the same number of model chunks)")
            if g is not None:
                raise SchemaError("", "microbatch_group_size", g,
                                  "absent (it groups the micro-batches of the interleaved "
                                  "schedule, and no stage lists chunk_layers)")
            return
        for k, j in self.stage_index:
            got = self.meshes[k].stages[j].chunk_layers
            if got is None or len(got) != v:
                raise SchemaError("", f"meshes[{k}].stages[{j}].chunk_layers", got,
                                  f"a list of {v} layer counts, as meshes[0].stages[0] (every "
                                  "stage of the chain runs the same number of model chunks)")
        if p == 1:
            raise SchemaError("", "meshes[0].stages[0].chunk_layers",
                              self.meshes[0].stages[0].chunk_layers,
                              "absent when there is a single pipeline stage (interleaving needs "
                              "pipeline parallelism)")
        for k, mesh in enumerate(self.meshes):
            for r, rep in enumerate(mesh.replicas):
                check_microbatch_group(p, g, f"meshes[{k}].replicas[{r}]", rep.num_microbatches)
        check_no_empty_chunk(self.virtual_stage_layers, p,
                             lambda s: "meshes[{}].stages[{}].chunk_layers".format(
                                 *self.stage_index[s]))
        d0, dl = self.meshes[0].data_parallel_size, self.meshes[-1].data_parallel_size
        if len(self.meshes) > 1 and max(d0, dl) % min(d0, dl):
            raise SchemaError("", f"meshes[{len(self.meshes) - 1}].replicas",
                              Described(f"{dl} replicas, with {d0} in meshes[0]"),
                              f"a multiple or a divisor of meshes[0]'s {d0} replicas (with "
                              "model chunks the last mesh's chunk c feeds mesh 0's chunk c + 1 "
                              "over a bridge, which joins or splits whole micro-batches)")

    def _check_sequence_parallel(self) -> None:
        if not self.sequence_parallel:
            return
        tps = [m.tensor_model_parallel_size for m in self.meshes]
        if max(tps) == 1:
            raise SchemaError("", "sequence_parallel", True,
                              "false when every mesh's tensor_model_parallel_size is 1 (sequence "
                              "parallelism splits the sequence over a tensor-parallel group)")
        s = self.model.seq_length
        for k, tp in enumerate(tps):
            if s % tp:
                raise SchemaError("", f"meshes[{k}].tensor_model_parallel_size", tp,
                                  f"a divisor of model.seq_length ({s}) with sequence_parallel "
                                  "(each tensor rank holds an equal share of the sequence)")

    def _check_layers(self) -> None:
        split = self.layer_split
        if sum(split) != self.model.num_layers:
            raise SchemaError("", "meshes", Described(f"stages with layers adding up to {sum(split)}"),
                              f"layers adding up to model.num_layers ({self.model.num_layers})")
        last = len(split) - 1
        for g, (k, j) in enumerate(self.stage_index):
            if split[g] == 0 and (0 < g < last or last == 0):
                raise SchemaError("", f"meshes[{k}].stages[{j}].num_layers", 0,
                                  "at least 1 layer (only the first and last stage of the model "
                                  "may hold just the embedding or the loss)")

    def _check_boundary(self, k: int) -> None:
        a, b = self.meshes[k], self.meshes[k + 1]
        da, db = a.data_parallel_size, b.data_parallel_size
        here = f"meshes[{k + 1}].replicas"
        if da == db:
            for r, (ra, rb) in enumerate(zip(a.replicas, b.replicas)):
                if ra != rb:
                    raise SchemaError("", f"{here}[{r}]", Described(_show(rb)),
                                      f"{_show(ra)}, as meshes[{k}].replicas[{r}] (the bridge "
                                      f"between meshes of equal data-parallel size keeps every "
                                      f"sample on one replica's path)")
            return
        if max(da, db) % min(da, db):
            raise SchemaError("", here, Described(f"{db} replicas after {da}"),
                              f"a multiple or a divisor of meshes[{k}]'s {da} replicas "
                              "(BridgeCommunicator joins or splits whole micro-batches)")
        for kk, mesh in ((k, a), (k + 1, b)):
            if not mesh.even:
                raise SchemaError("", f"meshes[{kk}].replicas", Described("replicas that differ"),
                                  f"replicas alike: uneven data parallelism needs the same "
                                  f"number of replicas on both sides of every bridge it "
                                  f"crosses, and meshes[{k}] has {da}, meshes[{k + 1}] {db} "
                                  "(a bridge that joins or splits micro-batches splits evenly)")
        if a.replicas[0].num_microbatches != b.replicas[0].num_microbatches:
            raise SchemaError("", f"{here}[0].num_microbatches", b.replicas[0].num_microbatches,
                              f"{a.replicas[0].num_microbatches}, as meshes[{k}] (a bridge "
                              "passes every micro-batch)")
        batch = da * a.replicas[0].micro_batch_size
        if batch != db * b.replicas[0].micro_batch_size:
            share = (f"{batch // db}" if batch % db == 0 else
                     f"a whole share, but {batch} samples do not divide over {db} replicas")
            raise SchemaError("", f"{here}[0].micro_batch_size", b.replicas[0].micro_batch_size,
                              f"{share} (meshes[{k}]'s micro-batch, {da} x "
                              f"{a.replicas[0].micro_batch_size} samples, split evenly over "
                              f"{db} replicas)")

    # -- shape -----------------------------------------------------------------------------------
    @property
    def stage_index(self) -> list[tuple[int, int]]:
        """(mesh, stage inside the mesh) of every pipeline stage, in pipeline order."""
        return [(k, j) for k, mesh in enumerate(self.meshes) for j in range(len(mesh.stages))]

    @property
    def layer_split(self) -> list[int]:
        return [st.num_layers for mesh in self.meshes for st in mesh.stages]

    @property
    def virtual_pipeline_size(self) -> int:
        """Model chunks per stage: mesh 0's first stage's ``chunk_layers`` (1 without)."""
        got = self.meshes[0].stages[0].chunk_layers
        return 1 if got is None else len(got)

    @property
    def virtual_stage_layers(self) -> list[int]:
        """Layers per virtual pipeline stage in model order (chunk-major over every stage of
        the chain); the stage totals without chunks."""
        stages = [st for mesh in self.meshes for st in mesh.stages]
        v = self.virtual_pipeline_size
        if v == 1:
            return [st.num_layers for st in stages]
        return [st.chunk_layers[c] for c in range(v) for st in stages]

    def plan(self) -> Plan:
        """The one in-memory plan: these meshes, each replica of a mesh running the mesh's
        stages on its device type (one stage list shared by the replicas)."""
        meshes = []
        for mesh in self.meshes:
            stages = [Stage(device_type=mesh.device_type, num_layers=st.num_layers,
                            recompute=st.recompute, offload=st.offload,
                            chunk_layers=None if st.chunk_layers is None else list(st.chunk_layers),
                            warmup_microbatches=st.warmup_microbatches)
                      for st in mesh.stages]
            meshes.append(Mesh(tensor_model_parallel_size=mesh.tensor_model_parallel_size,
                               expert_model_parallel_size=mesh.expert_model_parallel_size,
                               expert_tensor_parallel_size=mesh.expert_tensor_parallel_size,
                               pipelines=[Pipeline(micro_batch_size=r.micro_batch_size,
                                                   num_microbatches=r.num_microbatches,
                                                   stages=stages) for r in mesh.replicas]))
        return Plan(model=self.model, global_batch_size=self.global_batch_size, meshes=meshes,
                    precision=self.precision,
                    use_distributed_optimizer=self.use_distributed_optimizer,
                    sequence_parallel=self.sequence_parallel,
                    overlap_grad_reduce=self.overlap_grad_reduce,
                    virtual_pipeline_size=self.virtual_pipeline_size,
                    microbatch_group_size=self.microbatch_group_size, gpus=self.gpus,
                    prediction=self.prediction, catalog=self.catalog)


def mesh_plan(**fields) -> Plan:
    """The plan that a format-2 file with these fields (less ``format_version``) gives, with
    that file's checks."""
    return Format2Plan(format_version=MESH_FORMAT_VERSION, **fields).plan()


def _show(replica: Replica) -> str:
    return f"micro_batch_size {replica.micro_batch_size}, num_microbatches {replica.num_microbatches}"


def mesh_plan_from_data(data: object, *, source: str = "<plan>",
                        catalog: Catalog | None = None) -> Plan:
    """Build and check a mesh plan from plain data, its device types against ``catalog`` plus
    the plan's ``gpus`` (as :func:`.format1.plan_from_data`). Meshes may be of several vendors
    (each mesh is one device type; its bridges are the vendor boundaries): what runs them is
    :func:`.checks.host_bridges` and the vendor checks (docs/meshes.md)."""
    plan = from_data(Format2Plan, data, source=source)
    catalog = bind_catalog(plan, catalog, source=source)
    for k, mesh in enumerate(plan.meshes):
        path = f"meshes[{k}].device_type"
        check_device_type(catalog, mesh.device_type, precision=plan.precision,
                          source=source, path=path)
    return plan.plan()


def any_plan_from_data(data: object, *, source: str = "<plan>",
                       catalog: Catalog | None = None) -> Plan:
    """The plan of a format-1 or a format-2 file, by ``format_version``."""
    if isinstance(data, dict) and data.get("format_version") == MESH_FORMAT_VERSION:
        return mesh_plan_from_data(data, source=source, catalog=catalog)
    return plan_from_data(data, source=source, catalog=catalog)


def load_any_plan(path: str | Path, *, catalog: Catalog | None = None) -> Plan:
    """Load and check a plan file of either format."""
    return any_plan_from_data(read_yaml(path), source=str(path), catalog=catalog)


def save_any_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` in the simplest format that expresses it (:meth:`.types.Plan.to_data`)."""
    write_yaml(plan.to_data(), path)


def meshes_of(plan: Plan) -> Plan | None:
    """The chain of meshes that runs the one-mesh ``plan`` as it is: consecutive stages on one
    device type form a mesh of the plan's TP and DP. None where a stage index differs between
    replicas in device type, memory policy or warm-up (format 1 can say that; a mesh cannot),
    and where it runs model chunks."""
    first = plan.pipelines[0].stages
    for pipe in plan.pipelines[1:]:
        for a, b in zip(first, pipe.stages):
            if (a.device_type, a.recompute, a.offload, a.warmup_microbatches) != (
                    b.device_type, b.recompute, b.offload, b.warmup_microbatches):
                return None
    if plan.virtual_pipeline_size > 1:
        return None
    replicas = [Replica(micro_batch_size=p.micro_batch_size, num_microbatches=p.num_microbatches)
                for p in plan.pipelines]
    meshes: list[Format2Mesh] = []
    for st in first:
        stage = MeshStage(num_layers=st.num_layers, recompute=st.recompute, offload=st.offload,
                          warmup_microbatches=st.warmup_microbatches)
        if meshes and meshes[-1].device_type == st.device_type:
            meshes[-1].stages.append(stage)
        else:
            grid = plan.meshes[0]
            meshes.append(Format2Mesh(device_type=st.device_type,
                                      tensor_model_parallel_size=plan.tensor_model_parallel_size,
                                      replicas=list(replicas), stages=[stage],
                                      expert_model_parallel_size=grid.expert_model_parallel_size,
                                      expert_tensor_parallel_size=grid.expert_tensor_parallel_size))
    out = mesh_plan(model=plan.model, global_batch_size=plan.global_batch_size, meshes=meshes,
                    precision=plan.precision,
                    use_distributed_optimizer=plan.use_distributed_optimizer,
                    overlap_grad_reduce=plan.overlap_grad_reduce,
                    sequence_parallel=plan.sequence_parallel, gpus=dict(plan.gpus))
    out.catalog = plan.catalog
    return out
