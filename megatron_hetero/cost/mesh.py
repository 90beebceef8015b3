"""Costs of mesh plans (:mod:`megatron_hetero.plan.format2`): the
shape of each of its stages, and the bridge between two meshes.

Placement is :func:`megatron_hetero.placement.nodes.place`.

The bridge (megatron-core's ``BridgeCommunicator``) between mesh ``a`` (``D_a`` replicas of
``T_a`` ranks, micro-batch ``b_a``) and mesh ``b``, per micro-batch:

* forward: the leader rank of each replica of ``a``'s last stage sends its ``[s, b_a, h]``
  output to the leaders of ``b``'s first stage. With ``D_a > D_b`` each leader of ``b``
  receives ``D_a / D_b`` tensors one after another and joins them (fan-in); with ``D_a < D_b``
  each leader of ``a`` splits its tensor and sends the ``D_b / D_a`` pieces one after another
  (fan-out). Every transfer is a shape message and a tensor of ``min(b_a, b_b)`` samples over
  the link the two leaders' nodes share. The hub leader (the one that joins or splits) posts
  the shape messages of all its transfers in one batch (``_communicate_shapes``: one latency)
  and then its tensors one after another (blocking ``dist.send``/``dist.recv``), so the bridge
  takes the slowest hub's ``latency + sum(latency + bytes / bandwidth)``. Then the receiving
  leader broadcasts the ``[s, b_b, h]`` tensor (shape, then data) to its ``T_b - 1`` tensor
  peers on their node's link (``nbytes / bandwidth``, a pipelined broadcast).
* backward: the same transfers carry the gradients the other way (the hub splits or joins
  them), then ``a``'s leaders broadcast ``[s, b_a, h]`` gradients inside their ``T_a`` group.

With sequence parallelism (the plan's ``sequence_parallel``) a mesh of ``T > 1`` holds
``[s/T, b, h]`` per rank: the sending mesh's TP group first all-gathers its shards into the
whole tensor the leader sends (a ring all-gather, ``latency + (T_a - 1)/T_a x bytes /
bandwidth`` on its node's link), and each receiving rank keeps its own shard of what the leader
broadcast (no traffic); backward, the receiving mesh all-gathers its gradient shards likewise
before its leader sends, and each sending rank keeps its shard of the broadcast gradient.

With model chunks (:attr:`~megatron_hetero.plan.Plan.interleaved_chain`) every chunk boundary
between meshes is such a bridge, each crossed once per micro-batch and chunk in each direction,
and one more joins the last mesh's last stage (chunk ``c``) to mesh 0's first stage (chunk
``c + 1``): the wrap-around bridge, priced the same way with the last mesh sending.

Each message pays the cost model's ``p2p_latency_s``. Links are taken one transfer at a time
(concurrent transfers of different hubs on one inter-node link are not slowed down).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..plan import Mesh, Plan, Replica
from ..placement.nodes import Placement
from .stage import StageShape

__all__ = ["mesh_stage_shape", "Bridge", "bridge_seconds",
           "bridges", "bridge_crossings", "bridge_bytes", "same_replicas"]


def mesh_stage_shape(plan: Plan, mesh: int, stage: int, replica: int) -> StageShape:
    """The :class:`StageShape` of one tensor rank of (mesh, stage, replica): its mesh's TP, its
    replica's batch, its optimizer sharded over its mesh's replicas (:meth:`StageShape.at`,
    the one shape of every plan)."""
    return StageShape.at(plan, mesh, stage, replica)


@dataclass(frozen=True, kw_only=True, slots=True)
class Bridge:
    """What one bridge's cost depends on."""

    src_tp: int
    dst_tp: int
    src_micro_batch: int
    """Samples of a micro-batch on one replica of the sending mesh."""
    dst_micro_batch: int
    hubs: tuple[tuple[float, ...], ...]
    """Per leader that joins or splits (the side with fewer replicas; every leader when the
    sizes match): the GB/s of each of its transfers, done one after another."""
    src_broadcast_gb_s: float
    """The sending mesh's intra-node link (gradients broadcast in its TP group)."""
    dst_broadcast_gb_s: float
    sequence_parallel: bool = False
    """The plan runs sequence parallelism: a side of TP > 1 gathers its sequence shards (the
    sender forward, the receiver backward) on its broadcast link."""


