"""Edges of `tune` (tier 1): its plans are plans the runtime accepts (an uneven plan needs a
global batch size divisible by its data-parallel size: Megatron's own step accounting, see
:func:`megatron_hetero.runtime.plan_args.virtual_micro_batch_size`); tiny models."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.plan import ModelSpec
from megatron_hetero.runtime.plan_args import virtual_micro_batch_size
from megatron_hetero.tuner import tune

SMALL = ModelSpec(name="small", num_layers=16, hidden_size=2048, ffn_hidden_size=5504,
                  num_attention_heads=16, num_query_groups=16, vocab_size=32000, seq_length=2048)


def _runtime_accepts(plan) -> None:
    if not plan.uniform_data_parallel:
        assert plan.global_batch_size % plan.data_parallel_size == 0
        virtual_micro_batch_size(plan)  # raises ArgumentConflict when Megatron cannot count it


@pytest.mark.parametrize("groups", [
    [{"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 3}],
    [{"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 2},
     {"gpu": "V100-SXM2-32GB", "nodes": 1, "gpus_per_node": 1}],
])
def test_three_replicas_are_not_planned_for_a_batch_of_128(groups):
    # Used to emit DP=3 with 43:43:42 (and 28:28:8) micro-batches, which the runtime refuses at
    # start: 128 is not a multiple of 3.
    result = tune(SMALL, inventory_from_data({"groups": groups}), 128)
    _runtime_accepts(result.plan)
    if result.baseline_plan is not None:
        _runtime_accepts(result.baseline_plan)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=st.integers(1, 7), b=st.integers(0, 5), gbs=st.sampled_from([30, 64, 96, 100, 128]))
def test_any_small_pool_gets_a_plan_the_runtime_accepts(a, b, gbs):
    groups = [{"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": a}]
    if b:
        groups.append({"gpu": "V100-SXM2-32GB", "nodes": 1, "gpus_per_node": b})
    _runtime_accepts(tune(SMALL, inventory_from_data({"groups": groups}), gbs).plan)


@pytest.mark.parametrize("layers", [1, 2])
def test_models_of_one_or_two_layers(layers):
    # A 1-layer model crashed the search (IndexError in the per-layer time of its table).
    tiny = ModelSpec(name="tiny", num_layers=layers, hidden_size=64, ffn_hidden_size=128,
                     num_attention_heads=2, num_query_groups=1, vocab_size=100, seq_length=16)
    inv = inventory_from_data({"groups": [{"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 2},
                                          {"gpu": "V100-SXM2-32GB", "nodes": 1, "gpus_per_node": 2}]})
    plan = tune(tiny, inv, 4).plan
    assert sum(plan.layer_split) == layers and plan.pipeline_model_parallel_size <= layers
    _runtime_accepts(plan)
