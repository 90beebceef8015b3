"""Mesh plans (format 2): strict loading with field paths, the bridge rules, the check against
an inventory, rank numbering as megatron-core's HyperCommGrid has it, ``validate`` and ``args``
(tier 1)."""

from __future__ import annotations

import copy

import pytest
import yaml

from megatron_hetero import cli
from megatron_hetero.errors import SchemaError
from megatron_hetero.hardware import inventory_from_data
from megatron_hetero.plan.checks import host_bridges
from megatron_hetero.plan.megatron_args import megatron_args
from megatron_hetero.plan import (Plan, Slot, any_plan_from_data, load_any_plan, load_plan,
                                  mesh_plan_from_data, plan_from_data, save_any_plan)
from megatron_hetero.placement.inventory import check_against_inventory

from .conftest import EXAMPLE_PLANS, REPO, mesh_plan_error

EXAMPLE = REPO / "examples/meshes/3090-t4-plan.yaml"
INVENTORY = REPO / "examples/meshes/inventory.yaml"
BASE = yaml.safe_load(EXAMPLE.read_text())


def _replicas(n: int, mbs: int, m: int) -> list[dict]:
    return [{"micro_batch_size": mbs, "num_microbatches": m} for _ in range(n)]


def _with(**changes) -> dict:
    data = copy.deepcopy(BASE)
    for k, (key, value) in changes.items():
        data["meshes"][int(k[1:])][key] = value
    return data


def test_example_loads_and_round_trips(tmp_path):
    plan = load_any_plan(EXAMPLE)
    assert isinstance(plan, Plan) and not plan.one_grid and plan.format_version == 2
    assert plan.layer_split == [10, 10, 12] and plan.world_size == 32
    assert [m.data_parallel_size for m in plan.meshes] == [8, 8]
    save_any_plan(plan, tmp_path / "p.yaml")
    again = load_any_plan(tmp_path / "p.yaml")
    assert again == plan
    save_any_plan(again, tmp_path / "q.yaml")
    assert (tmp_path / "q.yaml").read_bytes() == (tmp_path / "p.yaml").read_bytes()


def test_offload_of_a_mesh_plan_is_per_stage():
    """The example offloads module inputs on the 3090 mesh's two stages only: the plan says so
    as a format-1 plan does, and each rank's stage (what its policies come from) is its own."""
    plan = load_any_plan(EXAMPLE)
    assert plan.offloads_module_inputs and not plan.offloads_optimizer
    first, t4 = Slot(0, 1, 7, 0), Slot(1, 0, 0, 1)
    assert plan.stage_of_slot(first).offload.module_inputs
    assert not plan.stage_of_slot(t4).offload.any
    assert plan.stage_of_slot(t4).recompute.granularity == "selective"
    data = copy.deepcopy(BASE)
    data["meshes"][1]["stages"][0]["offload"] = {"optimizer_fraction": 0.5}
    assert mesh_plan_from_data(data, source="p.yaml").offloads_optimizer
    assert "--use-precision-aware-optimizer" in megatron_args(
        mesh_plan_from_data(data, source="p.yaml"))


@pytest.mark.parametrize("path", EXAMPLE_PLANS, ids=lambda p: p.parent.name)
def test_format_1_plans_load_unchanged_and_round_trip_byte_identically(path, tmp_path):
    plan = load_any_plan(path)
    assert plan == load_plan(path)
    save_any_plan(plan, tmp_path / "p.yaml")
    written = (tmp_path / "p.yaml").read_bytes()
    save_any_plan(load_any_plan(tmp_path / "p.yaml"), tmp_path / "q.yaml")
    assert (tmp_path / "q.yaml").read_bytes() == written


def test_format_1_loader_refuses_a_mesh_plan_by_its_version():
    with pytest.raises(SchemaError, match=r"format_version: found 2; expected 1 here: this "
                                          r"command does not take mesh plans"):
        plan_from_data(BASE, source="p.yaml")


