"""Mesh plans (``format_version: 2``) inside Megatron-LM's own training loop (megatron-core 0.17).

:mod:`.hooks` sends a rank of a mesh plan here from the functions it wraps; nothing of Megatron is
copied, each step calls Megatron's own function or megatron-core's multimodule pieces
(docs/meshes.md, "Runtime"):

``validate_args``
    each rank takes its mesh's tensor-parallel size, its mesh's pipeline depth and its mesh's
    micro-batch from the plan (:func:`before_validate`), the plan's common arguments checked
    against the command line as for format 1. Megatron's own checks then run on *the mesh's
    view*: ``args.world_size`` is the mesh's ranks while they run (so Megatron's data-parallel
    size is the mesh's ``D`` and its micro-batch count ``G / (D x b)``) and the layout is the
    mesh's segments of the whole model's.
``parallel_state.initialize_model_parallel``
    Megatron's own function once per mesh, on every rank in plan order (group creation is
    collective), with the mesh's sizes, ``local_world_size`` its ranks and ``rank_offset`` its
    first rank; each rank keeps the ``parallel_state`` globals of its own mesh's call
    (:func:`initialize_per_mesh`). Then megatron-core's grids of every mesh
    (:func:`megatron_hetero.mcore.mesh_grids.mesh_grids`).
``parallel_state.is_pipeline_first_stage`` / ``is_pipeline_last_stage``
    the whole model's first and last stage (the mesh's groups alone would make every mesh's
    first stage "first"): the training loop's loss on the last mesh, ``get_batch``'s inputs.
``core_transformer_config_from_args``
    the ``TransformerConfig`` of the whole model's pipeline (its size and layout), its layer
    numbers found from the rank's *global* stage (:class:`MeshLayerLayout`): each layer keeps
    the one-process model's number, in checkpoints too. ``variable_seq_lengths`` (the
    multimodule schedule needs it).
``get_model``
    pre-/post-process from the global stage; the model's input and output in the multimodule
    communicator's ``{mesh name: tensor}`` (:func:`adapt_stage_model`); Megatron's own DDP over
    the mesh's data-parallel group with its gradient scale set to ``1 / D_last``
    (:func:`megatron_hetero.mcore.mesh_stage.gradient_scale`); then megatron-core's
    ``MultiModulePipelineCommunicator`` over the grids (collective).
``get_forward_backward_func``
    megatron-core's ``forward_backward_pipelining_without_interleaving`` with the communicator
    and the rank's ``MultiModuleProcessGroupCollection``.
``finalize_model_grads``
    Megatron's own, over the mesh's groups (the multimodule collection names none).
``clip_grads.get_grad_norm_fp32``
    Megatron's own gives the norm over the rank's mesh; the norm of the whole model is the sum of
    every mesh's square (:func:`whole_model_norm`), so clipping and the logged norm cover it.

The data loader needs nothing: Megatron's sampler over the mesh's data-parallel rank and size
reads replica ``r``'s share ``[r b, (r + 1) b)`` of every global micro-batch of ``D b`` samples,
and ``D b`` is the same in every mesh (the plan checks it), so a sample meets itself at every
bridge.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
import re
from dataclasses import dataclass

from ..errors import HeteroError
from ..megatron_args import mesh_megatron_args
from ..plan_mesh import MeshPlan, MeshSlot
from . import plan_args, policies
from .placement import CPU_ENV

__all__ = ["MeshRankState", "before_validate", "mesh_view", "after_validate",
           "initialize_per_mesh", "global_stage_check", "mesh_config", "adapt_stage_model",
           "scale_gradients", "build_communicator", "mesh_schedule", "mesh_finalize",
           "whole_model_norm", "MeshLayerLayout", "get_model", "mesh_only_targets"]

_PER_MESH_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                   "--micro-batch-size", "--num-layers-per-virtual-pipeline-stage",
                   "--num-virtual-stages-per-pipeline-rank", "--sequence-parallel",
                   "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers")


@dataclass(kw_only=True, slots=True)
class MeshRankState:
    """What the hooks decided for one rank of a mesh plan."""

    plan: MeshPlan
    plan_path: str
    rank: int
    """This process's rank: the launcher's, which the plan's rank numbering places."""
    slot: MeshSlot
    grids: list | None = None
    """megatron-core's ``HyperCommGrid`` of every mesh (after ``initialize_model_parallel``)."""
    communicator: object = None
    """megatron-core's ``MultiModulePipelineCommunicator`` (after ``get_model``)."""
    config: object = None
    """The model's ``TransformerConfig`` (the communicator's config)."""

    @property
    def mesh(self):
        return self.plan.meshes[self.slot.mesh]

    @property
    def last_mesh(self) -> bool:
        return self.slot.mesh == len(self.plan.meshes) - 1

    @property
    def first_stage(self) -> int:
        """The global pipeline index of this mesh's first stage."""
        return sum(len(m.stages) for m in self.plan.meshes[:self.slot.mesh])

    @property
    def global_stage(self) -> int:
        return self.first_stage + self.slot.stage

    def describe(self) -> str:
        m, r = self.mesh, self.mesh.replicas[self.slot.replica]
        return (f"megatron-hetero: rank {self.rank} ({m.device_type}): mesh {self.slot.mesh} "
                f"(TP {m.tensor_model_parallel_size}, DP {m.data_parallel_size}, PP "
                f"{len(m.stages)}) stage {self.slot.stage} replica {self.slot.replica} tp "
                f"{self.slot.tensor_rank}; global stage {self.global_stage} of "
                f"{self.plan.pipeline_model_parallel_size}; "
                f"{m.stages[self.slot.stage].num_layers} layers; {r.num_microbatches} "
                f"micro-batches of {r.micro_batch_size}")


