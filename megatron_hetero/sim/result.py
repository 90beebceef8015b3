"""What a simulated step gives: :class:`SimResult` (the step time, throughput, MFU and memory
verdict), a :class:`StageResult` per (replica, stage), the recorded :class:`Event` intervals (and
their Gantt chart) and the :class:`HostMemory` of nodes with ``host_memory_gb``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..cost.model import CostModel
from ..cost.stage import Memory
from ..models import step_model_flops
from ..plan import Plan

__all__ = ["SimResult", "StageResult", "HostMemory", "Event", "nodes_host_memory", "step_result"]


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


def step_result(plan: Plan, cost: CostModel, *, step: float, stages: list, events: list,
                hosts: list, fits: bool) -> SimResult:
    """The :class:`SimResult` of a simulated step (:func:`.step.simulate` ends here): throughput and MFU
    from the plan's model and GPUs, the memory verdict with the hosts', events in stage order."""
    flops = step_model_flops(plan.model, plan.global_batch_size)
    peak = sum(n * cost.peak_flops(t) for t, n in plan.device_counts().items())
    tokens = plan.global_batch_size * plan.model.seq_length
    events.sort(key=lambda e: (e.pipeline, e.stage, e.start))
    return SimResult(step_time_s=step, stages=stages, tokens_per_s=tokens / step, model_flops=flops,
                     mfu=flops / step / peak, fits_memory=fits and all(h.fits for h in hosts),
                     events=events, host_nodes=hosts)
