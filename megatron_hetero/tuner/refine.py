"""Local search on the simulator around the best plan the structured search found.

The structured search (:mod:`.search`) ranks candidates by an estimate: stages balanced by a
dynamic program on per-stage times, chunks split evenly, micro-batches water-filled on the
estimate's fill and drain. The simulator sees what the estimate leaves out (the bubbles of
unequal chunks, where the fill and drain really fall, the overlapped gradient reduction), so
the last few percent are found by moving things one step at a time and keeping what the
simulator says is faster:

* a layer across each boundary of the model's sequence of virtual stages (chunk ``c`` of stage
  ``s`` is virtual stage ``c p + s``): between stages, and in effect between chunks;
* a layer between two chunks of one stage;
* the chunk count ``v`` (1 up to ``max_virtual_pipeline_size``, which the search sets above
  its own cap: :attr:`TuneOptions.refine_max_virtual_pipeline_size`), each stage's layers spread
  evenly, the remainder on the early or the late chunks; an end chunk may be left with just
  the embedding or the loss (which the structured search does not try);
* one unit of micro-batches (when interleaved ``p``, or the group the counts are whole groups
  of where ``p`` does not divide them; else 1) from the pipeline that finishes
  last to the one that finishes first;
* with interleaving, the micro-batch group (Megatron's
  ``--microbatch-group-size-per-virtual-pipeline-stage``, by default ``p``) to the next value
  below or above among :func:`group_choices` (those Megatron takes, up to ``2 p``): a larger
  group runs more forwards of one chunk before the next, which gives the later stages slack in
  the fill and drain and holds more micro-batches in flight (the memory policies see that).

The walk stops at a local optimum, and the landscape has many: which device type plays the
early stages changes where the fill and drain fall, and a better order often needs other
chunk counts and splits at once. So the search then climbs again from every other order of the
plan's runs of one device type along the pipeline (its GPUs keep their stages' types; layers
re-split by a min-max dynamic program on the new order, with the plan's chunk count or none),
where that start is within ``restart_margin`` of the best plan so far, and keeps the best.

After every move each (pipeline, stage) takes the cheapest memory policy that fits under the
exact memory model: the fewest layers of ``block`` recompute (or selective recompute where
attention is unfused), with or without the layers' module inputs offloaded to the host, with
part or all of the optimizer state offloaded where that is cheaper (:class:`_Policies`). Each
round simulates every move and keeps the best (best improvement); the walk stops at a local
optimum or after ``max_rounds``. It is deterministic: moves and restarts are generated in a
fixed order and ties keep the earlier one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from ..cost.model import CostModel
from ..cost.stage import StageShape
from ..errors import InfeasibleError, SchemaError
from ..plan import Pipeline, Plan, Stage, group_fits, uniform_plan
from ..schedule.rules import whole_group
from ..sim.step import SimResult, simulate
from .policy import Menu, Policy, cheapest_for_stage
from .problem import Problem, TuneOptions
from .experts import split_scale
from ..schedule.split import min_max_split
from .tables import even_chunks

__all__ = ["refine", "climb", "refine_chunk_cap", "Layout"]


@dataclass(frozen=True, slots=True)
class Layout:
    """What a move changes: layers per virtual stage (model order), chunks per stage, and the
    micro-batches of each pipeline."""

    seq: tuple[int, ...]
    v: int
    microbatches: tuple[int, ...]
    order: tuple[int, ...] | None = None
    """Stage ``s`` runs on the GPUs of the starting plan's stage ``order[s]`` (None: as there)."""
    group: int | None = None
    """The interleaved schedule's micro-batch group (None: Megatron's default, ``p``)."""

    def chunks(self, p: int, s: int) -> tuple[int, ...]:
        return tuple(self.seq[c * p + s] for c in range(self.v))

    def valid(self, p: int) -> bool:
        """Every virtual stage holds a layer but the two ends (embedding or loss only), and with
        ``v`` > 1 every pipeline's micro-batches form whole groups of ``p`` (or of the
        layout's group, which they must then fill) and take the micro-batch group
        (:func:`group_fits`)."""
        inner = self.seq[1:-1] if len(self.seq) > 1 else self.seq
        if min(inner, default=1) < 1 or min(self.seq) < 0:
            return False
        if self.v == 1 and (min(self.seq) < 1 or self.group is not None):
            return False
        if self.v > 1 and any(m % (self.group or p) and m % p for m in self.microbatches):
            return False
        if self.group is not None and not group_fits(self.group, p, self.microbatches):
            return False
        return min(self.microbatches) >= 1


