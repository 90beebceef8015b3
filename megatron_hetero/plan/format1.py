"""Format 1 of the plan file (``plan.yaml``, ``format_version: 1``): one mesh.

It loads into the one in-memory plan (:class:`.types.Plan`) as one mesh, and a plan of one mesh
is written in it (:meth:`.types.Plan.to_data`). A file lists one pipeline per data-parallel
replica (in data-parallel rank order); each pipeline lists its stages in pipeline rank order. Stage ``s`` has the same number of layers in
every pipeline (Megatron's gradient buckets need it), but may run on a different GPU type and
with its own recompute and offload policy. Pipelines may differ in micro-batch size and count:
that is how uneven data parallelism is expressed.

Megatron rank order is ``tp-dp-pp``: the slot (pipeline ``d``, stage ``s``, tensor rank ``t``)
is Megatron rank ``t + T * (d + D * s)``; see :meth:`.types.Plan.slot_of_rank`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from .._schema import OMIT_DEFAULT, from_data, read_yaml, write_yaml
from ..errors import Described, SchemaError
from ..hardware.catalog import Catalog, GPUSpec, load_catalog
from ..schedule.rules import check_warmups, group_fits
from .experts import check_expert_vendors, check_experts
from .stages import ModelSpec, Pipeline
from .types import Mesh, Plan

__all__ = ["Format1Plan", "uniform_plan", "replace_grid", "load_plan", "save_plan", "plan_from_data",
           "FORMAT_VERSION", "check_microbatch_group", "check_no_empty_chunk"]

FORMAT_VERSION = 1


@dataclass(kw_only=True, slots=True)
class Format1Plan:
    """A format-1 file's plan, checked field by field; :meth:`plan` gives the one in-memory
    :class:`.types.Plan` (one mesh)."""

    SCHEMA_NAME: ClassVar[str] = "Plan"

    format_version: Literal[1]
    model: ModelSpec
    global_batch_size: int
    tensor_model_parallel_size: int
    pipelines: list[Pipeline]
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data parallelism (``--use-distributed-optimizer``)."""
    sequence_parallel: bool = False
    """Megatron's ``--sequence-parallel`` (only meaningful with tensor parallelism)."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the last micro-batch's backward
    (Megatron's ``--overlap-grad-reduce``; with interleaving each model chunk's gradients go
    during that chunk's last backward, which for the later chunks comes earlier)."""
    virtual_pipeline_size: int = 1
    """Model chunks per pipeline stage (Megatron's interleaved 1F1B schedule when > 1). Every
    stage then lists ``chunk_layers``; the model runs chunk 0 of stages 0..p-1, then chunk 1 of
    stages 0..p-1, and so on."""
    microbatch_group_size: int | None = None
    """With interleaving: how many micro-batches run one model chunk in a row before the next
    chunk (Megatron's ``--microbatch-group-size-per-virtual-pipeline-stage``); None for
    Megatron's default, the pipeline size ``p``. A larger group gives the later stages more
    slack in the fill and drain, and every rank holds more micro-batches in flight. Megatron
    takes ``p`` to every pipeline's micro-batch count, with each count's remainder over it 0 or
    at least ``p``. Left out of the file when None."""
    gpus: dict[str, GPUSpec] = field(default_factory=dict)
    """Full catalog entries (the fields of catalog.yaml) by device type: the types this plan uses
    that the built-in catalog lacks, and built-in types whose figures the inventory overrode.
    Loading adds them to the catalog (replacing a built-in entry of the same name), so the
    runtime, ``rehearse`` and ``args`` know them without the inventory; ``tune`` writes them.
    Left out of the file when empty."""
    prediction: dict[str, float] | None = None
    """Figures the tuner predicted for this plan (informational; never read back as input)."""
    expert_model_parallel_size: int = field(default=1, metadata=OMIT_DEFAULT)
    """An MoE model's expert parallelism (EP, Megatron's ``--expert-model-parallel-size``):
    each stage's routed experts split over EP of its ranks (:mod:`.experts`)."""
    expert_tensor_parallel_size: int | None = None
    """Tensor ranks of one expert (Megatron's ``--expert-tensor-parallel-size``; None: TP)."""
    catalog: Catalog | None = field(default=None, compare=False, repr=False,
                                    metadata={"internal": True})
    """The catalog the plan was checked against on load (the given one plus ``gpus``); None for
    a plan built in code."""

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise SchemaError("", "global_batch_size", self.global_batch_size, "a positive integer")
        tp = self.tensor_model_parallel_size
        if tp < 1:
            raise SchemaError("", "tensor_model_parallel_size", tp, "a positive integer")
        m = self.model
        if m.num_attention_heads % tp or m.num_query_groups % tp:
            raise SchemaError("", "tensor_model_parallel_size", tp,
                              f"a divisor of model.num_attention_heads ({m.num_attention_heads}) "
                              f"and model.num_query_groups ({m.num_query_groups})")
        if not self.pipelines:
            raise SchemaError("", "pipelines", self.pipelines, "at least one pipeline")
        first = self.pipelines[0].stages
        for d, pipe in enumerate(self.pipelines[1:], start=1):
            if len(pipe.stages) != len(first):
                raise SchemaError("", f"pipelines[{d}].stages", Described(f"{len(pipe.stages)} stages"),
                                  f"{len(first)} stages, as in pipelines[0]")
            for s, stage in enumerate(pipe.stages):
                if stage.num_layers != first[s].num_layers:
                    raise SchemaError("", f"pipelines[{d}].stages[{s}].num_layers", stage.num_layers,
                                      f"{first[s].num_layers}, as in pipelines[0] (a stage index "
                                      "has the same layers in every pipeline)")
        total = sum(s.num_layers for s in first)
        if total != m.num_layers:
            raise SchemaError("", "pipelines[0].stages", Described(f"layers adding up to {total}"),
                              f"layers adding up to model.num_layers ({m.num_layers})")
        last = len(first) - 1
        for s, stage in enumerate(first):
            if stage.num_layers == 0 and 0 < s < last:
                raise SchemaError("", f"pipelines[0].stages[{s}].num_layers", 0,
                                  "at least 1 layer on a middle stage (only the first and last "
                                  "stage may hold just the embedding or the loss)")
        if len(first) == 1 and first[0].num_layers == 0:
            raise SchemaError("", "pipelines[0].stages[0].num_layers", 0, "at least 1")
        if self.sequence_parallel and tp == 1:
            raise SchemaError("", "sequence_parallel", True,
                              "false when tensor_model_parallel_size is 1")
        self._check_chunks()
        check_experts(m, tp=tp, ep=self.expert_model_parallel_size,
                      etp=self.expert_tensor_parallel_size, pipelines=self.pipelines,
                      sequence_parallel=self.sequence_parallel, where="", replicas="pipelines")
        check_warmups(self)
        samples = sum(p.samples for p in self.pipelines)
        if samples != self.global_batch_size:
            raise SchemaError("", "global_batch_size", self.global_batch_size,
                              f"the sum over pipelines of micro_batch_size x num_microbatches "
                              f"({samples})")

    def _check_chunks(self) -> None:
        v, first = self.virtual_pipeline_size, self.pipelines[0].stages
        p, g = len(first), self.microbatch_group_size
        if v < 1:
            raise SchemaError("", "virtual_pipeline_size", v, "a positive integer")
        if g is not None and v == 1:
            raise SchemaError("", "microbatch_group_size", g,
                              "absent (it groups the micro-batches of the interleaved schedule, "
                              "and virtual_pipeline_size is 1)")
        if v == 1:
            for d, pipe in enumerate(self.pipelines):
                for s, stage in enumerate(pipe.stages):
                    if stage.chunk_layers is not None and len(stage.chunk_layers) != 1:
                        raise SchemaError("", f"pipelines[{d}].stages[{s}].chunk_layers",
                                          stage.chunk_layers, "absent (virtual_pipeline_size is 1)")
            return
        if p == 1:
            raise SchemaError("", "virtual_pipeline_size", v,
                              "1 when there is a single pipeline stage (interleaving needs "
                              "pipeline parallelism)")
        for d, pipe in enumerate(self.pipelines):
            for s, stage in enumerate(pipe.stages):
                path = f"pipelines[{d}].stages[{s}].chunk_layers"
                if stage.chunk_layers is None or len(stage.chunk_layers) != v:
                    raise SchemaError("", path, stage.chunk_layers,
                                      f"a list of {v} layer counts (virtual_pipeline_size is {v})")
                if stage.chunk_layers != first[s].chunk_layers:
                    raise SchemaError("", path, stage.chunk_layers,
                                      f"{first[s].chunk_layers}, as in pipelines[0] (a stage index "
                                      "has the same chunks in every pipeline)")
            check_microbatch_group(p, g, f"pipelines[{d}]", pipe.num_microbatches)
        check_no_empty_chunk(self.virtual_stage_layers, p,
                             lambda s: f"pipelines[0].stages[{s}].chunk_layers")

    # -- shape -----------------------------------------------------------------------------------
    @property
    def virtual_stage_layers(self) -> list[int]:
        """Layers per virtual pipeline stage in model order (chunk-major: chunk 0 of every stage,
        then chunk 1, ...); the stage totals when ``virtual_pipeline_size`` is 1."""
        stages = self.pipelines[0].stages
        if self.virtual_pipeline_size == 1:
            return [s.num_layers for s in stages]
        return [s.chunk_layers[c] for c in range(self.virtual_pipeline_size) for s in stages]

    def plan(self) -> Plan:
        """The one in-memory plan: one mesh of this file's TP and pipelines."""
        return Plan(model=self.model, global_batch_size=self.global_batch_size,
                    meshes=[Mesh(tensor_model_parallel_size=self.tensor_model_parallel_size,
                                 pipelines=self.pipelines,
                                 expert_model_parallel_size=self.expert_model_parallel_size,
                                 expert_tensor_parallel_size=self.expert_tensor_parallel_size)],
                    precision=self.precision,
                    use_distributed_optimizer=self.use_distributed_optimizer,
                    sequence_parallel=self.sequence_parallel,
                    overlap_grad_reduce=self.overlap_grad_reduce,
                    virtual_pipeline_size=self.virtual_pipeline_size,
                    microbatch_group_size=self.microbatch_group_size, gpus=self.gpus,
                    prediction=self.prediction, catalog=self.catalog)


