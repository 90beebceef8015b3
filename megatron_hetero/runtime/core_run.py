"""Plans whose stages all share one TP and DP size inside Megatron-LM, on megatron-core's own
schedules: :class:`CoreBackend`, the hooks' backend of a format-1 plan (:mod:`.hooks`).

``validate_args``
    before Megatron's own checks (:meth:`CoreBackend.start`): checks the command line against
    the plan and fills in what the plan implies (:mod:`.plan_args`), refuses policies this
    megatron-core cannot apply, places this process (:mod:`.placement`: ``args.rank`` becomes
    its Megatron rank, so Megatron's process groups follow the plan), and sets this rank's
    stage policies (recompute, optimizer offload) on its own ``args``; on a plan across
    vendors, makes the world group gloo and takes the per-group backends and pipeline-edge
    routing (:mod:`.vendors`, :mod:`.host_p2p`: the ``create_group`` and
    ``initialize_model_parallel`` points).
``core_transformer_config_from_args``
    this rank's stage policies on its own ``TransformerConfig`` (an interleaved plan's model
    chunks each get theirs: see ``get_model``).
``get_model``
    notes which model chunk (``vp_stage``) the model provider is building, so the config hook
    applies the stage's policies to that chunk
    (:func:`megatron_hetero.mcore.stage_policies.stage_config_kwargs`).
``get_forward_backward_func``
    (uneven plans) runs this replica's ``num_microbatches`` x ``micro_batch_size`` in every
    step while Megatron's step accounting keeps counting the global batch (the interleaved
    schedule too: every replica's count fills the schedule's micro-batch groups, of the
    pipeline size or of the plan's ``microbatch_group_size``); on a replica whose plan stages
    ask for more warm-up than Megatron's (``warmup_microbatches``), the schedule is the
    per-stage warm-up one built from megatron-core's pieces
    (:mod:`megatron_hetero.mcore.warmup_schedule`).
``build_pretraining_data_loader``
    (uneven plans) reads this replica's share of every global batch (:mod:`.sampler`).
``get_rng_state`` and ``_load_base_checkpoint``
    (uneven plans) a checkpoint keeps every replica's RNG state and each replica gets its own
    back (:mod:`.replica_rng`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Sequence

from ..errors import HeteroError
from ..mcore.cpu_backend import cpu_mode
from ..mcore.cpu_offload import join_offload_summary
from ..mcore.stage_policies import stage_config_kwargs
from ..mcore.warmup_schedule import refusal, schedule_for, unsupported
from ..plan import Plan, Slot, Stage
from ..schedule.rules import has_extra_warmup, stage_schedule
from . import plan_args, policies, vendors
from .backend import Backend
from .placement import check_device_stacks, detect_device_type, place_this_rank
from .replica_rng import own_rng_state_first, replicas_rng_state
from .sampler import sampler_for_replica

__all__ = ["CoreRankState", "CoreBackend", "check_warmup_args"]


@dataclass(kw_only=True, slots=True)
class CoreRankState:
    """What the hooks decided for this process."""

    plan: Plan
    """The plan (``--hetero-plan``)."""
    plan_path: str
    """Where it was read from (the start of every message about it)."""
    launcher_rank: int
    """This process's rank in the launcher's numbering."""
    megatron_rank: int
    """Its rank in the plan's numbering (Megatron's ``args.rank``)."""
    device_type: str
    """Its device type, a catalog name (``unknown: NAME`` where the catalog lacks it)."""
    slot: Slot
    """Its pipeline, stage and tensor rank in the plan."""
    virtual_num_microbatches: int | None = None
    """Megatron's own (global-accounting) micro-batch count; set after ``validate_args``."""
    args: object = None
    """Megatron's ``args`` of this rank."""
    server: object = None
    """The rendezvous store this process hosts, kept for the job's life (:class:`.placement.Placed`)."""

    @property
    def stage(self) -> Stage:
        return self.plan.stage(self.slot.pipeline, self.slot.stage)

    @property
    def pipeline(self):
        return self.plan.pipelines[self.slot.pipeline]

    def describe(self) -> str:
        s, p = self.stage, self.pipeline
        rec = s.recompute.granularity + (f"/{s.recompute.method}/{s.recompute.num_layers}"
                                         if s.recompute.granularity == "full" else "")
        chunks = (f" in chunks {'+'.join(map(str, s.chunk_layers))}"
                  if self.plan.virtual_pipeline_size > 1 else "")
        sched = (stage_schedule(self.plan, self.slot.pipeline, self.slot.stage)
                 if self.plan.virtual_pipeline_size == 1 else None)
        warmup = (f"; warm-up {sched.warmup} micro-batches (Megatron's {sched.megatron_warmup})"
                  if sched is not None and s.warmup_microbatches is not None else "")
        return (f"megatron-hetero: launcher rank {self.launcher_rank} ({self.device_type}) -> "
                f"Megatron rank {self.megatron_rank}: pipeline {self.slot.pipeline} stage "
                f"{self.slot.stage} tp {self.slot.tensor_rank}; {s.num_layers} layers{chunks}; "
                f"{p.num_microbatches} micro-batches of {p.micro_batch_size}{warmup}; "
                f"recompute {rec}; "
                f"optimizer offload {s.offload.optimizer_fraction:g}"
                + ("; module inputs offloaded to host" if s.offload.module_inputs else ""))


