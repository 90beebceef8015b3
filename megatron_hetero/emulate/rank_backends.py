"""The two ways the CPU trainer (:mod:`.trainer`) builds and steps one rank, behind one
interface, :class:`RankBackend`, as :mod:`megatron_hetero.runtime.backend` does for the GPU
runtime:

* :class:`GridRank`: one grid (:attr:`~megatron_hetero.plan.Plan.one_grid`): megatron-core's
  parallel state (TP, PP, DP and the pipeline layout from the plan), one ``GPTModel`` chunk per
  virtual pipeline stage, Megatron's DDP and optimizer, and megatron-core's own schedules
  (1F1B, interleaved 1F1B, or :mod:`megatron_hetero.mcore.warmup_schedule`'s per-stage
  warm-up);
* :class:`ChainRank`: a chain of meshes: :func:`megatron_hetero.mcore.mesh_train.build_mesh_rank`
  (the meshes' grids, the multimodule communicator and its bridges, the rank's ``GPTModel``
  slice, DDP and optimizer over its mesh) and megatron-core's non-interleaved 1F1B with the
  multimodule communicator (megatron-core 0.17+);
* :class:`InterleavedChainRank`: a chain of meshes on the chain's own schedule
  (:attr:`~megatron_hetero.plan.Plan.own_chain_schedule`: model chunks, or per-stage warm-ups):
  :mod:`megatron_hetero.mcore.mesh_interleaved`'s chunks, links and (interleaved) 1F1B
  (megatron-core 0.17.1+; before 0.19 each bridge's group from :mod:`~megatron_hetero.mcore.bridge_groups`).

Everything else (the data each replica reads, the steps, the hooks, the parameters' merge)
is the trainer's, the same for both. :func:`backend_for` picks the backend from the plan's
shape. Each rank runs its own stage's memory policies under either: recompute, module-input
offload and optimizer offload (:mod:`megatron_hetero.mcore.cpu_offload`, whose
:func:`join_offload_summary` keeps ranks that offload no module inputs from waiting forever in
megatron-core's offload summary).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterator

from ..errors import HeteroError
from ..mcore.config import plan_transformer_config
from ..mcore.cpu_offload import join_offload_summary
from ..mcore.model import gpt_model, wrap_ddp
from ..mcore.stage_policies import optimizer_offload_kwargs
from ..mcore.warmup_schedule import schedule_for
from ..plan import Plan, Slot, Stage
from .params import init_params, local_params

__all__ = ["RankBackend", "GridRank", "ChainRank", "InterleavedChainRank", "backend_for",
           "optimizer_config"]


def optimizer_config(plan: Plan, stage: Stage, config):
    """The rank's ``OptimizerConfig`` (``config``: the trainer's ``TrainConfig``): Adam or SGD,
    in ``config.precision`` (bf16 or fp16: megatron-core's mixed-precision optimizer, fp32 main
    parameters; fp16 with dynamic loss scaling from ``config.initial_loss_scale``), gradient
    clipping, the distributed optimizer as ``config`` decides it for ``plan``, and ``stage``'s
    optimizer offload."""
    from megatron.core.optimizer import OptimizerConfig

    from ..mcore.config import torch_dtype

    return OptimizerConfig(optimizer=config.optimizer, lr=config.lr,
                           weight_decay=config.weight_decay, clip_grad=config.clip_grad,
                           bf16=config.precision == "bf16", fp16=config.precision == "fp16",
                           params_dtype=torch_dtype(config.precision),
                           initial_loss_scale=config.initial_loss_scale,
                           hysteresis=config.loss_scale_hysteresis,
                           use_distributed_optimizer=config.distributed_optimizer(plan),
                           **optimizer_offload_kwargs(stage))


class RankBackend(ABC):
    """One rank's megatron-core model, optimizer and schedule under the CPU trainer."""

    ddps: list
    """The rank's model chunks, each in Megatron's ``DistributedDataParallel``."""
    optimizer: Any
    """The Megatron optimizer over them."""

    @classmethod
    def check_installed(cls, source: str) -> None:
        """Refuse, naming ``source``, where the installed megatron-core cannot run the backend."""

    @classmethod
    @abstractmethod
    def open(cls, plan: Plan, slot: Slot, config) -> contextlib.AbstractContextManager:
        """A context manager that builds the rank playing ``slot`` (collective: every rank of
        the world enters it) and yields the backend; on exit, tears down what megatron-core
        keeps between runs in this process."""

    @abstractmethod
    def run(self, batches: Callable[[], Iterator], forward_step, forward_only: bool, *,
            plan: Plan | None = None) -> float:
        """One pass of the schedule over the step's micro-batches (``batches()``: a fresh
        iterator of this replica's micro-batches of the step), ``forward_step`` the schedule's
        ``forward_step_func``; returns the step's loss over the whole model (every rank).
        ``plan``: the step's plan where live rebalancing moved the replicas' shares (the
        plan the rank was built for, with other micro-batch counts; one grid only)."""

    @abstractmethod
    def params(self) -> dict[str, tuple[Any, int | None, bool]]:
        """The rank's parameters by layout-independent name (:func:`.params.local_params`)."""


