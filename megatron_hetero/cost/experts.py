"""The mixture-of-experts half of the cost model: the all-to-alls of expert parallelism, the
load imbalance of the experts, and the gradient sync of expert-data parallelism.

Per MoE layer and micro-batch, one rank of an EP group of ``EP`` ranks sends its tokens' ``k``
routed 16-bit copies (``2 b s k h / t`` bytes, its share of the tokens under tensor and
sequence parallelism, :func:`megatron_hetero.models.moe_dispatch_bytes`) to the experts'
ranks, and gets them back after the experts: one dispatch and one combine all-to-all forward,
and the same two backward. Of each, ``(EP - 1) / EP`` leaves the rank, over the slowest link
the EP group spans (the stage's ``alltoall_gb_s``, which the simulator reads off the placement;
else :meth:`ExpertCosts.expert_link_gb_s`), at the load imbalance's multiple (the most loaded
rank receives the most), plus one message latency. At EP = 1 the tokens stay on the rank.
With expert tensor parallelism (ETP > 1: Megatron's default ETP = TP) the dispatcher also
all-gathers the routed tokens over the ETP ranks after the dispatch and reduce-scatters them
before the combine: ``(ETP - 1)`` times the rank's routed bytes over the device type's
intra-node link (an ETP group lies inside a tensor group's node), each way.

The load imbalance (the most loaded expert rank's routed tokens over the mean, at least 1) is
the device type's profile's ``moe_load_imbalance`` where it measured one, else the cost
model's ``moe_load_imbalance`` (default 1: balanced, what an auxiliary loss aims at). It slows
the routed experts' FLOPs (:meth:`~megatron_hetero.cost.model.CostModel.layer_times`) and the
all-to-alls alike. A run's telemetry measures it per expert (the most loaded expert's tokens
over the mean, :mod:`megatron_hetero.telemetry.records`): the expert rank's at EP = the number
of experts, and at a smaller EP a bound from above (a rank's experts even out).

Without grouped GEMM (``moe_grouped_gemm`` false, megatron-core's ``SequentialMLP``) the
experts run one after another, each a few kernels whose launch and bookkeeping cost does not
shrink with its tokens: :data:`SEQUENTIAL_EXPERT_S` per local expert (``num_experts / EP``) per
MoE layer and micro-batch, forward and backward, measured on an H200 (docs/gpu.md, run 4:
128 experts of 768, top 8, took 39.66 + 44.14 ms in the MoE block against 0.81 + 1.33 ms for a
dense block of the same FLOPs; 8 experts of 14336 took 0.39 + 0.43 ms each beyond FLOPs, part
of it the router's). A profile that measured the layer has it in its times, and the cost model
then adds nothing. With the constant, the catalog's prediction of a 4-layer Qwen3-30B-A3B step
on one H200 (run 5) went from 0.168 s to 1.477 s against 2.152 s measured (0.08x to 0.69x).

Gradient sync: a stage's dense parameters reduce over its ``D`` replicas as before; its expert
shard over the ``T D / (ETP EP)`` expert-data-parallel replicas (Megatron's
``expert_data_parallel`` group) on the same links.
"""

from __future__ import annotations

import functools

from .. import models as M
from ..errors import HeteroError
from .stage import StageShape

__all__ = ["ExpertCosts", "SEQUENTIAL_EXPERT_S", "check_imbalance", "per_stage_mix",
           "placed_expert_link"]

SEQUENTIAL_EXPERT_S = (3.04e-4, 3.35e-4)
"""(forward, backward) seconds each local expert adds to an MoE layer's micro-batch without
grouped GEMM, beyond its FLOPs (module docstring): ((39.66 - 0.81) / 128, (44.14 - 1.33) / 128)
ms on an H200."""


def per_stage_mix(method):
    """A cost-model method of a stage shape (its first argument) that prices a shape with its
    own ``moe_layers`` (a stage of a model that mixes MoE and dense layers) on the cost model of
    that stage's mix (:meth:`ExpertCosts.layer_mix`), and any other shape as it is."""
    name = method.__name__

    @functools.wraps(method)
    def priced(self, shape, *args):
        if shape.moe_layers is None:
            return method(self, shape, *args)
        mix = self.layer_mix(shape.moe_layers, shape.num_layers)
        return getattr(mix, name)(shape.but(moe_layers=None), *args)
    return priced


def check_imbalance(value: float, *, flag: str) -> float:
    """``value`` when it is a factor from 1 to 1000 (the user's mistake otherwise)."""
    if not (isinstance(value, (int, float)) and 1.0 <= value <= 1000.0):
        raise HeteroError(f"{flag}: {value!r}; expected the most loaded expert rank's tokens "
                          "over the mean, from 1 (balanced) to 1000")
    return float(value)


