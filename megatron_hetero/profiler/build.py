"""Building the measured megatron-core model: its TransformerConfig, layer spec and DDP wrapper."""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import ModelSpec


@dataclass(slots=True)
class Parts:
    model: object
    rope: object
    dtype: object
    device: str
    tp_group: object
    ddp: object
    """Megatron's DDP around ``model``: kept alive so its gradient hooks stay registered."""


def torch_dtype(precision: str):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def transformer_config(model: ModelSpec, tp: int, precision: str, device: str, layers: int,
                       pp: int = 1):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    dtype = torch_dtype(precision)
    extra = {"pipeline_model_parallel_size": pp, "pipeline_dtype": dtype} if pp > 1 else {}
    return TransformerConfig(
        num_layers=layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        normalization=model.normalization,
        add_bias_linear=model.add_bias_linear,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=device == "cpu",
        params_dtype=dtype,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        **extra,
    )


def build_parts(model: ModelSpec, tp: int, precision: str, device: str, layers: int = 1) -> Parts:
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    dtype = torch_dtype(precision)
    config = transformer_config(model, tp, precision, device, layers)
    torch.manual_seed(1234)
    from megatron.core import tensor_parallel
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(model, device),
        vocab_size=model.vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type,
    )
    if device == "cuda":
        gpt = gpt.cuda()
    gpt = gpt.to(dtype)
    # Training wraps the model in Megatron's DDP, whose hooks accumulate every gradient into
    # its fp32 buffers during backward: a cost per layer that the profile must include.
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    ddp = DistributedDataParallel(config=config, module=gpt,
                                  ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    rope = getattr(gpt, "rotary_pos_emb", None)
    rope_emb = rope(model.seq_length) if rope is not None and model.position_embedding_type == "rope" \
        else None
    return Parts(model=gpt, rope=rope_emb, dtype=dtype, device=device,
                  tp_group=parallel_state.get_tensor_model_parallel_group(), ddp=ddp)


def layer_spec_name(device: str) -> str:
    from ..optional import have_transformer_engine
    return "transformer_engine" if device == "cuda" and have_transformer_engine() else "local"


def layer_spec(model: ModelSpec, device: str):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec,
    )
    if layer_spec_name(device) == "transformer_engine":
        return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec(normalization=model.normalization)

