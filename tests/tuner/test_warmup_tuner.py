"""The tuner's choice of per-stage warm-ups (tuner/warmup.py) on two sites joined by 1 Gb/s."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_hetero._schema import read_yaml
from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.models import load_model
from megatron_hetero.cost.model import CostModel
from megatron_hetero.plan import Plan, plan_from_data, replace_grid
from megatron_hetero.sim.step import simulate
from megatron_hetero.tuner import TuneOptions, tune
from megatron_hetero.tuner.warmup import harp_warmups

SLOW = Path(__file__).resolve().parents[2] / "examples" / "scenarios" / "a100-v100-1gbps-llama2-13b.yaml"


@pytest.fixture(scope="module")
def slow_pool():
    data = read_yaml(SLOW)
    return (load_model(data["model"], seq_length=data["seq_length"]),
            inventory_from_data(data["inventory"], source=str(SLOW)), data["global_batch_size"])


def _tune(pool, *, warmup: bool):
    model, inv, gbs = pool
    return tune(model, inv, gbs, options=TuneOptions(per_stage_warmup=warmup,
                                                     max_virtual_pipeline_size=1,
                                                     refine_max_virtual_pipeline_size=1))


def test_warmup_hides_the_slow_link_where_it_fits(slow_pool):
    plain, warm = _tune(slow_pool, warmup=False), _tune(slow_pool, warmup=True)
    assert plain.warmup_gain == 1.0
    assert all(st.warmup_microbatches is None for pipe in plain.plan.pipelines
               for st in pipe.stages)
    # the same structure, with more forwards in flight before the slow link
    assert warm.warmup_gain > 1.02
    assert warm.sim.step_time_s < plain.sim.step_time_s
    extra = [st.warmup_microbatches for pipe in warm.plan.pipelines for st in pipe.stages]
    assert any(w is not None for w in extra)
    # the gain reported is the simulator's, on the same plan under Megatron's counts
    cost = CostModel(slow_pool[0], slow_pool[1], precision=warm.plan.precision)
    megatron = simulate(_without_warmups(warm.plan), cost, record_events=False)
    assert warm.warmup_gain == pytest.approx(megatron.step_time_s / warm.sim.step_time_s,
                                             rel=1e-9)
    # every stage fits its card with the extra micro-batches in flight, and the plan reloads
    assert warm.sim.fits_memory
    again = plan_from_data(warm.plan.to_data())
    assert [st.warmup_microbatches for pipe in again.pipelines for st in pipe.stages] == extra


def _without_warmups(plan: Plan) -> Plan:
    return replace_grid(plan, pipelines=[
        dataclasses.replace(pipe, stages=[dataclasses.replace(st, warmup_microbatches=None)
                                          for st in pipe.stages]) for pipe in plan.pipelines])


def test_given_sends_replace_the_placed_links(slow_pool):
    """simulate(pipeline_sends=...): the placed link's own seconds change nothing; slower
    sends on one pipeline slow that pipeline and so the step, and leave the others alone."""
    model, inv, _ = slow_pool
    plan = _tune(slow_pool, warmup=False).plan
    cost = CostModel(model, inv, precision=plan.precision)
    placed = simulate(plan, cost, record_events=False)
    bws = cost.placement(plan).path_links(0, 0, False)
    same = [cost.p2p_seconds(plan.pipelines[0].micro_batch_size, bw,
                             tp=plan.tensor_model_parallel_size, sp=plan.sequence_parallel)
            for bw in bws]
    assert simulate(plan, cost, record_events=False,
                    pipeline_sends={0: same}).step_time_s == pytest.approx(placed.step_time_s,
                                                                          rel=1e-12)
    slower = simulate(plan, cost, record_events=False,
                      pipeline_sends={0: [10 * t for t in same]})
    assert slower.step_time_s > placed.step_time_s * 1.05
    busy = {(r.pipeline, r.stage): r.bubble_s for r in placed.stages}
    assert all(r.bubble_s == pytest.approx(busy[r.pipeline, r.stage], rel=1e-12)
               for r in slower.stages if r.pipeline != 0)


@pytest.mark.parametrize("gb_s, share, first", [(0.125, (0.1, 0.5), 2), (0.02, (0.5, 99), 3),
                                                 (100.0, (0.0, 0.1), None)])
def test_harp_rule_follows_the_link_against_the_slowest_stage(slow_pool, gb_s, share, first):
    """Harp's δ across the sites' link: 1 under a tenth of the slowest stage's forward plus
    backward (Megatron's counts kept), 2 under half, 3 above; the counts load as a plan."""
    model, inv, _ = slow_pool
    plan = _tune(slow_pool, warmup=False).plan
    assert plan.pipeline_model_parallel_size == 2 and plan.virtual_pipeline_size == 1
    cost = CostModel(model, dataclasses.replace(inv, inter_group_bandwidth_gb_s=gb_s),
                     precision=plan.precision)
    sim = simulate(plan, cost, record_events=False)
    slowest = max(s.forward_s + s.backward_s for s in sim.stages)
    link = cost.p2p_seconds(plan.pipelines[0].micro_batch_size,
                            cost.placement(plan).path_links(0, 0, False)[0],
                            tp=plan.tensor_model_parallel_size, sp=plan.sequence_parallel)
    assert share[0] <= link / slowest < share[1]  # the case's premise
    harp = harp_warmups(plan, sim, cost)
    assert [st.warmup_microbatches for st in harp.pipelines[0].stages] == [first, None]
    assert plan_from_data(harp.to_data()) == harp


def test_full_search_takes_the_warmup_plan_where_it_beats_interleaving(slow_pool):
    """With interleaving allowed, the non-interleaved plan with per-stage warm-ups competes with
    the interleaved best (whose own order keeps Megatron's warm-ups), and wins on 1 Gb/s."""
    model, inv, gbs = slow_pool
    full = tune(model, inv, gbs, options=TuneOptions())
    no_warmup = tune(model, inv, gbs, options=TuneOptions(per_stage_warmup=False))
    assert no_warmup.plan.virtual_pipeline_size > 1  # interleaving wins without warm-ups
    assert full.plan.virtual_pipeline_size == 1 and full.warmup_gain > 1.05
    assert full.sim.step_time_s < no_warmup.sim.step_time_s
    assert full.sim.fits_memory
    # where no link is slow the interleaved plan stays, and no extra climb runs
    fast = dataclasses.replace(inv, inter_group_bandwidth_gb_s=25.0)
    plain = tune(model, fast, gbs, options=TuneOptions())
    off = tune(model, fast, gbs, options=TuneOptions(per_stage_warmup=False))
    assert plain.plan == off.plan and plain.refine_simulations == off.refine_simulations
