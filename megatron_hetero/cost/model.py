"""The cost model: seconds and bytes of one pipeline stage on one device type.

Everything comes from the model shape (:mod:`megatron_hetero.models`), the catalog entry of the
device type (with the inventory's overrides) and, where given, a measured profile:

* compute: FLOPs / (catalog rate x efficiency); the efficiency is the profile's when it has one,
  else the catalog default. Measured (forward, backward) seconds replace the estimate wherever a
  profile has them. Precision ``fp32`` uses ``fp32_tflops``, 16-bit precisions ``bf16_tflops``.
* tensor parallelism: two ring all-reduces of the layer output per layer in forward and two in
  backward, ``2 (t-1)/t x bytes / bandwidth`` on the slowest intra-node link of the device type
  (not added to measured layer times, which include them).
* pipeline sends: one 16-bit ``[s, b, h]`` tensor over the link the two stages share
  (:mod:`.placement`), plus a fixed latency.
* data-parallel sync: with the distributed optimizer a reduce-scatter of the gradients plus an
  all-gather of the 16-bit parameters, else an all-reduce of the gradients, ``(D-1)/D`` ring
  traffic over the slowest link of the group; then the Adam step, memory-bound
  (about 30 bytes touched per parameter on the device; offloaded fractions at host bandwidth).
* memory per rank: 16-bit parameters, main gradients (4 bytes with bf16/fp32, 2 with fp16),
  Adam state (fp32 master + m + v = 12 bytes, 8 in fp32 training; sharded over data parallelism
  with the distributed optimizer; minus the offloaded fraction), activations of the micro-batches
  in flight (stage ``s`` of ``p`` holds ``min(p - s, m)`` in 1F1B), fp32 logits on the last stage,
  minus the module inputs a stage offloads to the host (fine-grained activation offloading:
  the LayerNorm and QKV inputs, Q/K/V and the projection input of every layer not recomputed;
  one layer's worth stays on the device; the copies run on side streams and cost a layer only
  what its own compute cannot hide at the host link's ``pcie_bandwidth_gb_s``),
  the transient activations of one recomputed chunk, and a fixed workspace reserve (CUDA context,
  communication buffers, allocator slack).
* host memory per rank (:meth:`CostModel.stage_host_bytes`): the offloaded fraction of the
  optimizer shard and the module inputs offloaded at the stage's peak; the simulator adds a
  node's ranks and a fixed reserve and compares them with the inventory's ``host_memory_gb``.
* interleaved pipelining (``v`` model chunks per stage): each chunk's costs come from its own
  layers (the embedding on chunk 0 of the first stage, the output layer and loss on chunk
  ``v - 1`` of the last); a stage's ``block`` recompute of ``k`` layers covers its first ``k``
  layers in chunk order, ``uniform`` and ``selective`` apply in every chunk (as the runtime sets
  each chunk's config); the activations in flight are the peak, over the rank's order of forwards
  and backwards (:mod:`.schedule`), of the summed activations of the chunks it has run forward
  and not yet backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Mapping

from .. import models as M
from ..hardware.inventory import Inventory
from ..plan import ModelSpec, Plan, Recompute
from .placement import Placement, place
from .profile_protocol import DeviceProfile
from .schedule import peak_activations

__all__ = ["CostModel", "StageTimes", "Memory", "RecomputeKey", "recompute_key",
           "chunk_recompute_keys"]

RecomputeKey = tuple[str, str | None, int | None]
"""Hashable form of a :class:`~megatron_hetero.plan.Recompute`: (granularity, method, num_layers)."""


def recompute_key(r: Recompute | RecomputeKey) -> RecomputeKey:
    if isinstance(r, tuple):
        return r
    return (r.granularity, r.method, r.num_layers)


def chunk_recompute_keys(r: RecomputeKey, chunk_layers) -> list[RecomputeKey]:
    """The recompute of each model chunk of an interleaved stage: ``block`` recompute of ``k``
    layers covers the stage's first ``k`` layers in chunk order (chunk 0 first), as the runtime
    applies it (:func:`megatron_hetero.runtime.policies.chunk_recompute_layers`); ``uniform``
    and ``selective`` apply in every chunk."""
    gran, method, k = r
    if gran != "full" or method != "block":
        return [r] * len(chunk_layers)
    out: list[RecomputeKey] = []
    before = 0
    for n in chunk_layers:
        kc = max(0, min(k - before, n))
        before += n
        out.append(("full", "block", kc) if kc else ("none", None, None))
    return out


@dataclass(frozen=True, slots=True)
class StageTimes:
    """Seconds of one micro-batch on one stage (compute plus tensor-parallel communication)."""

    forward_s: float
    backward_s: float
    """Includes the recompute forward when the stage recomputes."""

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True, slots=True)
class Memory:
    """Bytes one tensor rank of a stage needs at its peak, by kind, and what its device has."""

    params: float
    grads: float
    optimizer: float
    activations: float
    workspace: float
    capacity: float
    """Device memory (catalog ``memory_gb``)."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.workspace

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def to_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "workspace": self.workspace,
                "total": self.total, "capacity": self.capacity}


