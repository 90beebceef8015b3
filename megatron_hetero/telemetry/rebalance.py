"""Live rebalancing of the replicas' micro-batch shares (``--hetero-rebalance``): the decision.

With per-token loss, uneven data parallelism is exact whatever the shares, so shares may move
between global batches without changing the mathematics. At every report the collector hands
the step's record here:

- Each replica's measured pipeline time is priced as 1F1B runs it: its slowest stage's compute
  per micro-batch ``c`` for every micro-batch, plus the other stages' compute of one micro-batch
  (the fill and drain), ``T = sum_s c_s + (m - 1) max_s c_s``. Its *drift* is ``T`` over what
  the current shares expect of it, over the median of that ratio across replicas. What they
  expect is the plan's prediction until the first split decision, then the measured costs that
  decision rested on: a replica that was slow when its shares were cut is not drifting while
  it stays as slow, and one that speeds up again (or another that slows) drifts anew.
- A replica that drifts beyond ``threshold`` either way on ``patience`` reports in a row
  triggers a new split: the tuner's own min-max assignment
  (:func:`megatron_hetero.schedule.shares.fill_shares`) of the global batch's micro-batches
  under the plan's rules (:func:`share_rules`: an interleaved plan's whole micro-batch groups,
  an expert-parallel group's replicas on one count),
  each replica's fixed part and per-micro-batch part the median of those ``patience`` reports
  (one noisy report does not decide). Where no split beats the current one by ``min_gain``,
  nothing changes.
- Where one stage is slow in every replica (its measured over predicted compute beyond
  ``threshold`` times the job's median, on every replica), shares cannot restore balance: the
  decision says so and suggests re-planning from the run (``tune --from-run``).

Shares change for one-grid plans whose replicas share a micro-batch size (the global batch is
then a number of micro-batches); layers never move live.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from ..errors import HeteroError
from ..plan import Plan
from ..plan.format1 import replace_grid
from ..schedule.shares import fill_shares
from ..schedule.split import min_max_split
from .records import RebalanceNote, StepRecord

__all__ = ["RebalancePolicy", "Decision", "Rebalancer", "check_rebalanceable", "replica_costs",
           "share_rules", "with_shares"]


@dataclass(kw_only=True, slots=True)
class RebalancePolicy:
    """When to move shares."""

    threshold: float = 1.15
    """A replica drifts when its measured over predicted time exceeds the replicas' median of
    that ratio by more than this factor."""
    patience: int = 2
    """Reports in a row a replica must drift before its shares move."""
    relayer_gain: float = 1.10
    """A decision also says what moving layers would give (a re-plan: layers never move live)
    where that beats the best share split by more than this factor."""
    min_gain: float = 1.05
    """A new split moves only when it shortens the slowest replica's measured time by at least
    this factor: near-equal splits do not swap back and forth on measurement noise."""

    def __post_init__(self) -> None:
        if not 1.0 < self.threshold <= 100.0:
            raise HeteroError(f"--hetero-rebalance-threshold: found {self.threshold}; expected a "
                              "ratio above 1 and at most 100")
        if not 1.0 <= self.min_gain <= 100.0:
            raise HeteroError(f"rebalancing's min_gain: found {self.min_gain}; expected a "
                              "factor from 1 to 100")
        if not 1.0 <= self.relayer_gain <= 100.0:
            raise HeteroError(f"rebalancing's relayer_gain: found {self.relayer_gain}; expected "
                              "a factor from 1 to 100")
        if not 1 <= self.patience <= 1000:
            raise HeteroError(f"--hetero-rebalance-patience: found {self.patience}; expected a "
                              "number of reports from 1 to 1000")


@dataclass(kw_only=True, slots=True)
class Decision:
    """What one report decided."""

    shares: list[int] | None = None
    """The replicas' new micro-batch counts, or None: no change."""
    message: str = ""
    """What was decided and why (logged and written to the telemetry); empty: nothing to say."""


def check_rebalanceable(plan: Plan, *, source: str) -> None:
    """Refuse, at start, a plan whose shares cannot move live."""
    if not plan.one_grid:
        raise HeteroError(f"{source}: --hetero-rebalance moves shares between the replicas of "
                          "one grid; this plan is a chain of meshes")
    sizes = {p.micro_batch_size for p in plan.pipelines}
    if len(sizes) > 1:
        raise HeteroError(f"{source}: --hetero-rebalance needs one micro-batch size in every "
                          f"replica (found {sorted(sizes)}): shares move by whole micro-batches")
    if plan.data_parallel_size < 2:
        raise HeteroError(f"{source}: --hetero-rebalance needs at least two replicas")
    unit, alike = share_rules(plan)
    total = sum(p.num_microbatches for p in plan.pipelines)
    if alike == 0 or total % (unit * alike) or plan.data_parallel_size == alike:
        raise HeteroError(f"{source}: --hetero-rebalance moves whole micro-batch groups of "
                          f"{unit} between expert-parallel groups of "
                          f"{alike or 'uneven numbers of'} replicas; this plan's {total} "
                          f"micro-batches over {plan.data_parallel_size} replicas leave no "
                          "such move")


