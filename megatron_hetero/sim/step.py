"""A discrete-event simulator of one training step of a plan under Megatron's 1F1B schedule:
:func:`simulate`, one code path for every plan shape (a plan of one grid is a chain of one mesh,
with no bridges).

A *path* is the chain of stages one sample runs through, mesh after mesh. Where every mesh has
the same replicas (:func:`~megatron_hetero.cost.mesh.same_replicas`; always, for one mesh),
replica ``r`` of every mesh is path ``r``, and each path runs its pipeline on its own (paths alike
in every stage and link are simulated once). Where the data-parallel size changes at some bridge,
the schema makes every mesh's replicas alike and every mesh run the same micro-batches, so all
replicas of a mesh run in lockstep: one path stands for all, and each bridge costs its slowest
hub (:func:`~megatron_hetero.cost.mesh.bridges`). Inside a mesh a send is the cost model's
pipeline send at the mesh's TP over the link the two stages' nodes share; between meshes it is
the bridge's forward or backward (:func:`~megatron_hetero.cost.mesh.bridge_seconds`).

Each path runs non-interleaved 1F1B: stage ``s`` of ``p`` does ``min(p - s - 1, m)`` warm-up
forwards (or the stage's ``warmup_microbatches``, the heterogeneity-aware 1F1B), then
alternates one forward and one backward, then drains its backwards. A forward of
micro-batch ``i`` on stage ``s`` starts when stage ``s`` is free and the forward of ``i`` on
stage ``s - 1`` has ended and its activations have crossed the link between the two stages;
backwards likewise from stage ``s + 1``. Sends run on the link, not on the compute stream.

After its last backward every stage joins its data-parallel gradient sync (one group per stage:
its mesh's replicas, on the slowest link among their nodes): the sync starts when the slowest
replica of that stage is done (or, with ``overlap_grad_reduce``, when the last replica starts its
last backward; with interleaving, chunk by chunk as each chunk's last backward starts) and is
followed by the optimizer step. The step time is the latest end over all ranks. Sends across
vendors inside a mesh are recorded as ``T`` events (a bridge's are not drawn).

With interleaved pipelining (``virtual_pipeline_size`` v > 1) each rank runs its v model chunks
in Megatron's interleaved order (:func:`megatron_hetero.schedule.order.rank_order`, with the
plan's ``microbatch_group_size``), over one mesh or a chain of meshes alike: a path's stages are
every mesh's stages in pipeline order, and a rank's warm-up is that of its global stage. The
forward of (micro-batch ``i``, chunk ``c``) on stage ``s`` waits for (``i``, ``c``) on stage
``s - 1``, or for (``i``, ``c - 1``) on the last stage when ``s = 0`` (over the link from the
last stage back to the first: in a chain, the wrap-around bridge from the last mesh to mesh 0);
backwards mirror it. Every chunk boundary is a send, so each link, bridges included, carries v
times the sends of the non-interleaved schedule.

Per stage: ``busy_s`` compute, ``bubble_s`` waiting inside the schedule (from time 0 to the
stage's last backward), ``sync_s`` gradient sync and optimizer, ``idle_s`` the rest of the step
(waiting for slower replicas and stages).

Memory: every stage's peak (:meth:`~megatron_hetero.cost.CostModel.stage_memory`) against its
device; and, on the nodes of inventory groups that give ``host_memory_gb``, what the node's
ranks offload to the host (:meth:`~megatron_hetero.cost.CostModel.host_bytes`, each
(mesh, stage, replica) its mesh's TP ranks on its node from
:meth:`~megatron_hetero.cost.CostModel.placement`) plus the cost model's ``host_reserve_gb``
against the node's host memory (:attr:`SimResult.host_nodes`). Either one over makes
``fits_memory`` false.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..cost.experts import placed_expert_link
from ..cost.mesh import bridge_seconds, bridges, same_replicas
from ..cost.model import CostModel
from ..cost.stage import StageShape
from ..errors import HeteroError
from ..plan import Plan
from ..schedule.rules import has_extra_warmup, pipeline_warmups
from .bound import STEP_BOUND_SLACK, after_finish, lower_bound, per_replica
from .pipeline import pipeline_run
from .result import Event, HostMemory, SimResult, StageResult, nodes_host_memory, step_result

__all__ = ["simulate", "step_lower_bound", "check_recordable", "recorded_ops", "RECORD_MOST",
           "host_memory", "nodes_host_memory", "step_result", "SimResult", "StageResult",
           "HostMemory", "Event"]


RECORD_MOST = 2_000_000
"""The most compute ops a timeline records (:func:`check_recordable`): a few hundred megabytes
of events, far more than a picture shows."""


def recorded_ops(plan: Plan) -> int:
    """The compute ops a recorded step of ``plan`` holds: a forward and a backward of every
    micro-batch on every stage and chunk of every replica."""
    v = plan.virtual_pipeline_size
    return sum(2 * m.num_stages * v * pipe.num_microbatches
               for m in plan.meshes for pipe in m.pipelines)


def check_recordable(ops: int) -> None:
    """Refuse, with one line, a timeline of more than :data:`RECORD_MOST` compute ops (whose
    events would take minutes and gigabytes to record: a global batch of 10^6 or more)."""
    if ops > RECORD_MOST:
        raise HeteroError(f"--timeline: a step of {ops:,} forwards and backwards to draw; "
                          f"expected at most {RECORD_MOST:,} (a smaller --global-batch-size, "
                          "or no --timeline)")


def simulate(plan: Plan, cost: CostModel, *, record_events: bool = True,
             pipeline_sends: Mapping[int, Sequence[float]] | None = None,
             faster_than: float | None = None) -> SimResult | None:
    """Simulate one training step of ``plan`` (any shape) under ``cost``. ``pipeline_sends``:
    for the paths it names, the seconds of one send over each link between consecutive stages
    (and, interleaved, from the last stage back to the first) instead of the placed link's (the
    rehearsal's emulated links). ``faster_than`` (seconds; without ``record_events`` or
    ``pipeline_sends``): None instead of a result once the step is sure not to be below it
    (a pipeline run op by op stops where a stage's finish plus what
    :func:`step_lower_bound` adds after it reaches that: :func:`.pipeline.pipeline_run`'s
    ``limits``); a step that is below it comes back as without."""
    pipeline_sends = pipeline_sends or {}
    if record_events:
        check_recordable(recorded_ops(plan))
    placement, lockstep, rep, shapes, times_of = _priced(plan, cost)
    meshes, index = plan.meshes, plan.stage_index
    v, paths = plan.virtual_pipeline_size, len(rep)
    inputs = _path_inputs(plan, cost, placement, lockstep, rep, times_of, pipeline_sends)
    priced_syncs = _stage_syncs(plan, cost, placement, shapes,
                                per_replica(meshes, lockstep, rep, rep)[2])
    limits = None
    if faster_than is not None and not record_events and not pipeline_sends:
        after = after_finish(plan, priced_syncs, inputs)
        bound, finishes = lower_bound(plan, lockstep, rep, inputs, after)
        if bound >= faster_than:
            return None
        # the path likeliest to be cut short first
        order = sorted(range(paths), key=lambda d: -max(map(sum, zip(finishes[d], after))))
        limits = [faster_than * (1 + STEP_BOUND_SLACK) - a for a in after]
    cache: dict[tuple, tuple] = {}
    runs: list = [None] * paths
    for d in range(paths) if limits is None else order:
        runs[d] = _run_path(plan, *inputs[d], cache, record_events, limits)
        if runs[d] is None:
            return None
    memory_of = {r: [cost.memory(shape) for shape in row] for r, row in shapes.items()}
    sums = {r: [(sum(c.forward_s for c in row), sum(c.backward_s for c in row)) for row in rows]
            for r, rows in times_of.items()}
    most, run_of, rep_of = per_replica(meshes, lockstep, runs, rep)
    replicas = [meshes[k].data_parallel_size for k, _ in index]  # per stage
    events: list[Event] = []
    stage_end: list[list[float]] = []
    sync_of: list[list[float]] = []
    for s, (k, j) in enumerate(index):
        D = replicas[s]
        comm, seconds, opts = priced_syncs[s]
        staged = record_events and placement.dp_host_staged(k, j)
        mine = run_of if D == len(run_of) else run_of[:D]
        finish = max(run[0][s] for run in mine)
        if plan.overlap_grad_reduce or cost.overlap_grad_reduce:
            # each model chunk's buckets go once its last backward starts on every replica,
            # one after another on the data-parallel link
            if v == 1:
                parts = [(max(run[2][s] for run in mine), seconds[0])]
            else:
                parts = sorted((max(run[2][s][c] for run in mine), seconds[c])
                               for c in range(v))
            start = end = parts[0][0]
            for ready, seconds in parts:
                end = max(end, ready) + seconds
            sync_end = max(finish, end)
        else:
            start, sync_end = finish, finish + comm
        ends, syncs = [0.0] * D, [0.0] * D
        for d, opt in enumerate(opts):
            ends[d] = sync_end + opt
            syncs[d] = (sync_end - max(start, mine[d][0][s])) + opt
            if record_events:
                if comm:
                    events.append(Event(d, s, "S", -1, sync_end - comm, sync_end,
                                        host_staged=staged))
                events.append(Event(d, s, "O", -1, sync_end, sync_end + opt))
        stage_end.append(ends)
        sync_of.append(syncs)
    step = max(max(row) for row in stage_end)
    fits = all(mem.fits for row in memory_of.values() for mem in row)
    if record_events:
        for d in range(most):
            evs = run_of[d][3]
            if lockstep:  # the replica's own stages: meshes with more than d replicas
                evs = [ev for ev in evs if d < replicas[ev[0]]]
            events.extend(Event(d, *ev) for ev in evs)
            events.extend(_host_sends(plan, cost, placement, d, evs, pipeline_sends.get(d)))
    stages: list[StageResult] = []
    for d in range(most):
        finish, busy = run_of[d][0], run_of[d][1]
        sum_of, mem_of = sums[rep_of[d]], memory_of[rep_of[d]]
        s = 0
        for mesh in meshes:
            if d >= mesh.data_parallel_size:
                s += mesh.num_stages
                continue
            for st in mesh.pipelines[d].stages:
                bubble, sync = finish[s] - busy[s], sync_of[s][d]
                stages.append(StageResult(
                    pipeline=d, stage=s, device_type=st.device_type, num_layers=st.num_layers,
                    forward_s=sum_of[s][0], backward_s=sum_of[s][1], busy_s=busy[s],
                    bubble_s=bubble, sync_s=sync, idle_s=max(0.0, step - busy[s] - bubble - sync),
                    memory=mem_of[s]))
                s += 1
    if not plan.one_grid:  # stage by stage: a chain's replicas per stage differ
        stages.sort(key=lambda x: (x.stage, x.pipeline))
    return step_result(plan, cost, step=step, stages=stages, events=events,
                       hosts=host_memory(plan, cost, placement), fits=fits)


def step_lower_bound(plan: Plan, cost: CostModel) -> float:
    """A lower bound of :func:`simulate`'s step time of ``plan``, from the same stage costs and
    links but without running any schedule: where a search only wants plans faster than one
    it has, a plan whose bound is not below that one's step cannot be (and needs no run).

    Every stage's last backward ends no sooner than :func:`.pipeline.finish_lower_bound` (its
    fill, its forwards and backwards one after another, and the drain of the stages before it),
    on the slowest of its replicas; then, as :func:`simulate` prices it, its gradient sync (where
    overlapped, what the last backward's chunk leaves: :func:`.bound.after_finish`) and each
    replica's optimizer step. The step is the latest of these ends over all stages; the bound
    takes ``STEP_BOUND_SLACK`` off, and is 0.0 where a path runs more than
    :data:`.pipeline.EXACT_MOST` micro-batches (extrapolated past its last probe)."""
    placement, lockstep, rep, shapes, times_of = _priced(plan, cost)
    inputs = _path_inputs(plan, cost, placement, lockstep, rep, times_of, {})
    rep_of = per_replica(plan.meshes, lockstep, rep, rep)[2]
    after = after_finish(plan, _stage_syncs(plan, cost, placement, shapes, rep_of), inputs)
    return lower_bound(plan, lockstep, rep, inputs, after)[0]


def _stage_syncs(plan: Plan, cost: CostModel, placement, shapes, rep_of) -> list[tuple]:
    """Per stage (``rep_of``: each replica's representative): the seconds of its whole
    gradient sync over its replicas; where the sync overlaps the backwards, of each model
    chunk's (the whole stage's, one chunk), else none; each replica's optimizer step."""
    overlap = plan.overlap_grad_reduce or cost.overlap_grad_reduce
    v, meshes, out = plan.virtual_pipeline_size, plan.meshes, []
    for s, (k, j) in enumerate(plan.stage_index):
        D = meshes[k].data_parallel_size
        shape, bw = shapes[rep_of[0]][s], placement.dp_bandwidth(k, j)
        comm = cost.grad_sync_seconds(shape, bw)
        chunks: tuple | list = []
        if overlap:
            chunks = [comm] if v == 1 else cost.chunk_sync_seconds(shape, D, bw)
        opts = _optimizer_seconds(cost, meshes[k].pipelines, j, [shapes[r][s] for r in rep_of[:D]])
        out.append((comm, chunks, opts))
    return out


def _priced(plan: Plan, cost: CostModel):
    """What :func:`simulate` and :func:`step_lower_bound` price a plan from: its placement,
    whether its paths run in lockstep, each path's representative (:func:`_representatives`),
    and per representative every stage's shape and chunk times."""
    placement = cost.placement(plan)
    meshes, index = plan.meshes, plan.stage_index
    lockstep = not same_replicas(meshes)
    # replica r of every mesh runs path r, or all of them the one lockstep path 0
    paths = 1 if lockstep else meshes[0].data_parallel_size
    # paths alike in every stage share their costs (large pools repeat one template)
    rep = _representatives(plan, paths)
    shapes = {r: [placed_expert_link(StageShape.at(plan, k, j, r, global_stage=s), meshes[k],
                                     placement, k, j, r) for s, (k, j) in enumerate(index)]
              for r in set(rep)}
    times_of = {r: [cost.chunk_times(shape) for shape in row] for r, row in shapes.items()}
    return placement, lockstep, rep, shapes, times_of


def _optimizer_seconds(cost: CostModel, pipes, j: int, shapes) -> list[float]:
    """The optimizer step of stage ``j`` of each of ``pipes`` (``shapes``: each one's stage
    shape), priced once per device type and optimizer offload."""
    opts: dict[tuple, float] = {}
    out = []
    for pipe, shape in zip(pipes, shapes):
        st = pipe.stages[j]
        key = (st.device_type, st.offload.optimizer_fraction)
        if key not in opts:
            opts[key] = cost.optimizer_seconds(shape)
        out.append(opts[key])
    return out


def _run_path(plan: Plan, full: tuple, args: tuple, cache: dict, record: bool,
              limits: list[float] | None):
    """Simulate one path (the non-interleaved or the interleaved schedule) on ``args``
    (:func:`_path_inputs`); runs are cached by ``full``. None where the run stopped at
    ``limits`` (:func:`.pipeline.pipeline_run`)."""
    if full in cache and not record:
        return cache[full]
    fwd, bwd, send_f, send_b, m, warmups = args
    got = pipeline_run(fwd, bwd, send_f, send_b, m, record=record,
                       group=plan.microbatch_group_size, warmups=warmups, limits=limits)
    if got is None:
        return None
    if plan.virtual_pipeline_size == 1:  # last backwards per stage; events without a chunk
        got = (got[0], got[1], [x[0] for x in got[2]], [e[:5] for e in got[3]])
    cache[full] = got
    return got


def _path_inputs(plan: Plan, cost: CostModel, placement, lockstep: bool, rep: list[int],
                 times_of: dict, pipeline_sends: Mapping[int, Sequence[float]]) -> list[tuple]:
    """Per path ``d``: (what names its run: its representative's costs, :func:`_representatives`,
    and its links or the sends given in ``pipeline_sends``; :func:`_path_args` of it), each
    distinct one found once."""
    out, seen = [], {}
    for d, r in enumerate(rep):
        if d in pipeline_sends:
            links, sends = None, tuple(pipeline_sends[d])
            full = (r, "sends", sends)
        else:
            links, sends = _path_links(plan, cost, placement, d, lockstep), None
            full = (r, links)
        if full not in seen:
            seen[full] = _path_args(plan, cost, times_of[r], d, links, sends)
        out.append((full, seen[full]))
    return out


def _path_args(plan: Plan, cost: CostModel, times, d: int, links: tuple | None,
               sends: tuple[float, ...] | None):
    """What the pipeline of path ``d`` runs on (:func:`.pipeline.pipeline_run`'s arguments but
    the group): forward and backward seconds per stage and chunk, the sends over its ``links``
    (or the ``sends`` given), its micro-batches, and the stages' warm-ups where the plan sets
    them (None: Megatron's schedule, as the runtime picks it)."""
    if sends is None:
        send_f, send_b = _sends(plan, cost, d, links)
    else:
        send_f = send_b = list(sends)
    pipe = plan.path_pipeline(d)
    fwd = [[c.forward_s for c in t] for t in times]
    bwd = [[c.backward_s for c in t] for t in times]
    warmups = None
    v, group = plan.virtual_pipeline_size, plan.microbatch_group_size
    if has_extra_warmup(pipe, v, group):
        warmups = tuple(pipeline_warmups(pipe, v, group))
    return fwd, bwd, send_f, send_b, pipe.num_microbatches, warmups


def _path_links(plan: Plan, cost: CostModel, placement, d: int, lockstep: bool) -> tuple:
    """The links of path ``d`` in stage order: GB/s between consecutive stages inside a mesh
    (and, interleaved, from the last stage back to the first), a
    :class:`~megatron_hetero.cost.mesh.Bridge` between meshes (interleaved, the last one the
    wrap-around bridge from the last mesh back to mesh 0)."""
    meshes = plan.meshes
    if len(meshes) == 1:
        return placement.path_links(0, d, plan.virtual_pipeline_size > 1)
    bridge_of = bridges(plan, placement, cost.inventory, replica_of_path=None if lockstep else d)
    out: list = []
    for k in range(len(meshes)):
        out.extend(placement.path_links(k, d, False))
        if k < len(bridge_of):
            out.append(bridge_of[k])
    return tuple(out)


def _sends(plan: Plan, cost: CostModel, d: int, links: tuple) -> tuple[list, list]:
    """(forward, backward) seconds of one micro-batch over each of path ``d``'s ``links``."""
    send_f, send_b = [], []
    it = iter(links)
    sp, wrap, last = plan.sequence_parallel, plan.virtual_pipeline_size > 1, len(plan.meshes) - 1
    for k, mesh in enumerate(plan.meshes):
        mbs, tp = mesh.pipelines[d].micro_batch_size, mesh.tensor_model_parallel_size
        # interleaved, one mesh wraps around over its own link, a chain over a bridge
        for _ in range(mesh.num_stages - 1 + (wrap and last == 0)):
            seconds = cost.p2p_seconds(mbs, next(it), tp=tp, sp=sp)
            send_f.append(seconds)
            send_b.append(seconds)
        if k < last or (wrap and last > 0):
            f, b = bridge_seconds(cost, next(it))
            send_f.append(f)
            send_b.append(b)
    return send_f, send_b


def _representatives(plan: Plan, paths: int) -> list[int]:
    """For each path, the first path with the same per-stage costs (:func:`_pipeline_key` of
    its replica in every mesh; replicas that share one list of stages are alike at once)."""
    first: dict[tuple, int] = {}
    by_stages: dict[tuple, int] = {}
    rep = []
    meshes = plan.meshes
    one = len(meshes) == 1  # one mesh: its pipelines themselves (the search's hot path)
    for d in range(paths):
        if one:
            pipe = meshes[0].pipelines[d]
            quick = (id(pipe.stages), pipe.micro_batch_size, pipe.num_microbatches)
        else:
            pipes = [m.pipelines[d] for m in meshes]
            quick = tuple((id(x.stages), x.micro_batch_size, x.num_microbatches) for x in pipes)
        r = by_stages.get(quick)
        if r is None:
            key = _pipeline_key(pipe) if one else tuple(_pipeline_key(x) for x in pipes)
            r = by_stages[quick] = first.setdefault(key, d)
        rep.append(r)
    return rep


def _pipeline_key(pipe) -> tuple:
    """What a pipeline's per-stage costs depend on (its placement aside)."""
    return (pipe.micro_batch_size, pipe.num_microbatches,
            tuple((st.device_type, st.num_layers, st.recompute,
                   st.offload.optimizer_fraction, st.offload.activations, st.offload.module_inputs,
                   tuple(st.chunk_layers) if st.chunk_layers else None,
                   st.warmup_microbatches) for st in pipe.stages))


def _host_sends(plan: Plan, cost: CostModel, placement, d: int, evs,
                given: Sequence[float] | None) -> list[Event]:
    """The sends of replica ``d`` over links inside a mesh across vendors, as ``T`` events: each
    forward sends to the next stage (the last stage's, interleaved, back to the first), each
    backward to the previous one, when its compute ends (``evs``: the replica's recorded
    compute; ``given``: the seconds of one send per link where the caller gives them)."""
    meshes, index = plan.meshes, plan.stage_index
    p, v = len(index), plan.virtual_pipeline_size
    edges = {s: (k, j, j + 1) for s, (k, j) in enumerate(index)
             if d < meshes[k].data_parallel_size and j + 1 < meshes[k].num_stages}
    wraps = v > 1 and len(meshes) == 1  # a chain's wrap-around is a bridge (not drawn)
    if wraps:
        edges[p - 1] = (0, p - 1, 0)
    staged = {e: (k, a) for e, (k, a, b) in edges.items()
              if placement.host_staged(placement.node(k, a, d), placement.node(k, b, d))}
    if not staged:
        return []
    out = []
    for stage, kind, mb, _, end, *chunk in evs:
        c = chunk[0] if chunk else 0
        if kind == "F" and not (stage == p - 1 and c == v - 1):
            edge = stage
        elif kind == "B" and not (stage == 0 and c == 0):
            edge = (stage - 1) % p
        else:
            continue
        if edge in staged:
            k, a = staged[edge]
            mesh = meshes[k]
            seconds = given[edge] if given is not None else cost.p2p_seconds(
                mesh.pipelines[d].micro_batch_size, placement.path_links(k, d, wraps)[a],
                tp=mesh.tensor_model_parallel_size, sp=plan.sequence_parallel)
            out.append(Event(d, stage, "T", mb, end, end + seconds, c, host_staged=True))
    return out


def host_memory(plan: Plan, cost: CostModel, placement) -> list[HostMemory]:
    """Host memory of every node ``plan`` uses in a group with ``host_memory_gb``: each
    (mesh, stage, replica) puts its mesh's ``tensor_model_parallel_size`` ranks on its node."""
    inv = cost.inventory
    if not any(g.host_memory_gb for g in inv.groups):
        return []
    caps = {gi for gi, g in enumerate(inv.groups) if g.host_memory_gb}
    index = plan.stage_index
    slots = [(d, s) for s, (k, _) in enumerate(index)
             for d in range(plan.meshes[k].data_parallel_size)]
    if plan.one_grid:  # pipeline by pipeline, as the stages of the result
        slots.sort()
    used: dict = {}
    for d, s in slots:
        k, j = index[s]
        node = placement.node(k, j, d)
        if node.group in caps:
            tp = plan.meshes[k].tensor_model_parallel_size
            used[node] = used.get(node, 0.0) + tp * cost.host_bytes(
                StageShape.at(plan, k, j, d, global_stage=s))
    return nodes_host_memory(used, cost)
