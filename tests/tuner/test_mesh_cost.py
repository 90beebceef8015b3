"""Cost model and simulator of mesh plans at their limits (tier 1): one mesh is the uniform
plan; the bridge grows with the data-parallel ratio; each mesh's own TP and DP in memory and
gradient sync."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hetero.cost.mesh import Bridge, bridge_seconds, mesh_stage_shape
from megatron_hetero.cost.model import CostModel
from megatron_hetero.cost.stage import StageShape
from megatron_hetero.hardware import inventory_from_data
from megatron_hetero.models import load_model
from megatron_hetero.plan import (Format2Mesh, MeshStage, Offload, Pipeline, Plan, Recompute,
                                  Replica, Stage, mesh_plan, meshes_of, uniform_plan)
from megatron_hetero.sim.step import simulate

MODEL = load_model("llama2-7b", seq_length=2048)
INV = inventory_from_data({"groups": [
    {"gpu": "RTX3090-24GB", "nodes": 2, "gpus_per_node": 8},
    {"gpu": "T4-16GB", "nodes": 4, "gpus_per_node": 4}]}, source="inv.yaml")
COST = CostModel(MODEL, INV, precision="fp16")
FULL = Recompute(granularity="full", method="uniform", num_layers=1)


def _uniform(tp: int, dp: int, split: list[int], *, m: int, device: str = "RTX3090-24GB") -> Plan:
    stages = lambda: [Stage(device_type=device, num_layers=n, recompute=FULL)  # noqa: E731
                      for n in split]
    return uniform_plan(model=MODEL, global_batch_size=dp * m, precision="fp16",
                tensor_model_parallel_size=tp,
                pipelines=[Pipeline(micro_batch_size=1, num_microbatches=m, stages=stages())
                           for _ in range(dp)])


@pytest.mark.parametrize("tp, dp, split, m", [(1, 4, [8, 8, 8, 8], 8), (2, 4, [16, 16], 6),
                                              (4, 1, [11, 11, 10], 5), (8, 2, [32], 3)])
def test_one_mesh_equals_the_uniform_plan_exactly(tp, dp, split, m):
    plan = _uniform(tp, dp, split, m=m)
    mesh = meshes_of(plan)
    assert len(mesh.meshes) == 1
    a, b = simulate(plan, COST), simulate(mesh, COST)
    assert b.step_time_s == a.step_time_s and b.mfu == a.mfu
    key = lambda r: (r.pipeline, r.stage)  # noqa: E731
    for x, y in zip(sorted(a.stages, key=key), sorted(b.stages, key=key)):
        assert dataclasses.asdict(x) == dataclasses.asdict(y)
    ev = lambda s: sorted((e.pipeline, e.stage, e.kind, e.microbatch, e.start, e.end)  # noqa: E731
                          for e in s.events)
    assert ev(a) == ev(b)


def test_bridge_grows_with_the_data_parallel_ratio():
    """Joining k micro-batch pieces of one sample each on one leader: the k shape messages in
    one batch (one latency), then k transfers in sequence; the receiving TP group's broadcast
    adds the joined tensor once."""
    bw = 12.5
    one = bridge_seconds(COST, Bridge(src_tp=1, dst_tp=1, src_micro_batch=1, dst_micro_batch=1,
                                      hubs=((bw,),), src_broadcast_gb_s=32, dst_broadcast_gb_s=16))
    # TP1 -> TP1 at equal DP: one send (and its shape message) each way
    assert one[0] == one[1] == pytest.approx(COST.p2p_seconds(1, bw) + COST.p2p_latency_s)
    last = one
    for k in (2, 4, 8):
        got = bridge_seconds(COST, Bridge(src_tp=1, dst_tp=1, src_micro_batch=1, dst_micro_batch=k,
                                          hubs=((bw,) * k,), src_broadcast_gb_s=32,
                                          dst_broadcast_gb_s=16))
        shapes = COST.p2p_latency_s  # posted together (megatron-core's _communicate_shapes)
        assert got[0] == pytest.approx(shapes + k * (one[0] - shapes)) and got[0] > last[0]
        assert got[0] == got[1]  # the gradients split back the same way
        last = got
    # a TP=2 receiver broadcasts the joined [s, 4, h] tensor on its node's link
    joined = bridge_seconds(COST, Bridge(src_tp=1, dst_tp=2, src_micro_batch=1, dst_micro_batch=4,
                                         hubs=((bw,) * 4,), src_broadcast_gb_s=32,
                                         dst_broadcast_gb_s=16))
    plain = bridge_seconds(COST, Bridge(src_tp=1, dst_tp=1, src_micro_batch=1, dst_micro_batch=4,
                                        hubs=((bw,) * 4,), src_broadcast_gb_s=32,
                                        dst_broadcast_gb_s=16))
    assert joined[0] - plain[0] == pytest.approx(2 * COST.p2p_latency_s
                                                 + COST.hidden_bytes(4, 1) / 16e9)
    assert joined[1] == plain[1]  # gradients go back to TP=1 leaders: no broadcast
    # the slowest hub sets the bridge
    slow = bridge_seconds(COST, Bridge(src_tp=1, dst_tp=1, src_micro_batch=1, dst_micro_batch=2,
                                       hubs=((bw, bw), (bw, bw / 10)), src_broadcast_gb_s=32,
                                       dst_broadcast_gb_s=16))
    assert slow[0] > bridge_seconds(COST, Bridge(src_tp=1, dst_tp=1, src_micro_batch=1,
                                                 dst_micro_batch=2, hubs=((bw, bw),),
                                                 src_broadcast_gb_s=32, dst_broadcast_gb_s=16))[0]


def _two_meshes(dp_b: int, *, tp_b: int = 2) -> Plan:
    m = 16
    return mesh_plan(model=MODEL, global_batch_size=8 * m, precision="fp16",
                    meshes=[Format2Mesh(device_type="RTX3090-24GB", tensor_model_parallel_size=1,
                                        replicas=[Replica(micro_batch_size=1, num_microbatches=m)] * 8,
                                        stages=[MeshStage(num_layers=10, recompute=FULL),
                                                MeshStage(num_layers=10, recompute=FULL)]),
                            Format2Mesh(device_type="T4-16GB", tensor_model_parallel_size=tp_b,
                                        replicas=[Replica(micro_batch_size=8 // dp_b,
                                                          num_microbatches=m)] * dp_b,
                                        stages=[MeshStage(num_layers=12, recompute=FULL)])])


def test_each_mesh_has_its_own_tp_and_dp_in_memory_and_sync():
    plan = _two_meshes(4, tp_b=4)
    t4 = mesh_stage_shape(plan, 1, 0, 0)
    assert (t4.tensor_parallel_size, t4.data_parallel_size, t4.micro_batch_size, t4.stage) == (4, 4, 2, 2)
    r = mesh_stage_shape(plan, 0, 1, 3)
    assert (r.tensor_parallel_size, r.data_parallel_size, r.micro_batch_size) == (1, 8, 1)
    # the distributed optimizer shards over the mesh's own replicas
    assert COST.memory(t4).optimizer == pytest.approx(
        COST.memory(t4.but(data_parallel_size=1)).optimizer / 4)
    sim = simulate(plan, COST)
    assert {(s.stage, s.pipeline) for s in sim.stages} == (
        {(s, d) for s in (0, 1) for d in range(8)} | {(2, d) for d in range(4)})
    assert sim.stage(3, 2).memory == COST.memory(t4)
    assert sim.stage(7, 1).memory == COST.memory(mesh_stage_shape(plan, 0, 1, 7))


def test_fan_in_costs_more_than_a_bridge_that_keeps_the_replicas():
    """Same T4 work per GPU: DP 8 -> 8 at TP 2 against 8 -> 4 at TP 4 (each T4 leader joins two
    pieces and broadcasts to 3 peers)."""
    keep, fan = simulate(_two_meshes(8), COST), simulate(_two_meshes(4, tp_b=4), COST)
    assert keep.fits_memory
    f_keep = [e for e in keep.events if e.kind == "F" and e.stage == 2][0]
    f_fan = [e for e in fan.events if e.kind == "F" and e.stage == 2][0]
    f_src = [e for e in keep.events if e.kind == "F" and e.stage == 1][0]
    assert f_fan.start - f_src.end > f_keep.start - f_src.end > 0


def test_simulate_command_draws_a_mesh_timeline(tmp_path, capsys):
    from megatron_hetero import cli
    from tests.conftest import REPO
    png = tmp_path / "t.png"
    assert cli.main(["simulate", str(REPO / "examples/meshes/3090-t4-plan.yaml"), "--inventory",
                     str(REPO / "examples/meshes/inventory.yaml"), "--timeline", str(png)]) == 0
    out = capsys.readouterr().out
    assert "predicted: step" in out and "mesh 1: 16x T4-16GB TP=2 DP=8" in out
    assert png.stat().st_size > 10_000


def test_host_memory_of_a_mesh_plan_per_node():
    """The 3090 mesh offloads its module inputs: its two nodes carry that beside the reserve,
    and a host too small for it makes the plan not fit."""
    from megatron_hetero.plan import load_any_plan
    from tests.conftest import REPO

    plan = load_any_plan(REPO / "examples/meshes/3090-t4-plan.yaml")

    def run(host_gb):
        inv = inventory_from_data({"groups": [
            {"gpu": "RTX3090-24GB", "nodes": 2, "gpus_per_node": 8, "host_memory_gb": host_gb},
            {"gpu": "T4-16GB", "nodes": 4, "gpus_per_node": 4}]}, source="inv.yaml")
        return simulate(plan, CostModel(MODEL, inv, precision="fp16"), record_events=False)

    roomy = run(1024)
    assert [h.index for h in roomy.host_nodes] == [0, 1] and roomy.fits_memory
    cost = CostModel(MODEL, INV, precision="fp16")
    per_node = 8 * cost.host_bytes(mesh_stage_shape(plan, 0, 0, 0))  # stage 0 fills node 0
    assert per_node > 0
    assert roomy.host_nodes[0].used_bytes == pytest.approx(per_node + cost.host_reserve_bytes)
    assert not run(64).fits_memory


def test_uneven_replicas_run_their_own_paths():
    """DP 4 -> 4 with 10/10/6/6 micro-batches: each path runs its own count, the gradient sync
    of every stage starts once its slowest replica is done."""
    reps = [Replica(micro_batch_size=1, num_microbatches=n) for n in (10, 10, 6, 6)]
    plan = mesh_plan(model=MODEL, global_batch_size=32, precision="fp16",
                    meshes=[Format2Mesh(device_type="RTX3090-24GB", tensor_model_parallel_size=2,
                                        replicas=list(reps), stages=[MeshStage(num_layers=20, recompute=FULL)]),
                            Format2Mesh(device_type="T4-16GB", tensor_model_parallel_size=2,
                                        replicas=list(reps), stages=[MeshStage(num_layers=12, recompute=FULL)])])
    sim = simulate(plan, COST)
    busy = {(s.pipeline, s.stage): s.busy_s for s in sim.stages}
    assert busy[(0, 0)] == pytest.approx(busy[(2, 0)] * 10 / 6)
    assert busy[(1, 1)] == busy[(0, 1)]
    last_b = {d: max(e.end for e in sim.events if e.kind == "B" and e.pipeline == d and e.stage == 0)
              for d in range(4)}
    sync_start = min(e.start for e in sim.events if e.kind == "S" and e.stage == 0)
    assert last_b[0] > last_b[2] and sync_start >= last_b[0]


def test_a_chain_runs_per_stage_warmups_in_the_one_simulator():
    """Format 1's per-stage warm-ups on a chain of meshes (one code path for every shape): stage
    0 of the 3-stage path warms up 3 forwards where Megatron's 1F1B warms up 2."""
    def first_ops(plan: Plan) -> str:
        ops = sorted((e.start, e.kind) for e in simulate(plan, COST).events
                     if e.pipeline == 0 and e.stage == 0 and e.kind in "FB")
        return "".join(kind for _, kind in ops[:5])

    plan = _two_meshes(8)
    assert first_ops(plan)[:4] == "FFFB"
    for pipe in plan.meshes[0].pipelines:
        pipe.stages = [dataclasses.replace(pipe.stages[0], warmup_microbatches=3), pipe.stages[1]]
    assert first_ops(plan) == "FFFFB"


