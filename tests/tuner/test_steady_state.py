"""The simulator's steady-state extrapolation (simulate_pipeline.pipeline_run) against the
op-by-op simulation: long pipelines cost no more than short ones and give the same figures."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_hetero.errors import HeteroError
from megatron_hetero.sim.step import RECORD_MOST, check_recordable, recorded_ops
from megatron_hetero.sim.pipeline import (DIRECT_MICROBATCHES, PROBE_MOST, interleaved_1f1b,
                                               pipeline_run)

TOLERANCE = 1e-9
"""Relative difference allowed between an extrapolated run and the op-by-op one: the
extrapolation adds whole periods of one measured shift, so only rounding separates them."""

durations = st.floats(0.01, 3.0, allow_nan=False, allow_infinity=False)


@st.composite
def pipelines(draw):
    p = draw(st.integers(1, 5))
    v = draw(st.integers(1, 3)) if p > 1 else 1
    fwd = [[draw(durations) for _ in range(v)] for _ in range(p)]
    bwd = [[draw(durations) for _ in range(v)] for _ in range(p)]
    sends = [draw(st.floats(0.0, 4.0)) for _ in range(p)]
    group = draw(st.sampled_from([None, p + 1, 2 * p])) if v > 1 else None
    m = draw(st.integers(DIRECT_MICROBATCHES + 1, 3000))
    return fwd, bwd, sends, m, group


@settings(max_examples=60, deadline=None)
@given(pipelines())
def test_long_pipelines_match_the_op_by_op_simulation(case):
    fwd, bwd, sends, m, group = case
    try:
        want = interleaved_1f1b(fwd, bwd, sends, sends, m, group=group)
    except AssertionError:  # an order Megatron cannot run (interleaved, m too ragged)
        assume(False)
    got = pipeline_run(fwd, bwd, sends, sends, m, group=group)
    assert got[1] == want[1]  # busy: exact
    assert got[0] == pytest.approx(want[0], rel=TOLERANCE)
    for a, b in zip(got[2], want[2]):
        assert a == pytest.approx(b, rel=TOLERANCE)


@st.composite
def warmup_pipelines(draw):
    """Non-interleaved pipelines under the per-stage warm-up schedule (more warm-up forwards
    than Megatron's on some stages)."""
    p = draw(st.integers(2, 5))
    w = [0] * p
    w[-1] = draw(st.integers(0, 1))
    for s in range(p - 2, -1, -1):
        w[s] = w[s + 1] + draw(st.integers(1, 3))
    fwd = [[draw(durations)] for _ in range(p)]
    bwd = [[draw(durations)] for _ in range(p)]
    sends = [draw(st.floats(0.0, 2.0)) for _ in range(p)]
    return fwd, bwd, sends, draw(st.integers(DIRECT_MICROBATCHES + 1, 2500)), tuple(w)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(warmup_pipelines())
def test_per_stage_warmup_pipelines_match_the_op_by_op_simulation(case):
    fwd, bwd, sends, m, w = case
    want = interleaved_1f1b(fwd, bwd, sends, sends, m, warmups=w)
    got = pipeline_run(fwd, bwd, sends, sends, m, warmups=w)
    assert got[0] == pytest.approx(want[0], rel=TOLERANCE)
    for a, b in zip(got[2], want[2]):
        assert a == pytest.approx(b, rel=TOLERANCE)


def test_a_transient_of_hundreds_of_micro_batches_is_outlasted():
    # a pipeline of the 64-GPU A800 + A40 plan at GBS 16384: two stages' paces are so close
    # that the ends settle into their period only after some 470 micro-batches
    a, b = 0.1809004902890225, 0.349218068578045
    fwd = [[0.1829976422890225, a]] + [[a, a]] * 3 + [[0.12449554642051282, 0.22409198355692306]] \
        + [[0.17429376498871796] * 2] * 2 + [[0.17429376498871796, 0.18117672539897436]]
    bwd = [[b, b]] * 4 + [[0.2705347589251282, 0.4421441693538461]] \
        + [[0.34388990949743586] * 2] * 3
    bwd[-1] = [0.34388990949743586, 0.3576558303179487]
    sends = [0.00136217728] * 3 + [0.00270435456] + [0.00136217728] * 3 + [0.00270435456]
    want = interleaved_1f1b(fwd, bwd, sends, sends, 4096)
    got = pipeline_run(fwd, bwd, sends, sends, 4096)
    assert got[0] == pytest.approx(want[0], rel=TOLERANCE)
    for x, y in zip(got[2], want[2]):
        assert x == pytest.approx(y, rel=TOLERANCE)


def test_a_timeline_of_a_huge_batch_is_refused_in_one_line():
    from megatron_hetero.plan import load_plan
    from pathlib import Path
    plan = load_plan(Path(__file__).resolve().parents[1] / "data" / "plan_a100_v100.yaml")
    assert recorded_ops(plan) == 2 * 2 * 128  # a forward and a backward per micro-batch and stage
    check_recordable(RECORD_MOST)
    with pytest.raises(HeteroError, match=r"^--timeline: .*at most 2,000,000") as got:
        check_recordable(RECORD_MOST + 1)
    assert "\n" not in str(got.value)


def test_short_pipelines_and_recorded_runs_are_simulated_op_by_op():
    fwd, bwd, sends = [[1.0], [1.5]], [[2.0], [2.5]], [0.3, 0.3]
    for m, record in ((DIRECT_MICROBATCHES, False), (DIRECT_MICROBATCHES * 4, True)):
        assert pipeline_run(fwd, bwd, sends, sends, m, record=record) == \
            interleaved_1f1b(fwd, bwd, sends, sends, m, record=record)


def test_probes_stay_short_for_any_batch(monkeypatch):
    # a billion micro-batches cost one probe of at most PROBE_MOST (here far fewer)
    import megatron_hetero.sim.pipeline as sp
    lengths = []
    real = sp._run
    monkeypatch.setattr(sp, "_RUNS", {})
    monkeypatch.setattr(sp, "_run", lambda *args, **kw: (lengths.append(args[4]),
                                                         real(*args, **kw))[1])
    fwd, bwd, sends = [[1.0], [1.25], [0.5]], [[2.0], [2.5], [1.0]], [0.1] * 3
    pipeline_run(fwd, bwd, sends, sends, 10**9 + 7)
    assert lengths and max(lengths) <= PROBE_MOST and len(lengths) <= 2


def test_a_billion_micro_batches_extrapolate_from_the_steady_state():
    # op by op this would be 8e9 ops; the answer follows from a period of short runs
    fwd, bwd, sends = [[1.0], [1.25], [0.5], [1.0]], [[2.0], [2.5], [1.0], [2.0]], [0.1] * 4
    m = 10**9
    finish, busy, _, events = pipeline_run(fwd, bwd, sends, sends, m)
    assert events == []
    # the slowest stage (1.25 + 2.5 s per micro-batch, each held 0.1 s more by its send: Megatron
    # waits for its sends) sets the pace: the finish is its time plus a bounded fill and drain
    assert busy[1] == m * 3.75
    pace = 3.75 + 0.2
    assert m * pace <= max(finish) <= m * pace + 4 * pace


@st.composite
def resumed_runs(draw):
    """A pipeline (interleaved or not, some with per-stage warm-ups) and two lengths: a run of
    the second resumes from a run of the first."""
    fwd, bwd, sends, _, group = draw(pipelines())
    p, v = len(fwd), len(fwd[0])
    warmups = None
    if v == 1 and p > 1 and draw(st.booleans()):
        warmups = tuple(2 * (p - 1 - s) + draw(st.integers(0, 1)) for s in range(p))
    first = draw(st.integers(1, 300))
    second = draw(st.sampled_from([2 * first, first + draw(st.integers(1, 40)),
                                   max(1, first - draw(st.integers(1, 40)))]))
    return fwd, bwd, sends, group, warmups, first, second


@settings(max_examples=60, deadline=None)
@given(resumed_runs())
def test_a_run_resumed_from_a_shorter_one_is_that_run_from_the_start(case):
    # a longer probe takes the ops its order shares with the probe before from that probe
    # (simulate_pipeline._run's since): every figure must be the very same float
    from megatron_hetero.sim import pipeline as sp
    fwd, bwd, sends, group, warmups, first, second = case
    try:
        before = sp._run(fwd, bwd, sends, sends, first, group=group, record=False,
                         warmups=warmups)
        want = sp._run(fwd, bwd, sends, sends, second, group=group, record=False,
                       warmups=warmups)
    except AssertionError:  # an order Megatron cannot run (interleaved, m too ragged)
        assume(False)
    got = sp._run(fwd, bwd, sends, sends, second, group=group, record=False, warmups=warmups,
                  since=before)
    assert got[:4] == want[:4]  # finish, busy, last backwards' starts, every op's end
    assert got[6] == want[6]  # and what a later run would resume from


def test_a_probe_twice_as_long_resumes_from_most_of_the_one_before():
    # the 8-stage, 2-chunk probes of the 64-GPU search: 112 micro-batches, then 224 where no
    # period shows; all but the drain of the first (its last ~4%) is not simulated again
    from megatron_hetero.sim import pipeline as sp
    short, long = (8, 112, 2, None, None), (8, 224, 2, None, None)
    shared = sp._shared_ops(short, long)
    ops, longer = sp._compiled_order(*short)[0], sp._compiled_order(*long)[0]
    assert 0.95 * len(ops) < shared < len(ops)
    assert ops[:shared] == longer[:shared]
