"""The heterogeneity-aware 1F1B: per-stage warm-up counts that hide slow links (Harp).

Megatron's 1F1B warms stage ``s`` of ``p`` up with ``p - s - 1`` forwards. Harp gives each
stage its own count: the last stage none, every earlier one its successor's plus ``δ``, with
``δ`` = 1 inside a group of fast links and up to 3 across a slow link, so that forwards in
flight cover the time a gradient takes to come back over it. Each extra forward holds one more
micro-batch of activations (:attr:`~megatron_hetero.cost.stage.StageShape.in_flight`).

:func:`best_warmups` weighs, for a tuned non-interleaved plan, every ``δ`` in 1..3 at the
(up to three) pipeline boundaries whose sends take longest, where those sends are worth hiding
(at least :data:`SLOW_LINK_SHARE` of the slowest stage's forward and backward); each choice
must fit memory on every stage, and the fastest in the simulator wins over Megatron's counts
when it is faster at all.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

from ..cost.model import CostModel
from ..plan import Plan, replace_grid
from ..schedule.rules import megatron_warmup
from ..sim.step import SimResult, simulate
from .problem import Problem
from .refine import climb

__all__ = ["SLOW_LINK_SHARE", "WarmupChoice", "best_warmups", "harp_warmups", "slow_boundaries",
           "warmups_or_flat", "with_warmups", "FLAT_WARMUP_CANDIDATES"]

SLOW_LINK_SHARE = 0.1
"""A boundary's warm-up is weighed when one send over it takes at least this share of the
slowest stage's forward plus backward of a micro-batch."""

FLAT_WARMUP_CANDIDATES = 2
"""Non-interleaved plans given warm-ups where the best plan interleaves: the fastest under
Megatron's 1F1B is not always the fastest once warm-ups hide its slow link (two plans a few
tenths of a percent apart under 1F1B can differ by percents with warm-ups)."""

_MOST_BOUNDARIES = 3
_DELTAS = (1, 2, 3)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WarmupChoice:
    """What :func:`best_warmups` found."""

    plan: Plan
    """The plan with the chosen warm-ups (the plan given when Megatron's counts are best)."""
    sim: SimResult
    megatron_step_time_s: float
    """The same plan under Megatron's 1F1B."""
    candidates: int
    """Warm-up choices simulated."""

    @property
    def gain(self) -> float:
        """Megatron's 1F1B step over the chosen one's (1.0: no gain)."""
        return self.megatron_step_time_s / self.sim.step_time_s


def best_warmups(plan: Plan, sim: SimResult, cost: CostModel) -> WarmupChoice:
    """``plan`` (simulated as ``sim``, with Megatron's warm-ups) with the fastest per-stage
    warm-ups that fit (see the module docstring)."""
    best = WarmupChoice(plan=plan, sim=sim, megatron_step_time_s=sim.step_time_s, candidates=0)
    p = plan.pipeline_model_parallel_size
    if plan.virtual_pipeline_size > 1 or p == 1:
        return best
    slow = slow_boundaries(plan, sim, cost)
    count = 0
    for deltas in itertools.product(_DELTAS, repeat=len(slow)):
        if all(d == 1 for d in deltas):
            continue  # Megatron's counts
        step = dict(zip(slow, deltas))
        cand = with_warmups(plan, [step.get(s, 1) for s in range(p - 1)])
        if not all(cost.stage_memory(cand, d, s).fits for d in range(plan.data_parallel_size)
                   for s in range(p)):
            continue  # more in flight than the cards hold
        count += 1
        got = simulate(cand, cost, record_events=False)
        if got.fits_memory and got.step_time_s < best.sim.step_time_s * (1 - 1e-9):
            best = dataclasses.replace(best, plan=cand, sim=got)
    return dataclasses.replace(best, candidates=count)


def slow_boundaries(plan: Plan, sim: SimResult, cost: CostModel) -> list[int]:
    """The boundaries of non-interleaved ``plan`` (simulated as ``sim``) whose sends are worth
    hiding with more warm-up (at least :data:`SLOW_LINK_SHARE` of the slowest stage's forward
    plus backward; the slowest :data:`_MOST_BOUNDARIES`), in pipeline order; boundary ``s``
    lies between stages ``s`` and ``s + 1``."""
    return sorted(_send_seconds(plan, sim, cost)[0])


