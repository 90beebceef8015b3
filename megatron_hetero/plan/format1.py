"""The plan (``plan.yaml``, ``format_version: 1``): the one contract between the tuner, the
runtime, the launch scripts and the user.

A plan lists one pipeline per data-parallel replica (in data-parallel rank order); each
pipeline lists its stages in pipeline rank order. Stage ``s`` has the same number of layers in
every pipeline (Megatron's gradient buckets need it), but may run on a different GPU type and
with its own recompute and offload policy. Pipelines may differ in micro-batch size and count:
that is how uneven data parallelism is expressed.

Megatron rank order is ``tp-dp-pp``: the slot (pipeline ``d``, stage ``s``, tensor rank ``t``)
is Megatron rank ``t + T * (d + D * s)``; see :meth:`Plan.slot_of_rank`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .._schema import from_data, read_yaml, to_data, write_yaml
from ..errors import Described, SchemaError
from ..hardware.catalog import Catalog, GPUSpec, load_catalog
from ..limits import check_model_sizes
from .policy import Offload, Recompute, chunk_recompute
from ..schedule.rules import check_warmups, group_fits

__all__ = ["ModelSpec", "Recompute", "Offload", "Stage", "Pipeline", "Plan", "Slot",
           "load_plan", "save_plan", "plan_from_data", "group_fits", "chunk_recompute",
           "FORMAT_VERSION"]

FORMAT_VERSION = 1


@dataclass(kw_only=True, slots=True)
class ModelSpec:
    """Transformer shape. Names follow Megatron's arguments."""

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """Key/value head groups; equal to ``num_attention_heads`` for plain multi-head attention."""
    vocab_size: int
    seq_length: int
    swiglu: bool = True
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    position_embedding_type: Literal["rope", "learned_absolute"] = "rope"
    untie_embeddings_and_output_weights: bool = True
    add_bias_linear: bool = False

    def __post_init__(self) -> None:
        check_model_sizes(self)
        if self.hidden_size % self.num_attention_heads:
            raise SchemaError("", "hidden_size", self.hidden_size,
                              f"a multiple of num_attention_heads ({self.num_attention_heads})")
        head_dim = self.hidden_size // self.num_attention_heads
        if self.position_embedding_type == "rope" and head_dim % 2:
            raise SchemaError("", "hidden_size", self.hidden_size,
                              f"an even size per attention head for rope (hidden_size / "
                              f"num_attention_heads = {head_dim})")
        if self.num_attention_heads % self.num_query_groups:
            raise SchemaError("", "num_query_groups", self.num_query_groups,
                              f"a divisor of num_attention_heads ({self.num_attention_heads})")


@dataclass(kw_only=True, slots=True)
class Stage:
    """One pipeline stage of one replica: its GPU type, its layers and its memory policy."""

    device_type: str
    """Canonical catalog name of the GPU type that runs this stage (all its TP ranks)."""
    num_layers: int
    recompute: Recompute = field(default_factory=Recompute)
    offload: Offload = field(default_factory=Offload)
    chunk_layers: list[int] | None = None
    """With interleaved pipelining (``Plan.virtual_pipeline_size`` = v > 1): the layers of each
    of this stage's v model chunks, in chunk order; they add up to ``num_layers``."""
    warmup_microbatches: int | None = None
    """Warm-up forwards of this stage's 1F1B, run before it alternates forwards and backwards
    (Megatron's ``num_warmup_microbatches``; None: its ``min(p - s - 1, num_microbatches)``).
    More keeps micro-batches in flight so that sends over a slow link hide behind compute. At
    most ``num_microbatches``, at least one more than the next stage's; non-interleaved plans
    only (:mod:`.schedule_order`). Left out of the file when None."""

    def __post_init__(self) -> None:
        if self.num_layers < 0:
            raise SchemaError("", "num_layers", self.num_layers, "a non-negative integer")
        if self.chunk_layers is not None:
            if not self.chunk_layers or min(self.chunk_layers) < 0:
                raise SchemaError("", "chunk_layers", self.chunk_layers,
                                  "a list of non-negative layer counts, one per model chunk")
            if sum(self.chunk_layers) != self.num_layers:
                raise SchemaError("", "chunk_layers", self.chunk_layers,
                                  f"counts adding up to num_layers ({self.num_layers})")
        if self.recompute.num_layers is not None and self.recompute.num_layers > max(self.num_layers, 1):
            raise SchemaError("", "recompute.num_layers", self.recompute.num_layers,
                              f"at most the stage's num_layers ({self.num_layers})")