def group_choices(p: int, microbatches) -> list[int]:
    """The micro-batch groups the tuner tries on ``p`` stages: those Megatron takes
    (:func:`group_fits`) from ``p`` up to ``2 p``. Past that every rank holds ``(v - 1)(g - p)``
    more micro-batches in flight for fill and drain slack it mostly has by then, and each new
    group costs the simulator a schedule order of its own."""
    return [g for g in range(p, 2 * p + 1) if group_fits(g, p, microbatches)]


def layout_of(plan: Plan) -> Layout:
    return Layout(tuple(plan.virtual_stage_layers), plan.virtual_pipeline_size,
                  tuple(pl.num_microbatches for pl in plan.pipelines),
                  group=plan.microbatch_group_size)


_UNSET = object()
"""Not in a memo (a memo's value may be None)."""


class _Policies:
    """The cheapest memory policy that fits each stage position of the plan's shape
    (:func:`.policy.cheapest_for_stage`, exact memory), remembered per position."""

    def __init__(self, cost: CostModel, plan: Plan, menu: Menu):
        self.cost, self.menu = cost, menu
        self.tp, self.p, self.D = plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size, \
            plan.data_parallel_size
        self.sp = plan.sequence_parallel and self.tp > 1
        grid = plan.meshes[0]
        self.experts = dict(expert_parallel_size=grid.expert_model_parallel_size,
                            expert_tensor_parallel_size=grid.expert_tensor_parallel_size)
        self._memo: dict[tuple, Policy | None] = {}

    def choose(self, gpu: str, chunks: tuple[int, ...], s: int, *, micro_batch_size: int,
               microbatches: int, group: int | None) -> Policy | None:
        group = group if len(chunks) > 1 else None
        key = (gpu, chunks, s, micro_batch_size, microbatches, group)  # all that varies
        got = self._memo.get(key, _UNSET)
        if got is _UNSET:
            shape = StageShape(device_type=gpu, chunk_layers=chunks,
                               micro_batch_size=micro_batch_size, tensor_parallel_size=self.tp,
                               sequence_parallel=self.sp, pipeline_size=self.p, stage=s,
                               num_microbatches=microbatches, microbatch_group=group,
                               data_parallel_size=self.D, **self.experts)
            got = self._memo[key] = cheapest_for_stage(self.cost, shape, self.menu)
        return got


def _build(plan: Plan, lay: Layout, policies: _Policies, *, share: bool = True) -> Plan | None:
    """``plan`` reshaped to ``lay``, every stage on its cheapest fitting policy (None: some
    stage fits under no policy, or Megatron could not run it). With ``share``, pipelines alike
    (device types, micro-batch size and count) share one list of stages: the search builds
    thousands of plans it only simulates."""
    p = plan.pipeline_model_parallel_size
    order = lay.order or range(p)
    built: dict[tuple, list[Stage]] = {}
    pipelines = []
    for d, pipe in enumerate(plan.pipelines):
        m = lay.microbatches[d]
        olds = [pipe.stages[o] for o in order]
        key = (tuple(st.device_type for st in olds), pipe.micro_batch_size, m)
        stages = built.get(key) if share else None
        if stages is None:
            stages = []
            for s, old in enumerate(olds):
                chunks = lay.chunks(p, s)
                pol = policies.choose(old.device_type, chunks, s,
                                      micro_batch_size=pipe.micro_batch_size, microbatches=m,
                                      group=lay.group)
                if pol is None:
                    return None
                stages.append(Stage(device_type=old.device_type, num_layers=sum(chunks),
                                    recompute=pol.recompute, offload=pol.offload,
                                    chunk_layers=list(chunks) if lay.v > 1 else None))
            built[key] = stages
        pipelines.append(Pipeline(micro_batch_size=pipe.micro_batch_size, num_microbatches=m,
                                  stages=stages))
    try:
        return uniform_plan(model=plan.model, global_batch_size=plan.global_batch_size,
                    tensor_model_parallel_size=plan.tensor_model_parallel_size, pipelines=pipelines,
                    precision=plan.precision, use_distributed_optimizer=plan.use_distributed_optimizer,
                    sequence_parallel=plan.sequence_parallel, virtual_pipeline_size=lay.v,
                    microbatch_group_size=lay.group, overlap_grad_reduce=plan.overlap_grad_reduce,
                    expert_model_parallel_size=plan.meshes[0].expert_model_parallel_size,
                    expert_tensor_parallel_size=plan.meshes[0].expert_tensor_parallel_size)
    except SchemaError:
        return None


