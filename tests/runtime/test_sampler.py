"""Uneven-DP sampler: every sample of every full global batch is read exactly once, by the
replica whose share holds it, and a resumed sampler lands on the same samples."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hetero.runtime.sampler import HeteroBatchSampler, sampler_for_replica

from .plans import make_plan

replicas_st = st.lists(st.tuples(st.integers(1, 4), st.integers(1, 5)), min_size=1, max_size=5)


def _all(plan, total, consumed=0):
    return [list(sampler_for_replica(plan, d, total_samples=total, consumed_samples=consumed))
            for d in range(plan.data_parallel_size)]


@settings(max_examples=200, deadline=None)
@given(replicas=replicas_st, batches=st.integers(0, 6), tail=st.integers(0, 50))
def test_every_sample_read_exactly_once(replicas, batches, tail):
    plan = make_plan(replicas=replicas)
    g = plan.global_batch_size
    total = batches * g + min(tail, g - 1)  # a partial last global batch is not read
    per_replica = _all(plan, total)
    read = [i for batches_d in per_replica for mb in batches_d for i in mb]
    assert sorted(read) == list(range(batches * g))
    for d, (mbs, n) in enumerate(replicas):
        assert all(len(mb) == mbs for mb in per_replica[d])
        assert len(per_replica[d]) == batches * n == len(
            sampler_for_replica(plan, d, total_samples=total, consumed_samples=0))
        # global batch k of replica d is its own slice of [k*g, (k+1)*g)
        offset, count = plan.replica_sample_range(d)
        for k in range(batches):
            got = [i for mb in per_replica[d][k * n:(k + 1) * n] for i in mb]
            assert got == list(range(k * g + offset, k * g + offset + count))


@settings(max_examples=100, deadline=None)
@given(replicas=replicas_st, batches=st.integers(1, 6), done=st.integers(0, 6))
def test_resume_lands_on_the_same_samples(replicas, batches, done):
    plan = make_plan(replicas=replicas)
    g = plan.global_batch_size
    done = min(done, batches)
    fresh = _all(plan, batches * g)
    resumed = _all(plan, batches * g, consumed=done * g)
    for d, (_, n) in enumerate(replicas):
        assert resumed[d] == fresh[d][done * n:]


def test_replicas_take_consecutive_shares():
    plan = make_plan(replicas=[(2, 3), (2, 3)])
    a, b = _all(plan, 24)
    assert a[:3] == [[0, 1], [2, 3], [4, 5]] and b[:3] == [[6, 7], [8, 9], [10, 11]]


def test_bad_resume_point_is_refused():
    plan = make_plan(replicas=[(1, 3), (1, 1)])
    with pytest.raises(ValueError, match="multiple of the global batch size"):
        sampler_for_replica(plan, 0, total_samples=100, consumed_samples=6)
    with pytest.raises(ValueError, match="does not fit"):
        HeteroBatchSampler(total_samples=10, consumed_samples=0, global_batch_size=4, offset=3,
                           micro_batch_size=1, num_microbatches=2)


@st.composite
def _two_plans(draw):
    """Two plans of the same global batch size with different replicas."""
    a = draw(replicas_st)
    g = sum(m * n for m, n in a)
    b, left = [], g
    while left:
        mbs = draw(st.integers(1, min(4, left)))
        n = draw(st.integers(1, left // mbs))
        b.append((mbs, n))
        left -= mbs * n
    return a, b


@settings(max_examples=200, deadline=None)
@given(plans=_two_plans(), before=st.integers(0, 4), after=st.integers(0, 4))
def test_no_sample_lost_or_read_twice_across_a_plan_change(plans, before, after):
    """Plan A reads ``before`` global batches, plan B resumes at A's consumed samples and reads
    ``after`` more: together they read the first ``before + after`` global batches once each."""
    a, b = (make_plan(replicas=r) for r in plans)
    g = a.global_batch_size
    assert b.global_batch_size == g
    total = (before + after) * g
    first = _all(a, before * g)
    second = _all(b, total, consumed=before * g)
    read = [i for part in (first, second) for batches_d in part for mb in batches_d for i in mb]
    assert sorted(read) == list(range(total))


@settings(max_examples=150, deadline=None)
@given(mbs=st.integers(1, 3), shares=st.lists(st.integers(1, 5), min_size=2, max_size=4),
       changes=st.lists(st.tuples(st.integers(1, 6), st.randoms(use_true_random=False)),
                        max_size=3),
       batches=st.integers(1, 8), consumed=st.integers(0, 3))
def test_shares_that_change_between_batches_read_every_sample_once(mbs, shares, changes,
                                                                    batches, consumed):
    """Live rebalancing: every replica switches to the new shares at the same global batch;
    each batch is still read exactly once, each replica reading its new slice, and a sampler
    resumed after the switch reads what the switched one does."""
    plan = make_plan(replicas=[(mbs, n) for n in shares])
    g, total = plan.global_batch_size, batches * plan.global_batch_size
    consumed = min(consumed, batches) * g
    samplers = [sampler_for_replica(plan, d, total_samples=total, consumed_samples=consumed)
                for d in range(len(shares))]
    shares_of = {0: list(shares)}
    at = 0
    for step, rng in changes:
        at += step
        new = list(shares)
        rng.shuffle(new)  # the same micro-batches, moved between replicas
        offsets = [sum(new[:d]) * mbs for d in range(len(new))]
        for d, s in enumerate(samplers):
            s.switch(from_batch=at, offset=offsets[d], num_microbatches=new[d])
        shares_of[at] = new
    read = [list(s) for s in samplers]
    assert sorted(i for r in read for mb in r for i in mb) == list(range(consumed, total))
    for d, s in enumerate(samplers):
        assert len(s) == len(read[d]) and all(len(mb) == mbs for mb in read[d])
        pos = 0
        for k in range(consumed // g, batches):
            current = shares_of[max(b for b in shares_of if b <= k)]
            lo = k * g + sum(current[:d]) * mbs
            got = [i for mb in read[d][pos:pos + current[d]] for i in mb]
            assert got == list(range(lo, lo + current[d] * mbs)), (d, k)
            pos += current[d]


def test_a_switch_of_a_started_batch_is_refused():
    plan = make_plan(replicas=[(1, 2), (1, 2)])
    s = sampler_for_replica(plan, 0, total_samples=40, consumed_samples=0)
    it = iter(s)
    next(it)  # batch 0 started
    with pytest.raises(ValueError, match="already being read"):
        s.switch(from_batch=0, offset=0, num_microbatches=3)
    s.switch(from_batch=1, offset=0, num_microbatches=3)
    assert [next(it) for _ in range(4)] == [[1], [4], [5], [6]]
    with pytest.raises(ValueError, match="does not fit"):
        s.switch(from_batch=2, offset=2, num_microbatches=3)