@pytest.mark.parametrize("data, path, expected", [
    (_with(m1=("tensor_model_parallel_size", 3)), "meshes[1].tensor_model_parallel_size",
     "a divisor of model.num_attention_heads (32)"),
    (_with(m0=("stages", [{"num_layers": 10}])), "meshes",
     "layers adding up to model.num_layers (32)"),
    (_with(m1=("replicas", _replicas(8, 1, 15))), "meshes[1].replicas",
     "adding up to global_batch_size (128)"),
    # DP 8 -> 3: neither divides the other
    (_with(m1=("replicas", _replicas(3, 1, 16)[:2] + [{"micro_batch_size": 1, "num_microbatches": 96}])),
     "meshes[1].replicas", "a multiple or a divisor of meshes[0]'s 8 replicas"),
    # DP 8 -> 4 with the micro-batch counts changed across the bridge
    (_with(m1=("replicas", _replicas(4, 4, 8))), "meshes[1].replicas[0].num_microbatches",
     "16, as meshes[0]"),
    # DP 8 -> 16, the micro-batch of 8 samples split over 16 replicas
    (_with(m1=("replicas", _replicas(16, 1, 8))), "meshes[1].replicas[0].num_microbatches",
     "16, as meshes[0]"),
    # equal DP: replica r must be the same on both sides of the bridge
    (_with(m1=("replicas", _replicas(7, 1, 16) + [{"micro_batch_size": 2, "num_microbatches": 8}])),
     "meshes[1].replicas[7]", "keeps every sample on one replica's path"),
    (_with(m0=("device_type", "RTX 3090")), "meshes[0].device_type", "a canonical catalog name"),
    (_with(m1=("stages", [{"num_layers": 12, "chunk_layers": [6, 6]}])),
     "meshes[1].stages[0].chunk_layers", "absent, as in meshes[0].stages[0]"),
])
def test_errors_name_the_field(data, path, expected):
    err = mesh_plan_error(data)
    assert err.path == path and expected in err.expected, str(err)


def test_tied_embeddings_are_refused_where_the_model_has_several_stages():
    """The output layer tied to the embedding needs an embedding group between the model's first
    and last stage, which a mesh plan does not have: refused with the field's path; a plan of one
    stage keeps it (nothing to tie across)."""
    data = copy.deepcopy(BASE)
    data["model"]["untie_embeddings_and_output_weights"] = False
    err = mesh_plan_error(data)
    assert err.path == "model.untie_embeddings_and_output_weights", str(err)
    assert "no embedding group" in err.expected
    one = copy.deepcopy(data)
    one["meshes"] = [one["meshes"][0]]
    one["meshes"][0]["stages"] = [{"num_layers": 32}]
    assert mesh_plan_from_data(one, source="p.yaml").layer_split == [32]


def test_meshes_of_two_vendors_load_and_their_bridge_is_host_staged():
    """A bridge between an NVIDIA mesh and an AMD one is a vendor boundary on a pipeline edge:
    the plan loads (simulate prices the bridge on the host path,
    tests/test_plan_mesh_vendors.py), Megatron-LM's path takes it, and its bridge is the one
    staged through host memory."""
    plan = mesh_plan_from_data(_with(m1=("device_type", "MI300X-192GB")), source="p.yaml")
    assert host_bridges(plan) == [True, True]  # mesh 0 -> 1, and the wrap-around 1 -> 0
    same = mesh_plan_from_data(_with(m1=("device_type", "H100-SXM-80GB")), source="p.yaml")
    assert host_bridges(same) == [False, False]


def test_micro_batch_must_split_evenly_across_a_bridge():
    data = _with(m1=("replicas", _replicas(4, 3, 16)))  # 8 x 1 samples -> 4 x 3
    data["global_batch_size"] = 128
    err = mesh_plan_error(data)
    # the sums differ first: the T4 mesh would take 192 samples
    assert err.path == "meshes[1].replicas"
    data = copy.deepcopy(BASE)
    data["meshes"][0]["replicas"] = _replicas(8, 2, 8)
    data["meshes"][1]["replicas"] = _replicas(2, 4, 16)  # 128 samples, 8 x 2 != 2 x 4 per micro-batch
    err = mesh_plan_error(data)
    assert err.path == "meshes[1].replicas[0].num_microbatches"
    data["meshes"][1]["replicas"] = _replicas(2, 8, 8)
    assert mesh_plan_from_data(data).meshes[1].replicas[0].micro_batch_size == 8
    data["meshes"][1]["replicas"] = _replicas(32, 1, 4)
    assert mesh_plan_error(data).path == "meshes[1].replicas[0].num_microbatches"


