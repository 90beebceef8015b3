"""The device profile file's format (``profile.yaml``, ``format_version: 2``): its version
numbers, the model-shape fields a measurement applies to, and the dataclasses of the file.

Reading, looking up and writing these files is :mod:`megatron_hetero.cost.profile_file`; the
format is documented in ``docs/profile-format.md``. Construction is strict: a bad value is a
:class:`SchemaError` naming the field.

No torch here: the tuner imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .._schema import to_data
from ..errors import Described, SchemaError
from ..limits import quantity
from ..plan import ModelSpec

__all__ = ["FORMAT_VERSION", "READABLE_VERSIONS", "LAYER_SHAPE_FIELDS", "VOCAB_SHAPE_FIELDS",
           "DeviceInfo", "Software", "Timing", "PartTimes", "MemoryFigures", "StepPenalty",
           "ProfileEntry", "BandwidthSample", "Communication", "PipelineStageTimes",
           "PipelineEntry", "PipelineFigures", "ProfileData"]

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Format versions :func:`~megatron_hetero.cost.profile_file.load_profile` reads (1: no
``pipeline`` section)."""

LAYER_SHAPE_FIELDS = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                      "seq_length", "swiglu", "normalization", "add_bias_linear", "add_qkv_bias",
                      "kv_channels", "qk_layernorm")
"""ModelSpec fields that decide the cost of one transformer layer."""
VOCAB_SHAPE_FIELDS = LAYER_SHAPE_FIELDS + ("vocab_size", "position_embedding_type")
"""ModelSpec fields that decide the cost of the embedding and of the output layer with its loss."""


@dataclass(kw_only=True, slots=True)
class DeviceInfo:
    """What was profiled."""

    name: str
    """Name the device reports (``torch.cuda.get_device_name()``, or the CPU model)."""
    type: str
    """Canonical catalog name of the device type, or ``CPU`` for a CPU run (add a ``CPU`` entry
    under the inventory's ``gpus:`` key to plan with it)."""
    backend: Literal["cuda", "cpu"]
    ranks: int = 1
    """Processes used; more than 1 when TP > 1 was profiled or bandwidth was measured."""
    peak_matmul_tflops: float | None = field(default=None, metadata=quantity("tflops"))
    """Dense matmul rate measured on this device in the profiled precision (TFLOPS)."""
    memory_bytes: int | None = field(default=None, metadata=quantity("bytes"))
    """Device memory the profiler saw (total device memory, or host RAM on CPU)."""

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise SchemaError("", "ranks", self.ranks, "a positive integer")


@dataclass(kw_only=True, slots=True)
class Software:
    """Versions of what ran the measurement (``null`` when not installed)."""

    megatron_hetero: str
    python: str
    torch: str
    megatron_core: str
    transformer_engine: str | None = None
    cuda: str | None = None


@dataclass(kw_only=True, slots=True)
class Timing:
    """How the times were taken."""

    method: Literal["cuda-events", "thread-cpu-time", "synchronize-wall-clock", "run-telemetry"]
    """``cuda-events``: GPU time between CUDA events. ``thread-cpu-time``: CPU time of the calling
    thread (CPU runs with one torch thread; immune to other processes on the cores).
    ``synchronize-wall-clock``: wall-clock time (CPU runs with several threads).
    ``run-telemetry``: a training run's own measured stage compute (``--hetero-telemetry``),
    apportioned to the parts in the ratios the cost model prices them
    (:mod:`megatron_hetero.telemetry.profile_out`); no memory figures."""
    warmup: int
    """Untimed iterations before the timed ones."""
    repeats: int
    """Timed iterations; every time in the file is their median."""
    layer_spec: Literal["transformer_engine", "local"]
    precision: Literal["bf16", "fp16", "fp32"]
    layers: int = 1
    """Transformer layers run in sequence for the ``layer`` figures, which are per layer (the
    stack's time and bytes over this count; ``memory.peak_bytes`` is the stack's)."""
    idle_factor: float = 0.0
    """CPU only (format 2): the idle gap, in multiples of a step, after which the entries'
    ``idle_penalty`` was measured (as the rehearsal's speed emulation runs a device
    ``idle_factor + 1`` times slower than the CPU); 0: not measured. The parts are always
    timed back to back."""

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise SchemaError("", "warmup", self.warmup, "a non-negative integer")
        if self.repeats < 1:
            raise SchemaError("", "repeats", self.repeats, "a positive integer")
        if self.layers < 1:
            raise SchemaError("", "layers", self.layers, "a positive integer")
        if not self.idle_factor >= 0:
            raise SchemaError("", "idle_factor", self.idle_factor, "a number >= 0")


