"""Sequence parallelism in a mesh plan (issue 28): the plan's ``sequence_parallel`` runs in
every mesh of TP > 1: it loads and round-trips, is refused at its field path where no mesh can
run it or a mesh's TP does not divide the sequence, lets an MoE mesh run TP > 1, reaches
``args``, shards the activation memory of TP > 1 meshes only, and prices the bridge's sequence
gathers (tier 1)."""

from __future__ import annotations

import copy

import pytest
import yaml

from megatron_hetero.cost.mesh import Bridge, bridge_seconds
from megatron_hetero.cost.model import CostModel
from megatron_hetero.cost.stage import StageShape
from megatron_hetero.hardware import inventory_from_data
from megatron_hetero.plan import load_any_plan, mesh_plan_from_data, save_any_plan
from megatron_hetero.plan.megatron_args import megatron_args

from .conftest import REPO, mesh_plan_error

BASE = yaml.safe_load((REPO / "examples/meshes/3090-t4-plan.yaml").read_text())
INV = inventory_from_data({"groups": [
    {"gpu": "RTX3090-24GB", "nodes": 2, "gpus_per_node": 8},
    {"gpu": "T4-16GB", "nodes": 4, "gpus_per_node": 4}]}, source="inv.yaml")


def _data(**top) -> dict:
    data = copy.deepcopy(BASE)  # mesh 0: TP 1, mesh 1: TP 2
    data.update(top)
    return data


def test_sequence_parallel_loads_round_trips_and_reaches_args(tmp_path):
    plan = mesh_plan_from_data(_data(sequence_parallel=True), source="p.yaml")
    assert plan.sequence_parallel and plan.format_version == 2
    assert [plan.sequence_parallel_in(k) for k in range(2)] == [False, True]  # TP 1, TP 2
    save_any_plan(plan, tmp_path / "p.yaml")
    assert yaml.safe_load((tmp_path / "p.yaml").read_text())["sequence_parallel"] is True
    assert load_any_plan(tmp_path / "p.yaml") == plan
    assert "--sequence-parallel" in megatron_args(plan)
    plain = mesh_plan_from_data(_data(), source="p.yaml")
    assert plain.to_data()["sequence_parallel"] is False  # written out, as format 1 does
    assert "--sequence-parallel" not in megatron_args(plain)


def test_sequence_parallel_without_a_tensor_parallel_mesh_is_refused():
    data = _data(sequence_parallel=True)
    data["meshes"][1]["tensor_model_parallel_size"] = 1
    err = mesh_plan_error(data)
    assert err.path == "sequence_parallel" and "tensor_model_parallel_size is 1" in str(err)


def test_a_mesh_tp_that_does_not_divide_the_sequence_is_refused():
    data = _data(sequence_parallel=True)
    data["model"]["seq_length"] = 2047
    err = mesh_plan_error(data)
    assert err.path == "meshes[1].tensor_model_parallel_size"
    assert "model.seq_length (2047)" in str(err)
    data["sequence_parallel"] = False  # without it any sequence length goes
    assert mesh_plan_from_data(data, source="p.yaml").model.seq_length == 2047


def test_an_moe_mesh_runs_tp_2_with_sequence_parallelism_only():
    data = _data()
    data["model"].update(num_experts=8, moe_router_topk=2)
    err = mesh_plan_error(data)
    assert err.path == "meshes[1].tensor_model_parallel_size"
    assert "sequence_parallel: true" in str(err)
    data["sequence_parallel"] = True
    assert mesh_plan_from_data(data, source="p.yaml").model.num_experts == 8


def test_activation_memory_shards_on_tensor_parallel_meshes_only():
    cost = CostModel(load_any_plan(REPO / "examples/meshes/3090-t4-plan.yaml").model, INV)
    plain = mesh_plan_from_data(_data(), source="p.yaml")
    sp = mesh_plan_from_data(_data(sequence_parallel=True), source="p.yaml")
    for mesh, sharded in ((0, False), (1, True)):
        a, b = (cost.memory(StageShape.at(p, mesh, 0, 0)).activations for p in (plain, sp))
        assert (b < a) if sharded else (b == a), (mesh, a, b)


def test_bridge_gathers_the_sequence_of_each_tensor_parallel_side():
    """Forward, the sending mesh's TP group joins its shards before the leader sends; backward
    the receiving mesh's does: a ring all-gather, ``(T - 1) / T`` of the tensor on the side's
    node link plus one latency, nothing at TP 1 or without sequence parallelism."""
    cost = CostModel(load_any_plan(REPO / "examples/meshes/3090-t4-plan.yaml").model, INV)
    lat = cost.p2p_latency_s

    def seconds(src_tp, dst_tp, sp):
        return bridge_seconds(cost, Bridge(src_tp=src_tp, dst_tp=dst_tp, src_micro_batch=2,
                                           dst_micro_batch=2, hubs=((12.5,),),
                                           src_broadcast_gb_s=32, dst_broadcast_gb_s=16,
                                           sequence_parallel=sp))

    def gather(tp, gb_s):
        return lat + (tp - 1) / tp * cost.hidden_bytes(2, 1) / (gb_s * 1e9)

    for src_tp, dst_tp in ((1, 1), (2, 1), (1, 4), (4, 2)):
        plain, sp = seconds(src_tp, dst_tp, False), seconds(src_tp, dst_tp, True)
        want_f = gather(src_tp, 32) if src_tp > 1 else 0.0
        want_b = gather(dst_tp, 16) if dst_tp > 1 else 0.0
        assert sp[0] - plain[0] == pytest.approx(want_f, abs=1e-12), (src_tp, dst_tp)
        assert sp[1] - plain[1] == pytest.approx(want_b, abs=1e-12), (src_tp, dst_tp)