def _spread(totals: list[int], v: int, early: bool) -> tuple[int, ...]:
    """Stage totals over ``v`` chunks each (:func:`.tables.even_chunks`); model order."""
    per = [even_chunks(n, v, early) for n in totals]
    return tuple(per[s][c] for c in range(v) for s in range(len(totals)))


def _regroup(mb: tuple[int, ...], unit: int) -> tuple[int, ...] | None:
    """Micro-batch counts rounded to multiples of ``unit`` with the same total (largest
    remainders first; None when the total is not a multiple)."""
    total = sum(mb)
    if total % unit:
        return None
    base = [m // unit for m in mb]
    left = total // unit - sum(base)
    order = sorted(range(len(mb)), key=lambda d: (-(mb[d] % unit), d))
    for d in order[:left]:
        base[d] += 1
    if min(base) < 1:
        return None
    return tuple(b * unit for b in base)


def _block_orders(types: tuple[str, ...]):
    """Stage orders that put the runs of one device type along the pipeline (``types``, the
    starting plan's stage types) in every other order, one per distinct sequence of types.
    Pipelines of more than four runs are left to the structured search (5! orders)."""
    blocks: list[list[int]] = []
    for s, t in enumerate(types):
        if blocks and types[blocks[-1][-1]] == t:
            blocks[-1].append(s)
        else:
            blocks.append([s])
    if len(blocks) > 4:
        return
    seen = {types}
    for perm in itertools.permutations(blocks):
        order = tuple(s for block in perm for s in block)
        key = tuple(types[s] for s in order)
        if key not in seen:
            seen.add(key)
            yield order


def _even_layouts(lay: Layout, p: int, chunk_counts, totals_for, order):
    """``lay`` at each of ``chunk_counts`` with stage totals ``totals_for(w, microbatches)``
    (None: skip) in stage order ``order``, each stage spread evenly over its chunks with the
    remainder late or early; the micro-batches regrouped into whole groups of ``p`` when
    interleaved (of :func:`~megatron_hetero.schedule.rules.whole_group`'s group, which the layout
    then takes, where ``p`` does not divide their total), keeping ``lay``'s micro-batch group
    where it still fits."""
    unit = whole_group(p, [sum(lay.microbatches)])
    for w in chunk_counts:
        mb = lay.microbatches if w == 1 else unit and _regroup(lay.microbatches, unit)
        totals = None if mb is None else totals_for(w, mb)
        if totals is None:
            continue
        group = (_kept_group(lay.group, p, mb) or (None if unit == p else unit)) if w > 1 else None
        for early in ((False, True) if w > 1 else (False,)):
            yield replace(lay, seq=_spread(totals, w, early), v=w, microbatches=mb, order=order,
                          group=group)


def _kept_group(g: int | None, p: int, microbatches) -> int | None:
    """``g`` where it fits ``microbatches`` (:func:`group_fits`), else Megatron's default."""
    return g if g is not None and group_fits(g, p, microbatches) else None


def _moves(lay: Layout, p: int, max_v: int, sim: SimResult):
    """Neighbouring layouts of ``lay``, in a fixed order."""
    seq, v = list(lay.seq), lay.v
    # a layer across each boundary of the virtual-stage sequence, then between two chunks of
    # one stage (``p`` apart in the sequence)
    shifts = [pair for i in range(len(seq) - 1) for pair in ((i, i + 1), (i + 1, i))]
    if v > 1 and p > 1:
        shifts += [(ca * p + s, cb * p + s) for s in range(p) for ca in range(v) for cb in range(v)
                   if ca != cb]
    for a, b in shifts:
        if seq[a] > 0:
            new = seq.copy()
            new[a] -= 1
            new[b] += 1
            yield replace(lay, seq=tuple(new))
    # the chunk count, each stage's layers spread evenly
    if p > 1:
        totals = [sum(lay.seq[c * p + s] for c in range(v)) for s in range(p)]
        yield from _even_layouts(lay, p, [w for w in range(1, max_v + 1) if w != v],
                                 lambda w, mb: totals, lay.order)
    # one unit of micro-batches from the pipeline that finishes last to the one first done
    D = len(lay.microbatches)
    if D > 1:
        unit = 1 if v == 1 else whole_group(p, lay.microbatches) or p
        finish = [max(r.busy_s + r.bubble_s for r in sim.stages if r.pipeline == d) for d in range(D)]
        late = max(range(D), key=lambda d: (finish[d], -d))
        early_d = min(range(D), key=lambda d: (finish[d], d))
        if late != early_d and lay.microbatches[late] > unit:
            mb = list(lay.microbatches)
            mb[late] -= unit
            mb[early_d] += unit
            yield replace(lay, microbatches=tuple(mb), group=_kept_group(lay.group, p, mb))
    # the next micro-batch group below and above the current one (:func:`group_choices`)
    if v > 1:
        g, choices = lay.group or p, group_choices(p, lay.microbatches)
        down = max((h for h in choices if h < g), default=None)
        up = min((h for h in choices if h > g), default=None)
        for h in (down, up):
            if h is not None:
                yield replace(lay, group=None if h == p else h)


class _Climb:
    """Hill climbs on the simulator over layouts of one starting plan, sharing what was seen."""

    def __init__(self, plan: Plan, cost: CostModel, policies: _Policies, max_v: int,
                 max_rounds: int):
        self.plan, self.cost, self.policies = plan, cost, policies
        self.max_v, self.max_rounds = max_v, max_rounds
        self.p = plan.pipeline_model_parallel_size
        self.seen: set[Layout] = set()
        self.sims = 0
        # layouts simulated: to the end, or until sure not to beat the climb's best

    def evaluate(self, lay: Layout, beat: float | None = None) -> tuple[Plan, SimResult] | None:
        """``lay`` built and simulated (None: seen before, invalid, or it does not fit). With
        ``beat``, a layout whose step is sure not to be below ``beat`` seconds is not simulated
        to its end (None; :func:`~megatron_hetero.sim.step.simulate`'s ``faster_than``): the
        climb would not take it, and having seen it never looks at it again, as when it is
        simulated to the end. Both count in :attr:`sims`."""
        if lay in self.seen or not lay.valid(self.p):
            return None
        self.seen.add(lay)
        new = _build(self.plan, lay, self.policies)
        if new is None:
            return None
        try:
            got = simulate(new, self.cost, record_events=False, faster_than=beat)
        except InfeasibleError:
            return None
        self.sims += 1
        if got is None:  # sure not to beat ``beat``: cut short
            return None
        return (new, got) if got.fits_memory else None

    def climb(self, lay: Layout, plan: Plan, sim: SimResult) -> tuple[Layout, Plan, SimResult]:
        """Best-improvement moves from ``lay`` until none is faster or the rounds run out."""
        self.seen.add(lay)
        for _ in range(self.max_rounds):
            winner = None
            for cand in _moves(lay, self.p, max(self.max_v, lay.v), sim):
                ref = winner[2] if winner else sim
                got = self.evaluate(cand, beat=ref.step_time_s * (1 - 1e-9))
                if got is not None and got[1].step_time_s < ref.step_time_s * (1 - 1e-9):
                    winner = (cand, *got)
            if winner is None:
                break
            lay, plan, sim = winner
        return lay, plan, sim


def _balanced_totals(plan: Plan, cost: CostModel, order: tuple[int, ...], v: int,
                     microbatches: tuple[int, ...]) -> list[int] | None:
    """Layers per stage for the stage order ``order`` of ``plan``: the split that minimises the
    slowest stage (:func:`.split.min_max_split`), each stage's time its pipeline's
    ``microbatches`` times its forward and backward without recompute, the embedding and the
    output layer on the ends."""
    p, L = plan.pipeline_model_parallel_size, plan.model.num_layers
    tp = plan.tensor_model_parallel_size
    costs = np.zeros((p, L + 1))
    kinds = {(tuple(pipe.stages[o].device_type for o in order), pipe.micro_batch_size, m)
             for pipe, m in zip(plan.pipelines, microbatches)}
    for gpus, mbs, m in sorted(kinds):
        for s, gpu in enumerate(gpus):
            row = [m * cost.times(StageShape(
                device_type=gpu, chunk_layers=(n,), micro_batch_size=mbs, tensor_parallel_size=tp,
                sequence_parallel=plan.sequence_parallel, pipeline_size=p, stage=s,
                expert_parallel_size=plan.meshes[0].expert_model_parallel_size,
                expert_tensor_parallel_size=plan.meshes[0].expert_tensor_parallel_size)).total_s
                for n in range(L + 1)]
            costs[s] = np.maximum(costs[s], row)
    costs[:, :v] = np.inf  # every chunk holds a layer
    got = min_max_split(costs, L, split_scale(plan.model))
    return None if got is None else got[1]


def _restart(run: _Climb, cost: CostModel, order: tuple[int, ...],
             lay: Layout) -> tuple[Layout, Plan, SimResult] | None:
    """The best start in stage order ``order``: layers re-split for that order, without
    interleaving or with ``lay``'s chunk count (remainder early or late); None if none fits."""
    plan, p = run.plan, run.p
    start = None
    totals_for = lambda w, mb: _balanced_totals(plan, cost, order, w, mb)  # noqa: E731
    # the climb moves the chunk count on from there
    for cand in _even_layouts(lay, p, sorted({1, lay.v}), totals_for, order):
        got = run.evaluate(cand)
        if got is not None and (start is None or got[1].step_time_s < start[2].step_time_s):
            start = (cand, *got)
    return start


def refine(plan: Plan, sim: SimResult, cost: CostModel, *, max_virtual_pipeline_size: int,
           optimizer_offload: bool = True, activation_offload: bool = True,
           max_rounds: int = 8, reorder: bool = True, restart_margin: float = 0.02,
           climbed: Callable[[int, int], None] | None = None) -> tuple[Plan, SimResult, int]:
    """Hill-climb from ``plan`` (simulated as ``sim``), then from every other order of its
    runs of one device type along the pipeline (``reorder``); returns the best plan found,
    its simulation and the number of simulations run. ``optimizer_offload`` and
    ``activation_offload`` (module inputs) allow those policies; the chunk count goes up to
    ``max_virtual_pipeline_size``. ``climbed(done, total)`` is told after each start (the
    plan and each other order) is done with, for a progress bar."""
    p = plan.pipeline_model_parallel_size
    menu = Menu(optimizer_offload=optimizer_offload,
                module_inputs=(False, True) if activation_offload else (False,))
    run = _Climb(plan, cost, _Policies(cost, plan, menu), max_virtual_pipeline_size, max_rounds)
    types = tuple(st.device_type for st in plan.pipelines[0].stages)
    orders = list(_block_orders(types)) if reorder and p > 1 else []
    report = climbed or (lambda done, total: None)
    lay, best_plan, best_sim = run.climb(layout_of(plan), plan, sim)
    best_lay = lay
    report(1, 1 + len(orders))
    for k, order in enumerate(orders, start=2):
        start = _restart(run, cost, order, lay)
        if start is not None and start[2].step_time_s <= best_sim.step_time_s * (1 + restart_margin):
            got_lay, got_plan, got_sim = run.climb(*start)
            if got_sim.step_time_s < best_sim.step_time_s * (1 - 1e-9):
                best_lay, best_plan, best_sim = got_lay, got_plan, got_sim
        report(k, 1 + len(orders))
    if best_plan is not plan:  # its own stage objects for every pipeline
        best_plan = _build(plan, best_lay, run.policies, share=False)
    return best_plan, best_sim, run.sims


def climb(problem: Problem, plan: Plan, sim: SimResult, *, chunk_cap: int,
          climbed: Callable[[int, int], None] | None = None) -> tuple[Plan, SimResult, int]:
    """:func:`refine` from ``plan`` under ``problem``'s options, up to ``chunk_cap`` chunks per
    stage: (plan, its simulation, simulations run)."""
    options = problem.opt
    return refine(plan, sim, problem.cost(plan.precision), max_virtual_pipeline_size=chunk_cap,
                  optimizer_offload=options.optimizer_offload,
                  activation_offload=options.activation_offload,
                  max_rounds=options.refine_rounds, restart_margin=options.refine_restart_margin,
                  climbed=climbed)


def refine_chunk_cap(options: TuneOptions) -> int:
    """Most chunks per stage the local search tries: ``refine_max_virtual_pipeline_size`` (at
    least the structured search's), or 1 where interleaving is off."""
    if options.max_virtual_pipeline_size <= 1:
        return 1
    return max(options.max_virtual_pipeline_size, options.refine_max_virtual_pipeline_size)