@dataclass(kw_only=True, slots=True)
class PartTimes:
    """Median seconds of one micro-batch through one part, per rank of the TP group."""

    forward_s: float = field(metadata=quantity("seconds"))
    backward_s: float = field(metadata=quantity("seconds"))

    def __post_init__(self) -> None:
        for key in ("forward_s", "backward_s"):
            if not getattr(self, key) > 0:
                raise SchemaError("", key, getattr(self, key), "a positive number of seconds")


@dataclass(kw_only=True, slots=True)
class MemoryFigures:
    """Memory of one micro-batch on one rank of the TP group (bytes)."""

    method: Literal["cuda-max-memory-allocated", "saved-tensors"]
    """``cuda-max-memory-allocated``: allocator peaks on a GPU. ``saved-tensors``: on CPU, the
    bytes autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``), counted once
    per storage; ``peak_bytes`` is then parameters + gradients + saved tensors, not an allocator
    peak."""
    parameter_bytes_per_layer: int = field(metadata=quantity("bytes"))
    activation_bytes_per_layer: int = field(metadata=quantity("bytes"))
    """Bytes one layer keeps for backward (no recompute)."""
    peak_bytes: int = field(metadata=quantity("bytes"))
    """Peak over the forward and backward of the ``timing.layers`` timed layers, parameters and
    gradients included."""


@dataclass(kw_only=True, slots=True)
class StepPenalty:
    """Seconds one step (a forward or a backward call) costs more after an idle gap than back to
    back (format 2; may be negative within the scatter)."""

    forward_s: float
    backward_s: float


@dataclass(kw_only=True, slots=True)
class ProfileEntry:
    """Measurements at one (micro-batch size, TP size)."""

    micro_batch_size: int
    tensor_parallel_size: int
    layer: PartTimes
    """One transformer layer."""
    embedding: PartTimes
    output: PartTimes
    """The output layer with its cross-entropy loss."""
    memory: MemoryFigures | None = None
    """None in a profile taken from a run's telemetry (``timing.method: run-telemetry``): the
    cost model then prices memory as it does without a profile."""
    achieved_tflops: float | None = field(default=None, metadata=quantity("tflops"))
    """Model FLOPs of one layer's forward and backward over its measured time, per rank."""
    clock: Literal["cuda-events", "thread-cpu-time", "synchronize-wall-clock"] | None = None
    """How this entry was timed when it differs from ``timing.method`` (a CPU run times TP > 1
    by wall clock, so that the tensor-parallel communication, which the CPU-time clock does not
    see, is included as it is on a GPU)."""
    idle_penalty: StepPenalty | None = None
    """CPU, TP=1, with ``timing.idle_factor`` > 0 (format 2): what a step of the layer stack
    costs more after an idle gap of ``idle_factor`` times its duration than back to back (per
    step, not per layer): what the rehearsal's emulated devices pay on every step."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise SchemaError("", "micro_batch_size", self.micro_batch_size, "a positive integer")
        if self.tensor_parallel_size < 1:
            raise SchemaError("", "tensor_parallel_size", self.tensor_parallel_size,
                              "a positive integer")


@dataclass(kw_only=True, slots=True)
class BandwidthSample:
    """One message size of a collective, median of repeats."""

    bytes: int = field(metadata=quantity("bytes"))
    seconds: float = field(metadata=quantity("seconds"))
    gb_s: float = field(metadata=quantity("bandwidth_gb_s"))
    """Bus bandwidth in GB/s: bytes / seconds for p2p; 2 (n-1)/n bytes / seconds for all-reduce."""


@dataclass(kw_only=True, slots=True)
class Communication:
    """Bandwidth between the profiler's ranks (only when it ran with more than one)."""

    ranks: int
    backend: str
    """torch.distributed backend (``nccl``, ``gloo``)."""
    p2p: list[BandwidthSample]
    all_reduce: list[BandwidthSample]
    p2p_latency_s: float | None = field(default=None, metadata=quantity("latency_s"))
    """One-way time of the smallest p2p message (4 KiB): the fixed cost of a message, the
    alpha of ``alpha + bytes / bandwidth`` (format 2)."""