def uniform_plan(**fields) -> Plan:
    """The plan of one mesh that a format-1 file with these fields (less ``format_version``)
    gives, with that file's checks."""
    return Format1Plan(format_version=FORMAT_VERSION, **fields).plan()


def replace_grid(plan: Plan, **changes) -> Plan:
    """``plan`` (one grid) with ``changes`` to its format-1 fields (``pipelines``,
    ``microbatch_group_size``, ``model``...), checked as a format-1 file is."""
    fields = dict(model=plan.model, global_batch_size=plan.global_batch_size,
                  tensor_model_parallel_size=plan.tensor_model_parallel_size,
                  pipelines=plan.pipelines, precision=plan.precision,
                  use_distributed_optimizer=plan.use_distributed_optimizer,
                  sequence_parallel=plan.sequence_parallel,
                  overlap_grad_reduce=plan.overlap_grad_reduce,
                  virtual_pipeline_size=plan.virtual_pipeline_size,
                  microbatch_group_size=plan.microbatch_group_size, gpus=plan.gpus,
                  prediction=plan.prediction, catalog=plan.catalog,
                  expert_model_parallel_size=plan.meshes[0].expert_model_parallel_size,
                  expert_tensor_parallel_size=plan.meshes[0].expert_tensor_parallel_size)
    return uniform_plan(**(fields | changes))


