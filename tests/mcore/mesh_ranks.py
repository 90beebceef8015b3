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


def fake_grid_ranks(plan_path: str, ranks: list[int]) -> list[dict]:
    """On megatron-core's fake process groups (no processes): for each rank of ``ranks``, a
    world of the plan's size on that rank, its grids and communicator built, and the groups it
    belongs to."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_hetero.mcore.mesh_grids import gloo_bridges, mesh_communicator, mesh_grids
    from megatron_hetero.plan_mesh import load_any_plan
    from megatron.core.model_parallel_config import ModelParallelConfig

    gloo_bridges()
    plan = load_any_plan(plan_path)
    out = []
    for rank in ranks:
        dist.init_process_group("fake", rank=rank, world_size=plan.world_size, store=FakeStore())
        grids = mesh_grids(plan)
        comm = mesh_communicator(plan, grids, ModelParallelConfig(pipeline_dtype=torch.float32,
                                                                  variable_seq_lengths=True))
        slot = plan.slot_of_rank(rank)
        grid = grids[slot.mesh]
        out.append({"rank": rank, "tp": dist.get_process_group_ranks(grid.get_pg("tp")),
                    "dp": dist.get_process_group_ranks(grid.get_pg("dp")),
                    "pp": dist.get_process_group_ranks(grid.get_pg("pp")),
                    "current_stage": comm.current_stage, "total_stages": comm.total_stages})
        from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator
        BridgeCommunicator.destroy_broadcast_pgs()
        dist.destroy_process_group()
    return out
