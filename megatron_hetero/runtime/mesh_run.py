"""Mesh plans (``format_version: 2``) inside Megatron-LM's own training loop (megatron-core 0.17).

:class:`MeshBackend`, the multimodule backend: :mod:`.hooks` hands it a rank of a mesh plan's
calls of the functions it wraps (:class:`.backend.Backend`); nothing of Megatron is copied, each
step calls Megatron's own function or megatron-core's multimodule pieces (docs/meshes.md,
"Runtime"):

``validate_args``
    each rank takes its mesh's tensor-parallel size, its mesh's pipeline depth and its mesh's
    micro-batch from the plan (:func:`before_validate`), the plan's common arguments checked
    against the command line as for format 1. Megatron's own checks then run on *the mesh's
    view*: ``args.world_size`` is the mesh's ranks while they run (so Megatron's data-parallel
    size is the mesh's ``D`` and its micro-batch count ``G / (D x b)``) and the layout is the
    mesh's segments of the whole model's. Each rank takes its own stage's recompute and offload
    (:func:`.policies.stage_args`), what megatron-core cannot apply refused at start with its
    ``meshes[k].stages[j]`` field (:func:`.policies.check_supported`).
``parallel_state.initialize_model_parallel``
    Megatron's own function once per mesh, on every rank in plan order (group creation is
    collective), with the mesh's sizes, ``local_world_size`` its ranks and ``rank_offset`` its
    first rank; each rank keeps the ``parallel_state`` globals of its own mesh's call
    (:func:`initialize_per_mesh`). Then megatron-core's grids of every mesh
    (:func:`megatron_hetero.mcore.mesh_grids.mesh_grids`). On a plan across vendors the world
    is gloo and each group on its vendor's backend (:mod:`.vendors`, through
    ``create_group``), each mesh's grid too, and a bridge between vendors host-staged
    (:mod:`megatron_hetero.mcore.bridge_groups`).
``parallel_state.is_pipeline_first_stage`` / ``is_pipeline_last_stage``
    the whole model's first and last stage (the mesh's groups alone would make every mesh's
    first stage "first"): the training loop's loss on the last mesh, ``get_batch``'s inputs.
``core_transformer_config_from_args``, ``get_model`` (:mod:`.mesh_model`)
    the whole model's pipeline size and layout in the config, each layer numbered from the
    rank's *global* stage (the one-process model's numbers, in checkpoints too);
    pre-/post-process from the global stage; the model's input and output in the multimodule
    communicator's ``{mesh name: tensor}``; Megatron's own DDP over the mesh's data-parallel
    group, scaled by ``1 / D_last``; then megatron-core's ``MultiModulePipelineCommunicator``.
``get_forward_backward_func``
    megatron-core's ``forward_backward_pipelining_without_interleaving`` with the communicator
    and the rank's ``MultiModuleProcessGroupCollection`` (replicas that differ: each runs its
    own micro-batches under Megatron's global step accounting, as format 1's uneven plans);
    a rank that offloads no module inputs joins the offloading ranks' world-wide offload
    summary once (:func:`megatron_hetero.mcore.cpu_offload.join_offload_summary`).
``finalize_model_grads``
    Megatron's own, over the mesh's groups (the multimodule collection names none); with
    per-token loss (replicas that differ) the global batch's token count reaches every mesh.
``get_megatron_optimizer``
    Megatron's own, over the mesh's groups; then its gradient norm, and so clipping and the
    logged norm, taken over the whole model as the CPU rehearsal's optimizer takes it
    (:func:`megatron_hetero.mcore.mesh_train.use_whole_model_grad_norm`, :func:`whole_model_optimizer`).

The data loader: with every replica alike Megatron's sampler over the mesh's data-parallel
rank and size reads replica ``r``'s share ``[r b, (r + 1) b)`` of every global micro-batch of
``D b`` samples, and ``D b`` is the same in every mesh (the plan checks it), so a sample meets
itself at every bridge. Replicas that differ (every mesh then has the same replicas) read their
consecutive shares of the global batch (:func:`replica_data_loader`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
import re
from dataclasses import dataclass

from typing import Sequence

from ..errors import HeteroError
from ..mcore.cpu_backend import cpu_mode
from ..mcore.cpu_offload import join_offload_summary
from ..plan.megatron_args import megatron_args
from ..plan import Plan, Slot
from . import mesh_model, plan_args, policies, vendors
from .backend import Backend
from .mesh_checkpoint import check_mixed_grids, rng_state_per_mesh
from .mesh_state import MeshRankState, even_plan
from .placement import detect_device_type, device_type_of_rank, place_this_rank
from .sampler import HeteroBatchSampler

__all__ = ["MeshBackend", "MeshRankState", "before_validate", "mesh_view", "after_validate",
           "initialize_per_mesh", "global_stage_check", "mesh_schedule", "mesh_finalize",
           "whole_model_optimizer", "replica_data_loader", "uneven", "even_plan",
           "replica_micro_batch_size"]

_PER_MESH_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                   "--micro-batch-size", "--num-layers-per-virtual-pipeline-stage",
                   "--num-virtual-stages-per-pipeline-rank", "--sequence-parallel",
                   "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers")


# -- arguments ---------------------------------------------------------------------------------

def _mesh_layout(plan: Plan, st: MeshRankState) -> str | None:
    """The mesh's segments of the whole model's layout (Megatron's checks count them)."""
    if plan.pipeline_model_parallel_size == 1:
        return None
    parts = plan.layout().split("|")
    return "|".join(parts[st.first_stage:st.first_stage + len(st.mesh.stages)])


def before_validate(args, plan: Plan, *, path: str, argv) -> MeshRankState:
    """Check the command line against ``plan``, place this process (its device type) on a rank
    of the plan and give it its mesh's sizes."""
    launcher_rank, world = int(args.rank), int(args.world_size)
    emulated = (device_type_of_rank(plan, launcher_rank)
                if cpu_mode() and launcher_rank < plan.world_size else None)
    device = detect_device_type(override=getattr(args, "hetero_device_type", None),
                                catalog=plan.catalog, emulated=emulated,
                                where=f"launcher rank {launcher_rank}: ", unknown_ok=True)
    placed = place_this_rank(plan, launcher_rank=launcher_rank, world_size=world,
                             device_type=device, source=path,
                             timeout_minutes=getattr(args, "distributed_timeout_minutes", 10))
    rank = placed.rank
    given = plan_args.given_flags(argv)
    conflicts = [f"  {flag}: each rank takes its mesh's from the plan; leave it out"
                 for flag in _PER_MESH_FLAGS if flag in given]
    for flag in ("--ddp-average-in-collective",) + (
            ("--calculate-per-token-loss",) if even_plan(plan) else ()):
        if flag in given:
            conflicts.append(f"  {flag}: not with a mesh plan (the gradients are scaled by "
                             "1 / D of the last mesh after a sum over each mesh)")
    for item in plan_args.implied_from_tokens(megatron_args(plan)):
        if item.flag == "--hetero-plan":
            continue
        current = getattr(args, item.dest, None)
        if item.flag in given:
            if item.flag == "--max-position-embeddings" and current is not None \
                    and current >= item.value:
                continue
            if item.dest == "pipeline_model_parallel_layout" and isinstance(current, str):
                current = current.replace(" ", "")
            if current != item.value:
                conflicts.append(f"  {item.flag}: the command line has {current!r}; the plan "
                                 f"implies {item.value!r}")
            continue
        setattr(args, item.dest, item.value)
    if conflicts:
        raise plan_args.ArgumentConflict(f"{path}: the command line contradicts the plan:\n"
                                         + "\n".join(conflicts))
    policies.check_supported(plan, source=path, use_precision_aware_optimizer=getattr(
        args, "use_precision_aware_optimizer", None),
        transformer_impl=getattr(args, "transformer_impl", None))
    st = MeshRankState(plan=plan, plan_path=path, rank=rank, launcher_rank=launcher_rank,
                       device_type=device, slot=plan.slot_of_rank(rank), args=args,
                       server=placed.server)
    args.rank = rank
    os.environ["RANK"] = str(rank)
    mesh = st.mesh
    args.tensor_model_parallel_size = mesh.tensor_model_parallel_size
    args.pipeline_model_parallel_size = len(mesh.stages)
    args.micro_batch_size = (mesh.replicas[st.slot.replica].micro_batch_size if even_plan(plan)
                             else _virtual_micro_batch_size(plan, path))
    args.pipeline_model_parallel_layout = _mesh_layout(plan, st)
    args.sequence_parallel = plan.sequence_parallel_in(st.slot.mesh)
    args.ddp_average_in_collective = False
    policies.apply_stage_args(args, st.stage)
    return st


def _virtual_micro_batch_size(plan: Plan, path: str) -> int:
    """Uneven replicas (every mesh then has the same ``D`` and the same replicas): the
    ``--micro-batch-size`` Megatron's step accounting sees, ``micro-batch x D x count`` being
    the global batch, while each replica runs its own (as format 1's uneven plans do)."""
    d, gbs = plan.meshes[0].data_parallel_size, plan.global_batch_size
    for m in (plan.meshes[0].replicas[0].micro_batch_size, 1):
        if gbs % (m * d) == 0:
            return m
    raise HeteroError(f"{path}: global_batch_size {gbs} is not a multiple of the {d} replicas: "
                      "Megatron's step accounting (micro-batch size x DP x micro-batches) "
                      "cannot equal it")


@contextlib.contextmanager
def mesh_view(args, st: MeshRankState):
    """Megatron's ``validate_args`` on the mesh's ranks (its data-parallel size is the mesh's)."""
    saved = args.world_size
    args.world_size = st.mesh.world_size
    try:
        yield
    finally:
        args.world_size = saved


def after_validate(args, st: MeshRankState) -> None:
    if args.data_parallel_size != st.mesh.data_parallel_size:
        raise HeteroError(f"{st.plan_path}: Megatron computed data-parallel size "
                          f"{args.data_parallel_size}; mesh {st.slot.mesh} has "
                          f"{st.mesh.data_parallel_size} replicas")
    if os.environ.get("MEGATRON_HETERO_VERBOSE") or st.slot == Slot(st.slot.mesh, 0, 0, 0):
        print(st.describe(), flush=True)


# -- process groups ----------------------------------------------------------------------------

_GLOBAL = re.compile(r"_[A-Z][A-Z0-9_]*")


def _snapshot(module) -> dict:
    return {name: copy.copy(value) if isinstance(value, (dict, list)) else value
            for name, value in vars(module).items() if _GLOBAL.fullmatch(name)}


def _restore(module, values: dict) -> None:
    for name, value in values.items():
        setattr(module, name, value)


def initialize_per_mesh(original, st: MeshRankState, *a, grid_backends=None, **kw) -> None:
    """Megatron's ``initialize_model_parallel`` once per mesh (see the module docstring), then
    the grids of every mesh (mesh ``k``'s groups on ``grid_backends[k]`` where given)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..mcore.mesh_grids import gloo_bridges, mesh_grids

    bound = inspect.signature(original).bind(*a, **kw).arguments
    pristine, mine = _snapshot(parallel_state), None
    for k, mesh in enumerate(st.plan.meshes):
        _restore(parallel_state, pristine)
        original(**{**bound, "tensor_model_parallel_size": mesh.tensor_model_parallel_size,
                    "pipeline_model_parallel_size": len(mesh.stages),
                    "virtual_pipeline_model_parallel_size": None,
                    "expert_model_parallel_size": mesh.expert_model_parallel_size,
                    "expert_tensor_parallel_size": mesh.expert_tensor_parallel_size,
                    "local_world_size": mesh.world_size,
                    "rank_offset": st.plan.rank_offset(k)})
        if k == st.slot.mesh:
            mine = _snapshot(parallel_state)
    _restore(parallel_state, mine)
    assert dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()) == [
        st.plan.rank_of_slot(Slot(st.slot.mesh, j, st.slot.replica, st.slot.tensor_rank))
        for j in range(len(st.mesh.stages))], "mesh pipeline group differs from the plan's"
    if cpu_mode():
        gloo_bridges()
    st.grids = mesh_grids(st.plan, backends=grid_backends)


def global_stage_check(original, st: MeshRankState, *, last: bool):
    """``is_pipeline_first_stage`` / ``is_pipeline_last_stage`` of the whole model."""
    @functools.wraps(original)
    def check(*a, **kw):
        edge = st.last_mesh if last else st.slot.mesh == 0
        return edge and original(*a, **kw)
    return check


def _collection(st: MeshRankState):
    from ..mcore.mesh_stage import mesh_process_groups, multimodule_collection

    return multimodule_collection(st.plan, st.slot.mesh, mesh_process_groups(st.grids[st.slot.mesh]))


@contextlib.contextmanager
def replica_micro_batch_size(st: MeshRankState):
    """Replicas that differ: ``args.micro_batch_size`` is the rank's replica's own while its
    schedule runs (``get_batch_on_this_tp_rank`` reads it), Megatron's step accounting's
    (:func:`_virtual_micro_batch_size`) otherwise."""
    saved = st.args.micro_batch_size
    st.args.micro_batch_size = st.mesh.replicas[st.slot.replica].micro_batch_size
    try:
        yield
    finally:
        st.args.micro_batch_size = saved


def mesh_schedule(st: MeshRankState):
    """megatron-core's non-interleaved 1F1B over the meshes."""
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving,
    )

    collection = _collection(st)
    replica = st.mesh.replicas[st.slot.replica]

    @functools.wraps(forward_backward_pipelining_without_interleaving)
    def forward_backward(*a, **kw):
        kw["p2p_communicator"], kw["pg_collection"] = st.communicator, collection
        if even_plan(st.plan) or st.args is None or kw.get("num_microbatches") != \
                st.plan.global_batch_size // (st.args.micro_batch_size * st.mesh.data_parallel_size):
            return forward_backward_pipelining_without_interleaving(*a, **kw)
        # uneven replicas: this replica's own micro-batches under Megatron's global accounting
        kw["num_microbatches"], kw["micro_batch_size"] = (replica.num_microbatches,
                                                          replica.micro_batch_size)
        with replica_micro_batch_size(st):
            return forward_backward_pipelining_without_interleaving(*a, **kw)
    # ranks that offload no module inputs join the others' offload summary
    return join_offload_summary(forward_backward, st.plan, st.stage)