def backend_for(plan: Plan) -> type[RankBackend]:
    """:class:`GridRank` where the plan is one grid, :class:`ChainRank` for a chain of meshes,
    :class:`InterleavedChainRank` for a chain of meshes on the chain's own schedule (model
    chunks, or per-stage warm-ups: :attr:`~megatron_hetero.plan.Plan.own_chain_schedule`)."""
    if plan.one_grid:
        return GridRank
    return InterleavedChainRank if plan.own_chain_schedule else ChainRank


class GridRank(RankBackend):
    """A rank of a plan of one grid on megatron-core's parallel state and own schedules."""

    def __init__(self, plan: Plan, slot: Slot, config) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        assert ps.get_data_parallel_rank() == slot.replica, "Megatron rank order is not tp-dp-pp"
        assert ps.get_pipeline_model_parallel_rank() == slot.stage
        tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
        self.plan, self.slot = plan, slot
        stage = plan.stage_of_slot(slot)
        self.chunks, self.models = self._build_chunks(plan, slot, stage, config)
        self.ddps, self.optimizer = self._wrap_for_training(plan, stage, self.models, config)
        self.forward_backward = self._schedule(plan)
        self.last_stage = ps.is_pipeline_last_stage()  # holds the loss (on its last chunk)

    def _schedule(self, plan: Plan):
        """The schedule of this rank's replica under ``plan`` (its per-stage warm-ups)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return join_offload_summary(schedule_for(  # non-offloading ranks join
            plan, self.slot.replica, get_forward_backward_func()), plan,
            plan.stage_of_slot(self.slot))

    @classmethod
    @contextlib.contextmanager
    def open(cls, plan: Plan, slot: Slot, config):
        from megatron.core import parallel_state as ps

        v, mesh = plan.virtual_pipeline_size, plan.meshes[0]
        ps.initialize_model_parallel(tensor_model_parallel_size=plan.tensor_model_parallel_size,
                                     pipeline_model_parallel_size=plan.pipeline_model_parallel_size,
                                     virtual_pipeline_model_parallel_size=v if v > 1 else None,
                                     expert_model_parallel_size=mesh.expert_model_parallel_size,
                                     expert_tensor_parallel_size=mesh.expert_tensor_size)
        try:
            yield cls(plan, slot, config)
        finally:
            ps.destroy_model_parallel()

    @staticmethod
    def _build_chunks(plan: Plan, slot: Slot, stage: Stage, config):
        """This rank's model chunks, each initialized by layout-independent names: ``[(pre,
        post)]`` (holds the embedding, holds the output layer) and the ``GPTModel`` of each."""
        from megatron.core import parallel_state as ps

        v = plan.virtual_pipeline_size
        tied = not plan.model.untie_embeddings_and_output_weights
        chunks, models = [], []
        for vp in range(v):
            tconf = plan_transformer_config(  # the stage's policies on its chunk
                plan, stage, vp, offload_min_numel=config.offload_min_numel,
                precision=config.precision)
            vp_stage = vp if v > 1 else None
            pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
            model = gpt_model(plan.model, tconf, pre_process=pre, post_process=post,
                              vp_stage=vp_stage)
            init_params(model, plan, config.seed, config.init_std, slot.tensor_rank,
                        tied and post and not pre, expert_offset=_expert_offset(plan, slot))
            chunks.append((pre, post))
            models.append(model)
        return chunks, models

    @staticmethod
    def _wrap_for_training(plan: Plan, stage: Stage, models: list, config):
        """Megatron's DDP around each chunk and ``get_megatron_optimizer`` over them, wired into
        the chunks' configs as Megatron-LM's training wires them: (ddps, optimizer)."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer

        v = plan.virtual_pipeline_size
        overlap = plan.overlap_grad_reduce  # gradient reduction during the last backward
        ddps = wrap_ddp(models, overlap_grad_reduce=overlap,
                        use_distributed_optimizer=config.distributed_optimizer(plan))
        optimizer = get_megatron_optimizer(optimizer_config(plan, stage, config), ddps)
        for tconf in (model.config for model in models):  # the schedule reads chunk 0's
            tconf.finalize_model_grads_func = finalize_model_grads
            tconf.grad_scale_func = optimizer.scale_loss
            tconf.no_sync_func = [d.no_sync for d in ddps] if v > 1 else ddps[0].no_sync
            if overlap:  # as Megatron-LM's training sets it (align_grad_reduce)
                tconf.grad_sync_func = ([d.start_grad_sync for d in ddps] if v > 1
                                        else ddps[0].start_grad_sync)
        return ddps, optimizer

    def run(self, batches, forward_step, forward_only: bool, *, plan=None) -> float:
        import torch
        import torch.distributed as dist

        plan = plan or self.plan
        pipe = plan.meshes[0].pipelines[self.slot.replica]
        schedule = self.forward_backward if plan is self.plan else self._schedule(plan)
        # every chunk reads the replica's micro-batches in order (the interleaved schedule
        # takes one iterator per chunk)
        data = [batches() for _ in self.ddps]
        reduced = schedule(
            forward_step_func=forward_step, data_iterator=data if len(data) > 1 else data[0],
            model=self.ddps, num_microbatches=pipe.num_microbatches,
            seq_length=plan.model.seq_length, micro_batch_size=pipe.micro_batch_size,
            forward_only=forward_only)
        totals = torch.zeros(2, dtype=torch.float64)
        if self.last_stage and self.slot.tensor_rank == 0:
            for item in reduced:
                totals += item["lm loss"].double()
        dist.all_reduce(totals)
        return float(totals[0] / totals[1])

    def params(self):
        tied = not self.plan.model.untie_embeddings_and_output_weights
        return local_params(self.models, self.chunks, self.plan, tied,
                            expert_offset=_expert_offset(self.plan, self.slot))