def harp_warmups(plan: Plan, sim: SimResult, cost: CostModel) -> Plan:
    """``plan`` (non-interleaved, simulated as ``sim``) with Harp's own rule for ``δ`` instead
    of a search: across a boundary whose send takes under a tenth of the slowest stage's
    forward plus backward 1, under half 2, else 3 (memory not checked; for comparison)."""
    _, worst, slowest = _send_seconds(plan, sim, cost)
    deltas = [1 if t < slowest / 10 else 2 if t < slowest / 2 else 3
              for _, t in sorted(worst.items())]
    return with_warmups(plan, deltas)


def _send_seconds(plan: Plan, sim: SimResult, cost: CostModel
                  ) -> tuple[list[int], dict[int, float], float]:
    """(the boundaries worth more warm-up, slowest first, at most :data:`_MOST_BOUNDARIES`;
    every boundary ``s``'s longest send over all pipelines; the slowest stage's forward plus
    backward of a micro-batch). Boundary ``s`` lies between stages ``s`` and ``s + 1``."""
    placement = cost.placement(plan)
    slowest = max(s.forward_s + s.backward_s for s in sim.stages)
    worst: dict[int, float] = {}
    for d, pipe in enumerate(plan.pipelines):
        for s, bw in enumerate(placement.path_links(0, d, False)):
            t = cost.p2p_seconds(pipe.micro_batch_size, bw, tp=plan.tensor_model_parallel_size,
                                 sp=plan.sequence_parallel)
            worst[s] = max(worst.get(s, 0.0), t)
    slow = sorted((s for s, t in worst.items() if t >= SLOW_LINK_SHARE * slowest),
                  key=lambda s: -worst[s])
    return slow[:_MOST_BOUNDARIES], worst, slowest


def with_warmups(plan: Plan, deltas: list[int]) -> Plan:
    """``plan`` with each stage warming up its successor's count plus ``deltas[s]`` (the last
    stage none), at most its pipeline's micro-batches; None (Megatron's) where that is
    Megatron's own count."""
    p = plan.pipeline_model_parallel_size
    pipelines = []
    for pipe in plan.pipelines:
        m = pipe.num_microbatches
        counts = [0] * p
        for s in range(p - 2, -1, -1):
            counts[s] = min(m, counts[s + 1] + deltas[s])
        stages = [dataclasses.replace(st, warmup_microbatches=(
                      None if w == megatron_warmup(p, s, m) else w))
                  for s, (st, w) in enumerate(zip(pipe.stages, counts))]
        pipelines.append(dataclasses.replace(pipe, stages=stages))
    return replace_grid(plan, pipelines=pipelines)


def warmups_or_flat(problem: Problem, best: tuple[Plan, SimResult],
                    flats: Callable[[], list[tuple[Plan, SimResult]]]
                    ) -> tuple[tuple[Plan, SimResult], float, int]:
    """``best`` with the per-stage warm-ups that beat Megatron's 1F1B on it; where ``best``
    interleaves, the fastest non-interleaved plans (``flats()``, asked only then: up to
    :data:`FLAT_WARMUP_CANDIDATES`), each with a link worth hiding given its warm-ups as it is
    and once climbed, win instead when faster (they can hide a slow link that Megatron's interleaved
    order, which keeps its own warm-ups, cannot). Returns (plan and simulation, the warm-ups'
    gain over Megatron's 1F1B on that plan, simulations the non-interleaved climbs ran)."""
    warm = best_warmups(*best, problem.cost(best[0].precision))
    if best[0].virtual_pipeline_size == 1:
        return (warm.plan, warm.sim), warm.gain, 0
    sims = 0
    for flat in flats():
        if not slow_boundaries(*flat, problem.cost(flat[0].precision)):
            continue  # no link worth hiding
        tried = [flat]
        if problem.opt.refine_rounds > 0:  # the climb speeds up 1F1B, not always warm-ups
            plan, sim, more = climb(problem, *flat, chunk_cap=1)
            tried, sims = tried + [(plan, sim)], sims + more
        for plan, sim in tried:
            other = best_warmups(plan, sim, problem.cost(plan.precision))
            if other.sim.step_time_s < warm.sim.step_time_s * (1 - 1e-9):
                warm = other
    return (warm.plan, warm.sim), warm.gain, sims
