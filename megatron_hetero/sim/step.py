"""A discrete-event simulator of one training step of a plan under Megatron's 1F1B schedule.

Each pipeline runs non-interleaved 1F1B: stage ``s`` of ``p`` does ``min(p - s - 1, m)`` warm-up
forwards (or the stage's ``warmup_microbatches``, the heterogeneity-aware 1F1B), then alternates one forward and one backward, then drains its backwards. A forward of
micro-batch ``i`` on stage ``s`` starts when stage ``s`` is free and the forward of ``i`` on
stage ``s - 1`` has ended and its activations have crossed the link between the two stages;
backwards likewise from stage ``s + 1``. Sends run on the link, not on the compute stream.

After its last backward every stage index joins its data-parallel gradient sync (one group per
stage index across all pipelines): the sync starts when the slowest replica of that stage is
done (or, with ``overlap_grad_reduce``, when the last replica starts its last backward; with
interleaving, chunk by chunk as each chunk's last backward starts) and is followed by the
optimizer step. The step time is the latest end over all ranks.

With interleaved pipelining (``virtual_pipeline_size`` v > 1) each rank runs its v model
chunks in Megatron's interleaved order (:func:`megatron_hetero.schedule.order.rank_order`, with
the plan's ``microbatch_group_size``). The
forward of (micro-batch ``i``, chunk ``c``) on stage ``s`` waits for (``i``, ``c``) on stage
``s - 1``, or for (``i``, ``c - 1``) on the last stage when ``s = 0`` (over the link from the
last stage back to the first); backwards mirror it. Every chunk boundary is a send, so each
link carries v times the sends of the non-interleaved schedule.

Per stage: ``busy_s`` compute, ``bubble_s`` waiting inside the schedule (from time 0 to the
stage's last backward), ``sync_s`` gradient sync and optimizer, ``idle_s`` the rest of the step
(waiting for slower replicas and stages).

Memory: every stage's peak (:meth:`~megatron_hetero.cost.CostModel.stage_memory`) against its
device; and, on the nodes of inventory groups that give ``host_memory_gb``, what the node's
ranks offload to the host (:meth:`~megatron_hetero.cost.CostModel.host_bytes`, each
(pipeline, stage) on its node from :meth:`~megatron_hetero.cost.CostModel.placement`) plus the
cost model's ``host_reserve_gb`` against the node's host memory (:attr:`SimResult.host_nodes`).
Either one over makes ``fits_memory`` false.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..cost.model import CostModel
from ..errors import HeteroError
from ..cost.stage import Memory, StageShape
from ..models import step_model_flops
from ..plan import Plan
from ..schedule.rules import has_extra_warmup, pipeline_warmups
from .pipeline import pipeline_run

__all__ = ["simulate", "check_recordable", "RECORD_MOST", "host_memory", "nodes_host_memory", "SimResult", "StageResult", "HostMemory",
           "Event"]


@dataclass(frozen=True, slots=True)
class Event:
    """One compute or communication interval on one (pipeline, stage)."""

    pipeline: int
    stage: int
    kind: str
    """``F`` forward, ``B`` backward, ``S`` gradient sync, ``O`` optimizer step, ``T`` a send
    over a host-staged link (recorded for links across vendors only), on its sender's row."""
    microbatch: int
    start: float
    end: float
    chunk: int = 0
    """Model chunk of a forward or backward (0 unless the plan interleaves)."""
    host_staged: bool = False
    """The interval moves data across vendors on the host path: a ``T`` send, or the ``S`` sync
    of a data-parallel group that spans vendors (gloo)."""


@dataclass(kw_only=True, slots=True)
class StageResult:
    pipeline: int
    stage: int
    device_type: str
    num_layers: int
    forward_s: float
    """One micro-batch's forward."""
    backward_s: float
    busy_s: float
    bubble_s: float
    sync_s: float
    idle_s: float
    memory: Memory

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("pipeline", "stage", "device_type", "num_layers",
                                             "forward_s", "backward_s", "busy_s", "bubble_s",
                                             "sync_s", "idle_s")}
        out["memory_bytes"] = self.memory.total
        out["memory_capacity_bytes"] = self.memory.capacity
        return out


