"""What this machine can host: how many CPU ranks, their memory, the time scale its cores need."""

from __future__ import annotations

import os

from ..errors import HeteroError
from ..hardware.catalog import Catalog
from ..plan import Plan

__all__ = ["MAX_RANKS", "RANK_OVERHEAD_BYTES", "check_rank_count", "check_host_capacity",
           "auto_time_scale"]

MAX_RANKS = 16
"""Most CPU ranks a rehearsal starts on one machine."""
RANK_OVERHEAD_BYTES = 0.6e9
"""Host memory of one rank before its model: Python, torch, megatron-core, gloo."""


def _available_bytes() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


_HINT = ("rehearse a smaller plan (fewer pipelines or stages: the layer split and micro-batch "
         "shares are what the rehearsal checks), or a lower --hidden-size")


def check_rank_count(plan: Plan, *, max_ranks: int = MAX_RANKS, source: str = "PLAN") -> None:
    """Refuse a plan of more ranks than a rehearsal starts: no torch needed, so ``rehearse``
    says it at once, before it imports megatron-core."""
    n = plan.world_size
    if n > max_ranks:
        raise HeteroError(f"{source}: the plan has {n} ranks; this rehearsal starts at most "
                          f"{max_ranks} CPU processes on one machine: {_HINT}")


def check_host_capacity(shrunk: Plan, *, max_ranks: int = MAX_RANKS, source: str = "PLAN",
                        catalog: Catalog | None = None) -> float:
    """Refuse a plan this machine cannot host; returns the estimated host bytes."""
    from .memory import cpu_rank_bytes

    check_rank_count(shrunk, max_ranks=max_ranks, source=source)
    n = shrunk.world_size
    hint = _HINT
    need = n * RANK_OVERHEAD_BYTES + sum(cpu_rank_bytes(shrunk, catalog).values())
    have = _available_bytes()
    if need > have:
        raise HeteroError(f"{source}: rehearsing {n} ranks at hidden size "
                          f"{shrunk.model.hidden_size} needs about {need / 1e9:.1f} GB of host "
                          f"memory; {have / 1e9:.1f} GB is available: {hint}")
    return need


def auto_time_scale(plan: Plan, slowdowns: dict[str, float], *, utilization: float = 0.7) -> float:
    """The smallest extra slowdown (>= 1) at which the ranks' compute, each busy 1/factor of the
    time at most, asks for no more than ``utilization`` of this machine's cores."""
    demand = sum(1.0 / slowdowns[plan.device_type_of_rank(r)] for r in range(plan.world_size))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1.0, round(demand / (utilization * (cores or 1)), 2))
