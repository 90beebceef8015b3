"""The mini trainer of mesh plans (:mod:`megatron_hetero.plan.format2`, format 2): real
megatron-core 0.17.1 training of a mesh plan on CPU processes, one per plan rank.

Each rank is built by :func:`megatron_hetero.mcore.mesh_train.build_mesh_rank`: its mesh's grid,
the multimodule communicator and its bridges, its ``GPTModel`` slice, Megatron's DDP and
optimizer over its mesh (Adam or SGD, gradient clipping over the whole model, the distributed
optimizer when asked), and the mesh plan's gradient scale or per-token loss. Each rank runs
its own stage's memory policies, as the format-1 trainer's ranks do: recompute, module-input
offload (megatron-core's fine-grained activation offloading) and optimizer offload
(megatron-core's CPU-offload optimizer, under the distributed optimizer), on the CPU backend
through :mod:`megatron_hetero.mcore.cpu_offload`, whose :func:`join_offload_summary` keeps the
ranks that offload no module inputs from waiting forever in megatron-core's offload summary.
Steps run megatron-core's non-interleaved 1F1B with the multimodule communicator.

It takes :class:`~.trainer.TrainConfig` and :class:`~.trainer.RankHooks` and returns
:class:`~.trainer.RankResult` / :class:`~.trainer.TrainResult` as the format-1 trainer
(:mod:`.trainer`) does: ``RankResult.pipeline`` is the rank's replica in its mesh and
``RankResult.stage`` its stage in the whole pipeline. ``compare_results`` compares two results.

Data: the synthetic samples of :func:`~.trainer.sample_tokens`. Where every mesh is even (every
replica alike), micro-batch ``m`` of a step is samples ``m B .. (m + 1) B - 1`` of the step's
global batch (``B = D x micro_batch_size``, the same in every mesh), replica ``r`` taking rows
``r b .. (r + 1) b - 1`` of it: the order in which a bridge joins and splits them. Where replicas
differ (all meshes then have the same replicas), replica ``r`` takes its own consecutive share
of the global batch, micro-batch by micro-batch. Parameters are initialized by
layout-independent names (:mod:`.params`), so a mesh plan and its one-process reference
(:func:`mesh_reference_plan`) start from the same weights.
"""

from __future__ import annotations

import math
from typing import Callable

from ..mcore.cpu_offload import enable_cpu_offload, join_offload_summary
from ..mcore.stage_policies import optimizer_offload_kwargs
from ..plan import Format2Mesh, MeshStage, Plan, Replica, Slot, mesh_plan
from .params import init_params, local_params, merge_shards
from .trainer import (RankHooks, RankResult, TrainConfig, TrainResult, forward_step,
                      sample_tokens, train_on_ranks, train_steps)

__all__ = ["mesh_reference_plan", "mesh_micro_batches", "train_mesh_rank", "train_mesh_plan",
           "global_stage", "layer_offset"]


