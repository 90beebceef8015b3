"""The Megatron-LM command-line arguments a plan implies.

Only what is the same on every rank goes on the command line: parallel sizes, the layer split,
the model shape, batch sizes. What differs per rank (micro-batch counts, recompute, offload)
stays in the plan, and the runtime applies it on each rank (``--hetero-plan``).

Module-input offload (``Offload.module_inputs``, megatron-core's fine-grained activation
offloading) never goes on the command line, even when every stage has it: no
``--fine-grained-activation-offloading`` / ``--offload-modules`` (the runtime refuses them as a
conflict). The runtime sets ``args.fine_grained_activation_offloading`` and ``offload_modules``
on each rank before Megatron's ``validate_args``, which then checks them on the ranks that
offload: ``--transformer-impl transformer_engine`` (Megatron's default) and, with Transformer
Engine >= 2.10, ``NVTE_CPU_OFFLOAD_V1=1`` in the environment before TE is imported
(``python -m megatron_hetero.launch`` sets it for such a plan; a launcher of one's own must
export it). So a plan with module-input offload adds no argument here, and the line passes
Megatron's ``validate_args`` as it is.
"""

from __future__ import annotations

import shlex

from .stages import ModelSpec
from .types import Plan

__all__ = ["megatron_args", "megatron_args_line", "split_args", "GROUP_FLAG"]

GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"
"""Megatron's flag for the interleaved schedule's micro-batch group (``Plan.microbatch_group_size``;
its ``args`` attribute is ``microbatch_group_size_per_vp_stage``)."""


def split_args(plan: Plan) -> list[str]:
    """Arguments for the uneven layer split: nothing when even, first/last stage counts where
    they express the split exactly, else ``--pipeline-model-parallel-layout``.

    An interleaved plan (``virtual_pipeline_size`` v > 1) always gets the layout, one segment
    per virtual stage (``p v`` of them): Megatron derives its virtual pipeline size from their
    count, and the layout is exact for any chunks. (``--num-virtual-stages-per-pipeline-rank``
    would be exact only for equal virtual stages, and cannot be combined with a layout.) A plan
    with its own micro-batch group adds :data:`GROUP_FLAG`."""
    if plan.virtual_pipeline_size > 1:  # Megatron reads the virtual stages from the layout
        out = ["--pipeline-model-parallel-layout", plan.layout()]
        if plan.microbatch_group_size is not None:
            out += [GROUP_FLAG, str(plan.microbatch_group_size)]
        return out
    split = plan.layer_split
    pp = len(split)
    if pp == 1 or len(set(split)) == 1:
        return []
    first, middle, last = split[0], split[1:-1], split[-1]
    if first >= 1 and last >= 1 and len(set(middle)) <= 1 and (not middle or middle[0] >= 1):
        out = []
        if not middle or first != middle[0]:
            out += ["--decoder-first-pipeline-num-layers", str(first)]
        if not middle or last != middle[0]:
            out += ["--decoder-last-pipeline-num-layers", str(last)]
        return out
    return ["--pipeline-model-parallel-layout", plan.layout()]


def _recompute_args(recomputes, *, interleaved: bool = False) -> list[str]:
    """Megatron's recompute flags where every stage of ``recomputes`` has the same policy."""
    policies = {(r.granularity, r.method, r.num_layers) for r in recomputes}
    if len(policies) != 1:
        return []  # per-stage policies: the runtime applies them from the plan
    granularity, method, num_layers = policies.pop()
    if granularity == "none":
        return []
    if method == "block" and interleaved:
        return []  # Megatron would count it per model chunk; the runtime applies the plan's

    out = ["--recompute-granularity", granularity]
    if granularity == "full":
        out += ["--recompute-method", method, "--recompute-num-layers", str(num_layers)]
    return out


