"""Interleaved 1F1B over a chain of meshes in the cost model and the one simulator (issue 28,
part 3; tier 1): the chain runs the same order as a one-grid interleaved plan (the same step
where the bridges cost what the grid's sends do); every chunk crossing between meshes is a
bridge in both directions, the wrap-around from the last mesh to mesh 0 included; each rank
holds the micro-batches in flight per chunk of its global stage."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hetero.cost.mesh import bridge_bytes, bridge_crossings, bridge_seconds, bridges
from megatron_hetero.cost.model import CostModel
from megatron_hetero.cost.stage import StageShape
from megatron_hetero.hardware import inventory_from_data
from megatron_hetero.models import load_model
from megatron_hetero.plan import (Format2Mesh, MeshStage, Pipeline, Recompute, Replica, Stage,
                                  mesh_plan, uniform_plan)
from megatron_hetero.schedule.order import peak_activations
from megatron_hetero.sim.step import simulate

MODEL = load_model("llama2-7b", seq_length=2048)
SEL = Recompute(granularity="selective")


def _inventory(inter_gb_s: float = 12.5) -> object:
    return inventory_from_data({"inter_group_bandwidth_gb_s": inter_gb_s, "groups": [
        {"gpu": "RTX3090-24GB", "nodes": 2, "gpus_per_node": 8},
        {"gpu": "T4-16GB", "nodes": 4, "gpus_per_node": 4}]}, source="inv.yaml")


def _chain(chunks: list[list[list[int]]], *, tps=(1, 1), dp: int = 4, m: int = 8,
           devices=("RTX3090-24GB", "RTX3090-24GB"), group: int | None = None):
    """A chain of meshes, mesh ``k`` of ``len(chunks[k])`` stages with those chunks."""
    reps = [Replica(micro_batch_size=1, num_microbatches=m) for _ in range(dp)]
    return mesh_plan(model=MODEL, global_batch_size=dp * m, precision="fp16",
                     microbatch_group_size=group, meshes=[
                         Format2Mesh(device_type=dev, tensor_model_parallel_size=tp,
                                     replicas=list(reps),
                                     stages=[MeshStage(num_layers=sum(c), chunk_layers=c,
                                                       recompute=SEL) for c in rows])
                         for dev, tp, rows in zip(devices, tps, chunks)])


def _one_grid(chunks: list[list[int]], *, dp: int = 4, m: int = 8, group: int | None = None):
    stages = [Stage(device_type="RTX3090-24GB", num_layers=sum(c), chunk_layers=list(c),
                    recompute=SEL) for c in chunks]
    return uniform_plan(model=MODEL, global_batch_size=dp * m, precision="fp16",
                        tensor_model_parallel_size=1, virtual_pipeline_size=len(chunks[0]),
                        microbatch_group_size=group,
                        pipelines=[Pipeline(micro_batch_size=1, num_microbatches=m,
                                            stages=stages) for _ in range(dp)])


@pytest.mark.parametrize("chunks, group", [
    ([[[4, 4], [4, 4]], [[4, 4], [3, 5]]], None),        # even and uneven chunks
    ([[[4, 4, 3]], [[4, 4, 3], [4, 3, 3]]], 4),          # three chunks, groups of 4
])
def test_a_chain_sharing_tp_and_dp_steps_as_the_one_grid_interleaved_plan(chunks, group):
    """TP 1 everywhere and no message latency: a bridge then costs what a pipeline send does,
    and the chain (two meshes on one node type) runs the one-grid plan's interleaved order
    op for op: the same step, stage figures, memory and events."""
    cost = CostModel(MODEL, _inventory(), precision="fp16", p2p_latency_s=0.0)
    chain = _chain(chunks, group=group)
    grid = _one_grid([c for rows in chunks for c in rows], group=group)
    assert chain.interleaved_chain and chain.shares_tp_dp and grid.one_grid
    assert chain.layout() == grid.layout()
    a, b = simulate(grid, cost), simulate(chain, cost)
    assert b.step_time_s == pytest.approx(a.step_time_s, rel=1e-12)
    key = lambda r: (r.pipeline, r.stage)  # noqa: E731
    for x, y in zip(sorted(a.stages, key=key), sorted(b.stages, key=key)):
        assert dataclasses.asdict(x) == dataclasses.asdict(y)
    ev = lambda s: sorted((e.pipeline, e.stage, e.kind, e.microbatch, e.chunk,  # noqa: E731
                           round(e.start, 9), round(e.end, 9)) for e in s.events if e.kind in "FB")
    assert ev(a) == ev(b)


def test_every_chunk_crossing_is_a_bridge_both_ways_with_the_wrap_around():
    """3090 TP 1 -> T4 TP 2 over a slow inter-group link, two chunks a stage: the forward of
    (i, c) on the T4 waits for the 3090's (i, c) plus the bridge's forward; mesh 0's forward of
    (i, 1) waits for the T4's (i, 0) plus the wrap-around bridge's forward; backwards mirror
    both with the backward prices."""
    cost = CostModel(MODEL, _inventory(inter_gb_s=0.5), precision="fp16")
    plan = _chain([[[5, 5], [5, 5]], [[6, 6]]], tps=(1, 2), dp=4, m=6,
                  devices=("RTX3090-24GB", "T4-16GB"), group=None)
    placement = cost.placement(plan)
    link, wrap = bridges(plan, placement, cost.inventory, replica_of_path=0)
    (lf, lb), (wf, wb) = bridge_seconds(cost, link), bridge_seconds(cost, wrap)
    assert (link.src_tp, link.dst_tp, wrap.src_tp, wrap.dst_tp) == (1, 2, 2, 1)
    assert lf > lb and wb > wf  # the T4 side broadcasts in its TP group of 2
    events = {(e.stage, e.kind, e.microbatch, e.chunk): e for e in simulate(plan, cost).events
              if e.pipeline == 0 and e.kind in "FB"}
    for i in range(6):
        for c in range(2):
            assert events[2, "F", i, c].start >= events[1, "F", i, c].end + lf - 1e-12
            assert events[1, "B", i, c].start >= events[2, "B", i, c].end + lb - 1e-12
        assert events[0, "F", i, 1].start >= events[2, "F", i, 0].end + wf - 1e-12
        assert events[2, "B", i, 0].start >= events[0, "B", i, 1].end + wb - 1e-12
    # the slow bridge binds somewhere in each direction, wrap-around included
    assert any(abs(events[0, "F", i, 1].start - events[2, "F", i, 0].end - wf) < 1e-9
               for i in range(6))
    assert bridge_crossings(plan) == [2, 1]
    sample = cost.hidden_bytes(1, 1)
    assert bridge_bytes(plan, cost) == [2 * 24 * sample, 24 * sample]


def test_bridge_traffic_without_chunks_is_one_crossing_per_bridge():
    plan = mesh_plan(model=MODEL, global_batch_size=32, precision="fp16", meshes=[
        Format2Mesh(device_type=dev, tensor_model_parallel_size=1,
                    replicas=[Replica(micro_batch_size=1, num_microbatches=8)] * 4,
                    stages=[MeshStage(num_layers=n)])
        for dev, n in (("RTX3090-24GB", 16), ("T4-16GB", 16))])
    assert not plan.interleaved_chain and bridge_crossings(plan) == [1]


def test_memory_holds_the_micro_batches_in_flight_per_chunk_of_the_global_stage():
    """Each rank holds, at its peak, the chunks in flight of its global stage's interleaved
    order (warm-up (p - s - 1) 2 + (v - 1) g forwards): mesh 0's stages more than the last
    mesh's, and a larger micro-batch group more."""
    cost = CostModel(MODEL, _inventory(), precision="fp16")

    def acts(group):
        plan = _chain([[[4, 4], [4, 4]], [[4, 4], [4, 4]]], group=group, m=8)
        res = simulate(plan, cost, record_events=False)
        return {r.stage: r.memory.activations for r in res.stages if r.pipeline == 0}, plan

    base, plan = acts(None)
    assert base == {s: cost.memory(StageShape.at(plan, k, j, 0, global_stage=s)).activations
                    for s, (k, j) in enumerate(plan.stage_index)}
    assert base[0] > base[1] > base[2] > base[3]
    counts = [peak_activations(4, s, 8, 2, [1.0, 1.0]) for s in range(4)]
    assert counts == [11, 9, 7, 5]  # (p - s - 1) 2 + (v - 1) p + 1, at most m v
    bigger, _ = acts(8)
    assert all(bigger[s] >= base[s] for s in base) and bigger[3] > base[3]
