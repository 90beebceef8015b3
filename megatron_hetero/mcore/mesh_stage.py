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
           "use_mesh_globals", "gradient_scale"]


class MeshStageModule(torch.nn.Module):
    """A mesh's ``GPTModel`` (slice) between the multimodule communicator's dictionaries."""

    def __init__(self, gpt, *, mesh: int, last: bool):
        super().__init__()
        self.gpt, self.config, self.mesh, self.last = gpt, gpt.config, mesh, last

    def set_input_tensor(self, tensors) -> None:
        got = tensors[0] if isinstance(tensors, list) else tensors
        if isinstance(got, dict):  # from the stage before in this mesh, else from the bridge
            own, before = module_name(self.mesh), module_name(self.mesh - 1)
            got = got[own] if own in got else (got.get(before) if self.mesh else None)
        self.gpt.set_input_tensor(got)

    def forward(self, *args, **kwargs):
        out = self.gpt(*args, **kwargs)
        return out if self.last else {module_name(self.mesh): out}


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