def check_warmup_args(plan: Plan, args, *, source: str) -> None:
    """Refuse, before anything is built, what the per-stage warm-up schedule cannot run when
    some replica of ``plan`` runs it."""
    if plan.virtual_pipeline_size > 1 or not any(has_extra_warmup(p) for p in plan.pipelines):
        return
    problems = unsupported(
        variable_seq_lengths=bool(getattr(args, "variable_seq_lengths", False)),
        ring_exchange=bool(getattr(args, "use_ring_exchange_p2p", False)),
        cuda_graph_impl=getattr(args, "cuda_graph_impl", None))
    if problems:
        raise HeteroError(f"{source}: {refusal(problems)}")


def _place(args, plan: Plan, *, path: str) -> CoreRankState:
    """This process on a rank of ``plan`` (``args.rank`` becomes its Megatron rank)."""
    launcher_rank, world = int(args.rank), int(args.world_size)
    emulated = (plan.device_type_of_rank(launcher_rank)  # the CPU backend plays the plan's type
                if cpu_mode() and launcher_rank < plan.world_size else None)
    device = detect_device_type(override=getattr(args, "hetero_device_type", None),
                                catalog=plan.catalog,  # the built-in one plus the plan's gpus
                                emulated=emulated,
                                where=f"launcher rank {launcher_rank}: ", unknown_ok=True)
    placed = place_this_rank(plan, launcher_rank=launcher_rank, world_size=world,
                             device_type=device, source=path,
                             timeout_minutes=getattr(args, "distributed_timeout_minutes", 10))
    args.rank = placed.rank
    os.environ["RANK"] = str(placed.rank)
    return CoreRankState(plan=plan, plan_path=path, launcher_rank=launcher_rank,
                         megatron_rank=placed.rank, device_type=device,
                         slot=plan.slot_of_rank(placed.rank), args=args, server=placed.server)


