"""The search's caches and in-place rewrites give what the plain computations give, bit for bit
(issue 18: the 64-GPU search made faster without changing a figure)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_hetero.cost import CostModel
from megatron_hetero.cost.stage import StageShape
from megatron_hetero.schedule.order import (_held_states, peak_activations, peak_in_flight,
                                           rank_order)
from megatron_hetero.hardware.catalog import load_catalog
from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.models import model_preset
from megatron_hetero.plan import Offload, Recompute
from megatron_hetero.tuner.policy import (OFFLOAD_STEPS, Menu, cheapest_for_stage, option_costs,
                                          pick, timing_position)
from megatron_hetero.tuner.problem import Problem, TuneOptions
from megatron_hetero.tuner.tables import StageTables, _Builder, _canonical

from ..shapes import stage

GPU = "A100-SXM-80GB"
UNFUSED = "V100-SXM2-32GB"


def _cost() -> CostModel:
    inv = inventory_from_data({"groups": [{"gpu": GPU, "nodes": 2, "gpus_per_node": 8},
                                          {"gpu": UNFUSED, "nodes": 2, "gpus_per_node": 8}]})
    return CostModel(model_preset("llama2-13b"), inv)


def _shapes():
    """Stages of both types, at every place, plain and interleaved, under several policies."""
    out = []
    for gpu in (GPU, UNFUSED):
        for chunks in ((5,), (3, 2), (2, 2, 1)):
            n = sum(chunks)
            for place in ("only", "first", "middle", "last"):
                for k in (0, 1, n):
                    for mi in (False, True):
                        out.append(stage(gpu, chunks, place=place, tensor_parallel_size=2,
                                         sequence_parallel=True,
                                         recompute=Recompute.full_layers(k, of=n),
                                         offload=Offload(module_inputs=mi, optimizer_fraction=0.25),
                                         data_parallel_size=2))
            out.append(stage(gpu, chunks, recompute=Recompute(granularity="selective")))
    return out


def test_memory_and_times_from_warm_caches_match_a_fresh_cost_model():
    # the cost model caches parts of a stage's memory (parameters, each chunk's activations,
    # the in-flight peak) by their inputs: a stage costed after hundreds of others gets what a
    # cost model that never saw another stage gives
    warm = _cost()
    shapes = _shapes()
    for shape in reversed(shapes):
        warm.memory(shape)
        warm.times(shape)
        warm.chunk_times(shape)
    for shape in shapes:
        fresh = _cost()
        assert warm.memory(shape) == fresh.memory(shape)
        assert warm.times(shape) == fresh.times(shape)
        # the simulator's per-chunk seconds, cached per shape: one entry per chunk, as fresh
        assert warm.chunk_times(shape) == fresh.chunk_times(shape)
        assert len(warm.chunk_times(shape)) == len(shape.chunk_layers)
        assert warm.params(shape.num_layers, first=shape.first, last=shape.last, tp=2) == \
            fresh.params(shape.num_layers, first=shape.first, last=shape.last, tp=2)


def test_timing_position_has_the_same_times():
    cost = _cost()
    for shape in _shapes():
        timing = timing_position(shape)
        assert (timing.first, timing.last) == (shape.first, shape.last)
        assert cost.times(timing) == cost.times(shape)
        assert cost.chunk_times(timing) == cost.chunk_times(shape)
        # an interleaved stage costed whole: its chunks do not matter to times()
        assert cost.times(timing.but(chunk_layers=(timing.num_layers,))) == cost.times(shape)


def _cheapest_plainly(cost: CostModel, shape, menu: Menu):
    """cheapest_for_stage's pick over every option, each costed on its own shape."""
    from megatron_hetero.tuner.policy import _settings, cheapest
    settings = _settings(menu, shape.num_layers, not cost.uses_flash_attention(shape.device_type))
    mems, secs = [], []
    for recompute, offload in settings:
        got = shape.but(recompute=recompute, offload=offload)
        mems.append(cost.memory(got).total)
        secs.append(shape.num_microbatches * cost.times(got).total_s)
    plain = shape.but(offload=Offload())
    best = cheapest(np.array(mems), np.array(secs), optimizer=cost.memory(plain).optimizer,
                    capacity=cost.capacity(shape.device_type),
                    offload_seconds=cost.optimizer_offload_seconds(plain),
                    optimizer_offload=menu.optimizer_offload)
    if not np.isfinite(best.seconds):
        return None
    recompute, offload = settings[int(best.index)]
    return recompute, float(best.fraction), offload.module_inputs