@dataclass(kw_only=True, slots=True)
class PipelineStageTimes:
    """One stage of the profiler's 2-stage pipeline: median seconds of a micro-batch's forward
    and backward measured inside the running schedule, and the sum of the stage's parts timed
    alone (``entries``: embedding + layers on the first stage, layers + output on the last)."""

    forward_s: float = field(metadata=quantity("seconds"))
    backward_s: float = field(metadata=quantity("seconds"))
    parts_forward_s: float = field(metadata=quantity("seconds"))
    parts_backward_s: float = field(metadata=quantity("seconds"))


@dataclass(kw_only=True, slots=True)
class PipelineEntry:
    """The pipeline measurement at one micro-batch size."""

    micro_batch_size: int
    tensor_parallel_size: int = 1
    first: PipelineStageTimes
    last: PipelineStageTimes
    forward_overhead_s: float
    """Mean over the two stages of (in the pipeline - parts) for a forward: what a pipeline
    stage pays per micro-batch beyond its parts. May be negative within the measurement's
    scatter; the cost model counts it from 0 up."""
    backward_overhead_s: float

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise SchemaError("", "micro_batch_size", self.micro_batch_size, "a positive integer")


@dataclass(kw_only=True, slots=True)
class PipelineFigures:
    """A 2-stage pipeline run through megatron-core's own 1F1B schedule (format 2; only when
    the profiler ran with at least 2 ranks)."""

    stages: int
    layers_per_stage: int
    """Transformer layers of each stage (``timing.layers``)."""
    microbatches: int
    """Micro-batches per step."""
    entries: list[PipelineEntry]


@dataclass(kw_only=True, slots=True)
class ProfileData:
    """The whole ``profile.yaml``."""

    format_version: Literal[1, 2]
    device: DeviceInfo
    software: Software
    timing: Timing
    model: ModelSpec
    """The shape profiled (``num_layers`` is the model's, not what was run)."""
    entries: list[ProfileEntry]
    created: str = ""
    """UTC time of the measurement, ISO 8601."""
    efficiency: float | None = None
    """Fraction of the catalog's ``bf16_tflops`` (or of ``device.peak_matmul_tflops`` for a CPU)
    one transformer layer achieved at TP=1, best micro-batch size."""
    communication: Communication | None = None
    pipeline: PipelineFigures | None = None
    """Format 2: the pipeline measurement (:class:`PipelineFigures`)."""
    moe_load_imbalance: float | None = None
    """An MoE model's most loaded expert rank's routed tokens over the mean (at least 1), as
    measured (a run's telemetry measures it per expert, the bound at any EP): the cost model
    slows the routed experts and the all-to-alls by it on this device type (docs/moe.md). Left
    out of the file when None."""
    optimizer_factor: float | None = None
    """The optimizer step as measured over the cost model's price of it (memory-bound at the
    card's full bandwidth): a run's telemetry measures it (without Apex or Transformer Engine's
    fused Adam, megatron-core's fallback ran 4.7x the price on an H200, docs/gpu.md); the cost
    model prices this device type's optimizer step at it. Left out of the file when None."""

    def __post_init__(self) -> None:
        if self.format_version == 1 and (
                self.pipeline is not None or self.timing.idle_factor
                or any(e.idle_penalty is not None for e in self.entries)
                or (self.communication is not None
                    and self.communication.p2p_latency_s is not None)):
            raise SchemaError("", "format_version", 1,
                              "2 (the file has format-2 fields: pipeline, "
                              "timing.idle_factor or communication.p2p_latency_s)")
        if not self.entries:
            raise SchemaError("", "entries", self.entries, "at least one measurement")
        seen: dict[tuple[int, int], int] = {}
        for i, e in enumerate(self.entries):
            key = (e.micro_batch_size, e.tensor_parallel_size)
            if key in seen:
                raise SchemaError("", f"entries[{i}]",
                                  Described(f"micro_batch_size {key[0]}, tensor_parallel_size "
                                            f"{key[1]} again"),
                                  f"one entry per pair (entries[{seen[key]}] has it)")
            seen[key] = i
        if self.moe_load_imbalance is not None and not 1 <= self.moe_load_imbalance <= 1000:
            raise SchemaError("", "moe_load_imbalance", self.moe_load_imbalance,
                              "a factor from 1 (balanced) to 1000")
        if self.optimizer_factor is not None and not 0.01 <= self.optimizer_factor <= 1000:
            raise SchemaError("", "optimizer_factor", self.optimizer_factor,
                              "a factor from 0.01 to 1000")
        if self.efficiency is not None and not 0 < self.efficiency <= 1:
            raise SchemaError("", "efficiency", self.efficiency, "a fraction in (0, 1]")

    def to_data(self) -> dict:
        return to_data(self)