@dataclass(frozen=True, slots=True)
class HostMemory:
    """Host memory of one node the plan uses, in a group with ``host_memory_gb``."""

    node: str
    """The node's host name, else ``<group label> node <i>``."""
    group: int
    index: int
    """Node index inside the group."""
    used_bytes: float
    """What its ranks offload plus the cost model's host reserve."""
    capacity_bytes: float

    @property
    def fits(self) -> bool:
        return self.used_bytes <= self.capacity_bytes

    def to_dict(self) -> dict:
        return {"node": self.node, "group": self.group, "index": self.index,
                "used_bytes": self.used_bytes, "capacity_bytes": self.capacity_bytes}


@dataclass(kw_only=True, slots=True)
class SimResult:
    step_time_s: float
    stages: list[StageResult]
    tokens_per_s: float
    model_flops: float
    """Model FLOPs of one step (no recompute)."""
    mfu: float
    """Model FLOP/s over the summed peak (datasheet) FLOP/s of the plan's GPUs."""
    fits_memory: bool
    """Every stage fits its device and every node in ``host_nodes`` its host memory."""
    events: list[Event] = field(default_factory=list)
    host_nodes: list[HostMemory] = field(default_factory=list)
    """The nodes of groups with ``host_memory_gb`` the plan uses (empty when none gives it)."""

    def stage(self, pipeline: int, stage: int) -> StageResult:
        p = 1 + max(s.stage for s in self.stages)
        i = pipeline * p + stage
        if i < len(self.stages) and (self.stages[i].pipeline, self.stages[i].stage) == (pipeline, stage):
            return self.stages[i]
        # a mesh plan's stages: replicas per stage differ from mesh to mesh
        return next(s for s in self.stages if (s.pipeline, s.stage) == (pipeline, stage))

    def to_dict(self) -> dict:
        out = {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
               "mfu": self.mfu, "model_flops": self.model_flops, "fits_memory": self.fits_memory,
               "stages": [s.to_dict() for s in self.stages]}
        if self.host_nodes:
            out["host_nodes"] = [h.to_dict() for h in self.host_nodes]
        return out

    def timeline_png(self, path, *, max_pipelines: int = 8, seconds: float | None = None) -> None:
        """Gantt chart of the recorded events (the first ``max_pipelines`` pipelines); the time
        axis ends at ``seconds`` where given (to compare pictures side by side)."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if not self.events:
            raise ValueError("no events recorded: call simulate(..., record_events=True)")
        colors = {"F": "#4C72B0", "B": "#55A868", "S": "#C44E52", "O": "#8172B2"}
        chunks = 1 + max(e.chunk for e in self.events)
        if chunks > 1:  # one shade per model chunk: darker for later chunks
            shades = {"F": ("#A1C4E9", "#4C72B0", "#2A4A7F", "#142848"),
                      "B": ("#A8DDB5", "#55A868", "#2F6B3E", "#17391F")}
            colors = {f"{k}{c}": shades[k][min(c, 3) if chunks <= 4 else c * 3 // (chunks - 1)]
                      for k in "FB" for c in range(chunks)} | {"S": colors["S"], "O": colors["O"]}
        bars: dict[tuple, list] = {}
        for e in self.events:
            if e.pipeline < max_pipelines and e.kind != "T":
                kind = f"{e.kind}{e.chunk}" if chunks > 1 and e.kind in "FB" else e.kind
                bars.setdefault((e.pipeline, e.stage, kind), []).append((e.start, e.end - e.start))
        rows = sorted({(d, s) for d, s, _ in bars})
        index = {r: i for i, r in enumerate(rows)}
        fig, ax = plt.subplots(figsize=(12, 0.35 * len(rows) + 1.5))
        for (d, s, kind), spans in sorted(bars.items()):
            ax.broken_barh(spans, (index[(d, s)] - 0.4, 0.8), facecolors=colors[kind],
                           edgecolor="white", linewidth=0.2)
        staged = [e for e in self.events if e.host_staged and e.pipeline < max_pipelines]
        for e in staged:  # hatched: the transfer crosses vendors through the hosts; a send (T)
            # is a strip under its sender's bars (it runs on the link, not the compute stream)
            low, high = (0.25, 0.15) if e.kind == "T" else (-0.4, 0.8)
            ax.broken_barh([(e.start, e.end - e.start)], (index[(e.pipeline, e.stage)] + low, high),
                           facecolors="#DD8452" if e.kind == "T" else "none", edgecolor="black",
                           hatch="///", linewidth=0.0)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"p{d} s{s} {self.stage(d, s).device_type}" for d, s in rows], fontsize=7)
        ax.invert_yaxis()
        if seconds is not None:
            ax.set_xlim(0, seconds)
        ax.set_xlabel("seconds")
        ax.set_title(f"step {self.step_time_s:.3f} s (F forward, B backward, S grad sync, O optimizer"
                     + ("; T send across vendors" if staged else "")
                     + (f"; Fc/Bc: model chunk c of {chunks}" if chunks > 1 else "") + ")")
        from matplotlib.patches import Patch
        handles = [Patch(color=c, label=k) for k, c in colors.items()]
        if any(e.kind == "T" for e in staged):
            handles.append(Patch(facecolor="#DD8452", edgecolor="black", hatch="///",
                                 label="T send across vendors (host-staged)"))
        if any(e.kind == "S" for e in staged):
            handles.append(Patch(facecolor="white", edgecolor="black", hatch="///",
                                 label="S across vendors (gloo, host-staged)"))
        ax.legend(handles=handles, loc="upper left",
                  bbox_to_anchor=(1.0, 1.0), fontsize=7)  # beside the bars, not over them
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _run_pipeline(plan: Plan, cost: CostModel, placement, times, d: int, key, cache: dict,
                  record: bool, sends: tuple[float, ...] | None):
    """Simulate pipeline ``d`` (the non-interleaved or the interleaved schedule); ``key``
    names its costs (pipelines alike share it: :func:`_representatives`) and runs are cached
    by it and the sends; ``sends``: the seconds of one send over each of its links, where they
    are given rather than placed."""
    pipe = plan.pipelines[d]
    if sends is None:
        bws = placement.pipeline_links(d, plan.virtual_pipeline_size > 1)
        full = (key, bws)
    else:
        full = (key, "sends", sends)
    if full in cache and not record:
        return cache[full]
    if sends is None:
        tp, sp = plan.tensor_model_parallel_size, plan.sequence_parallel
        sends = [cost.p2p_seconds(pipe.micro_batch_size, bw, tp=tp, sp=sp) for bw in bws]
    fwd = [[c.forward_s for c in t] for t in times[d]]
    bwd = [[c.backward_s for c in t] for t in times[d]]
    warmups = None  # Megatron's schedule, as the runtime picks it
    if has_extra_warmup(pipe):
        warmups = tuple(pipeline_warmups(pipe))
    got = pipeline_run(fwd, bwd, sends, sends, pipe.num_microbatches, record=record,
                       group=plan.microbatch_group_size, warmups=warmups)
    if plan.virtual_pipeline_size == 1:  # last backwards per stage; events without a chunk
        got = (got[0], got[1], [x[0] for x in got[2]], [e[:5] for e in got[3]])
    cache[full] = got
    return got


def _representatives(plan: Plan) -> list[int]:
    """For each pipeline, the first pipeline with the same per-stage costs
    (:func:`_pipeline_key`; pipelines that share one list of stages are alike at once)."""
    first: dict[tuple, int] = {}
    by_stages: dict[tuple, int] = {}
    rep = []
    for d, pipe in enumerate(plan.pipelines):
        quick = (id(pipe.stages), pipe.micro_batch_size, pipe.num_microbatches)
        r = by_stages.get(quick)
        if r is None:
            r = by_stages[quick] = first.setdefault(_pipeline_key(pipe), d)
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
    """The sends of pipeline ``d`` over links across vendors, as ``T`` events: each forward
    sends to the next stage (the last stage's, interleaved, back to the first), each backward to
    the previous one, when its compute ends (``evs``: the pipeline's recorded compute;
    ``given``: the seconds of one send per link where the caller gives them)."""
    p, v = plan.pipeline_model_parallel_size, plan.virtual_pipeline_size
    row = placement.nodes[d]
    links = placement.pipeline_links(d, v > 1)
    staged = {e: placement.host_staged(row[e], row[(e + 1) % p]) for e in range(len(links))}
    if not any(staged.values()):
        return []
    pipe = plan.pipelines[d]
    out = []
    for stage, kind, mb, _, end, *chunk in evs:
        c = chunk[0] if chunk else 0
        if kind == "F" and not (stage == p - 1 and c == v - 1):
            edge = stage
        elif kind == "B" and not (stage == 0 and c == 0):
            edge = (stage - 1) % p
        else:
            continue
        if staged[edge]:
            seconds = given[edge] if given is not None else cost.p2p_seconds(
                pipe.micro_batch_size, links[edge], tp=plan.tensor_model_parallel_size,
                sp=plan.sequence_parallel)
            out.append(Event(d, stage, "T", mb, end, end + seconds, c, host_staged=True))
    return out


def host_memory(plan: Plan, cost: CostModel, placement) -> list[HostMemory]:
    """Host memory of every node ``plan`` uses in a group with ``host_memory_gb``: each
    (pipeline, stage) puts its ``tensor_model_parallel_size`` ranks on its node."""
    inv = cost.inventory
    caps = {gi: g.host_memory_gb for gi, g in enumerate(inv.groups) if g.host_memory_gb}
    if not caps:
        return []
    tp = plan.tensor_model_parallel_size
    used: dict = {}
    for d in range(plan.data_parallel_size):
        for s in range(plan.pipeline_model_parallel_size):
            node = placement.node(d, s)
            if node.group in caps:
                used[node] = used.get(node, 0.0) + tp * cost.host_bytes(StageShape.of(plan, d, s))
    return nodes_host_memory(used, cost)


def nodes_host_memory(used: Mapping, cost: CostModel) -> list[HostMemory]:
    """:class:`HostMemory` of each node in ``used`` (node -> bytes its ranks offload), in node
    order, with the cost model's host reserve added."""
    inv = cost.inventory
    caps = {gi: g.host_memory_gb for gi, g in enumerate(inv.groups) if g.host_memory_gb}
    out = []
    for node in sorted(used):
        hosts = inv.groups[node.group].hosts
        name = hosts[node.node] if hosts else f"{inv.group_label(node.group)} node {node.node}"
        out.append(HostMemory(node=name, group=node.group, index=node.node,
                              used_bytes=used[node] + cost.host_reserve_bytes,
                              capacity_bytes=caps[node.group] * 1e9))
    return out


RECORD_MOST = 2_000_000
"""The most compute ops a timeline records (:func:`check_recordable`): a few hundred megabytes
of events, far more than a picture shows."""


def recorded_ops(plan: Plan) -> int:
    """The compute ops a recorded step of ``plan`` holds: a forward and a backward of every
    micro-batch on every stage and chunk."""
    p, v = plan.pipeline_model_parallel_size, plan.virtual_pipeline_size
    return sum(2 * p * v * pipe.num_microbatches for pipe in plan.pipelines)


def check_recordable(ops: int) -> None:
    """Refuse, with one line, a timeline of more than :data:`RECORD_MOST` compute ops (whose
    events would take minutes and gigabytes to record: a global batch of 10^6 or more)."""
    if ops > RECORD_MOST:
        raise HeteroError(f"--timeline: a step of {ops:,} forwards and backwards to draw; "
                          f"expected at most {RECORD_MOST:,} (a smaller --global-batch-size, "
                          "or no --timeline)")


def simulate(plan: Plan, cost: CostModel, *, record_events: bool = True,
             pipeline_sends: Mapping[int, Sequence[float]] | None = None) -> SimResult:
    """Simulate one training step of ``plan`` under ``cost``. ``pipeline_sends``: for the
    pipelines it names, the seconds of one send over each link between consecutive stages (and,
    interleaved, from the last stage back to the first) instead of the placed link's (the
    rehearsal's emulated links)."""
    pipeline_sends = pipeline_sends or {}
    if record_events:
        check_recordable(recorded_ops(plan))
    placement = cost.placement(plan)
    p, D = plan.pipeline_model_parallel_size, plan.data_parallel_size
    pipes = plan.pipelines
    # pipelines alike in every stage share their costs (large pools repeat one template)
    rep = _representatives(plan)
    shapes = {r: [StageShape.of(plan, r, s) for s in range(p)] for r in set(rep)}
    times_of = {r: [cost.chunk_times(shape) for shape in row] for r, row in shapes.items()}
    memory_of = {r: [cost.memory(shape) for shape in row] for r, row in shapes.items()}
    sums = {r: [(sum(c.forward_s for c in row), sum(c.backward_s for c in row)) for row in rows]
            for r, rows in times_of.items()}
    times = [times_of[r] for r in rep]
    cache: dict[tuple, tuple] = {}
    runs = [_run_pipeline(plan, cost, placement, times, d, rep[d], cache, record_events,
                          None if d not in pipeline_sends else tuple(pipeline_sends[d]))
            for d in range(D)]
    events: list[Event] = []
    stage_end: list[list[float]] = [[0.0] * p for _ in range(D)]
    sync_of: list[list[float]] = [[0.0] * p for _ in range(D)]
    v = plan.virtual_pipeline_size
    for s in range(p):
        shape = shapes[rep[0]][s]
        params = cost.stage_params(shape)
        bw = placement.stage_bandwidth(s)
        comm = cost.dp_sync_seconds(params, D, bw)
        staged = record_events and placement.stage_host_staged(s)
        finish = max(runs[d][0][s] for d in range(D))
        if plan.overlap_grad_reduce or cost.overlap_grad_reduce:
            # each model chunk's buckets go once its last backward starts on every replica,
            # one after another on the data-parallel link
            if v == 1:
                parts = [(max(runs[d][2][s] for d in range(D)), comm)]
            else:
                parts = sorted((max(runs[d][2][s][c] for d in range(D)),
                                cost.dp_sync_seconds(cost.chunk_params(shape, c), D, bw))
                               for c in range(v))
            start = end = parts[0][0]
            for ready, seconds in parts:
                end = max(end, ready) + seconds
            sync_end = max(finish, end)
        else:
            start, sync_end = finish, finish + comm
        opts: dict[tuple, float] = {}
        for d in range(D):
            st = pipes[d].stages[s]
            key = (st.device_type, st.offload.optimizer_fraction)
            opt = opts.get(key)
            if opt is None:
                opt = opts[key] = cost.optimizer_seconds(shapes[rep[d]][s])
            stage_end[d][s] = sync_end + opt
            sync_of[d][s] = (sync_end - max(start, runs[d][0][s])) + opt
            if record_events:
                if comm:
                    events.append(Event(d, s, "S", -1, sync_end - comm, sync_end,
                                        host_staged=staged))
                events.append(Event(d, s, "O", -1, sync_end, sync_end + opt))
    step = max(max(row) for row in stage_end)
    stages: list[StageResult] = []
    fits = all(mem.fits for row in memory_of.values() for mem in row)
    for d in range(D):
        finish, busy, _, evs = runs[d]
        if record_events:
            events.extend(Event(d, *ev) for ev in evs)
            events.extend(_host_sends(plan, cost, placement, d, evs, pipeline_sends.get(d)))
        for s, st in enumerate(plan.pipelines[d].stages):
            mem = memory_of[rep[d]][s]
            bubble = finish[s] - busy[s]
            stages.append(StageResult(
                pipeline=d, stage=s, device_type=st.device_type, num_layers=st.num_layers,
                forward_s=sums[rep[d]][s][0], backward_s=sums[rep[d]][s][1], busy_s=busy[s],
                bubble_s=bubble,
                sync_s=sync_of[d][s], idle_s=max(0.0, step - busy[s] - bubble - sync_of[d][s]),
                memory=mem))
    return step_result(plan, cost, step=step, stages=stages, events=events,
                       hosts=host_memory(plan, cost, placement), fits=fits)


def step_result(plan: Plan, cost: CostModel, *, step: float, stages: list, events: list,
                hosts: list, fits: bool) -> SimResult:
    """The :class:`SimResult` of a simulated step (both simulators end here): throughput and MFU
    from the plan's model and GPUs, the memory verdict with the hosts', events in stage order."""
    flops = step_model_flops(plan.model, plan.global_batch_size)
    peak = sum(n * cost.peak_flops(t) for t, n in plan.device_counts().items())
    tokens = plan.global_batch_size * plan.model.seq_length
    events.sort(key=lambda e: (e.pipeline, e.stage, e.start))
    return SimResult(step_time_s=step, stages=stages, tokens_per_s=tokens / step, model_flops=flops,
                     mfu=flops / step / peak, fits_memory=fits and all(h.fits for h in hosts),
                     events=events, host_nodes=hosts)