class ExpertCosts:
    """MoE costs; a base of :class:`~megatron_hetero.cost.model.CostModel`, which sets the
    attributes it reads and caches :meth:`_alltoall` and :meth:`expert_link_gb_s`."""

    moe_load_imbalance: float
    sequential_expert_s: tuple[float, float]
    p2p_latency_s: float
    options: dict
    """The keyword arguments the cost model was built with (its mixes are built alike)."""
    _mixes: dict

    def layer_mix(self, moe_layers: int, layers: int):
        """The cost model, built alike, of a stage of ``layers`` layers of which ``moe_layers``
        are MoE layers (:func:`megatron_hetero.models.mixed_model`); itself for a stage of no
        layers."""
        if layers == 0:
            return self
        model = M.mixed_model(self.model, moe_layers, layers)
        key = (model.num_experts, tuple(model.moe_layer_pattern))
        got = self._mixes.get(key)
        if got is None:
            got = self._mixes[key] = type(self)(model, self.inventory, **self.options)
        return got

    def load_imbalance(self, device_type: str) -> float:
        """The device type's profile's measured imbalance, else the cost model's."""
        got = getattr(self.profiles.get(device_type), "moe_load_imbalance", None)
        return self.moe_load_imbalance if got is None else got

    def expert_link_gb_s(self, device_type: str, span: int) -> float:
        """GB/s of the slowest link an EP group of ``span`` consecutive ranks (its expert
        block) of ``device_type`` spans, placed as the placement places tensor groups: inside
        one node where a node of each group of the type holds ``span`` GPUs, else between
        nodes."""
        inv = self.inventory
        groups = [i for i, g in enumerate(inv.groups) if g.gpu == device_type]
        if not groups:
            return self.spec(device_type).intra_node_bandwidth_gb_s
        if all(span <= inv.groups[i].gpus_per_node for i in groups):
            return min(inv.intra_node_bandwidth(i) for i in groups)
        return min(inv.inter_node_bandwidth(i) for i in groups)

    @per_stage_mix
    def alltoall_seconds(self, shape: StageShape) -> float:
        """Seconds of one layer's token dispatch and combine on one micro-batch (the EP
        all-to-alls, the ETP gathers), the mean over the model's layers; forward and backward
        each pay it (module docstring)."""
        ep = shape.expert_parallel_size
        etp = shape.expert_shards // ep
        if (ep == 1 and etp == 1) or not self.model.is_moe:
            return 0.0
        gb_s = shape.alltoall_gb_s
        if gb_s is None:
            gb_s = self.expert_link_gb_s(shape.device_type, shape.expert_shards)
        return self._alltoall(shape.device_type, shape.micro_batch_size,
                              shape.tensor_parallel_size, ep, etp, gb_s)

    def _alltoall(self, device_type: str, b: int, tp: int, ep: int, etp: int,
                  gb_s: float) -> float:
        nbytes = M.moe_dispatch_bytes(self.model, b) / tp * self.load_imbalance(device_type)
        one = 0.0
        if ep > 1:
            one += (self.p2p_latency_s * M.moe_fraction(self.model)
                    + (ep - 1) / ep * nbytes / (gb_s * 1e9))
        if etp > 1:
            one += (etp - 1) * nbytes / self.intra_node_bandwidth(device_type)
        return 2.0 * one

    @per_stage_mix
    def sequential_expert_seconds(self, shape: StageShape) -> tuple[float, float]:
        """(forward, backward) seconds the stage's local experts add to one layer's micro-batch
        run one by one (module docstring), the mean over the model's layers; nothing with
        grouped GEMM, for a dense model, or where the device type's profile measured the
        layer."""
        return self.sequential_expert_times(shape.device_type, shape.micro_batch_size,
                                            shape.tensor_parallel_size,
                                            shape.expert_parallel_size)

    def sequential_expert_times(self, device_type: str, b: int, tp: int,
                                ep: int) -> tuple[float, float]:
        """:meth:`sequential_expert_seconds` of a stage of this device type, micro-batch size,
        TP and EP (the search's bound asks before it has a stage)."""
        m = self.model
        if not m.is_moe or m.moe_grouped_gemm or self._measured(device_type, "layer", b,
                                                                tp) is not None:
            return 0.0, 0.0
        local = m.num_experts / ep * M.moe_fraction(m)
        f, bw = self.sequential_expert_s
        return local * f, local * bw

    @per_stage_mix
    def grad_sync_seconds(self, shape: StageShape, bandwidth_gb_s: float) -> float:
        """The stage's gradient sync: dense parameters over its replicas, the expert shard
        over its expert-data-parallel replicas (module docstring)."""
        d = shape.data_parallel_size
        params = self.stage_params(shape)
        if not self.model.is_moe:
            return self.dp_sync_seconds(params, d, bandwidth_gb_s)
        experts = self.expert_params(shape)
        edp = max(1, shape.tensor_parallel_size * d // shape.expert_shards)
        return (self.dp_sync_seconds(params - experts, d, bandwidth_gb_s)
                + self.dp_sync_seconds(experts, edp, bandwidth_gb_s))


def placed_expert_link(shape: StageShape, mesh, placement, k: int, j: int, r: int) -> StageShape:
    """``shape`` (mesh ``k``'s stage ``j`` of replica ``r``) with the slowest link its EP group
    spans on ``placement``: the nodes of the replicas of its expert block."""
    if shape.expert_parallel_size == 1:
        return shape
    block = next(b for b in mesh.expert_blocks() if r in b)
    gb_s = placement.slowest_bandwidth([placement.node(k, j, x) for x in block])
    return shape.but(alltoall_gb_s=gb_s)
