"""The simulator's lower bounds (``finish_lower_bound``, ``step_lower_bound``) and the runs cut
short with them (``pipeline_run``'s ``limits``, ``simulate``'s ``faster_than``), which the local
search uses to skip plans that cannot beat its best: a bound never exceeds what the simulation
gives, and a run is only cut short when it could not have come in under its limit."""

from __future__ import annotations

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megatron_hetero.cost import CostModel
from megatron_hetero.errors import HeteroError
from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.plan import any_plan_from_data
from megatron_hetero.sim.pipeline import (DIRECT_MICROBATCHES, finish_lower_bound,
                                          interleaved_1f1b, pipeline_run)
from megatron_hetero.sim.step import simulate, step_lower_bound
from megatron_hetero.tuner.policy import Menu
from megatron_hetero.tuner.refine import _Climb, _Policies, layout_of

from .test_plan_properties import mesh_plans
from .test_refine import MODEL, _cost, _plan

SETTINGS = dict(derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))

durations = st.floats(0.01, 3.0, allow_nan=False, allow_infinity=False)


@st.composite
def pipelines(draw):
    """A pipeline of 1-5 stages, 1-3 chunks, random op and send seconds, micro-batches run op
    by op, Megatron's or a larger micro-batch group, or (one chunk) per-stage warm-ups."""
    p = draw(st.integers(1, 5))
    v = draw(st.integers(1, 3)) if p > 1 else 1
    fwd = [[draw(durations) for _ in range(v)] for _ in range(p)]
    bwd = [[draw(durations) for _ in range(v)] for _ in range(p)]
    send_f = [draw(st.floats(0.0, 4.0)) for _ in range(p)]
    send_b = [draw(st.floats(0.0, 4.0)) for _ in range(p)]
    group = draw(st.sampled_from([None, p + 1, 2 * p])) if v > 1 else None
    warmups = None
    if v == 1 and p > 1 and draw(st.booleans()):
        w = [0] * p
        for s in range(p - 2, -1, -1):
            w[s] = w[s + 1] + draw(st.integers(1, 3))
        warmups = tuple(w)
    m = draw(st.integers(1, 80))
    return fwd, bwd, send_f, send_b, m, group, warmups


def _run(case):
    fwd, bwd, send_f, send_b, m, group, warmups = case
    try:
        return interleaved_1f1b(fwd, bwd, send_f, send_b, m, group=group, warmups=warmups)
    except AssertionError:  # an order Megatron cannot run (interleaved, m too ragged)
        assume(False)


@settings(max_examples=150, **SETTINGS)
@given(pipelines())
def test_no_stage_finishes_before_its_lower_bound(case):
    fwd, bwd, send_f, send_b, m, _, warmups = case
    free = _run(case)[0]
    bound = finish_lower_bound(fwd, bwd, send_f, send_b, m, warmups=warmups)
    for got, low in zip(free, bound):
        assert low <= got * (1 + 1e-12)


@settings(max_examples=150, **SETTINGS)
@given(pipelines(), st.floats(0.5, 1.5))
def test_a_run_is_cut_short_only_when_some_stage_reaches_its_limit(case, scale):
    """Limits around the stages' real finish times: a run that comes back is the run without
    limits; one cut short (None) has some stage finishing at or past its limit."""
    fwd, bwd, send_f, send_b, m, group, warmups = case
    assert m <= DIRECT_MICROBATCHES
    want = _run(case)
    limits = [f * scale for f in want[0]]
    got = pipeline_run(fwd, bwd, send_f, send_b, m, group=group, warmups=warmups, limits=limits)
    if got is None:
        assert any(f >= lim * (1 - 1e-12) for f, lim in zip(want[0], limits))
    else:
        assert got[0] == want[0] and got[2] == want[2]
    # limits past every finish never cut a run short
    late = [f * 1.01 + 1e-9 for f in want[0]]
    assert pipeline_run(fwd, bwd, send_f, send_b, m, group=group, warmups=warmups,
                        limits=late) is not None


def _check_plan(plan, cost) -> float:
    """The step bound is under the simulated step; ``faster_than`` cuts the plan short only
    at or under its step and returns the full result above it."""
    sim = simulate(plan, cost, record_events=False)
    step = sim.step_time_s
    assert step_lower_bound(plan, cost) <= step
    above = simulate(plan, cost, record_events=False, faster_than=step * 1.001)
    assert above is not None and above.step_time_s == step
    for x in (step, step * 0.99, step_lower_bound(plan, cost)):
        got = simulate(plan, cost, record_events=False, faster_than=x)
        assert got is None or got.step_time_s == step
    return step