def plan_from_data(data: object, *, source: str = "<plan>", catalog: Catalog | None = None) -> Plan:
    """Build and check a plan from plain data. Device types must be canonical names of
    ``catalog`` (default: the built-in one) plus the plan's own ``gpus`` entries, which take
    precedence over ``catalog``'s (see :func:`.plan_inventory.check_plan_gpus` for the check
    against an inventory). The result's ``catalog`` is that merged catalog."""
    if isinstance(data, dict) and data.get("format_version") == 2:
        raise SchemaError(source, "format_version", 2,
                          "1 here: this command does not take mesh plans (format 2) yet")
    plan = from_data(Format1Plan, data, source=source)
    catalog = bind_catalog(plan, catalog, source=source)
    for d, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            check_device_type(catalog, stage.device_type, precision=plan.precision,
                              source=source, path=f"pipelines[{d}].stages[{s}].device_type")
    out = plan.plan()
    check_expert_vendors(out, catalog, source=source)
    return out


def bind_catalog(plan, catalog: Catalog | None, *, source: str) -> Catalog:
    """``catalog`` (default: the built-in one) with the plan file's ``gpus`` entries added; the
    plan keeps it and its entries resolved through it. Both formats' readers call it."""
    catalog = (catalog or load_catalog()).with_entries(plan.gpus, source=source)
    plan.gpus = {name: catalog.get(name) for name in plan.gpus}
    plan.catalog = catalog
    return catalog


