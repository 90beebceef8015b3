"""Mesh plans across vendors (issue 28): each mesh is one device type, so its groups stay
inside one vendor and its bridges are the vendor boundaries. Such a plan loads and round-trips,
the simulator prices each bridge between vendors on the host path (device -> host -> NIC ->
host -> device, placement/host_path.py), Ascend NPUs beside another vendor are refused as in
format 1, and Megatron-LM's path takes the plan, its bridges between vendors staged through
host memory (plan.checks.host_bridges; tier 1; the CPU ranks' runs:
tests/emulate/test_mesh_vendors.py, tests/runtime/test_mesh_vendors_training.py)."""

from __future__ import annotations

import pytest

from megatron_hetero.cost.mesh import bridges
from megatron_hetero.cost.model import CostModel
from megatron_hetero.errors import SchemaError
from megatron_hetero.hardware import inventory_from_data
from megatron_hetero.models import load_model
from megatron_hetero.placement.host_path import host_path
from megatron_hetero.placement.inventory import check_plan_vendors
from megatron_hetero.plan import (Format2Mesh, MeshStage, Replica, any_plan_from_data,
                                  mesh_plan)
from megatron_hetero.plan.checks import host_bridges
from megatron_hetero.sim.step import simulate

MODEL = load_model("llama2-13b", seq_length=4096)


def _inventory(second: str, *, rdma: bool = True) -> object:
    return inventory_from_data({"inter_group_bandwidth_gb_s": 25, "groups": [
        {"gpu": "A100-SXM-80GB", "nodes": 2, "gpus_per_node": 8, "nic_bandwidth_gb_s": 25,
         "rdma": rdma},
        {"gpu": second, "nodes": 1, "gpus_per_node": 8, "nic_bandwidth_gb_s": 50,
         "rdma": rdma}]}, source="inv.yaml")


def _plan(second: str = "MI300X-192GB"):
    reps = [Replica(micro_batch_size=1, num_microbatches=64)] * 4
    return mesh_plan(model=MODEL, global_batch_size=256, precision="bf16", meshes=[
        Format2Mesh(device_type="A100-SXM-80GB", tensor_model_parallel_size=2, replicas=reps,
                    stages=[MeshStage(num_layers=15), MeshStage(num_layers=15)]),
        Format2Mesh(device_type=second, tensor_model_parallel_size=2, replicas=reps,
                    stages=[MeshStage(num_layers=10)])])


def test_two_vendor_mesh_plan_loads_and_round_trips():
    plan = _plan()
    again = any_plan_from_data(plan.to_data(), source="p.yaml")
    assert again.to_data() == plan.to_data()
    assert [again.catalog.get(m.device_type).stack.library for m in again.meshes] == \
        ["NCCL", "RCCL (ROCm)"]
    check_plan_vendors(again, again.catalog, source="p.yaml")  # no group spans vendors


def test_bridge_between_vendors_is_priced_on_the_host_path():
    for second, staged in (("MI300X-192GB", True), ("H100-SXM-80GB", False)):
        inv = _inventory(second)
        plan = _plan(second)
        cost = CostModel(plan.model, inv)
        (bridge,) = bridges(plan, cost.placement(plan), inv)
        want = host_path(inv, (0, 1)).bandwidth_gb_s if staged else inv.inter_group_bandwidth_gb_s
        assert all(bw == pytest.approx(want) for hub in bridge.hubs for bw in hub), second
    # the step follows the host path: slower over TCP than over RDMA
    plan = _plan()
    rdma, tcp = (simulate(plan, CostModel(plan.model, _inventory("MI300X-192GB", rdma=r)))
                 .step_time_s for r in (True, False))
    assert tcp > rdma


def test_ascend_beside_another_vendor_is_refused_at_the_mesh():
    plan = any_plan_from_data(_plan("Ascend910B-64GB").to_data(), source="p.yaml")
    with pytest.raises(SchemaError) as exc:
        check_plan_vendors(plan, plan.catalog, source="p.yaml")
    assert exc.value.path == "meshes[1].stages[0].device_type"
    assert "gloo" in str(exc.value)


def test_megatron_lms_path_takes_bridges_between_vendors_staged_through_the_host():
    """Only the bridge between the two libraries is host-staged (the wrap-around of a chain
    of two meshes joins them too); a plan of one library stages none."""
    assert host_bridges(_plan()) == [True, True]
    assert host_bridges(_plan("H100-SXM-80GB")) == [False, False]