def mesh_reference_plan(plan: Plan) -> Plan:
    """The same model and global batch on one process: one mesh of one stage, TP 1, one
    replica running the global batch in micro-batches of the largest size that divides every
    micro-batch of ``plan`` as its data order has them."""
    if plan.per_token_loss:
        mbs = math.gcd(*(r.micro_batch_size for r in plan.meshes[0].replicas))
    else:
        first = plan.meshes[0]
        mbs = first.data_parallel_size * first.replicas[0].micro_batch_size
    mesh = Format2Mesh(device_type=plan.meshes[0].device_type, tensor_model_parallel_size=1,
                       replicas=[Replica(micro_batch_size=mbs,
                                         num_microbatches=plan.global_batch_size // mbs)],
                       stages=[MeshStage(num_layers=plan.model.num_layers)])
    ref = mesh_plan(model=plan.model, global_batch_size=plan.global_batch_size,
                    meshes=[mesh], precision=plan.precision, use_distributed_optimizer=False,
                    overlap_grad_reduce=False, gpus=dict(plan.gpus))
    ref.catalog = plan.catalog
    return ref


def global_stage(plan: Plan, slot: Slot) -> int:
    """The pipeline stage of ``slot`` in the whole model (over all meshes)."""
    return sum(len(m.stages) for m in plan.meshes[:slot.mesh]) + slot.stage


def layer_offset(plan: Plan, slot: Slot) -> int:
    """The model's layers before ``slot``'s stage."""
    return sum(plan.layer_split[:global_stage(plan, slot)])


def _sample_index(plan: Plan, slot: Slot, step: int, micro: int, row: int) -> int:
    mesh = plan.meshes[slot.mesh]
    replica = mesh.replicas[slot.replica]
    base = step * plan.global_batch_size
    if plan.per_token_loss:
        offset = sum(r.samples for r in mesh.replicas[:slot.replica])
        return base + offset + micro * replica.micro_batch_size + row
    b = replica.micro_batch_size
    return base + micro * mesh.data_parallel_size * b + slot.replica * b + row


def mesh_micro_batches(plan: Plan, slot: Slot, step: int, seed: int):
    """The micro-batches ``slot``'s replica reads in step ``step`` (see the module docstring),
    as the batches the trainer's ``forward_step`` takes (every stage reads them: the first
    its tokens, the last its labels)."""
    import torch
    m = plan.model
    replica = plan.meshes[slot.mesh].replicas[slot.replica]
    for k in range(replica.num_microbatches):
        rows = [sample_tokens(_sample_index(plan, slot, step, k, j), seed, m.seq_length,
                              m.vocab_size) for j in range(replica.micro_batch_size)]
        tokens = torch.stack(rows)
        yield {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
               "loss_mask": torch.ones(len(rows), m.seq_length),
               "position_ids": torch.arange(m.seq_length).unsqueeze(0).expand(len(rows), -1)}


def _optimizer_config(plan: Plan, slot: Slot, config: TrainConfig):
    """The rank's ``OptimizerConfig``: its stage's optimizer offload (its mesh's ranks each
    build their own), the distributed optimizer as the format-1 trainer decides it."""
    import torch
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer=config.optimizer, lr=config.lr,
                           weight_decay=config.weight_decay, clip_grad=config.clip_grad,
                           bf16=False, fp16=False, params_dtype=torch.float32,
                           use_distributed_optimizer=config.distributed_optimizer(plan),
                           **optimizer_offload_kwargs(plan.stage_of_slot(slot)))


def train_mesh_rank(plan: Plan, rank: int, config: TrainConfig | None = None,
                    hooks: RankHooks | None = None) -> RankResult:
    """Train ``plan`` as rank ``rank`` (see the module docstring). The default gloo process group
    of ``plan.world_size`` ranks must be initialized."""
    import torch.distributed as dist

    from ..mcore.cpu_backend import enable_cpu_backend

    config = config or TrainConfig()
    hooks = hooks or RankHooks()
    enable_cpu_backend()
    if plan.offloads_optimizer or plan.offloads_module_inputs:
        enable_cpu_offload()  # megatron-core's offload paths on the CPU backend
    if dist.get_world_size() != plan.world_size:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks; the plan needs "
                         f"{plan.world_size}")
    from megatron.core import tensor_parallel

    from ..mcore.mesh_train import (build_mesh_rank, mesh_schedule, mesh_transformer_config,
                                    whole_model_loss)

    slot = plan.slot_of_rank(rank)
    mesh = plan.meshes[slot.mesh]
    offset = layer_offset(plan, slot)
    tensor_parallel.model_parallel_cuda_manual_seed(config.seed, tp_rank=slot.tensor_rank,
                                                    ep_rank=0, etp_rank=0)

    def init(gpt, slot):
        init_params(gpt, plan, config.seed, config.init_std, slot.tensor_rank, False,
                    tensor_parallel_size=mesh.tensor_model_parallel_size, layer_offset=offset)

    built = build_mesh_rank(plan, rank, _optimizer_config(plan, slot, config), init=init,
                            config=mesh_transformer_config(
                                plan, slot, offload_min_numel=config.offload_min_numel),
                            overlap_grad_reduce=plan.overlap_grad_reduce, gloo=True)
    if hooks.on_built:
        hooks.on_built([built.ddp], built.optimizer)
    # ranks that offload no module inputs join the others' offload summary
    schedule = join_offload_summary(mesh_schedule, plan, plan.stage_of_slot(slot))

    def run(step: int, forward_only: bool) -> float:
        data = mesh_micro_batches(plan, slot, step, config.seed)
        reduced = schedule(built, forward_step, data, forward_only=forward_only)
        return whole_model_loss(plan, slot, reduced)

    try:
        losses, times, grad_norms, eval_loss = train_steps(run, [built.ddp], built.optimizer,
                                                           config, hooks)
        params = {}
        if config.gather_params:
            chunk = (built.first, built.last)
            params = local_params([built.gpt], [chunk], plan, False, layer_offset=offset)
        return RankResult(rank=rank, pipeline=slot.replica, stage=global_stage(plan, slot),
                          tensor_rank=slot.tensor_rank, losses=losses, eval_loss=eval_loss,
                          grad_norms=grad_norms, step_times=times, params=params,
                          extra=hooks.report() if hooks.report else None)
    finally:
        from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator
        BridgeCommunicator.destroy_broadcast_pgs()


def train_mesh_plan(plan: Plan, config: TrainConfig | None = None,
                    hooks_factory: Callable[[Plan, int], RankHooks] | None = None,
                    env: dict[str, str] | None = None) -> TrainResult:
    """Train ``plan`` on ``plan.world_size`` CPU processes and merge what they return: the
    global loss per step, the forward-only loss after training, every parameter under its
    layout-independent name (from replica 0 of each mesh, tensor-parallel shards joined) and
    each rank's step times."""
    return train_on_ranks(train_mesh_rank, plan, config, hooks_factory, env, _merge_params)


def _merge_params(ranks: list[RankResult]) -> dict:
    """Every parameter from replica 0 of each mesh, its tensor-parallel shards joined."""
    by_name: dict[str, dict[int, tuple]] = {}
    for r in ranks:
        if r.pipeline == 0:
            for name, shard in r.params.items():
                by_name.setdefault(name, {})[r.tensor_rank] = shard
    return merge_shards(by_name)
