"""megatron-core's ``GPTModel`` of a :class:`~megatron_hetero.plan.ModelSpec`, and Megatron's
``DistributedDataParallel`` around model chunks."""

from __future__ import annotations

import copy
import dataclasses
from typing import Sequence

from ..plan import ModelSpec

__all__ = ["layer_spec_name", "layer_spec", "gpt_model", "wrap_ddp", "SequenceParallelTorchNorm"]


def layer_spec_name(device: str = "cpu") -> str:
    """``transformer_engine`` on a GPU where Transformer Engine is installed, else ``local``."""
    from ..hardware.optional import have_transformer_engine
    return "transformer_engine" if device == "cuda" and have_transformer_engine() else "local"


def layer_spec(model: ModelSpec, device: str = "cpu"):
    """megatron-core's GPT layer spec for ``device`` (see :func:`layer_spec_name`)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec,
    )
    if layer_spec_name(device) == "transformer_engine":
        return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec(normalization=model.normalization)


class SequenceParallelTorchNorm:
    """megatron-core's torch norm (``WrappedTorchNorm``, the local layers' on a machine without
    Transformer Engine or Apex, which refuses sequence parallelism) for a layer that runs it:
    the same norm over the rank's shard of the sequence, its weights marked
    ``sequence_parallel`` so that ``finalize_model_grads`` sums their gradients over the TP
    group (what Transformer Engine's norm does)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        whole = copy.copy(config)
        whole.sequence_parallel = False
        norm = WrappedTorchNorm(whole, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm


def _sequence_parallel_norms(spec, num_layers: int):
    """``spec`` (a layer's spec, or a decoder block's) with :class:`SequenceParallelTorchNorm`
    for megatron-core's torch norm, as the block of a model of ``num_layers`` layers (a mesh
    stage: a model of its own)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    def layer(one):
        sub = copy.copy(one.submodules)
        for f in dataclasses.fields(sub):
            if getattr(sub, f.name) is WrappedTorchNorm:
                setattr(sub, f.name, SequenceParallelTorchNorm)
        return dataclasses.replace(one, submodules=sub)

    layers = (spec.layer_specs if isinstance(spec, TransformerBlockSubmodules)
              else [spec] * num_layers)
    return TransformerBlockSubmodules(layer_specs=[layer(s) for s in layers],
                                      layer_norm=SequenceParallelTorchNorm)


def gpt_model(model: ModelSpec, config, *, pre_process: bool = True, post_process: bool = True,
              vp_stage: int | None = None, device: str = "cpu", pg_collection=None):
    """The ``GPTModel`` (or pipeline stage of it: ``pre_process`` holds the embedding,
    ``post_process`` the final norm and output layer; ``vp_stage`` the model chunk of an
    interleaved plan) of ``model`` on ``config``, with the layer spec of ``device``, on
    ``parallel_state``'s groups or ``pg_collection``'s (a mesh plan's rank; under sequence
    parallelism with the local layers, their norms :class:`SequenceParallelTorchNorm`). An MoE model's
    layers follow ``config.moe_layer_freq`` (megatron-core's decoder block spec). Built where
    ``config`` says (``use_cpu_initialization``); moving it is the caller's."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    tied = not model.untie_embeddings_and_output_weights
    spec = layer_spec(model, device)
    if model.is_moe:  # MoE and dense layers as config.moe_layer_freq says, this chunk's slice
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=layer_spec_name(device) == "transformer_engine",
            normalization=model.normalization, vp_stage=vp_stage,
            pp_rank=0 if pg_collection is not None else None)  # a mesh stage: a model of its own
    if config.sequence_parallel and layer_spec_name(device) == "local" \
            and pg_collection is not None:
        spec = _sequence_parallel_norms(spec, config.num_layers)
    return GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=model.vocab_size, max_sequence_length=model.seq_length,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=tied,
                    position_embedding_type=model.position_embedding_type,
                    **({"vp_stage": vp_stage} if vp_stage is not None else {}),
                    **({"pg_collection": pg_collection} if pg_collection is not None else {}))


def wrap_ddp(models: Sequence, *, overlap_grad_reduce: bool = False,
             use_distributed_optimizer: bool = False) -> list:
    """Megatron's ``DistributedDataParallel`` around each model chunk, as its training wraps
    them: gradients reduced in fp32 buffers, one configuration for all chunks, bucketing on the
    first chunk only. Its hooks accumulate every gradient into those buffers during the backward
    (a cost the profiler must include)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                               overlap_grad_reduce=overlap_grad_reduce,
                                               use_distributed_optimizer=use_distributed_optimizer)
    return [DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model,
                                    disable_bucketing=i > 0)
            for i, model in enumerate(models)]