# -- arguments ---------------------------------------------------------------------------------

def _mesh_layout(plan: MeshPlan, st: MeshRankState) -> str | None:
    """The mesh's segments of the whole model's layout (Megatron's checks count them)."""
    if plan.pipeline_model_parallel_size == 1:
        return None
    parts = plan.layout().split("|")
    return "|".join(parts[st.first_stage:st.first_stage + len(st.mesh.stages)])


def before_validate(args, plan: MeshPlan, *, path: str, argv) -> MeshRankState:
    """Check the command line against ``plan`` and give this rank its mesh's sizes."""
    rank, world = int(args.rank), int(args.world_size)
    if world != plan.world_size:
        raise HeteroError(f"{path}: the mesh plan has {plan.world_size} ranks "
                          f"({plan.device_counts()}); the job has {world}")
    if any(not m.even for m in plan.meshes):
        raise HeteroError(f"{path}: meshes[*].replicas: replicas that differ inside a mesh need "
                          "the per-token loss counted over every mesh, which the mesh runtime "
                          "does not do yet; give every replica of a mesh the same micro-batches")
    if plan.pipeline_model_parallel_size > 1 and not plan.model.untie_embeddings_and_output_weights:
        raise HeteroError(f"{path}: model.untie_embeddings_and_output_weights: found false; "
                          "expected true (a mesh plan's first and last stage share no "
                          "embedding group)")
    given = plan_args.given_flags(argv)
    conflicts = [f"  {flag}: each rank takes its mesh's from the plan; leave it out"
                 for flag in _PER_MESH_FLAGS if flag in given]
    for flag in ("--ddp-average-in-collective", "--calculate-per-token-loss"):
        if flag in given:
            conflicts.append(f"  {flag}: not with a mesh plan (the gradients are scaled by "
                             "1 / D of the last mesh after a sum over each mesh)")
    for item in plan_args.implied_from_tokens(mesh_megatron_args(plan)):
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
    st = MeshRankState(plan=plan, plan_path=path, rank=rank, slot=plan.slot_of_rank(rank))
    mesh = st.mesh
    args.tensor_model_parallel_size = mesh.tensor_model_parallel_size
    args.pipeline_model_parallel_size = len(mesh.stages)
    args.micro_batch_size = mesh.replicas[st.slot.replica].micro_batch_size
    args.pipeline_model_parallel_layout = _mesh_layout(plan, st)
    args.sequence_parallel = False
    args.ddp_average_in_collective = False
    stage = mesh.stages[st.slot.stage]
    for key, value in policies.stage_args(stage).items():
        if hasattr(args, key) or key.startswith("recompute_"):
            setattr(args, key, value)
    return st


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
    if os.environ.get("MEGATRON_HETERO_VERBOSE") or st.slot == MeshSlot(st.slot.mesh, 0, 0, 0):
        print(st.describe(), flush=True)


# -- process groups ----------------------------------------------------------------------------

_GLOBAL = re.compile(r"_[A-Z][A-Z0-9_]*")


def _snapshot(module) -> dict:
    return {name: copy.copy(value) if isinstance(value, (dict, list)) else value
            for name, value in vars(module).items() if _GLOBAL.fullmatch(name)}


def _restore(module, values: dict) -> None:
    for name, value in values.items():
        setattr(module, name, value)


def initialize_per_mesh(original, st: MeshRankState, *a, **kw) -> None:
    """Megatron's ``initialize_model_parallel`` once per mesh (see the module docstring), then
    the grids of every mesh."""
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
                    "expert_tensor_parallel_size": None,
                    "local_world_size": mesh.world_size,
                    "rank_offset": st.plan.rank_offset(k)})
        if k == st.slot.mesh:
            mine = _snapshot(parallel_state)
    _restore(parallel_state, mine)
    assert dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()) == [
        st.plan.rank_of_slot(MeshSlot(st.slot.mesh, j, st.slot.replica, st.slot.tensor_rank))
        for j in range(len(st.mesh.stages))], "mesh pipeline group differs from the plan's"
    if os.environ.get(CPU_ENV, "") not in ("", "0"):
        gloo_bridges()
    st.grids = mesh_grids(st.plan)