def share_rules(plan: Plan) -> tuple[int, int]:
    """How a one-grid plan's shares may move: (unit, alike). Shares move in whole ``unit``s of
    micro-batches (an interleaved plan's micro-batch group, else 1), and every run of ``alike``
    consecutive replicas (one expert-parallel group's, whose all-to-alls pair up) keeps one
    count; ``alike`` 0 where the expert groups do not split the replicas into equal runs."""
    mesh = plan.meshes[0]
    unit = plan.microbatch_group if plan.virtual_pipeline_size > 1 else 1
    blocks = mesh.expert_blocks()
    if all(len(b) == 1 for b in blocks):  # each group inside one replica's tensor ranks
        return unit, 1
    n = len(blocks[0])
    return unit, (n if blocks == [range(i, i + n) for i in range(0, plan.data_parallel_size, n)]
                  else 0)


def _per_micro_batch(record: StepRecord, *, predicted: bool) -> dict[int, list[float]]:
    """Per replica, each stage's compute of one micro-batch (measured or predicted)."""
    out: dict[int, list[tuple[int, float]]] = {}
    for s in record.stages:
        f = s.predicted if predicted else s.measured
        if f is None:
            raise HeteroError("telemetry: no prediction to rebalance against")
        out.setdefault(s.replica, []).append((s.stage, f.compute_s / s.micro_batches))
    return {r: [c for _, c in sorted(rows)] for r, rows in out.items()}


def replica_costs(record: StepRecord, *, predicted: bool = False) -> list[tuple[float, float]]:
    """Per replica: (fixed seconds, seconds per micro-batch) of its pipeline under 1F1B, as
    measured (or predicted): the fill and drain of one micro-batch through the other stages,
    and the slowest stage's compute per micro-batch."""
    return _pipeline_costs(_per_micro_batch(record, predicted=predicted))


def _pipeline_costs(per: dict[int, list[float]]) -> list[tuple[float, float]]:
    return [(sum(c) - max(c), max(c)) for _, c in sorted(per.items())]


def _median_stages(window: list[dict[int, list[float]]]) -> dict[int, list[float]]:
    """Each replica's stages' compute per micro-batch, the median over the reports of
    ``window``."""
    return {r: [statistics.median(w[r][s] for w in window) for s in range(len(stages))]
            for r, stages in window[-1].items()}


def _relayered(plan: Plan, stages: dict[int, list[float]]) -> dict[int, list[float]]:
    """Each replica's stages' compute per micro-batch had its layers been split anew by the
    tuner's split (:func:`~megatron_hetero.schedule.split.min_max_split`) at each stage's measured
    compute per layer: what re-planning from the run could move that shares cannot."""
    out = {}
    for r, costs in stages.items():
        layers = [st.num_layers for st in plan.pipelines[r].stages]
        total = sum(layers)
        per_layer = np.array([c / max(n, 1) for c, n in zip(costs, layers)])
        table = per_layer[:, None] * np.arange(total + 1)[None, :]
        found = min_max_split(table, total)
        out[r] = costs if found is None else [float(x) for x in per_layer * found[1]]
    return out


