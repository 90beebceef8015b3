"""The chain's own schedule (:attr:`~megatron_hetero.plan.Plan.own_chain_schedule`: interleaved
1F1B over a chain of meshes, or a chain whose stages warm up other than Megatron's, as one chunk
a stage) inside Megatron-LM's own training loop: :class:`InterleavedMeshBackend`, the
multimodule backend (:class:`.mesh_run.MeshBackend`) with model chunks. Everything but the
model's chunks and the schedule is the mesh backend's (the mesh's view in ``validate_args``, the groups of every mesh,
the whole model's config and layout, the gradient scale, finalize, the whole-model gradient
norm, the checkpoints); the schedule is
:func:`megatron_hetero.mcore.mesh_interleaved.interleaved_mesh_schedule`, the one the CPU
trainer and ``rehearse`` run, plugged in where the mesh backend plugs megatron-core's
non-interleaved multimodule schedule (``get_forward_backward_func``):

``validate_args``, ``initialize_model_parallel``
    Megatron's checks see the mesh's stages without chunks (the mesh backend's layout: one
    segment per stage of the mesh), since its own interleaved schedule, which they check for,
    does not run; then, with model chunks (``v`` > 1; one chunk a stage leaves Megatron's
    arguments and parallel state without a virtual pipeline, and builds its one model chunk
    without a ``vp_stage``), ``args.virtual_pipeline_model_parallel_size`` is the plan's ``v``, so
    that Megatron builds one data iterator per chunk and the config's layout (the whole model's
    ``P v`` segments, :func:`.mesh_model.mesh_config`) numbers each chunk's layers; the mesh's
    parallel state gets a virtual pipeline of ``v`` (which megatron-core's own initialisation
    refuses for a mesh of one stage), as its layout asks for a chunk's ``vp_stage`` only then.
``get_model``
    one model chunk per virtual stage ``c P + s`` of the rank's global stage ``s``
    (:func:`chunk_models`): the embedding on virtual stage 0, the output layer and the loss on
    the last; the chunk's input and output are plain tensors (the schedule's links carry them).
    Then the links of the rank's stage, every bridge built collectively on every rank (the
    wrap-around bridge among them, :func:`~megatron_hetero.mcore.mesh_interleaved.chain_bridges`).
``get_forward_backward_func``
    the interleaved schedule over Megatron's chunks and its data iterator of each chunk, with
    model chunk 0's config for every chunk, as Megatron's own interleaved schedule takes it (its
    training sets the schedule's hooks, finalize among them, on that config); with replicas
    that differ, each replica's own micro-batches (:func:`.mesh_run.replica_micro_batch_size`).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

from ..mcore.cpu_offload import join_offload_summary
from . import mesh_model
from .mesh_run import MeshBackend, replica_micro_batch_size, uneven
from .mesh_state import MeshRankState

__all__ = ["InterleavedMeshBackend", "chunk_models", "chain_rank"]


def chunk_models(original, st: MeshRankState, model_provider_func, *a, **kw) -> list:
    """Megatron's ``get_model`` building the rank's ``v`` model chunks: chunk ``c`` with
    ``vp_stage=c``, pre-process on virtual stage 0 and post-process on the last. Where the
    mesh's pipeline has more than one stage Megatron's ``get_model`` asks for every chunk in one
    call (its ``vp_stage``); otherwise it builds one model a call, once per chunk."""
    plan, s = st.plan, st.global_stage
    v, p = plan.virtual_pipeline_size, plan.pipeline_model_parallel_size
    asked_all = [False]

    def provider_of(chunk: int):
        @functools.wraps(model_provider_func)
        def provider(*pa, **pkw):
            c = pkw.get("vp_stage")
            if c is None:
                c = chunk
            else:
                asked_all[0] = True
            vs = c * p + s
            pkw.update(pre_process=vs == 0, post_process=vs == p * v - 1)
            if v > 1:  # one chunk a stage: Megatron's plain pipeline, no virtual stage
                pkw["vp_stage"] = c
            return model_provider_func(*pa, **pkw)
        return provider

    model: list = []
    for chunk in range(v):
        model += list(original(provider_of(chunk), *a, **kw))
        if asked_all[0]:
            break
    assert len(model) == v, f"built {len(model)} model chunks, the plan has {v}"
    return model


def chain_rank(st: MeshRankState, model: list):
    """The :class:`~megatron_hetero.mcore.mesh_interleaved.InterleavedMeshRank` of Megatron's
    ``model`` chunks on this rank: its mesh's groups and the links of its stage (collective:
    every bridge is built on every rank, in chain order). The optimizer is Megatron's own."""
    from megatron.core.utils import get_model_config, unwrap_model

    from ..mcore.mesh_interleaved import (InterleavedMeshRank, chain_bridges,
                                          chunk_virtual_stage, stage_links)
    from ..mcore.mesh_stage import mesh_process_groups

    plan, slot = st.plan, st.slot
    config = get_model_config(model[0])
    # Megatron's training frees each output's data once sent (deallocate_pipeline_outputs);
    # here a sender thread may still hold it: outputs stay whole, as the CPU trainer's
    config.deallocate_pipeline_outputs = False
    into, out = stage_links(plan, slot, st.grids, chain_bridges(plan, st.grids, config), config)
    layers = plan.virtual_stage_layers
    return InterleavedMeshRank(
        plan=plan, slot=slot, grids=st.grids, into=into, out=out,
        pgs=mesh_process_groups(st.grids[slot.mesh]), gpts=unwrap_model(model), ddps=model,
        optimizer=None,
        layer_offsets=[sum(layers[:chunk_virtual_stage(plan, slot, c)]) for c in range(len(model))])


