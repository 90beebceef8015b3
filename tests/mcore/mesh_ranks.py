"""Rank functions of the mesh-grid tests (importable by name for :func:`spawn`)."""

from __future__ import annotations


def bridge_ranks(rank: int, world_size: int, plan_path: str) -> dict:
    """Build the plan's grids and multimodule communicator, then pass one global micro-batch
    ``[s, B, h]`` forward across the bridge from the first mesh's last stage and its gradient
    (twice the activations) back; return what this rank sent and received."""
    import torch

    from megatron_hetero.mcore.cpu_backend import enable_cpu_backend
    from megatron_hetero.mcore.mesh_grids import (gloo_bridges, mesh_communicator, mesh_grids,
                                                  module_name)
    from megatron_hetero.plan_mesh import load_any_plan

    enable_cpu_backend()
    gloo_bridges()
    from megatron.core.model_parallel_config import ModelParallelConfig

    plan = load_any_plan(plan_path)
    grids = mesh_grids(plan)
    comm = mesh_communicator(plan, grids, ModelParallelConfig(pipeline_dtype=torch.float32,
                                                              variable_seq_lengths=True))
    slot = plan.slot_of_rank(rank)
    mesh = plan.meshes[slot.mesh]
    b = mesh.replicas[slot.replica].micro_batch_size
    s, h = 3, 5
    batch = b * mesh.data_parallel_size
    full = torch.arange(s * batch * h, dtype=torch.float32).reshape(s, batch, h)
    mine = full[:, slot.replica * b:(slot.replica + 1) * b].contiguous()
    out = {"rank": rank, "mesh": slot.mesh, "replica": slot.replica,
           "tensor_rank": slot.tensor_rank, "first": comm.is_pp_first_stage,
           "last": comm.is_pp_last_stage, "total_stages": comm.total_stages,
           "current_stage": comm.current_stage}
    if slot.mesh == 0:
        comm.send_forward({module_name(0): mine})
        grad = comm.recv_backward()[module_name(0)]
        out["grad_ok"] = torch.equal(grad, 2 * mine)
    else:
        got = comm.recv_forward()[module_name(0)]
        out["forward_ok"] = torch.equal(got, mine)
        comm.send_backward({module_name(0): 2 * got})
    torch.distributed.barrier()
    return out