def mesh_finalize(original, st: MeshRankState):
    """Megatron's ``finalize_model_grads`` over the rank's mesh groups where the schedule hands
    it the multimodule collection. With per-token loss the tokens of the global batch are
    counted on the model's last stage (each replica's tensor rank 0) and summed over the
    world; Megatron's own sums the count over the mesh's replicas, so it gets ``1 / D`` of it
    from each."""
    @functools.wraps(original)
    def finalize_model_grads(model, num_tokens=None, pg_collection=None, **kw):
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import (
            MultiModuleProcessGroupCollection,
            ProcessGroupCollection,
        )

        from ..mcore.mesh_train import global_batch_tokens

        if isinstance(pg_collection, MultiModuleProcessGroupCollection):
            pgs = ProcessGroupCollection()
            pgs.tp, pgs.pp = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
            pgs.dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
            # the mesh's own (untied embeddings: no group across meshes)
            pgs.embd = ps.get_embedding_group(check_initialized=False)
            pgs.pos_embd = ps.get_position_embedding_group(check_initialized=False)
            pg_collection = pgs
        if num_tokens is not None:  # Megatron's own sums it again over the mesh's replicas
            total = global_batch_tokens(st.plan, st.slot, num_tokens)
            num_tokens = total / st.mesh.data_parallel_size
        return original(model, num_tokens, pg_collection=pg_collection, **kw)
    return finalize_model_grads