def bridges(plan: Plan, placement: Placement, inventory,
            replica_of_path: int | None = None) -> list[Bridge]:
    """The bridge after every mesh but the last, then, with model chunks, the wrap-around
    bridge from the last mesh back to mesh 0. ``replica_of_path``: where every mesh has the
    same replicas, the one path (replica index) to cost; None costs the slowest hub of all."""
    n = len(plan.meshes)
    pairs = [(k, k + 1) for k in range(n - 1)]
    if plan.interleaved_chain:
        pairs.append((n - 1, 0))
    return [_bridge(plan, placement, inventory, a, b, replica_of_path) for a, b in pairs]


def _bridge(plan: Plan, placement: Placement, inventory, ka: int, kb: int,
            replica_of_path: int | None) -> Bridge:
    """The bridge from mesh ``ka``'s last stage to mesh ``kb``'s first stage."""
    a, b = plan.meshes[ka], plan.meshes[kb]
    da, db = a.data_parallel_size, b.data_parallel_size
    src = [placement.node(ka, a.num_stages - 1, r) for r in range(da)]
    dst = [placement.node(kb, 0, r) for r in range(db)]
    if da >= db:  # each leader of b joins da/db tensors (one when equal)
        ratio = da // db
        hubs = [tuple(placement.link_bandwidth(src[i * ratio + x], dst[i]) for x in range(ratio))
                for i in range(db)]
    else:  # each leader of a splits its tensor over db/da leaders of b
        ratio = db // da
        hubs = [tuple(placement.link_bandwidth(src[i], dst[i * ratio + x]) for x in range(ratio))
                for i in range(da)]
    if replica_of_path is not None:
        hubs = [hubs[replica_of_path]]
    return Bridge(src_tp=a.tensor_model_parallel_size, dst_tp=b.tensor_model_parallel_size,
                  src_micro_batch=_micro(a.replicas, replica_of_path),
                  dst_micro_batch=_micro(b.replicas, replica_of_path),
                  hubs=tuple(hubs),
                  src_broadcast_gb_s=inventory.intra_node_bandwidth(src[0].group),
                  dst_broadcast_gb_s=inventory.intra_node_bandwidth(dst[0].group),
                  sequence_parallel=plan.sequence_parallel)


def bridge_crossings(plan: Plan) -> list[int]:
    """How often each micro-batch crosses each bridge of :func:`bridges` per direction: once
    per model chunk between consecutive meshes, once per chunk but the last over the
    wrap-around bridge (the last mesh's chunk ``c`` to mesh 0's chunk ``c + 1``)."""
    v, n = plan.virtual_pipeline_size, len(plan.meshes)
    return [v] * (n - 1) + ([v - 1] if plan.interleaved_chain else [])


def bridge_bytes(plan: Plan, cost) -> list[float]:
    """Bytes each bridge of :func:`bridges` carries per step in each direction (activations
    forward, their gradients back: the same tensors), over all replicas: every sample crosses
    it :func:`bridge_crossings` times as one 16-bit ``[s, 1, h]`` slice."""
    sample = cost.hidden_bytes(1, 1)
    return [n * plan.global_batch_size * sample for n in bridge_crossings(plan)]


def _micro(replicas: list[Replica], r: int | None) -> int:
    return replicas[0 if r is None else r].micro_batch_size


def bridge_seconds(cost, bridge: Bridge) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch across ``bridge`` under ``cost`` (a
    :class:`~megatron_hetero.cost.model.CostModel`)."""
    lat = cost.p2p_latency_s
    piece = cost.hidden_bytes(min(bridge.src_micro_batch, bridge.dst_micro_batch), 1)
    transfers = max(lat + sum(lat + piece / (bw * 1e9) for bw in hub) for hub in bridge.hubs)

    def broadcast(tp: int, micro_batch: int, gb_s: float) -> float:
        if tp == 1:
            return 0.0
        return 2 * lat + cost.hidden_bytes(micro_batch, 1) / (gb_s * 1e9)

    def gather(tp: int, micro_batch: int, gb_s: float) -> float:
        if tp == 1 or not bridge.sequence_parallel:
            return 0.0
        return lat + (tp - 1) / tp * cost.hidden_bytes(micro_batch, 1) / (gb_s * 1e9)

    src = (bridge.src_tp, bridge.src_micro_batch, bridge.src_broadcast_gb_s)
    dst = (bridge.dst_tp, bridge.dst_micro_batch, bridge.dst_broadcast_gb_s)
    return (gather(*src) + transfers + broadcast(*dst),
            gather(*dst) + transfers + broadcast(*src))


def same_replicas(meshes: list[Mesh]) -> bool:
    """Every mesh has the same replicas (so replica ``r`` of each forms one path)."""
    return all(m.replicas == meshes[0].replicas for m in meshes[1:])
