"""Pure plan transformations of the mini trainer (no processes)."""

from __future__ import annotations

import pytest

from megatron_hetero.emulate.trainer import TrainConfig, reference_plan, sample_tokens, with_tiny_model
from megatron_hetero.plan import load_plan

from ..conftest import EXAMPLE_PLANS
from .conftest import tiny_plan


@pytest.mark.parametrize("path", EXAMPLE_PLANS, ids=lambda p: p.parent.name)
def test_shrink_keeps_split_pipelines_and_ranks(path):
    plan = load_plan(path)
    heads = 4 * plan.tensor_model_parallel_size
    small = with_tiny_model(plan, hidden_size=64, num_attention_heads=heads)
    assert small.layer_split == plan.layer_split
    assert small.world_size == plan.world_size
    assert [(p.micro_batch_size, p.num_microbatches) for p in small.pipelines] == [
        (p.micro_batch_size, p.num_microbatches) for p in plan.pipelines]
    assert small.model.hidden_size == 64 and small.precision == "fp32"
    assert small.layout() == plan.layout()


@pytest.mark.parametrize("path", EXAMPLE_PLANS, ids=lambda p: p.parent.name)
def test_reference_is_one_process_with_the_same_batch(path):
    plan = load_plan(path)
    ref = reference_plan(plan)
    assert ref.world_size == 1
    assert ref.global_batch_size == plan.global_batch_size
    assert ref.model == plan.model
    assert not ref.use_distributed_optimizer


def test_reference_micro_batch_divides_every_replica():
    plan = tiny_plan([2, 4], [(2, 3), (4, 1)])
    (pipe,) = reference_plan(plan).pipelines
    assert pipe.micro_batch_size == 2 and pipe.num_microbatches == 5


def test_samples_are_deterministic_and_distinct():
    a, b = sample_tokens(7, 1, 16, 50), sample_tokens(7, 1, 16, 50)
    assert a.tolist() == b.tolist() and len(a) == 17 and 0 <= int(a.min()) and int(a.max()) < 50
    assert sample_tokens(8, 1, 16, 50).tolist() != a.tolist()
    assert sample_tokens(7, 2, 16, 50).tolist() != a.tolist()


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="optimizer"):
        TrainConfig(optimizer="lamb")