@settings(max_examples=80, **SETTINGS)
@given(split=st.lists(st.integers(1, 5), min_size=2, max_size=2).filter(lambda x: sum(x) == 6),
       more=st.integers(0, 6), microbatches=st.lists(st.sampled_from([2, 4, 6, 8]), min_size=1,
                                                      max_size=2),
       v=st.sampled_from([1, 2, 3]), data=st.data())
def test_step_bound_holds_on_format1_plans(split, more, microbatches, v, data):
    """Two stages (A100, V100) of a 12-layer model, 1-2 pipelines, 1-3 chunks."""
    split = [split[0] + more, split[1] + 6 - more]
    chunks = None
    if v > 1:
        if min(split) < v:
            return
        chunks = [[n // v + (c < n % v) for c in range(v)] for n in split]
    try:
        plan = _plan(split, microbatches, v=v, chunks=chunks)
    except HeteroError:
        return
    _check_plan(plan, _cost())


def test_step_bound_holds_on_mesh_plans():
    checked = []

    @settings(max_examples=40, **SETTINGS)
    @given(mesh_plans())
    def run(data):
        try:
            plan = any_plan_from_data(data, source="drawn")
        except HeteroError:
            return
        inv = inventory_from_data({"groups": [{"gpu": gpu, "nodes": 1, "gpus_per_node": count}
                                              for gpu, count in plan.device_counts().items()]})
        cost = CostModel(plan.model, inv, precision=plan.precision,
                         use_distributed_optimizer=plan.use_distributed_optimizer)
        checked.append(_check_plan(plan, cost))

    run()
    assert len(checked) >= 10


def test_a_climb_skips_only_layouts_that_cannot_beat_its_best():
    """``evaluate`` with ``beat``: the same plan and simulation as without when the layout is
    faster; else that or None, and None far above its step (the bound alone shows it)."""
    plan = _plan([6, 6], [4, 4])
    cost = _cost()

    def climb():
        return _Climb(plan, cost, _Policies(cost, plan, Menu()), 2, 4)

    lay = layout_of(plan)
    for seq in ((5, 7), (7, 5), (4, 8)):
        cand = lay.__class__(seq=seq, v=1, microbatches=lay.microbatches)
        plain = climb().evaluate(cand)
        assert plain is not None and plain[0].model == MODEL
        step = plain[1].step_time_s
        for beat in (step, step * 0.999):
            got = climb().evaluate(cand, beat=beat)
            assert got is None or got[1].step_time_s == step
        assert climb().evaluate(cand, beat=step * 0.5) is None
        got = climb().evaluate(cand, beat=step * 1.001)
        assert got is not None and got[1].step_time_s == step
        assert got[0].to_data() == plain[0].to_data()


def test_a_climb_ends_where_one_simulating_every_move_in_order_ends():
    """The climb (each move cut short once it cannot beat the round's best so far) ends on
    the plan, and has seen the layouts, that simulating every move to its end reaches, from
    starts of 1-3 chunks and one or two pipelines."""
    class PlainClimb(_Climb):
        """The same climb, every move simulated to its end (``beat`` ignored)."""

        def evaluate(self, lay, beat=None):
            return _Climb.evaluate(self, lay)

    cost = _cost()
    starts = [_plan([9, 3], [4, 4]), _plan([3, 9], [6, 2]),
              _plan([6, 6], [4, 4], v=2, chunks=[[4, 2], [3, 3]]),
              _plan([6, 6], [8], v=3, chunks=[[2, 2, 2], [1, 3, 2]])]
    for plan in starts:
        sim = simulate(plan, cost, record_events=False)
        runs = [kind(plan, cost, _Policies(cost, plan, Menu()), 3, 6)
                for kind in (_Climb, PlainClimb)]
        lay_a, plan_a, sim_a = runs[0].climb(layout_of(plan), plan, sim)
        lay_b, plan_b, sim_b = runs[1].climb(layout_of(plan), plan, sim)
        assert lay_a == lay_b and sim_a.step_time_s == sim_b.step_time_s
        assert plan_a.to_data() == plan_b.to_data()
        assert runs[0].sims == runs[1].sims and runs[0].seen == runs[1].seen