def whole_model_optimizer(original, st: MeshRankState):
    """Megatron's ``get_megatron_optimizer`` over the rank's mesh, its gradient norm then taken
    over the whole model (:func:`megatron_hetero.mcore.mesh_train.use_whole_model_grad_norm`:
    squared norms summed over the world, each replica of a mesh adding its share)."""
    @functools.wraps(original)
    def get_megatron_optimizer(config, *a, **kw):
        from ..mcore.mesh_train import use_whole_model_grad_norm

        optimizer = original(config, *a, **kw)
        use_whole_model_grad_norm(st.plan, st.slot, optimizer,
                                  distributed=config.use_distributed_optimizer)
        return optimizer
    return get_megatron_optimizer


def replica_data_loader(dataset, consumed_samples, st: MeshRankState, *, num_workers: int = 0):
    """Uneven replicas: a DataLoader reading replica ``r``'s consecutive share of every global
    batch (the replicas before it first), in its own micro-batches (:mod:`.sampler`)."""
    import torch

    replicas = st.mesh.replicas
    mine = replicas[st.slot.replica]
    sampler = HeteroBatchSampler(
        total_samples=len(dataset), consumed_samples=consumed_samples,
        global_batch_size=st.plan.global_batch_size,
        offset=sum(r.samples for r in replicas[:st.slot.replica]),
        micro_batch_size=mine.micro_batch_size, num_microbatches=mine.num_microbatches)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       pin_memory=torch.cuda.is_available(),
                                       persistent_workers=num_workers > 0)


