"""The model of a rank of a mesh plan inside Megatron-LM's ``get_model`` (see
:mod:`.mesh_run`): the whole model's layout answering for the rank's global stage, the
model's input and output in the multimodule communicator's dictionaries, Megatron's DDP scaled
by ``1 / D`` of the last mesh, and megatron-core's multimodule communicator."""

from __future__ import annotations

import functools

from .mesh_state import MeshRankState, even_plan

__all__ = ["MeshLayerLayout", "mesh_config", "adapt_stage_model", "scale_gradients",
           "build_communicator", "get_model"]


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
    """The model's input from the communicator's dictionary (the stage before in its mesh, or
    the previous mesh's across the bridge), its output under its own mesh's name (the model's
    last stage returns the loss as it is), the sequence shards cut and joined at its bridges
    where its mesh runs sequence parallelism: what
    :class:`megatron_hetero.mcore.mesh_stage.MeshStageModule` does, on the module itself so
    that Megatron's wrappers, checkpoints and ``get_attr_wrapped_model`` see it unchanged."""
    from megatron.core import parallel_state

    from ..mcore.mesh_grids import module_name
    from ..mcore.mesh_stage import joined_for_bridge, sequence_group, shard_from_bridge

    set_input, forward = model.set_input_tensor, model.forward
    name = module_name(st.slot.mesh)
    group = sequence_group(st.plan, st.slot.mesh, parallel_state.get_tensor_model_parallel_group())
    # from the stage before in this mesh, else from the previous mesh across the bridge
    source = name if st.slot.stage else (module_name(st.slot.mesh - 1) if st.slot.mesh else None)
    bridged_in = st.slot.stage == 0 and st.slot.mesh > 0
    bridged_out = st.slot.stage == len(st.mesh.stages) - 1

    def set_input_tensor(tensors):
        got = tensors[0] if isinstance(tensors, list) else tensors
        if isinstance(got, dict):
            got = got.get(source) if source else None
            if bridged_in:
                got = shard_from_bridge(got, group)
        set_input(got)

    model.set_input_tensor = set_input_tensor
    if not (st.last_mesh and bridged_out):  # not the loss

        @functools.wraps(forward)
        def named_forward(*a, **kw):
            out = forward(*a, **kw)
            return {name: joined_for_bridge(out, group) if bridged_out else out}
        model.forward = named_forward
    return model


def scale_gradients(model_chunks, st: MeshRankState) -> None:
    """Megatron's DDP divides the sum over the mesh's replicas by the mesh's ``D``; a mesh
    plan's is ``1 / D`` of the last mesh on every mesh."""
    from ..mcore.mesh_stage import gradient_scale

    if not even_plan(st.plan):  # per-token loss: sums, divided by the global batch's tokens
        return
    factor = gradient_scale(st.plan)
    for chunk in model_chunks:
        for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
            buffer.gradient_scaling_factor = factor
            for bucket in buffer.buckets:
                bucket.gradient_scaling_factor = factor


_RECEIVING = ("recv_forward", "recv_backward", "send_forward_recv_backward",
              "send_backward_recv_forward")


def _unwrapped(method):
    """A communicator method whose ``{module: [tensor]}`` entries become ``{module: tensor}``."""
    @functools.wraps(method)
    def receive(*a, **kw):
        got = method(*a, **kw)
        if isinstance(got, dict):
            got = {k: v[0] if isinstance(v, list) and len(v) == 1 else v for k, v in got.items()}
        return got
    return receive


def build_communicator(st: MeshRankState) -> None:
    """megatron-core's multimodule communicator over the grids (collective: every rank).

    Between two stages of one mesh it hands over what the mesh's ``P2PCommunicator`` returns
    for the schedule's shapes (``[()]`` with variable sequence lengths): a list of one tensor,
    where a bridge hands the tensor. Megatron's training config frees pipeline outputs
    (``deallocate_pipeline_outputs``), whose backward takes a tensor, not a list: the
    receiving methods give the tensor."""
    from ..mcore.mesh_grids import mesh_communicator

    comm = mesh_communicator(st.plan, st.grids, st.config)
    for name in _RECEIVING:
        setattr(comm, name, _unwrapped(getattr(comm, name)))
    st.communicator = comm


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