def global_stage_check(original, st: MeshRankState, *, last: bool):
    """``is_pipeline_first_stage`` / ``is_pipeline_last_stage`` of the whole model."""
    @functools.wraps(original)
    def check(*a, **kw):
        edge = st.last_mesh if last else st.slot.mesh == 0
        return edge and original(*a, **kw)
    return check


# -- the model ---------------------------------------------------------------------------------

def _layout_class():
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    class MeshLayerLayout(PipelineParallelLayerLayout):
        """The whole model's layout, asked with a rank of one mesh's pipeline group: the
        stage is ``first_stage`` plus that rank."""

        def __init__(self, layout: str, pipeline_model_parallel_size: int, first_stage: int):
            super().__init__(layout, pipeline_model_parallel_size)
            self.first_stage = first_stage

        def _global(self, pp_rank):
            from megatron.core import parallel_state

            if pp_rank is None:
                pp_rank = parallel_state.get_pipeline_model_parallel_rank()
            return self.first_stage + pp_rank

        def get_num_layers_to_build(self, layer_type=None, vp_stage=None, pp_rank=None):
            kw = {} if layer_type is None else {"layer_type": layer_type}
            return super().get_num_layers_to_build(vp_stage=vp_stage,
                                                   pp_rank=self._global(pp_rank), **kw)

        def get_layer_offset(self, layer_type=None, vp_stage=None, pp_rank=None):
            kw = {} if layer_type is None else {"layer_type": layer_type}
            return super().get_layer_offset(vp_stage=vp_stage, pp_rank=self._global(pp_rank),
                                            **kw)

    return MeshLayerLayout


def MeshLayerLayout(layout: str, pipeline_model_parallel_size: int, first_stage: int):
    """megatron-core's ``PipelineParallelLayerLayout`` of the whole model whose stage is
    ``first_stage`` plus the mesh's pipeline rank it is asked with."""
    return _layout_class()(layout, pipeline_model_parallel_size, first_stage)


def mesh_config(original, st: MeshRankState, args, *a, **kw):
    """Megatron's ``core_transformer_config_from_args`` with the whole model's pipeline."""
    plan = st.plan
    saved = args.pipeline_model_parallel_size, args.pipeline_model_parallel_layout
    args.pipeline_model_parallel_size = plan.pipeline_model_parallel_size
    args.pipeline_model_parallel_layout = (plan.layout() if plan.pipeline_model_parallel_size > 1
                                           else None)
    try:
        config = original(args, *a, **kw)
    finally:
        args.pipeline_model_parallel_size, args.pipeline_model_parallel_layout = saved
    if plan.pipeline_model_parallel_size > 1:
        config.pipeline_model_parallel_layout = MeshLayerLayout(
            plan.layout(), plan.pipeline_model_parallel_size, st.first_stage)
    config.variable_seq_lengths = True  # the multimodule schedule's shapes travel with them
    st.config = config
    return config


def adapt_stage_model(model, st: MeshRankState):
    """The model's input from the previous mesh's entry of the communicator's dictionary, its
    output under its own mesh's name (the last mesh's loss as it is): what
    :class:`megatron_hetero.mcore.mesh_stage.MeshStageModule` does, on the module itself so
    that Megatron's wrappers, checkpoints and ``get_attr_wrapped_model`` see it unchanged."""
    from ..mcore.mesh_grids import module_name

    set_input, forward = model.set_input_tensor, model.forward
    previous = module_name(st.slot.mesh - 1) if st.slot.mesh else None

    def set_input_tensor(tensors):
        got = tensors[0] if isinstance(tensors, list) else tensors
        if isinstance(got, dict):
            got = got.get(previous) if previous else None
        set_input(got)

    model.set_input_tensor = set_input_tensor
    if not st.last_mesh:
        name = module_name(st.slot.mesh)

        @functools.wraps(forward)
        def named_forward(*a, **kw):
            return {name: forward(*a, **kw)}
        model.forward = named_forward
    return model


def scale_gradients(model_chunks, st: MeshRankState) -> None:
    """Megatron's DDP divides the sum over the mesh's replicas by the mesh's ``D``; a mesh
    plan's is ``1 / D`` of the last mesh on every mesh."""
    from ..mcore.mesh_stage import gradient_scale

    factor = gradient_scale(st.plan)
    for chunk in model_chunks:
        for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
            buffer.gradient_scaling_factor = factor
            for bucket in buffer.buckets:
                bucket.gradient_scaling_factor = factor


