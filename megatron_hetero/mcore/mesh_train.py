"""Training one rank of a mesh plan (:mod:`megatron_hetero.plan.format2`) with megatron-core
0.17.1's own pieces: ``DistributedDataParallel`` and ``get_megatron_optimizer`` over the rank's
mesh (its ``ProcessGroupCollection``), ``finalize_model_grads`` with the mesh's groups, and the
decisions a mesh plan adds to them, each made here once:

* **Gradient scale** (:func:`~.mesh_stage.gradient_scale`): each last-mesh replica's loss is the
  mean over its own samples, and a replica of an earlier mesh receives the gradients of every
  last-mesh replica it feeds, so after the sum over its mesh's data-parallel group every rank
  scales by ``1 / D_last``. Megatron's DDP divides by its own mesh's ``D_k``;
  :func:`mesh_finalize_model_grads` then multiplies by ``D_k / D_last``.
* **Per-token loss** (:func:`per_token_loss`): where replicas differ (uneven data
  parallelism), the loss is summed over tokens and the gradients divided by the tokens of the
  whole global batch. Those tokens are counted on the last mesh only; the finalize sums them
  over the whole world (every other rank adds 0), so the count reaches every mesh.
* **Gradient norm over the whole model** (:func:`use_whole_model_grad_norm`): the squared norms
  are summed over the whole world. With the distributed optimizer each rank holds a disjoint
  shard of its mesh's reduced gradients, so the world's sum is the model's. Without it every
  replica of a mesh holds the same gradients, so replica ``r`` of a mesh of ``D`` replicas adds
  only every ``D``-th of its gradient tensors, starting at the ``r``-th: the mesh's replicas
  together add each tensor once.
* **Loss over the whole model** (:func:`whole_model_loss`): the last mesh's token-loss sums and
  token counts summed over the world.

:func:`build_mesh_rank` composes them (grids, communicator, model slice, DDP, optimizer, the
schedule's hooks); the pieces stay public for a caller that builds the model or the optimizer
its own way (Megatron-LM's training loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..plan import Plan, Slot
from .mesh_grids import gloo_bridges, mesh_communicator, mesh_expert_grids, mesh_grids
from .mesh_stage import (MeshStageModule, gradient_scale, mesh_process_groups,
                         multimodule_collection, sequence_group, use_mesh_globals)

__all__ = ["MeshRank", "per_token_loss", "is_loss_rank", "global_batch_tokens",
           "mesh_transformer_config", "training_process_groups", "mesh_rank_groups",
           "mesh_ddp", "mesh_optimizer", "use_whole_model_grad_norm",
           "mesh_finalize_model_grads", "whole_model_loss", "wire_schedule", "build_mesh_rank",
           "mesh_schedule"]


def per_token_loss(plan: Plan) -> bool:
    """Whether the loss is summed over tokens and the gradients divided by the global batch's
    tokens (``calculate_per_token_loss``): where some mesh's replicas differ
    (:attr:`~megatron_hetero.plan.format2.Plan.per_token_loss`, what ``args`` prints)."""
    return plan.per_token_loss


def is_loss_rank(plan: Plan, slot: Slot) -> bool:
    """Tensor rank 0 of the model's last stage: one rank per last-mesh replica, the ranks whose
    token counts and losses are the global batch's."""
    last = len(plan.meshes) - 1
    return (slot.mesh == last and slot.stage == len(plan.meshes[last].stages) - 1
            and slot.tensor_rank == 0)


def global_batch_tokens(plan: Plan, slot: Slot, num_tokens):
    """The tokens of the whole global batch, on every rank (collective over the world): the sum
    of ``num_tokens`` (this rank's count of its micro-batches' tokens) over the
    :func:`is_loss_rank` ranks, every other rank adding 0. A float64 scalar tensor."""
    import torch
    import torch.distributed as dist

    tokens = torch.zeros(1, dtype=torch.float64,
                         device=getattr(num_tokens, "device", None) or "cpu")
    if is_loss_rank(plan, slot):
        tokens += float(num_tokens)
    dist.all_reduce(tokens)
    return tokens.reshape(())