def _expert_offset(plan: Plan, slot: Slot) -> int:
    """The routed experts of each MoE layer before ``slot``'s first (0 for a dense model): its
    expert-parallel rank in its mesh's expert grid (the stage's ``T x D`` ranks in ``tp-dp``
    order cut into blocks of ``ETP x EP``, megatron-core's order on one grid as on a chain's
    own expert grids) times its local experts."""
    if not plan.model.is_moe:
        return 0
    mesh = plan.meshes[slot.mesh]
    index = slot.replica * mesh.tensor_model_parallel_size + slot.tensor_rank
    ep_rank = index // mesh.expert_tensor_size % mesh.expert_model_parallel_size
    return ep_rank * (plan.model.num_experts // mesh.expert_model_parallel_size)


class ChainRank(RankBackend):
    """A rank of a chain of meshes on megatron-core's multimodule communicator."""

    def __init__(self, plan: Plan, slot: Slot, config) -> None:
        from megatron.core import tensor_parallel

        from ..mcore.mesh_train import build_mesh_rank, mesh_schedule, mesh_transformer_config

        mesh = plan.meshes[slot.mesh]
        offset = sum(plan.layer_split[:plan.global_stage(slot)])
        tensor_parallel.model_parallel_cuda_manual_seed(config.seed, tp_rank=slot.tensor_rank,
                                                        ep_rank=0, etp_rank=0)

        def init(gpt, slot):
            self.expert_offset = _expert_offset(plan, slot)
            init_params(gpt, plan, config.seed, config.init_std, slot.tensor_rank, False,
                        tensor_parallel_size=mesh.tensor_model_parallel_size,
                        layer_offset=offset, expert_offset=self.expert_offset)

        self.plan, self.slot, self.layer_offset = plan, slot, offset
        stage = plan.stage_of_slot(slot)
        self.built = build_mesh_rank(plan, plan.rank_of_slot(slot),
                                     optimizer_config(plan, stage, config), init=init,
                                     config=mesh_transformer_config(
                                         plan, slot, offload_min_numel=config.offload_min_numel,
                                         precision=config.precision),
                                     overlap_grad_reduce=plan.overlap_grad_reduce, gloo=True)
        self.ddps, self.optimizer = [self.built.ddp], self.built.optimizer
        # ranks that offload no module inputs join the others' offload summary
        self.schedule = join_offload_summary(mesh_schedule, plan, stage)

    @classmethod
    def check_installed(cls, source: str) -> None:
        """Refuse where megatron-core lacks the multimodule schedule (0.16)."""
        try:
            from megatron.core.process_groups_config import (  # noqa: F401
                MultiModuleProcessGroupCollection,
            )
        except ImportError:
            from importlib.metadata import version
            raise HeteroError(f"{source}: rehearsing a mesh plan needs megatron-core 0.17 (its "
                              "multimodule 1F1B schedule); megatron-core "
                              f"{version('megatron-core')} is installed") from None

    @classmethod
    @contextlib.contextmanager
    def open(cls, plan: Plan, slot: Slot, config):
        try:
            yield cls(plan, slot, config)
        finally:
            from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator
            BridgeCommunicator.destroy_broadcast_pgs()

    def run(self, batches, forward_step, forward_only: bool, *, plan=None) -> float:
        from ..mcore.mesh_train import whole_model_loss

        self._refuse_new_shares(plan)
        reduced = self.schedule(self.built, forward_step, batches(), forward_only=forward_only)
        return whole_model_loss(self.plan, self.slot, reduced)

    def _refuse_new_shares(self, plan) -> None:
        """Live rebalancing (``run``'s ``plan``) moves the shares of one grid only."""
        if plan is not None and plan != self.plan:
            raise HeteroError("live rebalancing moves the shares of one grid; this plan is a "
                              "chain of meshes")

    def params(self):
        chunk = (self.built.first, self.built.last)
        return local_params([self.built.gpt], [chunk], self.plan, False,
                            layer_offset=self.layer_offset, expert_offset=self.expert_offset)


class InterleavedChainRank(ChainRank):
    """A rank of a chain of meshes with model chunks, in interleaved 1F1B over the chain
    (:mod:`megatron_hetero.mcore.mesh_interleaved`); also, as one chunk a stage, a chain
    without chunks whose stages warm up beyond Megatron's (non-interleaved 1F1B with per-stage
    warm-up)."""

    def __init__(self, plan: Plan, slot: Slot, config) -> None:
        from megatron.core import tensor_parallel

        from ..mcore.mesh_interleaved import build_interleaved_mesh_rank, chunk_virtual_stage
        from ..mcore.mesh_train import mesh_transformer_config

        tp = plan.meshes[slot.mesh].tensor_model_parallel_size
        tensor_parallel.model_parallel_cuda_manual_seed(config.seed, tp_rank=slot.tensor_rank,
                                                        ep_rank=0, etp_rank=0)

        def init(gpt, slot, offset):
            init_params(gpt, plan, config.seed, config.init_std, slot.tensor_rank, False,
                        tensor_parallel_size=tp, layer_offset=offset,
                        expert_offset=_expert_offset(plan, slot))

        self.plan, self.slot = plan, slot
        stage = plan.stage_of_slot(slot)
        layers = plan.virtual_stage_layers
        configs = [mesh_transformer_config(
            plan, slot, num_layers=n, offload_min_numel=config.offload_min_numel,
            first_layer=sum(layers[:chunk_virtual_stage(plan, slot, c)]),
            precision=config.precision)
            for c, n in enumerate(stage.chunk_layers or [stage.num_layers])]
        self.built = build_interleaved_mesh_rank(
            plan, plan.rank_of_slot(slot), optimizer_config(plan, stage, config),
            configs=configs, init=init, overlap_grad_reduce=plan.overlap_grad_reduce, gloo=True)
        self.ddps, self.optimizer = self.built.ddps, self.built.optimizer
        self.schedule = join_offload_summary(_interleaved_schedule, plan, stage)

    @classmethod
    @contextlib.contextmanager
    def open(cls, plan: Plan, slot: Slot, config):
        with super().open(plan, slot, config) as backend:
            try:
                yield backend
            finally:
                backend.built.close()

    def run(self, batches, forward_step, forward_only: bool, *, plan=None) -> float:
        from ..mcore.mesh_train import whole_model_loss

        self._refuse_new_shares(plan)
        reduced = self.schedule(self.built, forward_step, [batches() for _ in self.ddps],
                                forward_only=forward_only)
        return whole_model_loss(self.plan, self.slot, reduced)

    def params(self):
        out = {}
        for c, (gpt, offset) in enumerate(zip(self.built.gpts, self.built.layer_offsets)):
            out.update(local_params([gpt], [self.built.chunk_ends(c)], self.plan, False,
                                    layer_offset=offset,
                                    expert_offset=_expert_offset(self.plan, self.slot)))
        return out


def _interleaved_schedule(built, forward_step, data_iterators, *, forward_only: bool) -> list:
    """:func:`~megatron_hetero.mcore.mesh_interleaved.interleaved_mesh_schedule` (imported when
    megatron-core is)."""
    from ..mcore.mesh_interleaved import interleaved_mesh_schedule

    return interleaved_mesh_schedule(built, forward_step, data_iterators,
                                     forward_only=forward_only)
