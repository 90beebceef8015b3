"""Pure plan transformations of the mini trainer (no processes)."""

from __future__ import annotations

import pytest

from megatron_hetero.emulate.trainer import TrainConfig, reference_plan, sample_tokens, with_tiny_model
from megatron_hetero.plan import load_plan

from ..conftest import EXAMPLE_PLANS, REPO
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


MESH_PLAN = REPO / "examples/meshes/rehearse-plan.yaml"


def test_backend_follows_the_plan_shape():
    """One grid trains on megatron-core's own schedules, a chain of meshes on the multimodule
    communicator; both behind one interface."""
    from megatron_hetero.emulate.rank_backends import ChainRank, GridRank, RankBackend, backend_for
    from megatron_hetero.plan import load_any_plan

    assert backend_for(tiny_plan([2, 4], [(2, 3), (4, 1)])) is GridRank
    assert backend_for(load_any_plan(MESH_PLAN)) is ChainRank
    assert issubclass(GridRank, RankBackend) and issubclass(ChainRank, RankBackend)


def test_chain_of_alike_replicas_joins_rows_one_grid_reads_shares():
    """A chain whose replicas are alike reads micro-batch m as rows of D x b samples (the
    bridge's order), replica r its rows r b .. (r + 1) b - 1; one grid's replicas read their own
    consecutive shares; the reference runs micro-batches of the same unit."""
    from megatron_hetero.emulate.trainer import rows_joined, sample_index
    from megatron_hetero.plan import Slot, load_any_plan

    chain = load_any_plan(MESH_PLAN)  # mesh 0: 2 replicas of 8 x 1; mesh 1: 1 replica of 8 x 2
    assert rows_joined(chain)
    assert [sample_index(chain, Slot(0, 0, r, 0), 1, 3, 0) for r in (0, 1)] == [16 + 6, 16 + 7]
    assert [sample_index(chain, Slot(1, 0, 0, 1), 1, 3, j) for j in (0, 1)] == [16 + 6, 16 + 7]
    (pipe,) = reference_plan(chain).pipelines
    assert (pipe.micro_batch_size, pipe.num_microbatches) == (2, 8)
    grid = tiny_plan([2, 4], [(2, 3), (4, 1)])  # replica 0: 6 samples, replica 1: 4
    assert not rows_joined(grid)
    assert sample_index(grid, Slot(0, 0, 1, 0), 0, 0, 2) == 6 + 2
    assert sample_index(grid, Slot(0, 0, 0, 0), 2, 1, 1) == 2 * grid.global_batch_size + 3
