"""The tuner's choice of per-stage warm-ups (tuner/warmup.py) on two sites joined by 1 Gb/s."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_hetero._schema import read_yaml
from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.models import load_model
from megatron_hetero.cost.model import CostModel
from megatron_hetero.plan import Plan, plan_from_data
from megatron_hetero.simulate import simulate
from megatron_hetero.tuner import TuneOptions, tune

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
    return dataclasses.replace(plan, pipelines=[
        dataclasses.replace(pipe, stages=[dataclasses.replace(st, warmup_microbatches=None)
                                          for st in pipe.stages]) for pipe in plan.pipelines])