def mesh_transformer_config(plan: Plan, slot: Slot, *, num_layers: int | None = None,
                            first_layer: int | None = None,
                            offload_min_numel: int | None = None, precision: str = "fp32",
                            **settings):
    """The ``TransformerConfig`` of ``slot``'s stage as a mesh rank builds it: in ``precision``
    (fp32 unless the CPU trainer asks for the plan's own), its
    mesh's TP, its stage's layers as a one-stage model (pre- and post-processing are the
    model's ends, :func:`build_mesh_rank`), its stage's recompute and module-input offload
    (as the format-1 trainer's, :func:`~.stage_policies.built_module_input_kwargs`: module
    inputs of at least ``offload_min_numel`` elements go to the host), variable sequence
    lengths (the multimodule schedule needs them, and they need the all-to-all token
    dispatcher to pass the config's checks), sequence parallelism where the plan runs it and
    the mesh's TP is above 1, and :func:`per_token_loss`; ``num_layers``: one
    model chunk's layers instead of the stage's (:mod:`.mesh_interleaved`), ``first_layer`` the
    chunk's first (an MoE model's pattern; default the stage's); ``settings`` are further
    fields."""
    from .config import moe_settings, transformer_config
    from .stage_policies import built_module_input_kwargs, recompute_kwargs

    mesh = plan.meshes[slot.mesh]
    stage = mesh.stages[slot.stage]
    fields = dict(perform_initialization=True, variable_seq_lengths=True,
                  sequence_parallel=plan.sequence_parallel_in(slot.mesh),
                  moe_token_dispatcher_type="alltoall",
                  calculate_per_token_loss=per_token_loss(plan), **recompute_kwargs(stage),
                  **built_module_input_kwargs(stage, offload_min_numel=offload_min_numel))
    n = stage.num_layers if num_layers is None else num_layers
    fields.update(moe_settings(  # these layers of an MoE model, its mesh's EP
        plan.model, num_layers=n, first_layer=(sum(plan.layer_split[:plan.global_stage(slot)])
                                               if first_layer is None else first_layer),
        expert_parallel_size=mesh.expert_model_parallel_size,
        expert_tensor_parallel_size=mesh.expert_tensor_size))
    fields.update(settings)
    return transformer_config(plan.model, num_layers=n,
                              tensor_parallel_size=mesh.tensor_model_parallel_size,
                              precision=precision, **fields)


def training_process_groups(grid, expert_grid=None):
    """The ``ProcessGroupCollection`` the model, DDP and the optimizer take on a rank of
    ``grid`` (its mesh's): :func:`~.mesh_stage.mesh_process_groups` plus what they ask for by
    name: the expert groups of ``expert_grid`` (an MoE model's, :func:`.mesh_grids.
    mesh_expert_grids`; a dense model has no expert parallelism, and its expert data-parallel
    group is the mesh's), and the distributed optimizer's gradient statistics over the whole
    world (:func:`use_whole_model_grad_norm`)."""
    import torch.distributed as dist

    pgs = mesh_process_groups(grid)
    if expert_grid is None:
        pgs.ep, pgs.tp_ep_pp = None, None
        pgs.expt_dp = pgs.dp
    else:
        pgs.ep, pgs.expt_tp = expert_grid.get_pg("ep"), expert_grid.get_pg("etp")
        pgs.expt_dp = expert_grid.get_pg("edp")
        pgs.tp_ep = expert_grid.get_pg(["etp", "ep"])
        pgs.tp_ep_pp = expert_grid.get_pg(["etp", "ep", "pp"])
    pgs.intra_dist_opt = dist.group.WORLD
    return pgs


