"""The parts of a plan (:mod:`.types`): the model, a pipeline stage, one replica's pipeline and
the batch a replica runs. Both file formats (:mod:`.format1`, :mod:`.format2`) build their plans
from these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .._schema import OMIT_DEFAULT
from ..errors import SchemaError
from ..limits import check_model_sizes
from .policy import Offload, Recompute

__all__ = ["ModelSpec", "Stage", "Pipeline", "Replica"]


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
    """False: the output layer shares the input embedding's weights (tied embeddings)."""
    add_bias_linear: bool = False
    add_qkv_bias: bool = field(default=False, metadata=OMIT_DEFAULT)
    """A bias on the query, key and value projections only (Qwen2/2.5)."""
    kv_channels: int | None = None
    """Size of one attention head; None: ``hidden_size / num_attention_heads`` (Gemma sets
    another)."""
    qk_layernorm: bool = field(default=False, metadata=OMIT_DEFAULT)
    """A norm over each query and key head (OLMo 2, Qwen3)."""
    rotary_base: int = field(default=10000, metadata=OMIT_DEFAULT)
    """Rotary position embedding's base (Mistral, Llama 3 and Qwen set larger ones)."""
    rotary_percent: float = field(default=1.0, metadata=OMIT_DEFAULT)
    """Fraction of each head's channels rotary embedding turns."""
    num_experts: int | None = None
    """Mixture of experts: the routed experts of each MoE layer (Megatron's ``--num-experts``);
    None for a dense model. Every key below needs it."""
    moe_router_topk: int = field(default=2, metadata=OMIT_DEFAULT)
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """FFN hidden size of one routed expert; None: ``ffn_hidden_size`` (as Megatron)."""
    moe_shared_expert_intermediate_size: int | None = None
    """FFN hidden size of the shared experts, all of them together (Qwen2-MoE, DeepSeek); None:
    none."""
    moe_shared_expert_gate: bool = field(default=False, metadata=OMIT_DEFAULT)
    """A sigmoid gate (one ``h x 1`` weight) on the shared experts' output (Qwen2-MoE)."""
    moe_layer_freq: int | list[int] = field(default=1, metadata=OMIT_DEFAULT)
    """Which layers are MoE layers (the rest dense, of ``ffn_hidden_size``): an integer N makes
    every N-th layer from layer 0 one; a list gives 1 (MoE) or 0 (dense) per layer."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss",
                                            "sinkhorn", "none"] = field(default="aux_loss",
                                                                        metadata=OMIT_DEFAULT)
    """The router's load balancing (Megatron's choices; it costs no more than the router)."""
    moe_grouped_gemm: bool = field(default=False, metadata=OMIT_DEFAULT)
    """Run each rank's experts as one grouped GEMM (``--moe-grouped-gemm``); the cost model
    prices both alike unless a profile measured them."""

    def __post_init__(self) -> None:
        check_model_sizes(self)
        self._check_moe()
        if self.kv_channels is not None and not 1 <= self.kv_channels <= self.hidden_size * 4:
            raise SchemaError("", "kv_channels", self.kv_channels,
                              f"a head size from 1 to {self.hidden_size * 4} (4 x hidden_size)")
        if not 1 <= self.rotary_base <= 10**9:
            raise SchemaError("", "rotary_base", self.rotary_base, "a base from 1 to 10^9")
        if not 0 < self.rotary_percent <= 1:
            raise SchemaError("", "rotary_percent", self.rotary_percent, "a fraction in (0, 1]")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise SchemaError("", "hidden_size", self.hidden_size,
                              f"a multiple of num_attention_heads ({self.num_attention_heads}), "
                              "or kv_channels given")
        if self.position_embedding_type == "rope" and self.head_size % 2:
            field_name = "kv_channels" if self.kv_channels is not None else "hidden_size"
            raise SchemaError("", field_name, getattr(self, field_name),
                              f"an even size per attention head for rope (head size "
                              f"{self.head_size})")
        if self.num_attention_heads % self.num_query_groups:
            raise SchemaError("", "num_query_groups", self.num_query_groups,
                              f"a divisor of num_attention_heads ({self.num_attention_heads})")

    def _check_moe(self) -> None:
        e = self.num_experts
        if e is None:
            for key, default in _MOE_DEFAULTS.items():
                if getattr(self, key) != default:
                    raise SchemaError("", key, getattr(self, key),
                                      "absent: it describes MoE layers, and num_experts is not set")
            return
        if not 1 <= e <= 65536:
            raise SchemaError("", "num_experts", e, "a number of experts from 1 to 65536")
        if not 1 <= self.moe_router_topk <= e:
            raise SchemaError("", "moe_router_topk", self.moe_router_topk,
                              f"from 1 to num_experts ({e})")
        for key in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            value = getattr(self, key)
            if value is not None and not 1 <= value <= 10**7:
                raise SchemaError("", key, value, "a hidden size from 1 to 10^7")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise SchemaError("", "moe_shared_expert_gate", True,
                              "false without moe_shared_expert_intermediate_size (no shared "
                              "experts to gate)")
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            if not 1 <= freq <= self.num_layers:
                raise SchemaError("", "moe_layer_freq", freq,
                                  f"an interval from 1 to num_layers ({self.num_layers}), or a "
                                  "list of 0 and 1 per layer")
        else:
            if len(freq) != self.num_layers or any(x not in (0, 1) for x in freq):
                raise SchemaError("", "moe_layer_freq", freq,
                                  f"a list of {self.num_layers} entries (num_layers), each 1 "
                                  "(MoE layer) or 0 (dense layer)")
            if 1 not in freq:
                raise SchemaError("", "moe_layer_freq", freq,
                                  "at least one MoE layer (1), or no num_experts")

    @property
    def head_size(self) -> int:
        """Channels of one attention head (``kv_channels`` where set)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        """The model has MoE layers (``num_experts`` is set)."""
        return self.num_experts is not None

    @property
    def moe_layer_pattern(self) -> tuple[int, ...]:
        """1 for each MoE layer, 0 for each dense layer (Megatron's reading of
        ``moe_layer_freq``); all 0 for a dense model."""
        if self.num_experts is None:
            return (0,) * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return tuple(int(i % freq == 0) for i in range(self.num_layers))
        return tuple(freq)

    @property
    def expert_ffn_hidden_size(self) -> int:
        """One routed expert's FFN hidden size (``moe_ffn_hidden_size`` or ``ffn_hidden_size``)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size


_MOE_DEFAULTS = {"moe_router_topk": 2, "moe_ffn_hidden_size": None,
                 "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
                 "moe_layer_freq": 1, "moe_router_load_balancing_type": "aux_loss",
                 "moe_grouped_gemm": False}
"""The MoE keys and their defaults (a dense model leaves them so)."""


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
    only (:mod:`megatron_hetero.schedule.rules`). Left out of the file when None."""

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


@dataclass(frozen=True, kw_only=True, slots=True)
class Replica:
    """One data-parallel replica of a mesh: the batch it runs per step."""

    micro_batch_size: int
    num_microbatches: int

    def __post_init__(self) -> None:
        for key in ("micro_batch_size", "num_microbatches"):
            if getattr(self, key) < 1:
                raise SchemaError("", key, getattr(self, key), "a positive integer")

    @property
    def samples(self) -> int:
        return self.micro_batch_size * self.num_microbatches
