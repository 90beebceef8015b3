"""Properties that reach the interesting plans (issue 33, part 4): pools drawn where uneven data
parallelism and mesh plans win, with the assertion that such plans occur; every emitted plan
passes ``validate --inventory``'s full checks (:func:`validate_plan`), round-trips through its
file and simulates to the figure the tuner reports; and mesh plans drawn at random keep their
invariants. Example counts stay small: each ``tune`` of a mesh pool takes seconds."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hetero.cost.model import CostModel
from megatron_hetero.errors import HeteroError
from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.models import load_model
from megatron_hetero.plan import ModelSpec, any_plan_from_data
from megatron_hetero.sim.step import simulate
from megatron_hetero.tuner import TuneOptions, tune
from megatron_hetero.tuner.validation import validate_plan

SMALL = ModelSpec(name="small", num_layers=8, hidden_size=1024, ffn_hidden_size=2816,
                  num_attention_heads=8, num_query_groups=4, vocab_size=32000, seq_length=2048)
SETTINGS = dict(derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))


def _gpu(tflops: float) -> dict:
    return {"vendor": "test", "bf16_tflops": tflops, "bf16": True, "fp32_tflops": tflops / 10,
            "memory_gb": 80, "memory_bandwidth_gb_s": 2000, "intra_node_link": "x",
            "intra_node_bandwidth_gb_s": 300, "efficiency": 0.5}


def _check(plan, sim, inventory) -> None:
    """``plan`` (emitted with ``sim``) passes validate --inventory, round-trips through its
    file format and simulates to ``sim``'s step on a cost model built from the file alone."""
    again = any_plan_from_data(plan.to_data(), source="tuned", catalog=inventory.catalog)
    assert again.to_data() == plan.to_data()
    validate_plan(again, inventory, source="tuned")
    cost = CostModel(again.model, inventory, precision=again.precision,
                     use_distributed_optimizer=again.use_distributed_optimizer)
    assert simulate(again, cost, record_events=False).step_time_s == pytest.approx(
        sim.step_time_s, rel=1e-9)


def _uneven(plan) -> bool:
    return plan.one_grid and len({(p.micro_batch_size, p.num_microbatches)
                                  for p in plan.pipelines}) > 1


def test_uneven_data_parallel_is_reached_and_every_such_plan_validates():
    """Two device types of equal memory, one faster by a drawn factor, a node each: shares
    follow speed, so most draws tune a plan whose replicas run different batches."""
    seen = []

    @settings(max_examples=12, **SETTINGS)
    @given(st.floats(1.5, 3.0), st.sampled_from([1, 2]), st.sampled_from([48, 64, 96, 128]))
    def run(speedup, per_node, gbs):
        inv = inventory_from_data({
            "groups": [{"gpu": "FAST", "nodes": 1, "gpus_per_node": per_node},
                       {"gpu": "SLOW", "nodes": 1, "gpus_per_node": per_node}],
            "gpus": {"FAST": _gpu(100.0 * speedup), "SLOW": _gpu(100.0)}})
        r = tune(SMALL, inv, gbs)
        _check(r.plan, r.sim, inv)
        if r.baseline_sim is not None:
            assert r.sim.step_time_s <= r.baseline_sim.step_time_s * (1 + 1e-9)
        if _uneven(r.plan):
            fast = [p.samples for p in r.plan.pipelines if p.stages[0].device_type == "FAST"]
            slow = [p.samples for p in r.plan.pipelines if p.stages[0].device_type == "SLOW"]
            assert fast and slow and min(fast) > max(slow)  # the faster cards take more
        seen.append(_uneven(r.plan))

    run()
    assert sum(seen) >= len(seen) // 2, seen


