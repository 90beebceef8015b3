"""Rank functions of the mesh-grid tests (importable by name for :func:`spawn`)."""

from __future__ import annotations


def _bridged_communicator(plan_path: str):
    """(plan, grids, the multimodule communicator the runtime builds) on the CPU backend, its
    bridges on gloo."""
    import torch

    from megatron_hetero.mcore.cpu_backend import enable_cpu_backend
    from megatron_hetero.mcore.mesh_grids import gloo_bridges, mesh_communicator, mesh_grids
    from megatron_hetero.plan import load_any_plan

    enable_cpu_backend()
    gloo_bridges()
    from megatron.core.model_parallel_config import ModelParallelConfig

    plan = load_any_plan(plan_path)
    grids = mesh_grids(plan)
    comm = mesh_communicator(plan, grids, ModelParallelConfig(pipeline_dtype=torch.float32,
                                                              variable_seq_lengths=True))
    return plan, grids, comm


def _round_trip(plan, rank: int, comm) -> dict:
    """Pass one global micro-batch ``[s, B, h]`` forward across the bridge from the first
    mesh's last stage and its gradient (twice the activations) back: ``grad_ok`` on the first
    mesh, ``forward_ok`` on the second."""
    import torch

    from megatron_hetero.mcore.mesh_grids import module_name

    slot = plan.slot_of_rank(rank)
    mesh = plan.meshes[slot.mesh]
    b = mesh.replicas[slot.replica].micro_batch_size
    s, h = 3, 5
    batch = b * mesh.data_parallel_size
    full = torch.arange(s * batch * h, dtype=torch.float32).reshape(s, batch, h)
    mine = full[:, slot.replica * b:(slot.replica + 1) * b].contiguous()
    if slot.mesh == 0:
        comm.send_forward({module_name(0): mine})
        return {"grad_ok": torch.equal(comm.recv_backward()[module_name(0)], 2 * mine)}
    got = comm.recv_forward()[module_name(0)]
    comm.send_backward({module_name(0): 2 * got})
    return {"forward_ok": torch.equal(got, mine)}


def bridge_ranks(rank: int, world_size: int, plan_path: str) -> dict:
    """Build the plan's grids and multimodule communicator, then pass a micro-batch across the
    bridge and back (:func:`_round_trip`); return what this rank saw."""
    import torch

    plan, _, comm = _bridged_communicator(plan_path)
    slot = plan.slot_of_rank(rank)
    out = {"rank": rank, "mesh": slot.mesh, "replica": slot.replica,
           "tensor_rank": slot.tensor_rank, "first": comm.is_pp_first_stage,
           "last": comm.is_pp_last_stage, "total_stages": comm.total_stages,
           "current_stage": comm.current_stage}
    out.update(_round_trip(plan, rank, comm))
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
    from megatron_hetero.plan import load_any_plan
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


def _pgs(tp, cp, pp, embd=None):
    from megatron.core.process_groups_config import ProcessGroupCollection
    pgs = ProcessGroupCollection()
    pgs.tp, pgs.cp, pgs.pp, pgs.embd, pgs.pos_embd = tp, cp, pp, embd, None
    return pgs


def _gpt(plan, num_layers, tp, pgs, *, pre, post, stage=None):
    from megatron_hetero.mcore.config import transformer_config
    from megatron_hetero.mcore.stage_policies import recompute_kwargs
    config = transformer_config(plan.model, num_layers=num_layers, tensor_parallel_size=tp,
                                precision="fp32", perform_initialization=True,
                                variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
                                **(recompute_kwargs(stage) if stage is not None else {}))
    from megatron.core.models.gpt import GPTModel
    from megatron_hetero.mcore.model import layer_spec
    return GPTModel(config=config, transformer_layer_spec=layer_spec(plan.model),
                    vocab_size=plan.model.vocab_size, max_sequence_length=plan.model.seq_length,
                    pre_process=pre, post_process=post,
                    share_embeddings_and_output_weights=False,
                    position_embedding_type=plan.model.position_embedding_type, pg_collection=pgs)


def _shard(name: str, full, param, tp_rank: int, tp: int, gated: bool):
    """This TP rank's part of the one-process parameter ``full``."""
    import torch
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim = param.partition_dim
    if gated and name.endswith("linear_fc1.weight"):
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp, dim=0)[tp_rank], torch.chunk(up, tp, dim=0)[tp_rank]])
    return torch.chunk(full, tp, dim=dim)[tp_rank]