def check_device_type(catalog: Catalog, name: str, *, precision: str, source: str,
                      path: str) -> str:
    """The canonical catalog name ``name`` at ``path`` must be (a :class:`SchemaError` for an
    unknown name, an alias, or bf16 on a card without it); returns it."""
    canonical = catalog.resolve(name)
    if canonical is None:
        catalog.get(name, source=source, path=path)  # raises the full message
    if canonical != name:
        raise SchemaError(source, path, name, f"a canonical catalog name ({canonical!r})")
    if precision == "bf16" and not catalog.get(canonical).bf16:
        raise SchemaError(source, "precision", precision,
                          f"fp16 or fp32: {canonical} (at {path}) has no bf16")
    return canonical


def load_plan(path: str | Path, *, catalog: Catalog | None = None) -> Plan:
    """Load and check ``plan.yaml``. Errors are :class:`SchemaError` naming file and field path."""
    return plan_from_data(read_yaml(path), source=str(path), catalog=catalog)


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` in the simplest format that expresses it (:meth:`.types.Plan.to_data`)."""
    write_yaml(plan.to_data(), path)


def check_microbatch_group(p: int, g: int | None, replica: str, m: int) -> None:
    """An interleaved plan's replica at field path ``replica`` runs ``m`` micro-batches over
    ``p`` pipeline stages: whole groups of ``p``, or of the plan's ``microbatch_group_size``
    ``g`` (the layouts the tuner searches keep them; Megatron itself takes any count whose
    remainder over its group is 0 or at least ``p``), each refused by its field path."""
    if m % p and g is None:
        raise SchemaError("", f"{replica}.num_microbatches", m,
                          f"a multiple of the {p} pipeline stages (whole groups of "
                          "micro-batches under the interleaved schedule), or a "
                          "microbatch_group_size whose groups it fills")
    if g is not None and not group_fits(g, p, [m]):
        raise SchemaError("", "microbatch_group_size", g,
                          f"between the {p} pipeline stages and {replica}'s {m} "
                          f"micro-batches, with {m} % group 0 or at least {p} "
                          "(Megatron's interleaved schedule refuses other groups)")


def check_no_empty_chunk(chunks: list[int], p: int, stage_path) -> None:
    """No virtual stage but the model's first and last holds 0 layers; ``chunks`` are the
    layers per virtual stage in model order over ``p`` stages, ``stage_path(s)`` the field path
    of stage ``s``'s ``chunk_layers``."""
    for i, n in enumerate(chunks):
        if n == 0 and 0 < i < len(chunks) - 1:
            c, s = divmod(i, p)
            raise SchemaError("", f"{stage_path(s)}[{c}]", 0,
                              "at least 1 layer (only the first chunk of the first stage and "
                              "the last chunk of the last stage may hold just the embedding "
                              "or the loss)")