def build_communicator(st: MeshRankState) -> None:
    """megatron-core's multimodule communicator over the grids (collective: every rank)."""
    from ..mcore.mesh_grids import mesh_communicator

    st.communicator = mesh_communicator(st.plan, st.grids, st.config)


def _collection(st: MeshRankState):
    from ..mcore.mesh_stage import mesh_process_groups, multimodule_collection

    return multimodule_collection(st.plan, st.slot.mesh, mesh_process_groups(st.grids[st.slot.mesh]))


def mesh_schedule(st: MeshRankState):
    """megatron-core's non-interleaved 1F1B over the meshes."""
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving,
    )

    collection = _collection(st)

    @functools.wraps(forward_backward_pipelining_without_interleaving)
    def forward_backward(*a, **kw):
        kw["p2p_communicator"], kw["pg_collection"] = st.communicator, collection
        return forward_backward_pipelining_without_interleaving(*a, **kw)
    return forward_backward


def mesh_finalize(original):
    """Megatron's ``finalize_model_grads`` over the rank's mesh groups where the schedule hands
    it the multimodule collection."""
    @functools.wraps(original)
    def finalize_model_grads(model, num_tokens=None, pg_collection=None, **kw):
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import (
            MultiModuleProcessGroupCollection,
            ProcessGroupCollection,
        )

        if isinstance(pg_collection, MultiModuleProcessGroupCollection):
            pgs = ProcessGroupCollection()
            pgs.tp, pgs.pp = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
            pgs.dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
            pgs.embd, pgs.pos_embd = None, None  # untied: no embedding group across meshes
            pg_collection = pgs
        return original(model, num_tokens, pg_collection=pg_collection, **kw)
    return finalize_model_grads


def whole_model_norm(original, st: MeshRankState):
    """Megatron's ``get_grad_norm_fp32`` (over the rank's mesh: its model-parallel group, or
    the distributed optimizer's instance group, the mesh's ranks), then the whole model's: each
    rank adds its mesh's square divided by the mesh's ranks, over the world."""
    @functools.wraps(original)
    def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
        import torch
        import torch.distributed as dist

        norm = original(grads_for_norm, norm_type=norm_type,
                        grad_stats_parallel_group=grad_stats_parallel_group)
        p = float(norm_type)
        if p == float("inf"):
            raise HeteroError(f"{st.plan_path}: the infinity norm is not summed over meshes")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        part = torch.tensor([float(norm) ** p / st.mesh.world_size], dtype=torch.float64,
                            device=device)
        dist.all_reduce(part)
        return float(part[0]) ** (1.0 / p)
    return get_grad_norm_fp32


def get_model(original, st: MeshRankState, model_provider_func, *a, **kw):
    """Megatron's ``get_model`` on a rank of a mesh plan (see the module docstring)."""
    @functools.wraps(model_provider_func)
    def provider(*pa, **pkw):
        pkw["pre_process"] = pkw.get("pre_process", True) and st.slot.mesh == 0
        pkw["post_process"] = pkw.get("post_process", True) and st.last_mesh
        return adapt_stage_model(model_provider_func(*pa, **pkw), st)

    model = original(provider, *a, **kw)
    if all(hasattr(chunk, "buffers") for chunk in model):  # Megatron's DDP
        scale_gradients(model, st)
    if st.communicator is None:
        build_communicator(st)
    return model


def mesh_only_targets(current) -> tuple:
    """``(module, function, make wrapper)`` of the functions only a mesh plan changes, for
    :func:`megatron_hetero.runtime.hooks.install`; each wrapper calls the original while
    ``current()`` (this process's :class:`MeshRankState`) is None."""
    from .mesh_checkpoint import check_mixed_grids, rng_state_per_mesh

    def through(mesh_version):
        def make(original):
            @functools.wraps(original)
            def wrapper(*a, **kw):
                st = current()
                if st is None:
                    return original(*a, **kw)
                return mesh_version(original, st)(*a, **kw)
            return wrapper
        return make

    return (
        ("megatron.core.parallel_state", "initialize_model_parallel",
         through(lambda o, st: functools.partial(initialize_per_mesh, o, st))),
        ("megatron.core.parallel_state", "is_pipeline_first_stage",
         through(lambda o, st: global_stage_check(o, st, last=False))),
        ("megatron.core.parallel_state", "is_pipeline_last_stage",
         through(lambda o, st: global_stage_check(o, st, last=True))),
        ("megatron.training.training", "finalize_model_grads",
         through(lambda o, st: mesh_finalize(o))),
        ("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32", through(whole_model_norm)),
        ("megatron.core.dist_checkpointing.validation", "_validate_sharding_for_key",
         through(lambda o, st: check_mixed_grids(o))),
        ("megatron.training.checkpointing", "get_rng_state",
         through(lambda o, st: rng_state_per_mesh(o, st.slot.mesh))),
    )