def test_a_chain_whose_replicas_differ_in_device_type_at_one_stage():
    """Replica 0 of the T4 mesh runs its stage on an RTX 3090 (what format 1 lets pipelines do):
    each replica's stage is costed on its own card and placed on a node of that type."""
    inv = inventory_from_data({"groups": [
        {"gpu": "RTX3090-24GB", "nodes": 3, "gpus_per_node": 8},
        {"gpu": "T4-16GB", "nodes": 4, "gpus_per_node": 4}]}, source="inv.yaml")
    cost = CostModel(MODEL, inv, precision="fp16")
    plan = _two_meshes(8)
    t4 = plan.meshes[1].pipelines[0]
    plan.meshes[1].pipelines[0] = Pipeline(
        micro_batch_size=t4.micro_batch_size, num_microbatches=t4.num_microbatches,
        stages=[dataclasses.replace(t4.stages[0], device_type="RTX3090-24GB")])
    sim = simulate(plan, cost)
    assert (sim.stage(0, 2).device_type, sim.stage(1, 2).device_type) == ("RTX3090-24GB", "T4-16GB")
    for d in (0, 1):
        shape = StageShape.at(plan, 1, 0, d)
        assert sim.stage(d, 2).forward_s == sum(c.forward_s for c in cost.chunk_times(shape))
    assert sim.stage(0, 2).forward_s != sim.stage(1, 2).forward_s
    node = cost.placement(plan).node(1, 0, 0)
    assert inv.groups[node.group].gpu == "RTX3090-24GB"