def megatron_args(plan: Plan, plan_path: str | None = None) -> list[str]:
    """The argument list for ``pretrain_gpt.py`` (without data, tokenizer and schedule options)
    of any plan: what is the same on every rank.

    One grid (:attr:`.types.Plan.one_grid`): the tensor-parallel and pipeline sizes, the layer
    split (:func:`split_args`) and Megatron's single ``--micro-batch-size`` (replica 0's; replicas
    that differ get theirs from the runtime) lead the line, and ``--sequence-parallel`` follows
    the plan. A chain of meshes: each mesh's tensor-parallel and pipeline sizes and micro-batch
    size are its own, so none goes on the line (each rank takes its mesh's from the plan,
    ``--hetero-plan``); the whole model's layout (one segment per stage over all meshes) does."""
    if plan.one_grid:
        args = ["--tensor-model-parallel-size", str(plan.tensor_model_parallel_size),
                "--pipeline-model-parallel-size", str(plan.pipeline_model_parallel_size),
                *split_args(plan), *_model_args(plan.model),
                "--micro-batch-size", str(plan.pipelines[0].micro_batch_size),
                "--global-batch-size", str(plan.global_batch_size)]
    else:
        args = [*_model_args(plan.model), "--global-batch-size", str(plan.global_batch_size)]
        if len(plan.layer_split) > 1:
            args += ["--pipeline-model-parallel-layout", plan.layout()]
        if plan.microbatch_group_size is not None:
            args += [GROUP_FLAG, str(plan.microbatch_group_size)]
    args += _expert_args(plan)
    if plan.precision != "fp32":
        args.append(f"--{plan.precision}")
    if plan.use_distributed_optimizer:
        args.append("--use-distributed-optimizer")
    if plan.sequence_parallel:
        args.append("--sequence-parallel")
    if plan.overlap_grad_reduce:
        args.append("--overlap-grad-reduce")
    if plan.offloads_optimizer:
        # Megatron's hybrid-device optimizer needs this flag; the runtime turns on
        # --optimizer-cpu-offload with each rank's own fraction.
        args.append("--use-precision-aware-optimizer")
    if plan.per_token_loss:
        args.append("--calculate-per-token-loss")
    args += _recompute_args((s.recompute for s in plan.all_stages()),
                            interleaved=plan.virtual_pipeline_size > 1)
    if plan_path is not None:
        args += ["--hetero-plan", str(plan_path)]
    return args


def _model_args(m: ModelSpec) -> list[str]:
    """The model's shape in Megatron's arguments."""
    args = [
        "--num-layers", str(m.num_layers),
        "--hidden-size", str(m.hidden_size),
        "--ffn-hidden-size", str(m.ffn_hidden_size),
        "--num-attention-heads", str(m.num_attention_heads),
    ]
    if m.num_query_groups != m.num_attention_heads:
        args += ["--group-query-attention", "--num-query-groups", str(m.num_query_groups)]
    args += ["--seq-length", str(m.seq_length), "--max-position-embeddings", str(m.seq_length)]
    args += ["--normalization", m.normalization, "--position-embedding-type", m.position_embedding_type]
    if m.swiglu:
        args.append("--swiglu")
    if m.untie_embeddings_and_output_weights:
        args.append("--untie-embeddings-and-output-weights")
    if not m.add_bias_linear:
        args.append("--disable-bias-linear")
    if m.add_qkv_bias:
        args.append("--add-qkv-bias")
    if m.kv_channels is not None:
        args += ["--kv-channels", str(m.kv_channels)]
    if m.qk_layernorm:
        args.append("--qk-layernorm")
    if m.position_embedding_type == "rope":
        if m.rotary_base != 10000:
            args += ["--rotary-base", str(m.rotary_base)]
        if m.rotary_percent != 1.0:
            args += ["--rotary-percent", f"{m.rotary_percent:g}"]
    return args


def _expert_args(plan: Plan) -> list[str]:
    """An MoE model's keys, and its expert-parallel sizes where every mesh has the same (a
    chain whose meshes differ leaves them to each rank's mesh, ``--hetero-plan``)."""
    m = plan.model
    if not m.is_moe:
        return []
    args = ["--num-experts", str(m.num_experts), "--moe-router-topk", str(m.moe_router_topk)]
    if m.moe_ffn_hidden_size is not None:
        args += ["--moe-ffn-hidden-size", str(m.moe_ffn_hidden_size)]
    if m.moe_shared_expert_intermediate_size is not None:
        args += ["--moe-shared-expert-intermediate-size",
                 str(m.moe_shared_expert_intermediate_size)]
    if m.moe_shared_expert_gate:
        args.append("--moe-shared-expert-gate")
    freq = m.moe_layer_freq
    if freq != 1:  # Megatron reads a pattern as a Python list expression
        args += ["--moe-layer-freq", str(freq) if isinstance(freq, int)
                 else "([" + ",".join(map(str, freq)) + "])"]
    args += ["--moe-router-load-balancing-type", m.moe_router_load_balancing_type,
             "--moe-token-dispatcher-type", "alltoall"]
    if m.moe_grouped_gemm:
        args.append("--moe-grouped-gemm")
    sizes = {(k.expert_model_parallel_size, k.expert_tensor_size) for k in plan.meshes}
    if len(sizes) == 1:
        ep, etp = sizes.pop()
        args += ["--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", str(etp)]
    return args


def megatron_args_line(plan: Plan, plan_path: str | None = None) -> str:
    """:func:`megatron_args` as one shell-ready line."""
    return shlex.join(megatron_args(plan, plan_path))