def schedule_ranks(rank: int, world_size: int, plan_path: str, steps: int = 3) -> dict:
    """``steps`` training steps of a plan of single-stage meshes under megatron-core's
    non-interleaved 1F1B with the multimodule communicator, the weights copied from a
    one-process model built on this rank and both trained by SGD; every rank's gradients summed
    over its mesh's DP group and scaled by :func:`gradient_scale`. Returns the losses of each
    step beside the one-process model's, and the largest relative difference of each gradient
    of the first step and each parameter after the last (this rank's shard) from the
    one-process model's."""
    import torch
    import torch.distributed as dist

    from megatron_hetero.mcore.cpu_backend import enable_cpu_backend
    from megatron_hetero.mcore.mesh_grids import gloo_bridges, mesh_communicator, mesh_grids
    from megatron_hetero.mcore.mesh_stage import (MeshStageModule, gradient_scale,
                                                  mesh_process_groups, multimodule_collection,
                                                  use_mesh_globals)
    from megatron_hetero.plan import load_any_plan

    enable_cpu_backend()
    gloo_bridges()
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    plan = load_any_plan(plan_path)
    m = plan.model
    grids = mesh_grids(plan)
    slot = plan.slot_of_rank(rank)
    k, mesh = slot.mesh, plan.meshes[slot.mesh]
    last = k == len(plan.meshes) - 1
    pgs = mesh_process_groups(grids[k])
    use_mesh_globals(pgs)
    # the one-process reference, on this rank alone (its loss in plain torch: the vocab-parallel
    # one reads the mesh's TP group)
    own, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world_size)])
    tensor_parallel.model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)
    torch.manual_seed(1234)
    ref = _gpt(plan, m.num_layers, 1, _pgs(own, own, own, own), pre=True, post=True)
    model = _gpt(plan, mesh.stages[0].num_layers, mesh.tensor_model_parallel_size, pgs,
                 pre=k == 0, post=last, stage=mesh.stages[0])
    offset = sum(x.stages[0].num_layers for x in plan.meshes[:k])
    ref_params = dict(ref.named_parameters())
    t, T = slot.tensor_rank, mesh.tensor_model_parallel_size
    names = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            ref_name = name
            if ".layers." in name:
                head, rest = name.split(".layers.", 1)
                i, tail = rest.split(".", 1)
                ref_name = f"{head}.layers.{int(i) + offset}.{tail}"
            names[name] = ref_name
            p.copy_(_shard(ref_name, ref_params[ref_name], p, t, T, m.swiglu))

    b = mesh.replicas[slot.replica].micro_batch_size
    B, M = b * mesh.data_parallel_size, mesh.replicas[0].num_microbatches
    gen = torch.Generator().manual_seed(7)
    pos = torch.arange(m.seq_length).unsqueeze(0)
    comm = mesh_communicator(plan, grids, model.config)
    stage = [MeshStageModule(model, mesh=k, last=last)]
    opt, ref_opt = (torch.optim.SGD(x.parameters(), lr=0.5) for x in (model, ref))

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach()}

    out = {"rank": rank, "mesh": k, "losses": [], "ref_losses": [], "grads": {}, "params": {}}
    batches = [torch.randint(0, m.vocab_size, (B, m.seq_length + 1), generator=gen)
               for _ in range(M)]  # the same batch every step: its loss falls
    for step in range(steps):
        it = iter(batches)

        def forward_step(data_iterator, model_chunk):
            tokens = next(it)[slot.replica * b:(slot.replica + 1) * b]
            out = model_chunk(tokens[:, :-1], pos.expand(len(tokens), -1), None,
                              labels=tokens[:, 1:])
            return out, loss_func

        opt.zero_grad(set_to_none=False)
        ref_opt.zero_grad()
        losses = forward_backward_pipelining_without_interleaving(
            forward_step_func=forward_step, data_iterator=None, model=stage, num_microbatches=M,
            seq_length=m.seq_length, micro_batch_size=b, p2p_communicator=comm,
            pg_collection=multimodule_collection(plan, k, pgs))
        for p in model.parameters():
            dist.all_reduce(p.grad, group=pgs.dp)
            p.grad *= gradient_scale(plan)
        total = 0.0
        for tokens in batches:
            logits = ref(tokens[:, :-1], pos.expand(len(tokens), -1), None)  # [b, s, V]
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            (loss / M).backward()
            total += float(loss) / M
        out["losses"].append(sum(float(x["loss"]) for x in losses) if losses else None)
        out["ref_losses"].append(total)
        if step == 0:
            for name, p in model.named_parameters():
                want = _shard(names[name], ref_params[names[name]].grad, p, t, T, m.swiglu)
                out["grads"][name] = _rel(p.grad, want)
        opt.step()
        ref_opt.step()
    for name, p in model.named_parameters():
        out["params"][name] = _rel(p, _shard(names[name], ref_params[names[name]], p, t, T,
                                             m.swiglu))
    dist.barrier()
    return out