def interleaved_schedule(backend: "InterleavedMeshBackend"):
    """The ``forward_backward_func`` Megatron's ``train_step`` calls (see the module
    docstring)."""
    from megatron.core.utils import get_model_config

    from ..mcore.mesh_interleaved import interleaved_mesh_schedule

    st = backend.state

    def forward_backward(*, forward_step_func, data_iterator, model, forward_only=False, **_):
        chain = backend.chain
        assert chain is not None and [id(m) for m in model] == [id(m) for m in chain.ddps], \
            "the schedule runs the model chunks get_model built"
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        assert len(iterators) == len(model), "one data iterator per model chunk"
        # replicas that differ: each its own micro-batches (the schedule counts them from the
        # plan) under Megatron's global step accounting
        with replica_micro_batch_size(st) if uneven(st) else contextlib.nullcontext():
            return interleaved_mesh_schedule(chain, forward_step_func, iterators,
                                             forward_only=forward_only,
                                             config=get_model_config(model[0]))
    # ranks that offload no module inputs join the others' offload summary
    return join_offload_summary(forward_backward, st.plan, st.stage)


@dataclass(kw_only=True, slots=True)
class InterleavedMeshBackend(MeshBackend):
    """A chain of meshes on its own schedule: model chunks, or per-stage warm-ups (module
    docstring)."""

    chain: Any = None
    """This rank's chunks and links (after ``get_model``)."""

    def validate_args(self, original, args, *a, **kw):
        result = MeshBackend.validate_args(self, original, args, *a, **kw)
        v = self.state.plan.virtual_pipeline_size
        args.virtual_pipeline_model_parallel_size = v if v > 1 else None
        return result

    def initialize_model_parallel(self, original, *a, **kw):
        from megatron.core import parallel_state

        MeshBackend.initialize_model_parallel(self, original, *a, **kw)
        if self.state.plan.virtual_pipeline_size == 1:
            return
        # megatron-core's layout numbers a chunk's layers by its vp_stage only where its
        # parallel state has a virtual pipeline (its own function refuses one at a mesh of one
        # stage): the mesh's groups, v chunks a rank
        parallel_state.set_virtual_pipeline_model_parallel_world_size(
            self.state.plan.virtual_pipeline_size)
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)

    def get_model(self, original, model_provider_func, *a, **kw):
        st = self.state
        model = chunk_models(original, st, model_provider_func, *a, **kw)
        if all(hasattr(chunk, "buffers") for chunk in model):  # Megatron's DDP
            mesh_model.scale_gradients(model, st)
        if self.chain is None:
            self.chain = chain_rank(st, model)
        return model

    def forward_backward_func(self, original, *a, **kw):
        return interleaved_schedule(self)