class CostModel:
    """Compute, memory and communication costs of a model on an inventory's device types."""

    def __init__(self, model: ModelSpec, inventory: Inventory, *,
                 profiles: Mapping[str, DeviceProfile] = {},
                 precision: Literal["bf16", "fp16", "fp32"] = "bf16",
                 use_distributed_optimizer: bool = True,
                 flash_attention: bool | None = None,
                 overlap_grad_reduce: bool = False,
                 workspace_gb: float = 2.0,
                 host_optimizer_gb_s: float = 5.0,
                 pcie_bandwidth_gb_s: float = 25.0,
                 host_reserve_gb: float = 64.0,
                 p2p_latency_s: float = 20e-6,
                 pipeline_overhead_s: tuple[float, float] = (0.0, 0.0)):
        """
        ``flash_attention``: core attention runs a fused kernel that stores no ``s x s``
        matrices (Megatron's default with Transformer Engine), so no-recompute activations
        exclude Korthikanti's ``5as^2b`` term. ``None``: per device type, where the catalog
        entry has ``bf16`` (Ampere and later; V100 and T4 run unfused attention).
        Sequence parallelism is not a setting of the model: plan-level costs follow each plan's
        ``sequence_parallel`` flag, and the primitives take it as ``sp`` (activations,
        checkpoints and pipeline sends sharded over the tensor ranks; the tensor-parallel
        traffic is the same, an all-gather plus a reduce-scatter in place of each all-reduce).
        ``overlap_grad_reduce``: the gradient sync overlaps
        the last backward (``--overlap-grad-reduce``). ``workspace_gb``: memory reserved per
        device outside the model. ``host_optimizer_gb_s``: optimizer state one GPU's share of
        the host processes per second when offloaded (CPU Adam plus PCIe copies; a node's
        CPUs serve all its GPUs at once). ``pcie_bandwidth_gb_s``: one GPU's host link, for
        offloaded activations. ``host_reserve_gb``: host memory per node kept for the OS and
        the training processes (data loaders, CUDA and NCCL host buffers), beside what the GPUs
        offload (:meth:`stage_host_bytes`), where the inventory gives ``host_memory_gb``.
        ``pipeline_overhead_s``: (forward, backward) seconds a stage of
        a pipeline pays per micro-batch beyond its parts (schedule, p2p handling) where no
        profile of the device type measured it (:meth:`pipeline_overhead`); default 0.
        """
        self.model = model
        self.inventory = inventory
        self.profiles = dict(profiles)
        self.precision = precision
        self.use_distributed_optimizer = use_distributed_optimizer
        self.flash_attention = flash_attention
        self.overlap_grad_reduce = overlap_grad_reduce
        self.workspace_bytes = workspace_gb * 1e9
        self.host_optimizer_rate = host_optimizer_gb_s * 1e9
        self.pcie_bandwidth = pcie_bandwidth_gb_s * 1e9
        self.host_reserve_bytes = host_reserve_gb * 1e9
        self.p2p_latency_s = p2p_latency_s
        self.pipeline_overhead_s = pipeline_overhead_s
        self.param_bytes = 4.0 if precision == "fp32" else 2.0
        self.grad_bytes = 2.0 if precision == "fp16" else 4.0
        self.optim_bytes = 8.0 if precision == "fp32" else 12.0
        # Cached primitives are per instance (the model and inventory are fixed).
        self._specs: dict = {}
        self.flops_rate = lru_cache(maxsize=None)(self.flops_rate)
        self.layer_times = lru_cache(maxsize=None)(self.layer_times)
        self.intra_node_bandwidth = lru_cache(maxsize=None)(self.intra_node_bandwidth)
        self.compute_times = lru_cache(maxsize=None)(self._compute_times)
        self.memory_need = lru_cache(maxsize=None)(self._memory_need)
        self.chunked_memory_need = lru_cache(maxsize=None)(self._chunked_memory_need)
        self._placements: dict[tuple, Placement] = {}

    # -- device figures -------------------------------------------------------------------------
    def spec(self, device_type: str):
        """The catalog entry (with the inventory's overrides) of a device type."""
        got = self._specs.get(device_type)
        if got is None:
            got = self._specs[device_type] = self.inventory.spec(device_type)
        return got

    def efficiency(self, device_type: str) -> float:
        prof = self.profiles.get(device_type)
        if prof is not None and prof.efficiency is not None:
            return prof.efficiency
        return self.spec(device_type).efficiency

    def flops_rate(self, device_type: str) -> float:
        """Achievable FLOP/s of one device of this type on transformer layers."""
        spec = self.spec(device_type)
        peak = spec.fp32_tflops if self.precision == "fp32" else spec.bf16_tflops
        return peak * 1e12 * self.efficiency(device_type)

    def peak_flops(self, device_type: str) -> float:
        spec = self.spec(device_type)
        return (spec.fp32_tflops if self.precision == "fp32" else spec.bf16_tflops) * 1e12

    def capacity(self, device_type: str) -> float:
        return self.spec(device_type).memory_bytes

    def intra_node_bandwidth(self, device_type: str) -> float:
        """Bytes/s of the slowest intra-node link among the groups of this type."""
        bws = [self.inventory.intra_node_bandwidth(i) for i, g in enumerate(self.inventory.groups)
               if g.gpu == device_type]
        return 1e9 * (min(bws) if bws else self.spec(device_type).intra_node_bandwidth_gb_s)

    def _allreduce(self, nbytes: float, n: int, bandwidth: float) -> float:
        return 0.0 if n <= 1 else 2.0 * (n - 1) / n * nbytes / bandwidth

    # -- per micro-batch compute ----------------------------------------------------------------
    def _measured(self, device_type: str, part: str, b: int, tp: int):
        prof = self.profiles.get(device_type)
        if prof is None:
            return None
        return prof.times(part, model=self.model, micro_batch_size=b, tensor_parallel_size=tp)

    def layer_times(self, device_type: str, b: int, tp: int) -> tuple[float, float]:
        """(forward, backward) seconds of one transformer layer on one micro-batch, TP included."""
        got = self._measured(device_type, "layer", b, tp)
        if got is not None:
            return got
        m = self.model
        fwd = M.layer_forward_flops(m, b) / tp / self.flops_rate(device_type)
        comm = 2 * self._allreduce(M.layer_input_bytes(m, b), tp, self.intra_node_bandwidth(device_type))
        return fwd + comm, 2 * fwd + comm

    def embedding_times(self, device_type: str, b: int, tp: int) -> tuple[float, float]:
        got = self._measured(device_type, "embedding", b, tp)
        if got is not None:
            return got
        comm = self._allreduce(M.layer_input_bytes(self.model, b), tp, self.intra_node_bandwidth(device_type))
        return comm, 0.0

    def output_times(self, device_type: str, b: int, tp: int) -> tuple[float, float]:
        got = self._measured(device_type, "output", b, tp)
        if got is not None:
            return got
        fwd = M.output_forward_flops(self.model, b, tp) / tp / self.flops_rate(device_type)
        return fwd, 2 * fwd

    def pipeline_overhead(self, device_type: str, b: int, tp: int) -> tuple[float, float]:
        """(forward, backward) seconds one pipeline stage pays per micro-batch beyond the sum of
        its parts: measured by the device type's profile (its 2-stage pipeline run), else the
        ``pipeline_overhead_s`` option. Added to every stage of a pipeline, not to a single
        stage."""
        prof = self.profiles.get(device_type)
        fn = getattr(prof, "pipeline_overhead", None)
        got = fn(model=self.model, micro_batch_size=b, tensor_parallel_size=tp) if fn else None
        return got if got is not None else self.pipeline_overhead_s

    def step_overhead(self, device_type: str, b: int, tp: int) -> tuple[float, float]:
        """(forward, backward) seconds every stage step pays once per micro-batch, whatever its
        layers: what the device type's profile says (``step_overhead``; the CPU rehearsal's
        emulated devices pay the CPU's penalty for starting a step after an idle gap), else 0."""
        fn = getattr(self.profiles.get(device_type), "step_overhead", None)
        got = fn(model=self.model, micro_batch_size=b, tensor_parallel_size=tp) if fn else None
        return got if got is not None else (0.0, 0.0)

    def _recompute_extra(self, device_type: str, b: int, tp: int, n: int, rk: RecomputeKey) -> float:
        gran, method, k = rk
        if gran == "none" or n == 0:
            return 0.0
        fwd, _ = self.layer_times(device_type, b, tp)
        if gran == "selective":
            share = M.core_attention_forward_flops(self.model, b) / M.layer_forward_flops(self.model, b)
            return n * fwd * share
        layers = n if method == "uniform" else min(k, n)
        return layers * fwd

    def _compute_times(self, device_type: str, num_layers: int, first: bool, last: bool,
                       micro_batch_size: int, tp: int, recompute: RecomputeKey = ("none", None, None),
                       activation_offload: bool = False, sp: bool = False,
                       module_inputs: bool = False) -> StageTimes:
        b = micro_batch_size
        lf, lb = self.layer_times(device_type, b, tp)
        fwd, bwd = num_layers * lf, num_layers * lb
        if module_inputs:
            # copies on side streams: a layer waits only for what its own compute cannot hide
            n = num_layers - self._recomputed_layers(num_layers, recompute)
            moved = self.module_input_bytes(b, tp, sp) / self.pcie_bandwidth
            fwd += n * max(0.0, moved - lf)
            bwd += n * max(0.0, moved - lb)
        if first:
            ef, eb = self.embedding_times(device_type, b, tp)
            fwd, bwd = fwd + ef, bwd + eb
        if last:
            of, ob = self.output_times(device_type, b, tp)
            fwd, bwd = fwd + of, bwd + ob
        bwd += self._recompute_extra(device_type, b, tp, num_layers, recompute)
        sf, sb = self.step_overhead(device_type, b, tp)
        fwd, bwd = fwd + sf, bwd + sb
        if not (first and last):  # a pipeline stage (or an interleaved chunk)
            pf, pb = self.pipeline_overhead(device_type, b, tp)
            fwd, bwd = fwd + pf, bwd + pb
        if activation_offload:
            moved = self._activations_per_microbatch(device_type, num_layers, first, last, b, tp,
                                                     recompute, sp)
            fwd += moved / self.pcie_bandwidth
            bwd += moved / self.pcie_bandwidth
        return StageTimes(fwd, bwd)

    # -- memory ---------------------------------------------------------------------------------
    def stage_params(self, num_layers: int, first: bool, last: bool, tp: int) -> float:
        """Parameters one tensor rank of the stage holds."""
        m = self.model
        n = num_layers * M.layer_params(m)
        if first:
            n += M.embedding_params(m, tp)
        if last:
            n += M.output_params(m, tp, single_stage=first)
        return n / tp

    def uses_flash_attention(self, device_type: str) -> bool:
        if self.flash_attention is not None:
            return self.flash_attention
        return self.spec(device_type).bf16

    def layer_activation_bytes(self, device_type: str, b: int, tp: int, policy: str,
                               sp: bool = False) -> float:
        """Bytes one tensor rank keeps per layer and micro-batch (:mod:`megatron_hetero.models`);
        ``sp``: sequence parallelism (ignored at TP = 1)."""
        return M.layer_activation_bytes(self.model, b, tp, policy,
                                        flash_attention=self.uses_flash_attention(device_type),
                                        sequence_parallel=sp and tp > 1)

    def hidden_bytes(self, b: int, tp: int, sp: bool = False) -> float:
        """One rank's ``[s, b, h]`` 16-bit tensor: a pipeline send, a full-recompute checkpoint
        (``[s/t, b, h]`` with sequence parallelism)."""
        return M.layer_input_bytes(self.model, b) / (tp if sp and tp > 1 else 1)

    def module_input_bytes(self, b: int, tp: int, sp: bool = False) -> float:
        """Bytes per layer and micro-batch that fine-grained activation offloading moves to
        the host (:func:`megatron_hetero.models.module_input_bytes`)."""
        return M.module_input_bytes(self.model, b, tp, sequence_parallel=sp and tp > 1)

    @staticmethod
    def _recomputed_layers(n: int, rk: RecomputeKey) -> int:
        gran, method, k = rk
        if gran != "full":
            return 0
        return n if method == "uniform" else min(k, n)

    def _activations_per_microbatch(self, device_type: str, n: int, first: bool, last: bool,
                                    b: int, tp: int, rk: RecomputeKey, sp: bool = False,
                                    module_inputs: bool = False) -> float:
        m = self.model
        gran, method, k = rk
        ckpt = self.hidden_bytes(b, tp, sp)
        kept = self.layer_activation_bytes(device_type, b, tp, "none" if gran == "full" else gran, sp)
        if module_inputs:
            kept -= self.module_input_bytes(b, tp, sp)
        if gran == "full":
            if method == "uniform":
                out = -(-n // k) * ckpt
            else:
                kk = min(k, n)
                out = kk * ckpt + (n - kk) * kept
        else:
            out = n * kept
        if first:
            out += ckpt / 2  # embedding dropout mask (1 byte per element)
        if last:
            out += ckpt + M.logits_bytes(m, b, tp)  # final norm input, fp32 logits
        return out

    def optimizer_shard(self, params: float, data_parallel: int) -> float:
        """Parameters whose optimizer state one rank holds: sharded over the data-parallel
        replicas with the distributed optimizer."""
        return params / data_parallel if self.use_distributed_optimizer else params

    def _module_input_margin(self, n: int, rk: RecomputeKey, b: int, tp: int, sp: bool,
                             module_inputs: bool) -> float:
        """What fine-grained offloading keeps on the device after all: megatron-core leaves the
        last group of each offloaded module in place so that reloading it never stalls the
        backward, about one layer's module inputs of one micro-batch."""
        if not module_inputs or n - self._recomputed_layers(n, rk) <= 0:
            return 0.0
        return self.module_input_bytes(b, tp, sp)

    def _memory_need(self, device_type: str, num_layers: int, first: bool, last: bool,
                     micro_batch_size: int, tp: int, recompute: RecomputeKey, in_flight: int,
                     data_parallel: int, optimizer_offload: float = 0.0,
                     activation_offload: bool = False, sp: bool = False,
                     module_inputs: bool = False) -> Memory:
        m, b = self.model, micro_batch_size
        params = self.stage_params(num_layers, first, last, tp)
        shard = self.optimizer_shard(params, data_parallel)
        per_mb = self._activations_per_microbatch(device_type, num_layers, first, last, b, tp,
                                                  recompute, sp, module_inputs)
        acts = (1 if activation_offload else in_flight) * per_mb
        acts += self._module_input_margin(num_layers, recompute, b, tp, sp, module_inputs)
        gran, method, k = recompute
        if gran == "full" and num_layers:
            chunk = k if method == "uniform" else 1
            acts += min(chunk, num_layers) * self.layer_activation_bytes(device_type, b, tp, "none", sp)
        return Memory(params=params * self.param_bytes, grads=params * self.grad_bytes,
                      optimizer=shard * self.optim_bytes * (1.0 - optimizer_offload),
                      activations=acts, workspace=self.workspace_bytes,
                      capacity=self.capacity(device_type))

    def _chunked_memory_need(self, device_type: str, chunk_layers: tuple[int, ...], first: bool,
                             last: bool, micro_batch_size: int, tp: int, recompute: RecomputeKey,
                             pipeline_size: int, stage: int, num_microbatches: int,
                             data_parallel: int, optimizer_offload: float = 0.0,
                             activation_offload: bool = False, sp: bool = False,
                             module_inputs: bool = False, group: int | None = None) -> Memory:
        """Peak memory of one tensor rank of stage ``stage`` of ``pipeline_size`` under the
        interleaved schedule (micro-batch group ``group``, default the pipeline size), its
        model chunks holding ``chunk_layers``."""
        v, b = len(chunk_layers), micro_batch_size
        num_layers = sum(chunk_layers)
        base = self.memory_need(device_type, num_layers, first, last, b, tp, ("none", None, None),
                                0, data_parallel, optimizer_offload, False, sp)
        keys = chunk_recompute_keys(recompute, chunk_layers)
        per_chunk = [self._activations_per_microbatch(device_type, n, first and c == 0,
                                                      last and c == v - 1, b, tp, keys[c], sp,
                                                      module_inputs)
                     for c, n in enumerate(chunk_layers)]
        if activation_offload:
            acts = max(per_chunk)
        else:
            acts = peak_activations(pipeline_size, stage, num_microbatches, v, per_chunk, group)
        transient = 0
        for (gran, method, k), n in zip(keys, chunk_layers):
            if gran == "full" and n:
                transient = max(transient, min(k if method == "uniform" else 1, n))
        acts += transient * self.layer_activation_bytes(device_type, b, tp, "none", sp)
        acts += self._module_input_margin(num_layers, recompute, b, tp, sp, module_inputs)
        return Memory(params=base.params, grads=base.grads, optimizer=base.optimizer,
                      activations=acts, workspace=base.workspace, capacity=base.capacity)

    # -- data-parallel sync and optimizer -------------------------------------------------------
    def dp_sync_seconds(self, params_per_rank: float, data_parallel: int, bandwidth_gb_s: float) -> float:
        """Gradient sync of one rank's parameters over ``data_parallel`` replicas."""
        d = data_parallel
        if d <= 1:
            return 0.0
        bw = bandwidth_gb_s * 1e9
        if self.use_distributed_optimizer:
            return (d - 1) / d * params_per_rank * (self.grad_bytes + self.param_bytes) / bw
        return 2.0 * (d - 1) / d * params_per_rank * self.grad_bytes / bw

    def optimizer_seconds(self, device_type: str, params_per_rank: float, data_parallel: int,
                          optimizer_offload: float = 0.0) -> float:
        shard = self.optimizer_shard(params_per_rank, data_parallel)
        touched = shard * (self.grad_bytes + 2 * self.optim_bytes + self.param_bytes)
        dev_bw = self.spec(device_type).memory_bandwidth_gb_s * 1e9
        return (1 - optimizer_offload) * touched / dev_bw + optimizer_offload * touched / self.host_optimizer_rate

    def p2p_seconds(self, micro_batch_size: int, bandwidth_gb_s: float, tp: int = 1,
                    sp: bool = False) -> float:
        """One pipeline send of a micro-batch's activations (or their gradients)."""
        return self.p2p_latency_s + self.hidden_bytes(micro_batch_size, tp, sp) / (bandwidth_gb_s * 1e9)

    # -- plan level -----------------------------------------------------------------------------
    @staticmethod
    def sequence_parallel_of(plan: Plan) -> bool:
        """Whether ``plan`` runs Megatron's ``--sequence-parallel`` (its flag, at TP > 1)."""
        return plan.sequence_parallel and plan.tensor_model_parallel_size > 1

    @staticmethod
    def _stage_key(plan: Plan, pipeline: int, stage: int):
        st = plan.stage(pipeline, stage)
        p = plan.pipeline_model_parallel_size
        return st, stage == 0, stage == p - 1

    def stage_times(self, plan: Plan, pipeline: int, stage: int) -> StageTimes:
        """Predicted forward and backward seconds of one micro-batch on (pipeline, stage)."""
        st, first, last = self._stage_key(plan, pipeline, stage)
        return self.compute_times(st.device_type, st.num_layers, first, last,
                                  plan.pipelines[pipeline].micro_batch_size,
                                  plan.tensor_model_parallel_size, recompute_key(st.recompute),
                                  st.offload.activations, self.sequence_parallel_of(plan),
                                  st.offload.module_inputs)

    def chunk_times(self, plan: Plan, pipeline: int, stage: int) -> list[StageTimes]:
        """Forward and backward seconds of one micro-batch on each model chunk of (pipeline,
        stage), in chunk order; one entry (the stage's) when the plan does not interleave."""
        v = plan.virtual_pipeline_size
        if v == 1:
            return [self.stage_times(plan, pipeline, stage)]
        st, first, last = self._stage_key(plan, pipeline, stage)
        keys = chunk_recompute_keys(recompute_key(st.recompute), st.chunk_layers)
        return [self.compute_times(st.device_type, n, first and c == 0, last and c == v - 1,
                                   plan.pipelines[pipeline].micro_batch_size,
                                   plan.tensor_model_parallel_size, keys[c],
                                   st.offload.activations, self.sequence_parallel_of(plan),
                                   st.offload.module_inputs)
                for c, n in enumerate(st.chunk_layers)]

    def stage_memory(self, plan: Plan, pipeline: int, stage: int) -> Memory:
        """Peak memory of one tensor rank of (pipeline, stage)."""
        return self._stage_memory(plan, pipeline, stage,
                                  plan.stage(pipeline, stage).offload.module_inputs)

    def stage_host_bytes(self, plan: Plan, pipeline: int, stage: int) -> float:
        """Host bytes one tensor rank of (pipeline, stage) keeps: the offloaded fraction of its
        optimizer shard (fp32 master weights and Adam state, as :meth:`stage_memory` counts
        them, plus the fp32 copy of those parameters' gradients the CPU optimizer steps on)
        and, with ``module_inputs``, the module inputs of the micro-batches in flight at the
        stage's peak (its activations without the offload less those with it)."""
        st, first, last = self._stage_key(plan, pipeline, stage)
        params = self.stage_params(st.num_layers, first, last, plan.tensor_model_parallel_size)
        shard = self.optimizer_shard(params, plan.data_parallel_size)
        host = st.offload.optimizer_fraction * shard * (self.optim_bytes + 4.0)
        if st.offload.module_inputs:
            kept = self._stage_memory(plan, pipeline, stage, False).activations
            host += max(0.0, kept - self.stage_memory(plan, pipeline, stage).activations)
        return host

    def _stage_memory(self, plan: Plan, pipeline: int, stage: int, module_inputs: bool) -> Memory:
        st, first, last = self._stage_key(plan, pipeline, stage)
        pipe = plan.pipelines[pipeline]
        if plan.virtual_pipeline_size > 1:
            return self.chunked_memory_need(
                st.device_type, tuple(st.chunk_layers), first, last, pipe.micro_batch_size,
                plan.tensor_model_parallel_size, recompute_key(st.recompute),
                plan.pipeline_model_parallel_size, stage, pipe.num_microbatches,
                plan.data_parallel_size, st.offload.optimizer_fraction, st.offload.activations,
                self.sequence_parallel_of(plan), module_inputs, plan.microbatch_group_size)
        in_flight = min(plan.pipeline_model_parallel_size - stage, pipe.num_microbatches)
        return self.memory_need(st.device_type, st.num_layers, first, last, pipe.micro_batch_size,
                                plan.tensor_model_parallel_size, recompute_key(st.recompute),
                                in_flight, plan.data_parallel_size, st.offload.optimizer_fraction,
                                st.offload.activations, self.sequence_parallel_of(plan),
                                module_inputs)

    def placement(self, plan: Plan) -> Placement:
        """Where ``plan``'s stages sit (cached per stage types and TP size: the search
        simulates many plans of one shape)."""
        key = (tuple(tuple(s.device_type for s in p.stages) for p in plan.pipelines),
               plan.tensor_model_parallel_size)
        got = self._placements.get(key)
        if got is None:
            got = self._placements[key] = place([list(t) for t in key[0]], key[1], self.inventory)
        return got

    def chunk_params_of(self, plan: Plan, stage: int, chunk: int) -> float:
        """Parameters one tensor rank holds in model chunk ``chunk`` of stage ``stage``."""
        p, v = plan.pipeline_model_parallel_size, plan.virtual_pipeline_size
        if v == 1:
            return self.stage_params_of(plan, stage)
        n = plan.pipelines[0].stages[stage].chunk_layers[chunk]
        return self.stage_params(n, stage == 0 and chunk == 0, stage == p - 1 and chunk == v - 1,
                                 plan.tensor_model_parallel_size)

    def stage_params_of(self, plan: Plan, stage: int) -> float:
        p = plan.pipeline_model_parallel_size
        return self.stage_params(plan.layer_split[stage], stage == 0, stage == p - 1,
                                 plan.tensor_model_parallel_size)