def test_mesh_plans_are_reached_and_every_emitted_one_validates():
    """8 A100s beside 2-4 nodes of 4 T4s, Llama-2 13B: the mesh search (TP per device type)
    wins on some of these pools; every mesh plan it emits, winning or not, validates."""
    seen = []

    @settings(max_examples=4, **SETTINGS)
    @given(st.sampled_from([2, 3, 4]), st.sampled_from([512, 1024]))
    def run(t4_nodes, gbs):
        inv = inventory_from_data({"groups": [
            {"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 8},
            {"gpu": "T4-16GB", "nodes": t4_nodes, "gpus_per_node": 4}]})
        r = tune(load_model("llama2-13b", seq_length=4096), inv, gbs,
                 options=TuneOptions(meshes=True))
        _check(r.plan, r.sim, inv)
        if r.mesh_plan is not None:
            _check(r.mesh_plan, r.mesh_sim, inv)
            assert r.mesh_wins == (r.mesh_sim.step_time_s < r.sim.step_time_s)
        plan, sim = r.best
        assert sim.step_time_s <= r.sim.step_time_s
        seen.append(r.mesh_wins)

    run()
    assert any(seen), seen


MESH_TYPES = ["A100-SXM-80GB", "V100-SXM2-32GB", "RTX3090-24GB", "T4-16GB"]


@st.composite
def mesh_plans(draw):
    """Plan data of 2-3 meshes, each a drawn type, TP, DP and stages, the layers of a 12-layer
    model split among its stages; every replica runs the same number of micro-batches (a
    bridge passes each micro-batch on), their size what the mesh's share of the batch gives."""
    n = draw(st.integers(2, 3))
    cuts = sorted(draw(st.lists(st.integers(1, 11), min_size=n - 1, max_size=n - 1,
                                unique=True)))
    layers = [b - a for a, b in zip([0, *cuts], [*cuts, 12])]
    gbs, per_replica = draw(st.sampled_from([8, 16])), draw(st.sampled_from([1, 2, 4]))
    meshes = []
    for k in range(n):
        dp = draw(st.sampled_from([1, 2, 4]))
        stages = draw(st.integers(1, min(2, layers[k])))
        split = [layers[k] // stages + (i < layers[k] % stages) for i in range(stages)]
        meshes.append({"device_type": draw(st.sampled_from(MESH_TYPES)),
                       "tensor_model_parallel_size": draw(st.sampled_from([1, 2])),
                       "replicas": [{"micro_batch_size": gbs // (dp * per_replica),
                                     "num_microbatches": per_replica} for _ in range(dp)],
                       "stages": [{"num_layers": x} for x in split]})
    bf16 = all(m["device_type"] != "V100-SXM2-32GB" for m in meshes)
    return {"format_version": 2,
            "model": {"name": "m", "num_layers": 12, "hidden_size": 1024,
                      "ffn_hidden_size": 2816, "num_attention_heads": 8, "num_query_groups": 8,
                      "vocab_size": 32000, "seq_length": 1024,
                      "untie_embeddings_and_output_weights": True},
            "global_batch_size": gbs, "precision": "bf16" if bf16 else "fp16",
            "use_distributed_optimizer": True, "meshes": meshes}


def test_mesh_plans_keep_their_invariants():
    """Mesh plans drawn at random: the loader accepts some (the check is reached) and every
    accepted one has its layers adding up, one rank per slot and back, each device type
    counted as its meshes' ranks, a file that reads back to the same plan, and on a pool of
    exactly its GPUs either validate's one-line refusal or a step no shorter than any
    stage's busy time."""
    accepted, simulated = [], []

    @settings(max_examples=40, **SETTINGS)
    @given(mesh_plans())
    def run(data):
        try:
            plan = any_plan_from_data(data, source="drawn")
        except HeteroError as exc:
            assert "\n" not in str(exc)
            accepted.append(False)
            return
        accepted.append(True)
        assert sum(plan.layer_split) == 12 and not plan.one_grid
        ranks = [plan.slot_of_rank(r) for r in range(plan.world_size)]
        assert len(set(ranks)) == plan.world_size
        assert [plan.rank_of_slot(s) for s in ranks] == list(range(plan.world_size))
        assert sum(plan.device_counts().values()) == plan.world_size
        for m, mesh in enumerate(plan.meshes):
            want = mesh.world_size
            assert sum(plan.device_type_of_rank(r) == mesh.device_type
                       for r in range(plan.rank_offset(m), plan.rank_offset(m) + want)) == want
        assert any_plan_from_data(plan.to_data(), source="again").to_data() == plan.to_data()
        inv = inventory_from_data({"groups": [{"gpu": gpu, "nodes": 1, "gpus_per_node": count}
                                              for gpu, count in plan.device_counts().items()]})
        try:
            validate_plan(plan, inv, source="drawn", memory_check=False)
        except HeteroError as exc:
            assert "\n" not in str(exc)
            return
        cost = CostModel(plan.model, inv, precision=plan.precision,
                         use_distributed_optimizer=plan.use_distributed_optimizer)
        sim = simulate(plan, cost, record_events=False)
        assert all(st_.busy_s <= sim.step_time_s * (1 + 1e-9) for st_ in sim.stages)
        simulated.append(sim.step_time_s)

    run()
    assert sum(accepted) >= len(accepted) // 2 and len(simulated) >= 5, (accepted, simulated)