def _rel(got, want) -> float:
    return float((got - want).abs().max() / (want.abs().max() + 1e-30))


def chain_bridge_groups(rank: int, world_size: int, plan_path: str) -> dict:
    """Build the chain's bridges (megatron_hetero.mcore.mesh_interleaved.chain_bridges) on
    gloo ranks; return, per bridge this rank leads on, the ranks of its group, and whether the
    forward bridge's and the wrap-around's groups are distinct objects, neither the world's."""
    import torch
    import torch.distributed as dist

    from megatron_hetero.mcore.cpu_backend import enable_cpu_backend
    from megatron_hetero.mcore.mesh_grids import gloo_bridges, mesh_grids
    from megatron_hetero.mcore.mesh_interleaved import chain_bridges
    from megatron_hetero.plan import load_any_plan

    enable_cpu_backend()
    gloo_bridges()
    from megatron.core.model_parallel_config import ModelParallelConfig

    plan = load_any_plan(plan_path)
    bridges = chain_bridges(plan, mesh_grids(plan),
                            ModelParallelConfig(pipeline_dtype=torch.float32))
    groups = [b.bridge_pg for b in bridges]
    member = [g not in (None, dist.GroupMember.NON_GROUP_MEMBER) for g in groups]
    out = {"ranks": [dist.get_process_group_ranks(g) if m else None
                     for g, m in zip(groups, member)],
           "distinct": all(m for m in member) and len({id(g) for g in groups}) == len(groups)
           and all(g is not dist.GroupMember.WORLD for g in groups)}
    if world_size == 2:
        out["crossed"] = _crossed_messages(rank, plan, *bridges)
    dist.barrier()
    return out


def _crossed_messages(rank: int, plan, forward, wrap) -> list:
    """Rank 0 sends an activation (ones) on the forward bridge, then, from another sender
    thread half a second later, a gradient (twos) on the wrap-around, both to rank 1, which
    receives the gradient first: on one shared queue the activation would arrive as the
    gradient. Returns what rank 1 received, in order (each tensor's distinct values)."""
    import time

    import torch

    from megatron_hetero.mcore.mesh_interleaved import Outbox

    b = plan.meshes[0].replicas[0].micro_batch_size
    if rank == 0:
        boxes = [Outbox(), Outbox()]
        boxes[0].post(forward.send_forward, torch.ones(3, b, 5))
        time.sleep(0.5)
        boxes[1].post(wrap.send_backward, torch.full((3, b, 5), 2.0))
        for box in boxes:
            box.close()
        return []
    got = [wrap.recv_backward(), forward.recv_forward()]
    return [sorted(set(t.flatten().tolist())) for t in got]


def vendor_bridge_ranks(rank: int, world_size: int, plan_path: str) -> dict:
    """On a chain whose bridge joins two collective libraries, through the multimodule
    communicator the runtime builds (``mesh_communicator``): the bridge's class, its group's
    backend and ranks, whether that group is none of the meshes' grids' groups (nor the
    world's), one micro-batch forward and its gradient back (:func:`_round_trip`, ``ok``), and
    how many messages this rank staged through host buffers (sent, received)."""
    import torch.distributed as dist

    plan, grids, comm = _bridged_communicator(plan_path)
    (bridge,) = comm.bridge_comms
    member = bridge.bridge_pg not in (None, dist.GroupMember.NON_GROUP_MEMBER)
    out = {"cls": type(bridge).__name__, "host": bridge.host,
           "backend": dist.get_backend(bridge.bridge_pg) if member else None,
           "group_ranks": dist.get_process_group_ranks(bridge.bridge_pg) if member else None,
           "own": all(bridge.bridge_pg is not pg for g in grids for pg in g._pgs.values())
           and bridge.bridge_pg is not dist.GroupMember.WORLD}
    (out["ok"],) = _round_trip(plan, rank, comm).values()
    out["staged"] = [bridge.host_sends, bridge.host_recvs]
    dist.barrier()
    return out
