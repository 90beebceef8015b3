"""Mixture-of-experts plans on CPU ranks equal one process: megatron-core's MoE layer, router and
all-to-all token dispatcher under expert parallelism carved out of data parallelism.

The tiny model has 4 routed experts (top-2, dropless: no capacity factor) in 4 of its 6 layers
(``moe_layer_freq`` [0, 1, 1, 0, 1, 1]: dense and MoE layers mixed). Each plan trains 3 steps
with Adam; losses, the forward-only loss after training and every parameter (each expert under
its global index, gathered from the replica that holds it) must match one process within the
tolerances of ``test_equivalence.py`` (losses rtol 1e-5; parameters rtol 1e-5 + atol 1e-5).
"""

from __future__ import annotations

import pytest

from megatron_hetero.emulate.trainer import TrainConfig, compare_results, reference_plan, train_plan

from .conftest import tiny_plan

pytestmark = pytest.mark.slow

MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
           moe_layer_freq=[0, 1, 1, 0, 1, 1])
CONFIG = TrainConfig(steps=3)


@pytest.mark.parametrize("name, plan", [
    ("pp2_dp2_ep2_split_2_4", tiny_plan([2, 4], [(1, 2), (1, 2)],
                                        expert_model_parallel_size=2, **MOE)),
    ("dp2_ep2_microbatches_3_3", tiny_plan([6], [(1, 3), (1, 3)],
                                           expert_model_parallel_size=2, **MOE)),
])
def test_expert_parallel_plan_equals_one_process(name, plan):
    assert plan.meshes[0].expert_model_parallel_size == 2 and plan.model.is_moe
    got = train_plan(plan, CONFIG)
    ref = train_plan(reference_plan(plan), CONFIG)
    experts = [n for n in ref.params if ".local_experts." in n]
    assert len(experts) == 4 * 4 * 2  # fc1 and fc2 of 4 experts in 4 MoE layers
    assert sorted(got.params) == sorted(ref.params)
    assert compare_results(got, ref, rtol=1e-5, atol=1e-5) is None