def test_uneven_replicas_only_where_the_bridges_keep_the_paths():
    uneven = [{"micro_batch_size": 1, "num_microbatches": n} for n in (20, 20, 20, 20, 12, 12, 12, 12)]
    data = copy.deepcopy(BASE)
    data["meshes"][0]["replicas"] = uneven
    data["meshes"][1]["replicas"] = copy.deepcopy(uneven)
    plan = mesh_plan_from_data(data)  # DP 8 -> 8: replica r's samples stay on path r
    assert not plan.meshes[0].even
    assert "--calculate-per-token-loss" in megatron_args(plan)
    data["meshes"][1]["replicas"] = _replicas(4, 2, 16)
    err = mesh_plan_error(data)
    assert err.path == "meshes[0].replicas"
    assert "uneven data parallelism needs the same number of replicas on both sides" in err.expected


def test_zero_layer_stage_only_at_the_ends():
    data = copy.deepcopy(BASE)
    data["meshes"][0]["stages"] = [{"num_layers": 0}, {"num_layers": 20}]
    assert mesh_plan_from_data(data).layer_split == [0, 20, 12]
    data["meshes"][0]["stages"] = [{"num_layers": 20}, {"num_layers": 0}]
    assert mesh_plan_error(data).path == "meshes[0].stages[1].num_layers"


def test_rank_numbering_matches_megatron_rank_generator_with_rank_offset():
    """Each mesh's ranks, as megatron-core's RankGenerator enumerates them for order tp-cp-dp-pp
    at the mesh's rank offset (HyperCommGrid's ``_gen_rank_enum`` is tested against it
    upstream; it needs einops, absent here), form the TP, DP and PP groups of the plan's
    slot_of_rank."""
    from megatron.core.parallel_state import RankGenerator

    plan = load_any_plan(EXAMPLE)
    seen = []
    for k, mesh in enumerate(plan.meshes):
        T, D, P = mesh.tensor_model_parallel_size, mesh.data_parallel_size, len(mesh.stages)
        gen = RankGenerator(tp=T, ep=1, dp=D, pp=P, cp=1, order="tp-cp-dp-pp",
                            rank_offset=plan.rank_offset(k))
        for dim, field in (("tp", "tensor_rank"), ("dp", "replica"), ("pp", "stage")):
            for group in gen.get_ranks(dim):
                slots = [plan.slot_of_rank(r) for r in group]
                assert {s.mesh for s in slots} == {k}
                assert [getattr(s, field) for s in slots] == list(range(len(group)))
                others = {tuple(getattr(s, f) for f in ("tensor_rank", "replica", "stage")
                                if f != field) for s in slots}
                assert len(others) == 1
        seen += sorted(r for group in gen.get_ranks("tp") for r in group)
    assert seen == list(range(plan.world_size))
    for rank in range(plan.world_size):
        assert plan.rank_of_slot(plan.slot_of_rank(rank)) == rank
    assert plan.slot_of_rank(16) == Slot(mesh=1, stage=0, replica=0, tensor_rank=0)
    assert plan.slot_of_rank(19) == Slot(mesh=1, stage=0, replica=1, tensor_rank=1)


def _inventory(t4_per_node: int = 4, t4_nodes: int = 4):
    return inventory_from_data({"groups": [
        {"gpu": "RTX3090-24GB", "nodes": 2, "gpus_per_node": 8},
        {"gpu": "T4-16GB", "nodes": t4_nodes, "gpus_per_node": t4_per_node}]}, source="inv.yaml")


def test_inventory_check_per_mesh_node_size():
    plan = load_any_plan(EXAMPLE)
    check_against_inventory(plan, _inventory(), source="p.yaml")
    data = _with(m1=("tensor_model_parallel_size", 8))
    data["meshes"][1]["replicas"] = _replicas(8, 1, 16)
    big = mesh_plan_from_data(data)
    with pytest.raises(SchemaError) as exc:  # 64 T4s asked for, 16 there
        check_against_inventory(big, _inventory(t4_per_node=4, t4_nodes=16), source="p.yaml")
    assert exc.value.path == "meshes[1].tensor_model_parallel_size"
    assert "at most 4, the GPUs per node of type T4-16GB" in exc.value.expected
    # TP=8 on the 3090s' 8-GPU nodes is fine where the pool is large enough
    data = copy.deepcopy(BASE)
    data["meshes"][0]["tensor_model_parallel_size"] = 8
    data["meshes"][0]["replicas"] = _replicas(1, 8, 16)
    data["meshes"][0]["stages"] = [{"num_layers": 20}]
    data["meshes"][1]["replicas"] = _replicas(8, 1, 16)
    check_against_inventory(mesh_plan_from_data(data), _inventory(), source="p.yaml")
    with pytest.raises(SchemaError) as exc:  # 16 T4s asked for, 12 there
        check_against_inventory(plan, _inventory(t4_nodes=3), source="p.yaml")
    assert exc.value.path == "meshes" and "at most 12" in exc.value.expected


