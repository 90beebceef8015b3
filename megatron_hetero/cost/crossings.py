"""Where a plan crosses vendors: its pipeline edges and data-parallel groups on the host path
(:mod:`.host_path`), and what each costs per step.

A tensor-parallel group never crosses: it is one stage's ranks, of one device type, inside one
node (:func:`.placement.place`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan
from .model import CostModel
from .stage import StageShape

__all__ = ["Crossing", "vendor_crossings", "host_staged_seconds"]


@dataclass(kw_only=True, slots=True, frozen=True)
class Crossing:
    """One pipeline edge, or one data-parallel group, whose ranks are of two vendors."""

    kind: str
    """``pipeline edge`` or ``data-parallel group``."""
    where: str
    """``pipelines[d] stages s->s+1`` or ``stage s`` (the group of every pipeline's stage s)."""
    vendors: tuple[str, ...]
    bandwidth_gb_s: float
    """The host path's rate (for a group, the ring rate of :meth:`HostPath.ring_gb_s`)."""
    seconds_per_step: float
    """Link time per step: every send of the edge (activations forward, gradients back), or
    the group's gradient sync."""

    def to_dict(self) -> dict:
        return {"kind": self.kind, "where": self.where, "vendors": list(self.vendors),
                "bandwidth_gb_s": self.bandwidth_gb_s, "seconds_per_step": self.seconds_per_step}


def vendor_crossings(plan: Plan, cost: CostModel) -> list[Crossing]:
    """Every pipeline edge and data-parallel group of ``plan`` that crosses vendors on
    ``cost``'s inventory (empty for a one-vendor pool)."""
    placement = cost.placement(plan)
    inv = cost.inventory
    v = plan.virtual_pipeline_size
    tp, sp = plan.tensor_model_parallel_size, plan.sequence_parallel
    p = plan.pipeline_model_parallel_size
    out = []
    for d, pipe in enumerate(plan.pipelines):
        row = placement.row(0, d)
        bws = placement.path_links(0, d, v > 1)
        for s, bw in enumerate(bws):
            a, b = row[s], row[(s + 1) % p]
            if not placement.host_staged(a, b):
                continue
            sends = 2 * pipe.num_microbatches * (v if s < p - 1 else v - 1)
            out.append(Crossing(
                kind="pipeline edge", where=f"pipelines[{d}] stages {s}->{(s + 1) % p}",
                vendors=(inv.vendor(a.group), inv.vendor(b.group)), bandwidth_gb_s=bw,
                seconds_per_step=sends * cost.p2p_seconds(pipe.micro_batch_size, bw, tp=tp, sp=sp)))
    D = plan.data_parallel_size
    for s in range(p):
        if not placement.dp_host_staged(0, s):
            continue
        bw = placement.dp_bandwidth(0, s)
        params = cost.stage_params(StageShape.of(plan, 0, s))
        vendors = sorted({inv.vendor(n.group) for n in placement.nodes[0][s]})
        out.append(Crossing(kind="data-parallel group", where=f"stage {s}", vendors=tuple(vendors),
                            bandwidth_gb_s=bw, seconds_per_step=cost.dp_sync_seconds(params, D, bw)))
    return out


def host_staged_seconds(crossings: list[Crossing]) -> float:
    """Seconds per step the busiest host-staged links are busy: the slowest pipeline edge's
    sends plus the slowest cross-vendor gradient sync (edges run side by side, the syncs after
    the pipelines). Sends overlap compute where the schedule allows, so this bounds what the
    host path adds to the step."""
    edges = [c.seconds_per_step for c in crossings if c.kind == "pipeline edge"]
    groups = [c.seconds_per_step for c in crossings if c.kind == "data-parallel group"]
    return max(edges, default=0.0) + max(groups, default=0.0)
