"""One rank's part of a mesh plan under megatron-core 0.17.1: its mesh's process groups, its
``GPTModel`` slice behind the multimodule communicator's dictionaries, and the schedule's
process-group collection.

``forward_backward_pipelining_without_interleaving`` with a ``MultiModulePipelineCommunicator``
hands each stage ``[{module name: tensor}]`` and sends what the stage returns as
``{module name: tensor}``; :class:`MeshStageModule` adapts a ``GPTModel`` to that: it takes
its own mesh's tensor (from the stage before it in the mesh), else the previous mesh's (across
the bridge) as its input and names its output after its own mesh (the last
mesh returns the loss as it is). Megatron-core 0.17.1 still reads two globals on this path:
the TP group of ``GPTModel``'s vocab-parallel loss and the attention's memory buffer
(:func:`use_mesh_globals`).

Sequence parallelism (the plan's ``sequence_parallel``, in a mesh of TP > 1): each tensor rank
holds its ``[s/T, b, h]`` shard of the sequence, and a bridge carries the whole ``[s, b, h]``
tensor from one leader rank. So a stage whose output crosses a bridge joins its mesh's shards
first (:func:`joined_for_bridge`, an all-gather in its TP group; each rank's gradient back is
its shard of the whole gradient the bridge broadcast), and a stage whose input came over a
bridge keeps its own shard of the whole tensor (:func:`shard_from_bridge`; the gradient back
is the TP group's shards joined). :class:`MeshStageModule` does both inside autograd; the
interleaved schedule's links outside it (:mod:`.mesh_interleaved`).

Gradient scale: the loss is the mean over each last-mesh replica's samples, and each replica of
an earlier mesh receives the gradients of every last-mesh replica it feeds; so after a sum over
its mesh's data-parallel group every rank scales its gradients by ``1 / D_last``
(:func:`gradient_scale`), where Megatron's DDP alone would divide by its own mesh's ``D``.
"""

from __future__ import annotations

import torch

from ..plan import Plan
from .mesh_grids import module_name

__all__ = ["MeshStageModule", "mesh_process_groups", "multimodule_collection",
           "use_mesh_globals", "gradient_scale", "sequence_group", "shard_from_bridge",
           "joined_for_bridge"]


def sequence_group(plan: Plan, mesh: int, tp_group):
    """``tp_group`` (a rank of mesh ``mesh``'s TP group) where that mesh runs sequence
    parallelism, else None."""
    return tp_group if plan.sequence_parallel_in(mesh) else None


def shard_from_bridge(tensor, group):
    """This rank's sequence shard of the whole ``tensor`` a bridge delivered (``group``: its
    :func:`sequence_group`; None or no tensor: as it is). Its gradient is the group's shards
    joined (megatron-core's ``scatter_to_sequence_parallel_region``)."""
    if group is None or tensor is None:
        return tensor
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

    return scatter_to_sequence_parallel_region(tensor, group=group)


def joined_for_bridge(tensor, group):
    """The whole tensor of the sequence shards of ``group`` (this rank's is ``tensor``) for a
    bridge to carry; its gradient, the same on every rank of ``group``, goes back as this rank's
    shard (megatron-core's ``gather_from_sequence_parallel_region`` without a reduce)."""
    if group is None:
        return tensor
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(tensor, tensor_parallel_output_grad=False,
                                                group=group)


class MeshStageModule(torch.nn.Module):
    """A mesh's ``GPTModel`` (slice) between the multimodule communicator's dictionaries;
    ``sequence_group``: its :func:`sequence_group`, ``bridge_out``: its output crosses a
    bridge (the mesh's last stage, not the model's)."""

    def __init__(self, gpt, *, mesh: int, last: bool, sequence_group=None,
                 bridge_out: bool = False):
        super().__init__()
        self.gpt, self.config, self.mesh, self.last = gpt, gpt.config, mesh, last
        self.sequence_group, self.bridge_out = sequence_group, bridge_out

    def set_input_tensor(self, tensors) -> None:
        got = tensors[0] if isinstance(tensors, list) else tensors
        if isinstance(got, dict):  # from the stage before in this mesh, else from the bridge
            own, before = module_name(self.mesh), module_name(self.mesh - 1)
            if own in got:
                got = got[own]
            else:
                got = shard_from_bridge(got.get(before) if self.mesh else None,
                                        self.sequence_group)
        self.gpt.set_input_tensor(got)

    def forward(self, *args, **kwargs):
        out = self.gpt(*args, **kwargs)
        if self.last:
            return out
        if self.bridge_out:
            out = joined_for_bridge(out, self.sequence_group)
        return {module_name(self.mesh): out}


def mesh_process_groups(grid):
    """The ``ProcessGroupCollection`` of a rank of ``grid`` (its mesh's grid): TP, CP, PP, DP
    (with CP), and no embedding groups (mesh plans untie the output layer, and each mesh's
    pipeline holds either end of the model at most once)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection()
    pgs.tp, pgs.cp, pgs.pp = grid.get_pg("tp"), grid.get_pg("cp"), grid.get_pg("pp")
    pgs.dp, pgs.dp_cp, pgs.tp_cp = grid.get_pg("dp"), grid.get_pg(["dp", "cp"]), grid.get_pg(["tp", "cp"])
    pgs.mp = grid.get_pg(["tp", "pp"])
    pgs.embd, pgs.pos_embd = None, None
    return pgs


def multimodule_collection(plan: Plan, mesh: int, pgs):
    """The schedule's ``MultiModuleProcessGroupCollection`` of a rank of ``mesh``: the last mesh
    holds the language model's loss."""
    from megatron.core.process_groups_config import MultiModuleProcessGroupCollection

    last = mesh == len(plan.meshes) - 1
    return MultiModuleProcessGroupCollection(
        module_pgs={module_name(mesh): pgs},
        language_model_module_name=module_name(mesh) if last else None)


def use_mesh_globals(pgs) -> None:
    """Set the two ``parallel_state`` globals megatron-core 0.17.1 reads on a mesh rank: the TP
    group (``GPTModel``'s vocab-parallel cross entropy) and the global memory buffer (the local
    attention's)."""
    from megatron.core import parallel_state

    parallel_state._TENSOR_MODEL_PARALLEL_GROUP = pgs.tp
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def gradient_scale(plan: Plan) -> float:
    """What every rank multiplies its gradients by after summing them over its mesh's
    data-parallel group (see the module docstring)."""
    return 1.0 / plan.meshes[-1].data_parallel_size
