"""The search's lower bound (tuner.space.structures): whole layers pace a large batch, and the
bound stays below every structure's estimate, so the walk prunes nothing it would keep."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hetero._schema import read_yaml
from megatron_hetero.hardware import inventory_from_data
from megatron_hetero.models import load_model
from megatron_hetero.tuner.problem import Problem, TuneOptions
from megatron_hetero.tuner.search import _Search
from megatron_hetero.tuner.space import _whole_layers, structures

SCENARIOS = Path(__file__).resolve().parents[2] / "examples" / "scenarios"


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.floats(0.01, 5.0), st.integers(1, 3)), min_size=1, max_size=3),
       st.integers(1, 9))
def test_whole_layers_is_the_least_slowest_stage(layer, L):
    stages = [x for x, k in layer for _ in range(k)]
    best = min(max(n * x for n, x in zip(split, stages))
               for split in itertools.product(range(L + 1), repeat=len(stages))
               if sum(split) == L)
    assert _whole_layers(layer, L) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("gbs", [128, 16384])
def test_the_bound_is_below_every_estimate(gbs):
    data = read_yaml(SCENARIOS / "a100-v100-llama2-7b.yaml")
    inventory = inventory_from_data(data["inventory"], source="scenario")
    model = load_model(data["model"], seq_length=data.get("seq_length"))
    problem = Problem(model, inventory, gbs, {}, TuneOptions())
    search = _Search(problem)
    checked = 0
    for lb, structure in structures(problem)[:150]:
        got = search.evaluate(structure, baseline=False)
        if got is not None:
            checked += 1
            assert lb <= got.score * (1 + 1e-9), structure
    assert checked > 20


@pytest.mark.parametrize("gbs", [7, 16384])
def test_structures_are_unique_and_in_bound_order(gbs):
    # sorted as (bound, fields) tuples and built once known to be new: in the order of the
    # bound then the fields, each structure once, at its least bound
    data = read_yaml(SCENARIOS / "4090-3090-a100-llama2-7b.yaml")
    inventory = inventory_from_data(data["inventory"], source="scenario")
    model = load_model(data["model"], seq_length=data.get("seq_length"))
    got = structures(Problem(model, inventory, gbs, {}, TuneOptions()))
    keys = [(lb, s.tp, s.pp, s.mbs, s.vp, s.templates) for lb, s in got]
    assert keys == sorted(keys)
    assert len({s for _, s in got}) == len(got) > 1000


@pytest.mark.parametrize("grouped", [False, True])
def test_the_bound_is_below_every_estimate_of_a_mixture_of_experts(grouped):
    """Qwen3-30B-A3B (128 experts): without grouped GEMM every stage pays each local expert's
    launch cost (cost.experts.SEQUENTIAL_EXPERT_S), which depends on the structure's EP; the
    bound counts it at that EP and stays below every estimate."""
    import dataclasses

    from megatron_hetero.models import model_preset
    inventory = inventory_from_data({"groups": [
        {"gpu": "H100-SXM-80GB", "nodes": 1, "gpus_per_node": 8},
        {"gpu": "A100-SXM-40GB", "nodes": 2, "gpus_per_node": 8}]}, source="pool")
    model = dataclasses.replace(model_preset("qwen3-30b-a3b"), moe_grouped_gemm=grouped)
    problem = Problem(model, inventory, 256, {}, TuneOptions())
    search = _Search(problem)
    checked, eps = 0, set()
    for lb, structure in structures(problem)[:120]:
        got = search.evaluate(structure, baseline=False)
        if got is not None:
            checked += 1
            eps.add(structure.ep)
            assert lb <= got.score * (1 + 1e-9), structure
    assert checked > 10 and len(eps) > 1


def test_sequential_experts_cost_per_local_expert_unless_grouped():
    import dataclasses

    from megatron_hetero.cost.experts import SEQUENTIAL_EXPERT_S
    from megatron_hetero.cost.model import CostModel
    from megatron_hetero.models import model_preset
    inventory = inventory_from_data({"groups": [{"gpu": "H100-SXM-80GB", "nodes": 1,
                                                 "gpus_per_node": 8}]}, source="pool")
    model = model_preset("qwen3-30b-a3b")
    cost = CostModel(model, inventory)
    one = cost.sequential_expert_times("H100-SXM-80GB", 1, 1, 1)
    assert one == pytest.approx((128 * SEQUENTIAL_EXPERT_S[0], 128 * SEQUENTIAL_EXPERT_S[1]))
    assert cost.sequential_expert_times("H100-SXM-80GB", 1, 1, 8) == pytest.approx(
        (one[0] / 8, one[1] / 8))
    grouped = CostModel(dataclasses.replace(model, moe_grouped_gemm=True), inventory)
    assert grouped.sequential_expert_times("H100-SXM-80GB", 1, 1, 1) == (0.0, 0.0)
    dense = CostModel(model_preset("llama2-7b"), inventory)
    assert dense.sequential_expert_times("H100-SXM-80GB", 1, 1, 1) == (0.0, 0.0)