@dataclass(kw_only=True, slots=True)
class Rebalancer:
    """The decisions of one run (rank 0 keeps it)."""

    policy: RebalancePolicy
    drifting: dict[int, int] = field(default_factory=dict)
    """Replica -> reports in a row it drifted."""
    said: str = ""
    """The last message that moved nothing (said once, not at every report)."""
    expected: list[tuple[float, float]] | None = None
    """Per replica, the (fixed, per micro-batch) costs the current shares rest on: None until
    the first split decision (the plan's prediction), then the measured costs it used."""
    recent: list[dict[int, list[float]]] = field(default_factory=list)
    """Each replica's stages' measured compute per micro-batch at the last ``patience``
    reports, oldest first."""

    def decide(self, plan: Plan, record: StepRecord) -> Decision:
        counts = [p.num_microbatches for p in plan.pipelines]
        stages_now = _per_micro_batch(record, predicted=False)
        measured = _pipeline_costs(stages_now)
        expected = self.expected or replica_costs(record, predicted=True)
        times = [a + m * c for (a, c), m in zip(measured, counts)]
        ratios = [t / (a + m * c) for t, (a, c), m in zip(times, expected, counts)]
        median = statistics.median(ratios)
        limit = self.policy.threshold
        for r, x in enumerate(ratios):
            drifts = x / median > limit or median / x > limit
            self.drifting[r] = self.drifting.get(r, 0) + 1 if drifts else 0
        self.recent = [*self.recent, stages_now][-self.policy.patience:]
        ready = sorted((r for r, n in self.drifting.items() if n >= self.policy.patience),
                       key=lambda r: -ratios[r])  # named: the slowest
        if not ready:
            return self._once(self._everywhere(record, median, limit))
        stages = _median_stages(self.recent)
        costs = _pipeline_costs(stages)
        unit, alike = share_rules(plan)
        fill = partial(fill_shares, total=sum(counts), unit=unit, alike=alike)
        shares = fill([a for a, _ in costs], [c for _, c in costs])
        self.drifting.clear()
        self.expected, self.recent = costs, []
        before = max(a + m * c for (a, c), m in zip(costs, counts))
        after = None if shares is None else max(a + m * c for (a, c), m in zip(costs, shares))
        advice = self._layers_advice(plan, stages, fill, before if after is None else
                                     min(before, after))
        if shares is None or shares == counts or before < self.policy.min_gain * after:
            return self._once(f"replica {ready[0]} drifts, and no other split of the "
                              f"{sum(counts)} micro-batches is {self.policy.min_gain:g}x faster: "
                              f"shares stay {counts}{advice}")
        self.said = ""
        return Decision(shares=shares,
                        message=f"replica {ready[0]} drifts {ratios[ready[0]] / median:.2f}x the "
                                f"replicas' median for {self.policy.patience} report(s): shares "
                                f"{counts} -> {shares} (slowest replica {before:.3g} s -> "
                                f"{after:.3g} s as measured){advice}")

    def _layers_advice(self, plan: Plan, stages: dict[int, list[float]], fill,
                       best: float) -> str:
        """Where moving layers too would beat the best share split (``best`` seconds) by more
        than ``policy.relayer_gain``: what it would give, and how to get it (layers never move
        live); else ''."""
        if plan.pipeline_model_parallel_size < 2:
            return ""
        costs = _pipeline_costs(_relayered(plan, stages))
        split = fill([a for a, _ in costs], [c for _, c in costs])
        if split is None:
            return ""
        moved = max(a + m * c for (a, c), m in zip(costs, split))
        if best <= self.policy.relayer_gain * moved:
            return ""
        return (f"; moving layers as well (each replica's layers split anew at its stages' "
                f"measured cost per layer, memory permitting) would make it {moved:.3g} s, "
                f"{best / moved:.2f}x faster than shares alone: layers do not move live; "
                "re-plan from what ran (megatron-hetero tune INVENTORY --from-run DIR) and "
                "resume from a checkpoint under the new plan")

    def note(self, plan: Plan, record: StepRecord, *, lookahead: int = 0) -> RebalanceNote | None:
        """The decision at this report as the telemetry writes it (None: nothing to say): new
        shares run from step ``record.step + 1 + lookahead`` (``lookahead``: global batches the
        data loader may have started beyond the next)."""
        decision = self.decide(plan, record)
        if decision.shares is None:
            return RebalanceNote(message=decision.message) if decision.message else None
        return RebalanceNote(message=decision.message, shares=decision.shares,
                             from_step=record.step + 1 + lookahead)

    def _once(self, message: str) -> Decision:
        if message == self.said:
            return Decision()
        self.said = message
        return Decision(message=message)

    @staticmethod
    def _everywhere(record: StepRecord, median_replica: float, limit: float) -> str:
        """A stage slow in every replica, which shares cannot help, or ''."""
        by_stage: dict[int, list[float]] = {}
        for s in record.stages:
            if s.predicted is not None and s.predicted.compute_s > 0:
                by_stage.setdefault(s.stage, []).append(s.measured.compute_s / s.predicted.compute_s)
        if len(by_stage) < 2:
            return ""
        median = statistics.median(x for xs in by_stage.values() for x in xs)
        slow = [st for st, xs in sorted(by_stage.items()) if min(xs) / median > limit]
        if not slow:
            return ""
        return (f"stage {slow[0]} is slow in every replica ({min(by_stage[slow[0]]) / median:.2f}x "
                "the job's median or more): moving shares between replicas cannot restore the "
                "balance; re-plan from what ran: megatron-hetero tune INVENTORY --from-run DIR")


def with_shares(plan: Plan, shares: list[int], *, source: str) -> Plan:
    """``plan`` with replica ``d`` running ``shares[d]`` micro-batches, checked as a plan file
    is (a warm-up or micro-batch group the new counts cannot hold is refused here)."""
    if len(shares) != plan.data_parallel_size or sum(shares) != sum(
            p.num_microbatches for p in plan.pipelines):
        raise HeteroError(f"{source}: shares {shares} do not split the plan's micro-batches")
    return replace_grid(plan, pipelines=[replace(p, num_microbatches=m)
                                         for p, m in zip(plan.pipelines, shares)])
