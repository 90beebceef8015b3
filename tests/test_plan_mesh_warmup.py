"""Per-stage warm-up in a mesh plan (issue 28): a mesh stage's ``warmup_microbatches`` loads and
round-trips, format 1's rules hold over each replica's path through the chain (refused at the
``meshes[k].stages[j]`` field), it converts from a format-1 plan, the simulator runs each stage's
count, the chain's own schedule takes it on every rank, and Megatron-LM's path takes it
(tier 1)."""

from __future__ import annotations

import copy

import pytest
import yaml

from megatron_hetero.cost.model import CostModel
from megatron_hetero.hardware import inventory_from_data
from megatron_hetero.plan import load_any_plan, mesh_plan_from_data, meshes_of, save_any_plan
from megatron_hetero.plan import Pipeline, Stage, uniform_plan
from megatron_hetero.schedule.order import rank_order
from megatron_hetero.tuner.validation import validate_plan
from megatron_hetero.schedule.rules import chain_warmup, megatron_warmup
from megatron_hetero.sim.step import simulate

from .conftest import REPO, mesh_plan_error

EXAMPLE = REPO / "examples/meshes/3090-t4-plan.yaml"  # stages 10 | 10 || 12, 16 micro-batches
BASE = yaml.safe_load(EXAMPLE.read_text())
INV = inventory_from_data({"groups": [
    {"gpu": "RTX3090-24GB", "nodes": 2, "gpus_per_node": 8},
    {"gpu": "T4-16GB", "nodes": 4, "gpus_per_node": 4}]}, source="inv.yaml")


def _data(*counts) -> dict:
    """The example with ``counts`` (mesh 0's two stages, mesh 1's one; None: absent)."""
    data = copy.deepcopy(BASE)
    stages = [*data["meshes"][0]["stages"], *data["meshes"][1]["stages"]]
    for stage, w in zip(stages, counts):
        if w is not None:
            stage["warmup_microbatches"] = w
    return data


def test_warmups_load_round_trip_and_choose_the_chain_schedule(tmp_path):
    plan = mesh_plan_from_data(_data(6, 3), source="p.yaml")
    assert [s.warmup_microbatches for m in plan.meshes for s in m.stages] == [6, 3, None]
    assert plan.format_version == 2 and plan.own_chain_schedule and not plan.interleaved_chain
    save_any_plan(plan, tmp_path / "p.yaml")
    again = load_any_plan(tmp_path / "p.yaml")
    assert again == plan
    assert "warmup_microbatches" not in yaml.safe_load(
        (tmp_path / "p.yaml").read_text())["meshes"][1]["stages"][0]  # None: left out
    # Megatron's own counts (P - s - 1: 2, 1, 0) stay on megatron-core's multimodule 1F1B
    same = mesh_plan_from_data(_data(2, 1, 0), source="p.yaml")
    assert not same.own_chain_schedule
    assert not mesh_plan_from_data(_data(), source="p.yaml").own_chain_schedule


@pytest.mark.parametrize("counts,path,expected", [
    ((3, 3), "meshes[0].stages[0].warmup_microbatches", "at least 4: stage 1 warms up 3"),
    ((None, 3), "meshes[0].stages[0].warmup_microbatches",
     "found nothing (Megatron's default 2); expected at least 4"),
    ((17,), "meshes[0].stages[0].warmup_microbatches",
     "at most 16, the micro-batches of meshes[0].replicas[0]"),
    ((None, None, -1), "meshes[1].stages[0].warmup_microbatches", "at least 0"),
])
def test_warmup_rules_hold_over_the_chain(counts, path, expected):
    err = mesh_plan_error(_data(*counts))
    assert err.path == path and expected in str(err), str(err)


