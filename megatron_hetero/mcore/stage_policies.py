"""A plan stage's memory policies as megatron-core ``TransformerConfig`` fields.

Megatron's recompute and offload options are global, but every rank builds its own
``TransformerConfig``, so each rank can take its own stage's (the runtime through Megatron-LM's
``args`` and config, the CPU trainer through :func:`.config.plan_transformer_config`):

* recompute: ``recompute_granularity`` / ``recompute_method`` / ``recompute_num_layers``;
* activation offload: ``cpu_offloading`` and its layer count;
* module-input offload (``Offload.module_inputs``): megatron-core's fine-grained activation
  offloading, ``fine_grained_activation_offloading`` + ``offload_modules`` =
  :data:`MODULE_INPUTS`, set on or off on every stage (ranks differ).

With interleaved pipelining (``Plan.virtual_pipeline_size`` > 1) a rank holds several model
chunks, each with its own ``TransformerConfig``, and Megatron counts ``recompute_num_layers`` per
chunk. The plan's numbers stay per stage: ``block`` recompute of n layers covers the stage's
first n layers in chunk order (chunk 0 first: it keeps the most micro-batches in flight), and
``uniform`` groups of k layers apply in every chunk (k must divide each chunk's layers).

Pure functions of the plan: nothing here imports torch or megatron.
"""

from __future__ import annotations

from ..plan import MeshStage, Stage, chunk_recompute

__all__ = ["MODULE_INPUTS", "recompute_kwargs", "offload_kwargs",
           "module_input_kwargs", "built_module_input_kwargs", "stage_config_kwargs",
           "optimizer_offload_kwargs"]

MODULE_INPUTS = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
"""megatron-core ``offload_modules`` of ``Offload.module_inputs`` (the dense layer's modules)."""

_NO_RECOMPUTE = {"recompute_granularity": None, "recompute_method": None,
                 "recompute_num_layers": None}


def recompute_kwargs(stage: Stage | MeshStage, chunk: int | None = None) -> dict:
    """TransformerConfig overrides that make one stage (or its model chunk ``chunk``, for an
    interleaved plan: :func:`~megatron_hetero.plan.chunk_recompute`) recompute as its plan entry
    says."""
    r = stage.recompute
    if chunk is not None and stage.chunk_layers is not None:
        r = chunk_recompute(r, stage.chunk_layers)[chunk]
    if r.granularity == "none":
        return dict(_NO_RECOMPUTE)
    if r.granularity == "selective":
        return {"recompute_granularity": "selective", "recompute_method": None,
                "recompute_num_layers": None}
    return {"recompute_granularity": "full", "recompute_method": r.method,
            "recompute_num_layers": r.num_layers}


def offload_kwargs(stage: Stage | MeshStage) -> dict:
    """TransformerConfig overrides for activation offload of one stage (PP = 1 only today)."""
    if not stage.offload.activations:
        return {}
    return {"cpu_offloading": True, "cpu_offloading_num_layers": max(stage.num_layers - 1, 0),
            "cpu_offloading_activations": True, "cpu_offloading_weights": False}


def module_input_kwargs(stage: Stage | MeshStage) -> dict:
    """TransformerConfig (and ``args``) fields of module-input offload, on or off: every rank
    sets them, since ranks differ. The same on every model chunk of the stage."""
    if stage.offload.module_inputs:
        return {"fine_grained_activation_offloading": True, "offload_modules": list(MODULE_INPUTS)}
    return {"fine_grained_activation_offloading": False, "offload_modules": []}


def built_module_input_kwargs(stage: Stage | MeshStage, *,
                              offload_min_numel: int | None = None) -> dict:
    """The module-input offload fields of a ``TransformerConfig`` that megatron-hetero builds
    itself (the CPU trainers of format-1 and mesh plans): none where the stage does not offload
    (the fields left out: megatron-core may not have them), else :func:`module_input_kwargs`
    and, where given, ``min_offloaded_tensor_size`` (the smallest tensor moved to the host;
    megatron-core's default 1M elements otherwise)."""
    if not stage.offload.module_inputs:
        return {}
    out = module_input_kwargs(stage)
    if offload_min_numel is not None:
        out["min_offloaded_tensor_size"] = offload_min_numel
    return out


def stage_config_kwargs(stage: Stage | MeshStage, chunk: int | None = None) -> dict:
    """Every TransformerConfig field this stage's plan entry sets (on its model chunk
    ``chunk`` for an interleaved plan)."""
    return {**recompute_kwargs(stage, chunk), **offload_kwargs(stage), **module_input_kwargs(stage)}


def optimizer_offload_kwargs(stage: Stage | MeshStage) -> dict:
    """``OptimizerConfig`` fields of the stage's optimizer offload (megatron-core's CPU-offload
    optimizer keeps ``offload.optimizer_fraction`` of the rank's optimizer state on the host;
    it runs under the distributed optimizer only, which the caller sets); none without it."""
    fraction = stage.offload.optimizer_fraction
    if fraction <= 0:
        return {}
    return {"optimizer_cpu_offload": True, "optimizer_offload_fraction": fraction,
            "use_precision_aware_optimizer": True}
