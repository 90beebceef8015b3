"""megatron-core's ``TransformerConfig`` of a model, and of one model chunk of a plan's stage.

Every ``TransformerConfig`` megatron-hetero builds itself comes from :func:`transformer_config`:
the model's shape from its :class:`~megatron_hetero.plan.ModelSpec`, no dropout, and none of the
fused kernels (they need CUDA or Apex; the CPU backend and the profiler's local layer spec run
without them). The real training run is the exception: Megatron-LM builds its config from its
own arguments, and the runtime only sets the stage's policies on it.
"""

from __future__ import annotations

from ..plan import ModelSpec, Plan, Stage
from .stage_policies import built_module_input_kwargs, recompute_kwargs

__all__ = ["torch_dtype", "transformer_config", "plan_transformer_config", "moe_settings"]


def torch_dtype(precision: str):
    """The torch dtype of a precision name (``bf16``, ``fp16``, ``fp32``)."""
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def moe_settings(model: ModelSpec, *, first_layer: int = 0, num_layers: int | None = None,
                 expert_parallel_size: int = 1, expert_tensor_parallel_size: int | None = None
                 ) -> dict:
    """The ``TransformerConfig`` fields of ``model``'s experts (none for a dense model), for
    its layers ``first_layer .. first_layer + num_layers - 1`` (all by default; a mesh stage
    builds its own layers as a model of their own, so the MoE pattern is that slice's), at
    these expert-parallel sizes. Routing is dropless (no capacity factor) and tokens travel
    by the all-to-all dispatcher, as ``megatron-hetero args`` tells Megatron-LM; the experts
    run one by one (megatron-core's ``SequentialMLP``) unless the model asks for grouped GEMM,
    which needs Transformer Engine."""
    if not model.is_moe:
        return {}
    n = model.num_layers - first_layer if num_layers is None else num_layers
    return dict(num_moe_experts=model.num_experts, moe_router_topk=model.moe_router_topk,
                moe_ffn_hidden_size=model.expert_ffn_hidden_size,
                moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
                moe_shared_expert_gate=model.moe_shared_expert_gate,
                moe_layer_freq=list(model.moe_layer_pattern[first_layer:first_layer + n]),
                moe_router_load_balancing_type=model.moe_router_load_balancing_type,
                moe_grouped_gemm=model.moe_grouped_gemm, moe_token_dispatcher_type="alltoall",
                expert_model_parallel_size=expert_parallel_size,
                expert_tensor_parallel_size=expert_tensor_parallel_size)


def transformer_config(model: ModelSpec, *, num_layers: int | None = None,
                       tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                       precision: str = "fp32", cpu_initialization: bool = True, **settings):
    """The ``TransformerConfig`` of ``model`` (its layer count unless ``num_layers``) at these
    parallel sizes and precision (parameters, pipeline messages and the bf16/fp16 switch),
    without dropout or fused kernels; ``settings`` are further ``TransformerConfig`` fields.
    An MoE model's experts come from :func:`moe_settings` (its first ``num_layers`` layers, no
    expert parallelism) unless ``settings`` gives them."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch_dtype(precision)
    kwargs = dict(
        num_layers=model.num_layers if num_layers is None else num_layers,
        hidden_size=model.hidden_size, ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.num_query_groups,
        gated_linear_unit=model.swiglu, activation_func=F.silu if model.swiglu else F.gelu,
        normalization=model.normalization, add_bias_linear=model.add_bias_linear,
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=pipeline_parallel_size, pipeline_dtype=dtype,
        params_dtype=dtype, bf16=precision == "bf16", fp16=precision == "fp16",
        use_cpu_initialization=cpu_initialization,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        # Megatron-LM's default (--attention-softmax-in-fp32 off), not megatron-core's: the local
        # layers' unfused softmax over [b, heads, s, s] in fp32 took 12% more of a Llama-2 7B
        # layer on an H200 than the 16-bit one Megatron-LM trains with (docs/gpu.md)
        attention_softmax_in_fp32=False,
    )
    kwargs.update(moe_settings(model, num_layers=num_layers))
    kwargs.update(settings)
    return TransformerConfig(**kwargs)


def plan_transformer_config(plan: Plan, stage: Stage, chunk: int | None = None, *,
                            offload_min_numel: int | None = None, precision: str = "fp32"):
    """The ``TransformerConfig`` of ``stage`` of ``plan`` (of its model chunk ``chunk`` for an
    interleaved plan) as the CPU trainer runs it: in ``precision`` (fp32 unless the trainer
    asks for the plan's own), initialized on the CPU, the plan's
    tensor and pipeline parallelism and pipeline layout, the loss summed over tokens
    (``calculate_per_token_loss``: uneven replicas stay exact), no sequence parallelism, the
    stage's recompute and its module-input offload (megatron-core's fine-grained activation
    offloading; on the CPU backend see :mod:`.cpu_offload`), which moves the module inputs of
    at least ``offload_min_numel`` elements to the host (``min_offloaded_tensor_size``; None:
    megatron-core's default, 1M). An interleaved plan runs Megatron-LM's default interleaved
    schedule: overlapped p2p, pipeline outputs freed after their send, the plan's micro-batch
    group."""
    pp = plan.pipeline_model_parallel_size
    settings: dict = {"perform_initialization": True, "calculate_per_token_loss": True,
                      "sequence_parallel": False}
    if pp > 1:
        settings["pipeline_model_parallel_layout"] = plan.layout()
    if plan.virtual_pipeline_size > 1:
        # --overlap-p2p-communication is Megatron-LM's default, and PP=2 needs it (both
        # directions go to one peer)
        settings.update(virtual_pipeline_model_parallel_size=plan.virtual_pipeline_size,
                        overlap_p2p_comm=True, batch_p2p_comm=False,
                        deallocate_pipeline_outputs=True,
                        microbatch_group_size_per_vp_stage=plan.microbatch_group)
    settings.update(recompute_kwargs(stage, chunk if plan.virtual_pipeline_size > 1 else None))
    settings.update(built_module_input_kwargs(stage, offload_min_numel=offload_min_numel))
    mesh = plan.meshes[0]
    settings.update(moe_settings(plan.model, expert_parallel_size=mesh.expert_model_parallel_size,
                                 expert_tensor_parallel_size=mesh.expert_tensor_size))
    return transformer_config(plan.model, tensor_parallel_size=plan.tensor_model_parallel_size,
                              pipeline_parallel_size=pp, precision=precision,
                              cpu_initialization=True, **settings)