def _chunked(*counts) -> dict:
    """:func:`_data` with two chunks a stage (groups of 4 micro-batches: Megatron's interleaved
    warm-ups 8, 6, 4 of 32 chunk-steps)."""
    data = _data(*counts)
    for mesh in data["meshes"]:
        for stage in mesh["stages"]:
            n = stage["num_layers"]
            stage["chunk_layers"] = [n // 2, n - n // 2]
    data["microbatch_group_size"] = 4  # whole groups of 16 micro-batches over 3 stages
    return data


def test_warmups_with_model_chunks_run_on_the_chain_within_the_chain_rule():
    """A chain with chunks takes counts of forward chunk-steps whose orders complete
    (megatron_hetero/schedule/chain.py; tests/test_schedule_chain.py), refuses the others
    naming the counts that would, and refuses any on a plan of one mesh (Megatron's own
    interleaved schedule runs it)."""
    plan = mesh_plan_from_data(_chunked(12), source="p.yaml")
    assert plan.interleaved_chain and plan.own_chain_schedule
    assert [chain_warmup(plan, plan.slot_of_rank(r)) for r in (0, 8, 16)] == [12, 6, 4]
    plain = mesh_plan_from_data(_chunked(), source="p.yaml")
    assert chain_warmup(plain, plain.slot_of_rank(0)) is None
    err = mesh_plan_error(_chunked(13))
    assert err.path == "meshes[0].stages[0].warmup_microbatches", str(err)
    assert "expected 6 to 12 with the other stages' counts as given" in str(err), str(err)
    err = mesh_plan_error(_chunked(None, None, 33))
    assert err.path == "meshes[1].stages[0].warmup_microbatches"
    assert "expected 0 to 32" in str(err), str(err)
    one = _chunked(3)
    one["meshes"] = one["meshes"][:1]
    for stage in one["meshes"][0]["stages"]:
        stage.update(num_layers=16, chunk_layers=[8, 8])
    del one["microbatch_group_size"]
    err = mesh_plan_error(one)
    assert err.path == "meshes[0].stages[0].warmup_microbatches"
    assert "runs Megatron's own interleaved schedule" in str(err), str(err)


def test_simulator_and_memory_price_an_interleaved_chains_warmup():
    """Stage 0 warmed up 12 chunk-steps instead of Megatron's 8: the simulator runs 12 + 1
    forwards before its first backward, and the memory model holds more activations there
    (more forwards in flight per chunk) and the same elsewhere."""
    warm = mesh_plan_from_data(_chunked(12), source="p.yaml")
    plain = mesh_plan_from_data(_chunked(), source="p.yaml")
    cost = CostModel(warm.model, INV)
    got, ref = simulate(warm, cost), simulate(plain, cost)
    for sim, w in ((got, 12), (ref, 8)):
        ops = sorted((e for e in sim.events if e.pipeline == 0 and e.stage == 0
                      and e.kind in "FB"), key=lambda e: e.start)
        assert next(i for i, e in enumerate(ops) if e.kind == "B") == w + 1
    acts = [[s.memory.activations for s in sim.stages if s.pipeline == 0] for sim in (got, ref)]
    assert acts[0][0] > acts[1][0] and acts[0][1:] == acts[1][1:]


def test_meshes_of_carries_a_format_1_plans_warmups():
    plan = load_any_plan(EXAMPLE)
    stages = [Stage(device_type=t, num_layers=n, warmup_microbatches=w)
              for t, n, w in (("RTX3090-24GB", 10, 6), ("RTX3090-24GB", 10, 3),
                              ("T4-16GB", 12, None))]
    one = uniform_plan(model=plan.model, global_batch_size=128, tensor_model_parallel_size=2,
                       precision="fp16",
                       pipelines=[Pipeline(micro_batch_size=1, num_microbatches=16,
                                           stages=stages)] * 8)
    chain = meshes_of(one)
    assert [[s.warmup_microbatches for s in m.stages] for m in chain.meshes] == [[6, 3], [None]]
    assert chain.own_chain_schedule
    assert [chain_warmup(chain, chain.slot_of_rank(r)) for r in (0, 16, 32)] == [6, 3, 0]


def test_simulator_and_chain_schedule_run_each_stages_warmup():
    plan = mesh_plan_from_data(_data(6, 3), source="p.yaml")
    cost = CostModel(plan.model, INV)
    got = simulate(plan, cost)
    m = plan.meshes[0].replicas[0].num_microbatches
    for s, w in enumerate([6, 3, 0]):
        ops = sorted((e for e in got.events if e.pipeline == 0 and e.stage == s
                      and e.kind in "FB"), key=lambda e: e.start)
        first_b = next(i for i, e in enumerate(ops) if e.kind == "B")
        assert first_b == w + (1 if w < m else 0), (s, [e.kind for e in ops[:10]])
    # every rank of the chain takes its stage's count, on every replica
    for rank in range(plan.world_size):
        slot = plan.slot_of_rank(rank)
        w = chain_warmup(plan, slot)
        assert w == [6, 3, 0][plan.global_stage(slot)]
        order = rank_order(plan.pipeline_model_parallel_size, plan.global_stage(slot), m, 1,
                           warmup=w)
        assert [kind for kind, _, _ in order[:w]] == [0] * w and order[w] == (0, w, 0)
    # Megatron's counts: no override (megatron-core's schedule runs the plan)
    plain = mesh_plan_from_data(_data(), source="p.yaml")
    assert chain_warmup(plain, plain.slot_of_rank(0)) is None
    assert megatron_warmup(3, 0, m) == 2


def test_megatron_lms_path_takes_chain_warmups():
    """``validate`` (what Megatron-LM's training checks too) takes a chain with warm-ups,
    interleaved or not: the chain's own schedule runs it there
    (tests/runtime/test_mesh_warmup_training.py trains them)."""
    for data in (_data(6, 3), _chunked(12), _data(2, 1, 0)):
        validate_plan(mesh_plan_from_data(data, source="p.yaml"), None, source="p.yaml",
                      memory_check=False)