def mesh_ddp(model, pgs, *, overlap_grad_reduce: bool = False,
             use_distributed_optimizer: bool = False):
    """Megatron's ``DistributedDataParallel`` around ``model`` (a mesh rank's module) over its
    mesh's data-parallel group (``pgs`` from :func:`training_process_groups`), gradients
    reduced in fp32. It divides by the mesh's ``D`` (or by nothing with per-token loss);
    :func:`mesh_finalize_model_grads` sets the mesh plan's scale."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                               overlap_grad_reduce=overlap_grad_reduce,
                                               use_distributed_optimizer=use_distributed_optimizer)
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model,
                                   pg_collection=pgs)


def mesh_optimizer(plan: Plan, slot: Slot, ddps: list, pgs, config):
    """``get_megatron_optimizer(config, ddps)`` over the rank's mesh (``pgs`` from
    :func:`training_process_groups`: the distributed optimizer shards over the mesh's
    data-parallel group), its gradient norm taken over the whole model
    (:func:`use_whole_model_grad_norm`)."""
    from megatron.core.optimizer import get_megatron_optimizer

    optimizer = get_megatron_optimizer(config, ddps, use_gloo_process_groups=False,
                                       pg_collection=pgs)
    use_whole_model_grad_norm(plan, slot, optimizer,
                              distributed=config.use_distributed_optimizer)
    return optimizer


def use_whole_model_grad_norm(plan: Plan, slot: Slot, optimizer, *,
                              distributed: bool) -> None:
    """Make ``optimizer`` (a Megatron optimizer, chained or not) take its gradient norm, and so
    its clipping, over the whole model: squared norms summed over the world, each replica of a
    mesh adding its share (the module docstring); ``distributed``: it is the distributed
    optimizer (each rank's shard is its own)."""
    import torch.distributed as dist

    d = plan.meshes[slot.mesh].data_parallel_size
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        opt.grad_stats_parallel_group = dist.group.WORLD
        if not distributed and d > 1:
            # megatron-core 0.19 renamed get_main_grads_for_grad_norm to get_grads_for_grad_norm
            name = ("get_grads_for_grad_norm" if hasattr(opt, "get_grads_for_grad_norm")
                    else "get_main_grads_for_grad_norm")
            setattr(opt, name, _ReplicaShare(getattr(opt, name), slot.replica, d))


class _ReplicaShare:
    """Replica ``replica``'s share of the gradients a (non-distributed) optimizer takes into its
    norm: every ``d``-th tensor."""

    def __init__(self, grads: Callable[[], list], replica: int, d: int):
        self.grads, self.replica, self.d = grads, replica, d

    def __call__(self) -> list:
        return self.grads()[self.replica::self.d]


def mesh_finalize_model_grads(plan: Plan, slot: Slot, pgs) -> Callable:
    """The ``finalize_model_grads_func`` of a mesh rank: megatron-core's ``finalize_model_grads``
    with the mesh's groups (``pgs``; the schedule passes its multimodule collection, which is not
    what it needs), then the mesh plan's gradient scale: ``D_k x gradient_scale(plan)`` after
    DDP's ``1 / D_k``, or, with per-token loss, one over the global batch's tokens, summed over
    the world from the last mesh's count."""
    d = plan.meshes[slot.mesh].data_parallel_size
    correction = d * gradient_scale(plan)

    def finalize(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(model, None, pg_collection=pgs, force_all_reduce=force_all_reduce)
        if num_tokens is not None:
            tokens = float(global_batch_tokens(plan, slot, num_tokens))
            scale = 1.0 / tokens if tokens > 0 else 1.0
        else:
            scale = correction
        if scale != 1.0:
            for chunk in model:
                chunk.scale_gradients(scale)

    return finalize


def whole_model_loss(plan: Plan, slot: Slot, losses_reduced: list,
                     key: str = "lm loss") -> float:
    """The step's loss over the whole model and global batch, on every rank (collective over the
    world): the sum of the token losses over the sum of the tokens, from the ``[sum, tokens]``
    that the loss function reports under ``key`` on the last mesh."""
    import torch
    import torch.distributed as dist

    totals = torch.zeros(2, dtype=torch.float64)
    if is_loss_rank(plan, slot):
        for item in losses_reduced:
            totals += item[key].double()
    dist.all_reduce(totals)
    return float(totals[0] / totals[1])


def wire_schedule(config, ddp, optimizer, finalize: Callable, *,
                  overlap_grad_reduce: bool = False) -> None:
    """Set on the model's ``config`` what Megatron-LM's training sets for the schedule: the
    finalize function, the loss scale, DDP's ``no_sync`` and, when overlapping, its gradient
    sync."""
    config.finalize_model_grads_func = finalize
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = ddp.no_sync
    if overlap_grad_reduce:
        config.grad_sync_func = ddp.start_grad_sync


@dataclass(kw_only=True, slots=True)
class MeshRank:
    """What :func:`build_mesh_rank` builds on one rank."""

    plan: Plan
    slot: Slot
    """The rank's mesh, stage, replica and tensor rank."""
    grids: list
    """Every mesh's ``HyperCommGrid``."""
    communicator: Any
    """The ``MultiModulePipelineCommunicator`` over the grids."""
    pgs: Any
    """The rank's ``ProcessGroupCollection`` (:func:`training_process_groups`)."""
    collection: Any
    """The schedule's ``MultiModuleProcessGroupCollection``."""
    gpt: Any
    """The rank's ``GPTModel`` slice."""
    ddp: Any
    """``DistributedDataParallel`` around ``MeshStageModule(gpt)``: the schedule's model."""
    optimizer: Any
    """The Megatron optimizer over ``ddp``."""

    @property
    def first(self) -> bool:
        """The rank holds the model's first stage (reads the tokens)."""
        return self.slot.mesh == 0 and self.slot.stage == 0

    @property
    def last(self) -> bool:
        """The rank holds the model's last stage (computes the loss)."""
        return (self.slot.mesh == len(self.plan.meshes) - 1
                and self.slot.stage == len(self.plan.meshes[-1].stages) - 1)


def mesh_rank_groups(plan: Plan, slot: Slot, *, gloo: bool = False) -> tuple[list, Any]:
    """Every mesh's grid (and an MoE model's expert grids) with their groups created, and
    ``slot``'s :func:`training_process_groups`, its mesh's globals set (collective: call on
    every rank); ``gloo``: the world is gloo (:func:`~.mesh_grids.gloo_bridges`)."""
    if gloo:
        gloo_bridges()
    grids = mesh_grids(plan)
    expert_grids = mesh_expert_grids(plan)
    pgs = training_process_groups(grids[slot.mesh], expert_grids[slot.mesh])
    use_mesh_globals(pgs)
    return grids, pgs


def build_mesh_rank(plan: Plan, rank: int, optimizer_config, *, config=None,
                    init: Callable[[Any, Slot], None] | None = None,
                    overlap_grad_reduce: bool = False, gloo: bool = False) -> MeshRank:
    """Build rank ``rank`` of ``plan`` (collective: call on every rank of a world of
    ``plan.world_size``): the meshes' grids and communicator, the rank's ``GPTModel`` slice on
    ``config`` (default :func:`mesh_transformer_config`; pre- and post-processing from its
    global stage) behind ``MeshStageModule``, DDP (:func:`mesh_ddp`), the optimizer of
    ``optimizer_config`` (``get_megatron_optimizer``'s ``OptimizerConfig``; its
    ``use_distributed_optimizer`` shards over the mesh), the schedule's hooks on the config
    (:func:`wire_schedule`, :func:`mesh_finalize_model_grads`). ``init(gpt, slot)`` sets the
    weights before DDP copies them into its buffers; ``gloo``: the world is gloo (CPU ranks,
    :func:`~.mesh_grids.gloo_bridges`)."""
    from .model import gpt_model

    slot = plan.slot_of_rank(rank)
    grids, pgs = mesh_rank_groups(plan, slot, gloo=gloo)
    config = config or mesh_transformer_config(plan, slot)
    last_mesh = slot.mesh == len(plan.meshes) - 1
    pre = slot.mesh == 0 and slot.stage == 0
    post = last_mesh and slot.stage == len(plan.meshes[-1].stages) - 1
    gpt = gpt_model(plan.model, config, pre_process=pre, post_process=post,
                    pg_collection=pgs)
    if init is not None:
        init(gpt, slot)
    module = MeshStageModule(  # post: returns the loss
        gpt, mesh=slot.mesh, last=post, sequence_group=sequence_group(plan, slot.mesh, pgs.tp),
        bridge_out=slot.stage == plan.meshes[slot.mesh].num_stages - 1)
    dist_opt = optimizer_config.use_distributed_optimizer
    ddp = mesh_ddp(module, pgs, overlap_grad_reduce=overlap_grad_reduce,
                   use_distributed_optimizer=dist_opt)
    optimizer = mesh_optimizer(plan, slot, [ddp], pgs, optimizer_config)
    wire_schedule(config, ddp, optimizer, mesh_finalize_model_grads(plan, slot, pgs),
                  overlap_grad_reduce=overlap_grad_reduce)
    comm = mesh_communicator(plan, grids, config)
    return MeshRank(plan=plan, slot=slot, grids=grids, communicator=comm, pgs=pgs,
                    collection=multimodule_collection(plan, slot.mesh, pgs), gpt=gpt, ddp=ddp,
                    optimizer=optimizer)


def mesh_schedule(mesh_rank: MeshRank, forward_step_func: Callable, data_iterator, *,
                  forward_only: bool = False) -> list:
    """One step's forward and backward of ``mesh_rank`` (its replica's micro-batches) under
    megatron-core's non-interleaved 1F1B with the multimodule communicator; returns what the
    loss function reported on the last stage (empty elsewhere)."""
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving,
    )

    plan, slot = mesh_rank.plan, mesh_rank.slot
    replica = plan.meshes[slot.mesh].replicas[slot.replica]
    return forward_backward_pipelining_without_interleaving(
        forward_step_func=forward_step_func, data_iterator=data_iterator,
        model=[mesh_rank.ddp], num_microbatches=replica.num_microbatches,
        seq_length=plan.model.seq_length, micro_batch_size=replica.micro_batch_size,
        forward_only=forward_only, p2p_communicator=mesh_rank.communicator,
        pg_collection=mesh_rank.collection)