@dataclass(kw_only=True, slots=True)
class Pipeline:
    """One data-parallel replica."""

    micro_batch_size: int
    num_microbatches: int
    """Micro-batches this replica runs per step; may differ between replicas."""
    stages: list[Stage]

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise SchemaError("", "micro_batch_size", self.micro_batch_size, "a positive integer")
        if self.num_microbatches < 1:
            raise SchemaError("", "num_microbatches", self.num_microbatches, "a positive integer")
        if not self.stages:
            raise SchemaError("", "stages", self.stages, "at least one stage")

    @property
    def samples(self) -> int:
        return self.micro_batch_size * self.num_microbatches


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one Megatron rank sits in the plan."""

    pipeline: int
    stage: int
    tensor_rank: int


@dataclass(kw_only=True, slots=True)
class Plan:
    """A complete heterogeneous training plan."""

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
            # whole groups of p, or of the plan's group: the layouts the tuner searches keep
            # them (Megatron itself takes any count whose remainder over its group is 0 or at
            # least p)
            m = pipe.num_microbatches
            if m % p and g is None:
                raise SchemaError("", f"pipelines[{d}].num_microbatches", m,
                                  f"a multiple of the {p} pipeline stages (whole groups of "
                                  "micro-batches under the interleaved schedule), or a "
                                  "microbatch_group_size whose groups it fills")
            if g is not None and not group_fits(g, p, [m]):
                raise SchemaError("", "microbatch_group_size", g,
                                  f"between the {p} pipeline stages and pipelines[{d}]'s {m} "
                                  f"micro-batches, with {m} % group 0 or at least {p} "
                                  "(Megatron's interleaved schedule refuses other groups)")
        chunks = self.virtual_stage_layers
        for i, n in enumerate(chunks):
            if n == 0 and 0 < i < len(chunks) - 1:
                c, s = divmod(i, p)
                raise SchemaError("", f"pipelines[0].stages[{s}].chunk_layers[{c}]", 0,
                                  "at least 1 layer (only the first chunk of the first stage and "
                                  "the last chunk of the last stage may hold just the embedding "
                                  "or the loss)")

    # -- shape -----------------------------------------------------------------------------------
    @property
    def virtual_stage_layers(self) -> list[int]:
        """Layers per virtual pipeline stage in model order (chunk-major: chunk 0 of every stage,
        then chunk 1, ...); the stage totals when ``virtual_pipeline_size`` is 1."""
        stages = self.pipelines[0].stages
        if self.virtual_pipeline_size == 1:
            return [s.num_layers for s in stages]
        return [s.chunk_layers[c] for c in range(self.virtual_pipeline_size) for s in stages]

    @property
    def pipeline_model_parallel_size(self) -> int:
        return len(self.pipelines[0].stages)

    @property
    def data_parallel_size(self) -> int:
        return len(self.pipelines)

    @property
    def world_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.data_parallel_size

    @property
    def layer_split(self) -> list[int]:
        return [s.num_layers for s in self.pipelines[0].stages]

    @property
    def uniform_data_parallel(self) -> bool:
        """True when every replica runs the same micro-batch size and count."""
        return len({(p.micro_batch_size, p.num_microbatches) for p in self.pipelines}) == 1

    def replica_sample_range(self, pipeline: int) -> tuple[int, int]:
        """(offset, count) of the samples of every global batch that replica ``pipeline`` reads:
        replicas take consecutive shares in data-parallel rank order."""
        offset = sum(p.samples for p in self.pipelines[:pipeline])
        return offset, self.pipelines[pipeline].samples

    @property
    def offloads_module_inputs(self) -> bool:
        """Whether any stage offloads its layers' module inputs (:class:`Offload`)."""
        return any(s.offload.module_inputs for p in self.pipelines for s in p.stages)

    @property
    def offloads_optimizer(self) -> bool:
        """True when some stage keeps part of its optimizer state on the host."""
        return any(s.offload.optimizer_fraction > 0 for p in self.pipelines for s in p.stages)

    def stage(self, pipeline: int, stage: int) -> Stage:
        return self.pipelines[pipeline].stages[stage]

    def slot_of_rank(self, rank: int) -> Slot:
        """The plan slot Megatron's rank ``rank`` plays (Megatron order ``tp-dp-pp``)."""
        tp, dp = self.tensor_model_parallel_size, self.data_parallel_size
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        return Slot(pipeline=(rank // tp) % dp, stage=rank // (tp * dp), tensor_rank=rank % tp)

    def rank_of_slot(self, slot: Slot) -> int:
        tp, dp = self.tensor_model_parallel_size, self.data_parallel_size
        return slot.tensor_rank + tp * (slot.pipeline + dp * slot.stage)

    def device_type_of_rank(self, rank: int) -> str:
        slot = self.slot_of_rank(rank)
        return self.stage(slot.pipeline, slot.stage).device_type

    def device_counts(self) -> Counter[str]:
        """GPUs the plan needs per device type."""
        counts: Counter[str] = Counter()
        for pipe in self.pipelines:
            for stage in pipe.stages:
                counts[stage.device_type] += self.tensor_model_parallel_size
        return counts

    def layout(self) -> str:
        """Megatron's ``pipeline_model_parallel_layout`` string for this plan's split: one segment
        per virtual pipeline stage, in model order."""
        parts = []
        split = self.virtual_stage_layers
        last = len(split) - 1
        for s, n in enumerate(split):
            body = "" if n == 0 else ("t" if n == 1 else f"t*{n}")
            parts.append(("E" if s == 0 else "") + body + ("L" if s == last else ""))
        return "|".join(parts)

    @property
    def microbatch_group(self) -> int:
        """The micro-batch group of the interleaved schedule (``microbatch_group_size``, by
        default the pipeline size)."""
        g = self.microbatch_group_size
        return self.pipeline_model_parallel_size if g is None else g

    # -- conversion ------------------------------------------------------------------------------
    def to_data(self) -> dict:
        data = to_data(self)
        if not self.gpus:
            data.pop("gpus", None)
        if self.microbatch_group_size is None:
            data.pop("microbatch_group_size", None)
        return data


def plan_from_data(data: object, *, source: str = "<plan>", catalog: Catalog | None = None) -> Plan:
    """Build and check a plan from plain data. Device types must be canonical names of
    ``catalog`` (default: the built-in one) plus the plan's own ``gpus`` entries, which take
    precedence over ``catalog``'s (see :func:`.plan_inventory.check_plan_gpus` for the check
    against an inventory). The result's ``catalog`` is that merged catalog."""
    if isinstance(data, dict) and data.get("format_version") == 2:
        raise SchemaError(source, "format_version", 2,
                          "1 here: this command does not take mesh plans (format 2) yet")
    plan = from_data(Plan, data, source=source)
    catalog = (catalog or load_catalog()).with_entries(plan.gpus, source=source)
    plan.gpus = {name: catalog.get(name) for name in plan.gpus}
    plan.catalog = catalog
    for d, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            path = f"pipelines[{d}].stages[{s}].device_type"
            canonical = catalog.resolve(stage.device_type)
            if canonical is None:
                catalog.get(stage.device_type, source=source, path=path)  # raises the full message
            if canonical != stage.device_type:
                raise SchemaError(source, path, stage.device_type,
                                  f"a canonical catalog name ({canonical!r})")
            if plan.precision == "bf16" and not catalog.get(canonical).bf16:
                raise SchemaError(source, "precision", plan.precision,
                                  f"fp16 or fp32: {canonical} (at {path}) has no bf16")
    return plan


def load_plan(path: str | Path, *, catalog: Catalog | None = None) -> Plan:
    """Load and check ``plan.yaml``. Errors are :class:`SchemaError` naming file and field path."""
    return plan_from_data(read_yaml(path), source=str(path), catalog=catalog)


def save_plan(plan: Plan, path: str | Path) -> None:
    write_yaml(plan.to_data(), path)