def uneven(st: MeshRankState | None) -> bool:
    """Whether ``st``'s plan has replicas that differ (per-token loss, own micro-batches)."""
    return st is not None and not even_plan(st.plan)


@dataclass(kw_only=True, slots=True)
class MeshBackend(Backend):
    """A mesh plan on megatron-core's multimodule pipeline (see the module docstring)."""

    state: MeshRankState
    """This rank's slot in the mesh plan."""
    vendor_groups: vendors.VendorGroups | None = None
    """The group hooks of a plan across vendors (None: one vendor): the world gloo, each group
    on its vendor's backend."""

    @classmethod
    def start(cls, args, plan: Plan, *, path: str, argv: Sequence[str]) -> "MeshBackend":
        st = before_validate(args, plan, path=path, argv=argv)
        return cls(state=st, vendor_groups=vendors.prepare(plan, args, source=path,
                                                           cpu_backend=cpu_mode()))

    def create_group(self, original, *a, **kw):
        if self.vendor_groups is None:
            return original(*a, **kw)
        return self.vendor_groups.create_group(original, *a, **kw)

    def validate_args(self, original, args, *a, **kw):
        with mesh_view(args, self.state):
            result = original(args, *a, **kw)
        after_validate(args, self.state)
        return result

    def transformer_config(self, original, *a, **kw):
        return mesh_model.mesh_config(original, self.state, *a, **kw)

    def get_model(self, original, model_provider_func, *a, **kw):
        return mesh_model.get_model(original, self.state, model_provider_func, *a, **kw)

    def forward_backward_func(self, original, *a, **kw):
        return mesh_schedule(self.state)

    def data_loader(self, original, dataset, consumed_samples, *a, **kw):
        if dataset is not None and uneven(self.state):
            return replica_data_loader(dataset, consumed_samples, self.state,
                                       num_workers=getattr(self.state.args, "num_workers", 0))
        return original(dataset, consumed_samples, *a, **kw)

    def initialize_model_parallel(self, original, *a, **kw):
        # across vendors on devices (a gloo world) each mesh's groups on its vendor's backend
        backends = (None if self.vendor_groups is None or self.vendor_groups.cpu_backend else
                    vendors.mesh_backends(self.state.plan))
        return initialize_per_mesh(original, self.state, *a, grid_backends=backends, **kw)

    def is_pipeline_first_stage(self, original, *a, **kw):
        return global_stage_check(original, self.state, last=False)(*a, **kw)

    def is_pipeline_last_stage(self, original, *a, **kw):
        return global_stage_check(original, self.state, last=True)(*a, **kw)

    def finalize_model_grads(self, original, *a, **kw):
        return mesh_finalize(original, self.state)(*a, **kw)

    def get_megatron_optimizer(self, original, *a, **kw):
        return whole_model_optimizer(original, self.state)(*a, **kw)

    def validate_sharding_for_key(self, original, *a, **kw):
        return check_mixed_grids(original)(*a, **kw)

    def get_rng_state(self, original, *a, **kw):
        return rng_state_per_mesh(original, self.state.slot.mesh)(*a, **kw)
