"""Building the measured megatron-core model (through :mod:`megatron_hetero.mcore`): its
``GPTModel`` of ``layers`` layers at one tensor-parallel size and precision, and the DDP wrapper
training puts around it."""

from __future__ import annotations

from dataclasses import dataclass

from ..mcore.config import torch_dtype, transformer_config
from ..mcore.model import gpt_model, wrap_ddp
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


def build_parts(model: ModelSpec, tp: int, precision: str, device: str, layers: int = 1) -> Parts:
    import torch
    from megatron.core import parallel_state, tensor_parallel

    dtype = torch_dtype(precision)
    config = transformer_config(model, num_layers=layers, tensor_parallel_size=tp,
                                precision=precision, cpu_initialization=device == "cpu")
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    gpt = gpt_model(model, config, device=device)
    if device == "cuda":
        gpt = gpt.cuda()
    gpt = gpt.to(dtype)
    # Training wraps the model in Megatron's DDP, whose hooks accumulate every gradient into
    # its fp32 buffers during backward: a cost per layer that the profile must include.
    (ddp,) = wrap_ddp([gpt])
    rope = getattr(gpt, "rotary_pos_emb", None)
    rope_emb = rope(model.seq_length) if rope is not None and model.position_embedding_type == "rope" \
        else None
    return Parts(model=gpt, rope=rope_emb, dtype=dtype, device=device,
                 tp_group=parallel_state.get_tensor_model_parallel_group(), ddp=ddp)
