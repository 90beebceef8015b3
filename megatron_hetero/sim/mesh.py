"""One training step of a mesh plan (:mod:`megatron_hetero.plan.format2`), simulated as
:mod:`megatron_hetero.sim.step` does a format-1 plan.

A *path* is the chain of stages one sample runs through. Where every mesh has the same replicas
(:func:`~megatron_hetero.cost.mesh.same_replicas`), replica ``r`` of every mesh is path ``r``,
and each path runs Megatron's 1F1B on its own (paths alike are simulated once). Where the
data-parallel size changes at some bridge, the schema makes every mesh's replicas alike and
every mesh run the same micro-batches, so all replicas of a mesh run in lockstep: one path
stands for all, and each bridge costs its slowest hub (:func:`~megatron_hetero.cost.mesh.bridges`).

Inside a mesh, a send between stages is the cost model's pipeline send at the mesh's TP over
the link the two stages' nodes share; between meshes it is the bridge's forward or backward
(:func:`~megatron_hetero.cost.mesh.bridge_seconds`). After its last backward each stage
syncs its gradients over its mesh's data-parallel group (that mesh's ``D``, on the slowest link
among its replicas' nodes) and runs its optimizer step on its own shard.
"""

from __future__ import annotations

from ..cost.mesh import bridge_seconds, bridges, mesh_stage_shape, same_replicas
from ..placement.meshes import place_meshes
from ..cost.model import CostModel
from ..plan import Plan
from .step import Event, HostMemory, SimResult, StageResult, nodes_host_memory, step_result
from .pipeline import pipeline_run

__all__ = ["simulate_mesh"]


def _path_sends(plan: Plan, cost: CostModel, placement, path: int | None):
    """(send_f, send_b): seconds of one micro-batch over each link of the path (replica
    ``path`` of every mesh; None: the lockstep path, every bridge at its slowest hub)."""
    send_f, send_b = [], []
    bridge_of = bridges(plan, placement, cost.inventory, replica_of_path=path)
    r = 0 if path is None else path
    for k, mesh in enumerate(plan.meshes):
        mbs = mesh.replicas[r].micro_batch_size
        for j in range(len(mesh.stages) - 1):
            bw = placement.link(placement.node(k, j, r), placement.node(k, j + 1, r))
            s = cost.p2p_seconds(mbs, bw, tp=mesh.tensor_model_parallel_size)
            send_f.append(s)
            send_b.append(s)
        if k < len(bridge_of):
            f, b = bridge_seconds(cost, bridge_of[k])
            send_f.append(f)
            send_b.append(b)
    return send_f, send_b


def _path_runs(plan: Plan, cost: CostModel, placement, *, record: bool):
    """The 1F1B run and the stage shapes of every path (paths alike are simulated once), and
    the path of each replica index (None: the one lockstep path)."""
    index = plan.stage_index
    paths = plan.meshes[0].data_parallel_size if same_replicas(plan.meshes) else None
    runs, shapes_of = {}, {}
    cache: dict = {}
    for path in (range(paths) if paths else [None]):
        r = 0 if path is None else path
        shapes = [mesh_stage_shape(plan, k, j, r) for k, j in index]
        sends = _path_sends(plan, cost, placement, path)
        key = (tuple(shapes), tuple(sends[0]), tuple(sends[1]))
        if key not in cache or record:
            times = [cost.chunk_times(sh) for sh in shapes]
            fwd = [[c.forward_s for c in t] for t in times]
            bwd = [[c.backward_s for c in t] for t in times]
            cache[key] = pipeline_run(fwd, bwd, *sends, shapes[0].num_microbatches, record=record)
        runs[path], shapes_of[path] = cache[key], shapes
    return runs, shapes_of, (lambda replica: replica if paths else None)


def simulate_mesh(plan: Plan, cost: CostModel, *, record_events: bool = True) -> SimResult:
    """Simulate one training step of the mesh plan ``plan`` under ``cost``."""
    placement = place_meshes(plan, cost.inventory)
    index = plan.stage_index
    runs, shapes_of, path_of = _path_runs(plan, cost, placement, record=record_events)

    events: list[Event] = []
    stages: list[StageResult] = []
    ends: dict[tuple[int, int], float] = {}
    sync_of: dict[tuple[int, int, int], float] = {}
    overlap = plan.overlap_grad_reduce or cost.overlap_grad_reduce
    for s, (k, j) in enumerate(index):
        mesh = plan.meshes[k]
        reps = range(mesh.data_parallel_size)
        shape = shapes_of[path_of(0)][s]
        comm = cost.dp_sync_seconds(cost.stage_params(shape), mesh.data_parallel_size,
                                    placement.dp_bandwidth(k, j))
        finish = max(runs[path_of(r)][0][s] for r in reps)
        if overlap:
            ready = max(runs[path_of(r)][2][s][0] for r in reps)
            start, sync_end = ready, max(finish, ready + comm)
        else:
            start, sync_end = finish, finish + comm
        for r in reps:
            run, sh = runs[path_of(r)], shapes_of[path_of(r)][s]
            opt = cost.optimizer_seconds(sh)
            ends[(r, s)] = sync_end + opt
            sync_of[(k, j, r)] = (sync_end - max(start, run[0][s])) + opt
            if record_events:
                if comm:
                    events.append(Event(r, s, "S", -1, sync_end - comm, sync_end))
                events.append(Event(r, s, "O", -1, sync_end, sync_end + opt))
    step = max(ends.values())
    fits = True
    for s, (k, j) in enumerate(index):
        mesh = plan.meshes[k]
        for r in range(mesh.data_parallel_size):
            finish, busy, _, evs = runs[path_of(r)]
            sh = shapes_of[path_of(r)][s]
            if record_events:
                events.extend(Event(r, *ev[:5]) for ev in evs if ev[0] == s)
            mem = cost.memory(sh)
            fits = fits and mem.fits
            times = cost.chunk_times(sh)
            bubble, sync = finish[s] - busy[s], sync_of[(k, j, r)]
            stages.append(StageResult(
                pipeline=r, stage=s, device_type=mesh.device_type,
                num_layers=mesh.stages[j].num_layers,
                forward_s=sum(c.forward_s for c in times),
                backward_s=sum(c.backward_s for c in times), busy_s=busy[s], bubble_s=bubble,
                sync_s=sync, idle_s=max(0.0, step - busy[s] - bubble - sync), memory=mem))
    return step_result(plan, cost, step=step, stages=stages, events=events,
                       hosts=_host_memory(plan, cost, placement), fits=fits)


def _host_memory(plan: Plan, cost: CostModel, placement) -> list[HostMemory]:
    """As :func:`megatron_hetero.sim.step.host_memory`, each (mesh, stage, replica) putting its
    mesh's TP ranks on its node."""
    inv = cost.inventory
    caps = {gi: g.host_memory_gb for gi, g in enumerate(inv.groups) if g.host_memory_gb}
    if not caps:
        return []
    used: dict = {}
    for k, mesh in enumerate(plan.meshes):
        for j in range(len(mesh.stages)):
            for r in range(mesh.data_parallel_size):
                node = placement.node(k, j, r)
                if node.group in caps:
                    used[node] = used.get(node, 0.0) + mesh.tensor_model_parallel_size * \
                        cost.host_bytes(mesh_stage_shape(plan, k, j, r))
    return nodes_host_memory(used, cost)