@dataclass(kw_only=True, slots=True)
class CoreBackend(Backend):
    """A plan on megatron-core's own schedules (see the module docstring)."""

    state: CoreRankState
    """This rank's placement and plan."""
    vendor_groups: vendors.VendorGroups | None = None
    """The group and pipeline-edge hooks of a plan across vendors (None: one vendor)."""
    building_chunk: int | None = field(default=None, init=False)
    """The model chunk (``vp_stage``) ``get_model``'s provider is building, else None."""
    live_shares: bool = field(default=False, init=False)
    """Whether the replicas' shares may move during the run (``--hetero-rebalance``): the
    replicas then run the uneven path (their own micro-batches and samplers) from the start."""
    train_sampler: object = field(default=None, init=False)
    """The training data loader's sampler (Megatron builds the training loader first)."""
    eval_plan: Plan | None = field(default=None, init=False)
    """With ``--hetero-rebalance``: the plan the run started with, whose shares evaluation
    keeps. Only the training loader's sampler switches (:mod:`.rebalance`); the validation and
    test loaders keep cutting every global batch by these shares, so the forward-only steps
    run these counts too (:meth:`replica_forward_backward`): switching an evaluation loader
    exactly would need a batch its prefetch has not cut yet, and evaluation, forward only and
    occasional, gains little from the balance."""

    @classmethod
    def start(cls, args, plan: Plan, *, path: str, argv: Sequence[str]) -> "CoreBackend":
        plan_args.check_and_apply(args, plan, argv, source=path)
        policies.check_supported(plan, source=path, use_precision_aware_optimizer=getattr(
            args, "use_precision_aware_optimizer", None),
            transformer_impl=getattr(args, "transformer_impl", None))
        check_warmup_args(plan, args, source=path)
        check_device_stacks(plan, source=path)
        st = _place(args, plan, path=path)
        groups = vendors.prepare(plan, args, source=path, cpu_backend=cpu_mode())
        policies.apply_stage_args(args, st.stage)
        return cls(state=st, vendor_groups=groups)

    @property
    def uneven(self) -> bool:
        """Whether the plan's replicas differ (each runs its own micro-batches), or may come to."""
        return not self.state.plan.uniform_data_parallel or self.live_shares

    def validate_args(self, original, args, *a, **kw):
        result = original(args, *a, **kw)
        st, plan = self.state, self.state.plan
        if args.data_parallel_size != plan.data_parallel_size:
            raise HeteroError(f"{st.plan_path}: Megatron computed data-parallel size "
                              f"{args.data_parallel_size}; the plan has {plan.data_parallel_size} "
                              f"pipelines")
        st.virtual_num_microbatches = plan.global_batch_size // (
            args.micro_batch_size * args.data_parallel_size)
        if self.uneven and getattr(args, "dataloader_type", "single") not in ("single", None):
            raise HeteroError(f"{st.plan_path}: an uneven plan reads each replica's share of "
                              f"every global batch in order; --dataloader-type "
                              f"{args.dataloader_type} is not supported with it (use single)")
        if os.environ.get("MEGATRON_HETERO_VERBOSE") or st.megatron_rank == 0:
            print(st.describe(), flush=True)
        return result

    def apply_stage_config(self, config, chunk: int | None = None) -> object:
        """This rank's stage policies on a ``TransformerConfig`` (returned, changed in place);
        for an interleaved plan, on model chunk ``chunk`` (default: the one being built)."""
        if chunk is None:
            chunk = self.building_chunk
        if self.state.plan.virtual_pipeline_size == 1:
            chunk = None
        for key, value in stage_config_kwargs(self.state.stage, chunk).items():
            setattr(config, key, value)
        return config

    def transformer_config(self, original, *a, **kw):
        return self.apply_stage_config(original(*a, **kw))

    def get_model(self, original, model_provider_func, *a, **kw):
        @functools.wraps(model_provider_func)
        def provider(*pa, **pkw):
            self.building_chunk = pkw.get("vp_stage")
            try:
                return model_provider_func(*pa, **pkw)
            finally:
                self.building_chunk = None
        return original(provider, *a, **kw)

    def replica_forward_backward(self, fb):
        """Wrap a schedule so that it runs this replica's micro-batches when called with
        Megatron's global-accounting count (training and evaluation steps both are; evaluation
        runs :attr:`eval_plan`'s where live rebalancing moved the training shares)."""
        st = self.state

        @functools.wraps(fb)
        def forward_backward(*a, **kw):
            if kw.get("num_microbatches") != st.virtual_num_microbatches:
                return fb(*a, **kw)
            evaluating = kw.get("forward_only") and self.eval_plan is not None
            pipe = self.eval_plan.pipelines[st.slot.pipeline] if evaluating else st.pipeline
            kw["num_microbatches"] = pipe.num_microbatches
            kw["micro_batch_size"] = pipe.micro_batch_size
            args, saved = st.args, st.args.micro_batch_size
            args.micro_batch_size = pipe.micro_batch_size  # get_batch_on_this_tp_rank reads it
            try:
                return fb(*a, **kw)
            finally:
                args.micro_batch_size = saved
        return forward_backward

    def forward_backward_func(self, original, *a, **kw):
        st = self.state
        # the plan's per-stage warm-up where it asks for more than Megatron's on this replica
        fb = schedule_for(st.plan, st.slot.pipeline, original(*a, **kw))
        # ranks that offload nothing join the others' offload summary
        fb = join_offload_summary(fb, st.plan, st.stage)
        return self.replica_forward_backward(fb) if self.uneven else fb

    def replica_data_loader(self, dataset, consumed_samples, *, num_workers: int = 0):
        """A DataLoader reading this replica's share of every global batch of ``dataset``."""
        import torch

        sampler = sampler_for_replica(self.state.plan, self.state.slot.pipeline,
                                      total_samples=len(dataset),
                                      consumed_samples=consumed_samples)
        if self.train_sampler is None:
            self.train_sampler = sampler
        return torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                                           num_workers=num_workers,
                                           pin_memory=torch.cuda.is_available(),
                                           persistent_workers=num_workers > 0)

    def data_loader(self, original, dataset, consumed_samples, *a, **kw):
        if dataset is None or not self.uneven:
            return original(dataset, consumed_samples, *a, **kw)
        from megatron.core import parallel_state

        dp_rank = parallel_state.get_data_parallel_rank()
        if dp_rank != self.state.slot.pipeline:
            raise AssertionError(f"data-parallel rank {dp_rank} != plan pipeline "
                                 f"{self.state.slot.pipeline}")
        return self.replica_data_loader(dataset, consumed_samples,
                                        num_workers=getattr(self.state.args, "num_workers", 0))

    def get_rng_state(self, original, *a, **kw):
        saved = original(*a, **kw)
        if not self.uneven:
            return saved
        from megatron.core import parallel_state

        group = kw.get("dp_group") or parallel_state.get_data_parallel_group()
        return replicas_rng_state(saved, group)

    def load_base_checkpoint(self, original, *a, **kw):
        loaded = original(*a, **kw)
        if self.uneven:
            from megatron.core import parallel_state

            own_rng_state_first(loaded[0], rank=parallel_state.get_data_parallel_rank(),
                                size=parallel_state.get_data_parallel_world_size())
        return loaded

    def create_group(self, original, *a, **kw):
        if self.vendor_groups is None:
            return original(*a, **kw)
        return self.vendor_groups.create_group(original, *a, **kw)

    def initialize_model_parallel(self, original, *a, **kw):
        result = original(*a, **kw)
        if self.vendor_groups is not None:
            self.vendor_groups.build_edges(
                timeout_minutes=kw.get("distributed_timeout_minutes", 30))
        return result