def test_whole_groups_inside_nodes():
    """TP=4 groups on 3-GPU nodes do not fit even where the count does."""
    data = copy.deepcopy(BASE)
    data["meshes"][1]["tensor_model_parallel_size"] = 2
    data["meshes"][1]["replicas"] = _replicas(8, 1, 16)
    plan = mesh_plan_from_data(data)
    with pytest.raises(SchemaError) as exc:
        check_against_inventory(plan, _inventory(t4_per_node=3, t4_nodes=6), source="p.yaml")
    assert exc.value.path == "meshes" and "whole groups of 2" in exc.value.expected


def test_validate_and_args_commands(capsys):
    assert cli.main(["validate", str(EXAMPLE), "--inventory", str(INVENTORY)]) == 0
    out = capsys.readouterr().out
    assert "valid mesh plan" in out and "mesh 1: 16x T4-16GB TP=2 DP=8 PP=1" in out
    assert cli.main(["args", str(EXAMPLE)]) == 0
    line = capsys.readouterr().out
    assert "--pipeline-model-parallel-layout 'Et*10|t*10|t*12L'" in line
    for per_mesh in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                     "--micro-batch-size"):
        assert per_mesh not in line
    assert "--global-batch-size 128" in line and "--fp16" in line


def test_any_loader_dispatches_on_the_version():
    data = yaml.safe_load(EXAMPLE_PLANS[0].read_text())
    one, chain = any_plan_from_data(data), any_plan_from_data(BASE)
    assert one.one_grid and one.format_version == 1
    assert not chain.one_grid and chain.format_version == 2


def _random_plan_data(draw, st):
    """A valid mesh plan: a DP chain where neighbours divide one another, even replicas."""
    n = draw(st.integers(1, 4))
    dps = [draw(st.sampled_from([1, 2, 4, 8]))]
    for _ in range(n - 1):
        dps.append(draw(st.sampled_from([d for d in (1, 2, 4, 8)
                                         if max(d, dps[-1]) % min(d, dps[-1]) == 0])))
    batch = 8  # samples per micro-batch: every DP in the chain divides it
    m = draw(st.integers(1, 4))
    stages = [draw(st.integers(1, 3)) for _ in range(n)]
    total = sum(stages)
    layers = [1] * total
    layers[0] += 32 - total
    it = iter(layers)
    meshes = [{"device_type": draw(st.sampled_from(["A100-SXM-80GB", "RTX3090-24GB", "T4-16GB"])),
               "tensor_model_parallel_size": draw(st.sampled_from([1, 2, 4])),
               "replicas": _replicas(dps[k], batch // dps[k], m),
               "stages": [{"num_layers": next(it)} for _ in range(stages[k])]}
              for k in range(n)]
    data = copy.deepcopy(BASE)
    data.update(global_batch_size=batch * m, meshes=meshes)
    return data


def test_random_mesh_plans_round_trip_and_number_every_rank_once(tmp_path):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from megatron_hetero.placement.nodes import place

    big = inventory_from_data({"groups": [
        {"gpu": g, "nodes": 64, "gpus_per_node": 8}
        for g in ("A100-SXM-80GB", "RTX3090-24GB", "T4-16GB")]}, source="big.yaml")

    @settings(max_examples=60, deadline=None)
    @given(st.data())
    def check(data):
        raw = _random_plan_data(data.draw, st)
        plan = mesh_plan_from_data(raw)
        # the normal form: a chain of one mesh is written as format 1, the same plan
        assert any_plan_from_data(plan.to_data()) == plan
        assert plan.to_data()["format_version"] == (1 if len(raw["meshes"]) == 1 else 2)
        slots = [plan.slot_of_rank(r) for r in range(plan.world_size)]
        assert len(set(slots)) == plan.world_size
        assert [plan.rank_of_slot(s) for s in slots] == list(range(plan.world_size))
        placed = place(plan, big)
        for k, mesh in enumerate(plan.meshes):
            for j in range(len(mesh.stages)):
                for r in range(mesh.data_parallel_size):
                    assert big.groups[placed.node(k, j, r).group].gpu == mesh.device_type
        check_against_inventory(plan, big, source="p.yaml")

    check()