@pytest.mark.parametrize("micro_batch_size", [1, 4, 16])
def test_cheapest_for_stage_with_kept_seconds_is_the_plain_pick(micro_batch_size):
    # the option seconds are kept per timing position and shared by stages of one place; the
    # policy is the one every option costed on its own picks
    cost = _cost()
    menu = Menu()
    picked = 0
    for gpu in (GPU, UNFUSED):
        for chunks in ((10,), (20,), (6, 6), (10, 9, 9)):
            for s in range(4):
                shape = stage(gpu, chunks, micro_batch_size=micro_batch_size, pipeline_size=4,
                              stage=s, num_microbatches=8, tensor_parallel_size=1)
                got = cheapest_for_stage(cost, shape, menu)
                want = _cheapest_plainly(cost, shape, menu)
                if want is None:
                    assert got is None
                    continue
                picked += 1
                assert (got.recompute, got.offload.optimizer_fraction,
                        got.offload.module_inputs) == want
    assert picked


def _option_costs_plainly(memory, seconds, *, optimizer, capacity, offload_seconds):
    optimizer = np.asarray(optimizer, dtype=float)[..., None]
    offload_seconds = np.asarray(offload_seconds, dtype=float)[..., None]
    fits = memory <= capacity
    with np.errstate(divide="ignore", invalid="ignore"):
        steps = np.ceil((memory - capacity) * (1 + 1e-9) / optimizer * OFFLOAD_STEPS)
        fraction = np.where(fits, 0.0, steps / OFFLOAD_STEPS)
        ok = fits | ((optimizer > 0) & (fraction <= 1.0)
                     & (memory - fraction * optimizer <= capacity))
        cost = np.where(ok, seconds + fraction * offload_seconds, np.inf)
    return np.where(ok, fraction, 0.0), cost


def test_option_costs_in_place_are_the_plain_formula():
    rng = np.random.default_rng(18)
    for _ in range(300):
        rows, cols = int(rng.integers(1, 90)), int(rng.integers(1, 9))
        memory = rng.uniform(0, 2e10, (rows, cols))
        memory[rng.random((rows, cols)) < 0.2] = np.inf  # not an option
        seconds = rng.uniform(0, 5, (rows, cols))
        optimizer = rng.uniform(0, 1e10, rows)
        optimizer[rng.random(rows) < 0.1] = 0.0
        offload = rng.uniform(0, 3, rows)
        offload[rng.random(rows) < 0.1] = 0.0
        capacity = float(rng.uniform(5e9, 1.5e10))
        got = option_costs(memory, seconds, optimizer=optimizer, capacity=capacity,
                           offload_seconds=offload, optimizer_offload=True)
        want = _option_costs_plainly(memory, seconds, optimizer=optimizer, capacity=capacity,
                                     offload_seconds=offload)
        for a, b in zip(got, want):
            assert a.shape == b.shape and np.array_equal(a, b)
        p = pick(*got)
        i = np.argmin(got[1], axis=-1)
        assert np.array_equal(p.index, i)
        assert np.array_equal(p.seconds, got[1][np.arange(rows), i])
        assert np.array_equal(p.fraction, got[0][np.arange(rows), i])


@pytest.mark.parametrize("p,v,group", [(2, 2, None), (4, 3, None), (3, 2, 4), (4, 2, 6)])
def test_cached_peak_is_the_walk_over_the_whole_order(p, v, group):
    rng = np.random.default_rng(p * 10 + v)
    for m in (p, 2 * p, 3 * p + (group or p), 40):
        if group is not None and (m < group or (m % group and m % group < p)):
            continue
        for r in range(p):
            for _ in range(3):
                weights = [float(x) for x in rng.uniform(0, 5, v)]
                order = rank_order(p, r, m, v, group)
                assert peak_activations(p, r, m, v, weights, group) == \
                    pytest.approx(peak_in_flight(order, weights), rel=1e-12)
                # again, from the cache
                assert peak_activations(p, r, m, v, list(weights), group) == \
                    peak_activations(p, r, m, v, weights, group)


def _held_plainly(p, r, m, v, g):
    """The held states kept by a walk over rank ``r``'s order, as the walk once found them."""
    held, seen = [0] * v, set()
    for kind, _, c in rank_order(p, r, m, v, g):
        held[c] += 1 if kind == 0 else -1
        if kind == 0:
            seen.add(tuple(held))
    states = sorted(seen, key=lambda x: (-sum(x), x))
    return [x for x in states if not any(y != x and all(a >= b for a, b in zip(y, x))
                                         for y in states)]


@pytest.mark.parametrize("p", [2, 3, 5])
def test_held_states_are_those_of_a_walk_over_the_order(p):
    # built with numpy from the order's chunks (forwards less the backwards run before them):
    # the same states, in the same order, as a walk over the rank's run order
    for v in (2, 3, 4):
        for g in range(p, 2 * p + 1):
            for m in (1, p - 1, g, g + 1, 2 * g + p, 3 * g):
                for r in range(p):
                    got = _held_states(p, r, max(m, 1), v, g)
                    assert got.tolist() == [list(map(float, x))
                                            for x in _held_plainly(p, r, max(m, 1), v, g)]


