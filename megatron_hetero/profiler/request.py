"""What ``megatron-hetero profile`` measures: :class:`ProfileRequest`, and a layer's FLOPs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import HeteroError
from ..plan import ModelSpec

CPU_DEVICE_TYPE = "CPU"


@dataclass(kw_only=True, slots=True)
class ProfileRequest:
    """What to measure."""

    model: ModelSpec
    micro_batch_sizes: list[int]
    tensor_parallel_sizes: list[int] = field(default_factory=lambda: [1])
    warmup: int = 2
    """Untimed iterations per part before the timed ones."""
    repeats: int = 5
    """Timed iterations per part; the median is kept."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """``auto``: bf16 on a GPU (fp16 where the catalog says the card has no bf16), fp32 on CPU."""
    device_type: str | None = None
    """Catalog name to record; detected from the device name when None (``CPU`` on CPU)."""
    cpu_threads: int | None = None
    """torch intra-op threads per CPU rank (None: torch's default)."""
    layers: int = 2
    """Transformer layers timed in sequence; per-layer figures are the total over this count,
    so that each layer meets caches holding the other layer's weights, as in a real stack."""
    bandwidth: bool = True
    """Measure p2p and all-reduce bandwidth when more than one rank runs."""
    pipeline: bool = True
    """Also run a 2-stage pipeline through Megatron's own 1F1B schedule and record how much
    longer each stage's forward and backward of a micro-batch take there than the sum of its
    parts timed alone (:func:`.pipeline.measure_pipeline`). Needs 2 ranks: on the CPU backend
    the profiler starts them; on GPUs, 2 visible GPUs or torchrun with at least 2 ranks."""
    pipeline_microbatches: int = 4
    """Micro-batches per step of that pipeline (1F1B: warm-up, steady state and cool-down)."""
    idle_factor: float = 0.0
    """CPU backend only: also measure what a step costs more when it follows an idle gap of
    ``idle_factor`` times its duration, as every step of a rehearsal rank that plays a device
    ``idle_factor + 1`` times slower than the CPU does (:func:`.parts.time_idle_penalty`; the
    entries' ``idle_penalty``). The parts themselves are always timed back to back. 0: not
    measured."""
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.micro_batch_sizes or min(self.micro_batch_sizes) < 1:
            raise HeteroError(f"micro_batch_sizes: {self.micro_batch_sizes}; expected positive integers")
        if not self.tensor_parallel_sizes or min(self.tensor_parallel_sizes) < 1:
            raise HeteroError(f"tensor_parallel_sizes: {self.tensor_parallel_sizes}; "
                             "expected positive integers")
        for tp in self.tensor_parallel_sizes:
            m = self.model
            if m.num_attention_heads % tp or m.num_query_groups % tp:
                raise HeteroError(
                    f"--tensor-parallel-sizes: {tp} does not divide the model's attention heads "
                    f"({m.num_attention_heads}) and query groups ({m.num_query_groups})")
        if self.layers < 1:
            raise HeteroError(f"--layers {self.layers}: expected at least 1")
        if not 0 <= self.idle_factor < float("inf"):
            raise HeteroError(f"--idle-factor {self.idle_factor}: expected a finite number >= 0")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise HeteroError(f"--cpu-threads {self.cpu_threads}: expected at least 1")
        if self.pipeline_microbatches < 2:
            raise HeteroError(f"pipeline_microbatches {self.pipeline_microbatches}: expected at "
                              "least 2 (a 2-stage pipeline)")
        if self.warmup < 0 or self.repeats < 1:
            raise HeteroError(f"--warmup {self.warmup} --repeats {self.repeats}: expected "
                              "warmup >= 0 and repeats >= 1")


def layer_flops(model: ModelSpec, micro_batch_size: int, tensor_parallel_size: int = 1) -> float:
    """Model FLOPs of one transformer layer's forward and backward (backward = 2 x forward) for
    one micro-batch, per rank of the TP group: the tuner's own formula
    (:func:`megatron_hetero.models.layer_forward_flops`)."""
    from ..models import layer_forward_flops
    return 3.0 * layer_forward_flops(model, micro_batch_size) / tensor_parallel_size