def test_memory_of_is_the_memory_of_the_shape_it_stands_for():
    # the tables and the local search ask a position's memory with other chunks, recompute and
    # offload without building that shape: bit for bit the shape's
    cost = _cost()
    for shape in _shapes():
        for chunks in {shape.chunk_layers, (3,), (2, 2), (1, 2, 3)}:
            for r in (Recompute(), Recompute(granularity="selective"),
                      Recompute.full_layers(1, of=sum(chunks))):
                for off in (Offload(), Offload(module_inputs=True),
                            Offload(activations=True, optimizer_fraction=0.5)):
                    want = cost.memory(shape.but(chunk_layers=chunks, recompute=r, offload=off))
                    assert cost.memory_of(shape, chunks, r, off) == want


def test_builtin_catalog_read_once_but_each_caller_gets_its_own():
    a, b = load_catalog(), load_catalog()
    assert a is not b and a.names() == b.names()
    spec = dataclasses.replace(a.get(GPU), aliases=[])
    c = a.with_entries({"MyGPU": spec}, source="test")
    assert "MyGPU" in c and "MyGPU" not in load_catalog() and "MyGPU" not in a


def test_a_stage_shape_hashes_as_its_fields_in_any_process():
    """A shape keeps its hash (the cost model's caches key on it); a copy unpickled in a process
    with other string hashes derives its own, so it finds what an equal shape keyed there."""
    import os
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    from megatron_hetero.cost.stage import StageShape

    shape = StageShape(device_type="A100-SXM-80GB", chunk_layers=(3, 2), micro_batch_size=2,
                       recompute=Recompute(granularity="selective"), stage=1, pipeline_size=2)
    copy = pickle.loads(pickle.dumps(shape))
    assert copy == shape and hash(copy) == hash(shape) and copy.num_layers == 5
    script = ("import pickle, sys\n"
              "from megatron_hetero.cost.stage import StageShape\n"
              "from megatron_hetero.plan import Recompute\n"
              "got = pickle.loads(sys.stdin.buffer.read())\n"
              "mine = StageShape(device_type='A100-SXM-80GB', chunk_layers=(3, 2),\n"
              "                  micro_batch_size=2, recompute=Recompute(granularity='selective'),\n"
              "                  stage=1, pipeline_size=2)\n"
              "print({mine: 'found'}.get(got), got.num_layers)\n")
    repo = Path(__file__).resolve().parents[2]
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(shape),
                             capture_output=True, env={**os.environ, "PYTHONHASHSEED": seed},
                             cwd=repo, check=True)
        assert out.stdout.split() == [b"found", b"5"]


@pytest.mark.parametrize("p", [2, 3, 5, 8])
@pytest.mark.parametrize("group", [None, "more"])
def test_canonical_interleaved_position_costs_what_the_position_does(p, group):
    # the stage tables key an interleaved position by its first/last place and the stages
    # after it (the group named): each stage of p, at every layer count and policy, costs in
    # memory and time what its canonical position does, and its table is the same
    cost = _cost()
    problem = Problem(cost.model, cost.inventory, 128, {}, TuneOptions())
    tables = StageTables(problem)
    prec = problem.precision_for([GPU])
    v, m = 3, 4 * p
    g = None if group is None else p + 1 if m % (p + 1) == 0 else 2 * p
    for s in range(p):
        position = StageShape(device_type=GPU, chunk_layers=(0,) * v, micro_batch_size=1,
                              tensor_parallel_size=2, pipeline_size=p, stage=s,
                              num_microbatches=m, microbatch_group=g, data_parallel_size=2)
        canon = _canonical(position)
        assert (canon.first, canon.last) == (position.first, position.last)
        assert canon.pipeline_size <= p
        for chunks in ((1, 1, 1), (3, 2, 2), (4, 4, 5)):
            for recompute in (Recompute(), Recompute.full_layers(2, of=sum(chunks))):
                got = position.but(chunk_layers=chunks, recompute=recompute)
                same = canon.but(chunk_layers=chunks, recompute=recompute)
                assert cost.memory(same) == cost.memory(got)
                assert cost.times(same) == cost.times(got)
        exact = _Builder(problem, position, prec, timing_lines={}, figures={}).build()
        table = tables.table(position, precision=prec)
        np.testing.assert_array_equal(table.fit.seconds, exact.fit.seconds)
        np.testing.assert_array_equal(table.t_none, exact.t_none)
