"""The cost model: seconds and bytes of one pipeline stage on one device type.

Everything comes from the model shape (:mod:`megatron_hetero.models`), the catalog entry of the
device type (with the inventory's overrides) and, where given, a measured profile:

* compute: FLOPs / (catalog rate x efficiency); the efficiency is the profile's when it has one,
  else the catalog default. Measured (forward, backward) seconds replace the estimate wherever a
  profile has them. Precision ``fp32`` uses ``fp32_tflops``, 16-bit precisions ``bf16_tflops``.
* tensor parallelism: two ring all-reduces of the layer output per layer in forward and two in
  backward, ``2 (t-1)/t x bytes / bandwidth`` on the slowest intra-node link of the device type
  (not added to measured layer times, which include them); the forward waits for its two, the
  backward only for each one's excess over the weight-gradient GEMM it overlaps (with sequence
  parallelism: half an all-reduce per linear, exposed, besides;
  :meth:`CostModel._tp_backward_seconds`).
* pipeline sends: one 16-bit ``[s, b, h]`` tensor over the link the two stages share
  (:mod:`.placement`), plus a fixed latency.
* data-parallel sync: with the distributed optimizer a reduce-scatter of the gradients plus an
  all-gather of the 16-bit parameters, else an all-reduce of the gradients, ``(D-1)/D`` ring
  traffic over the slowest link of the group; then the Adam step, memory-bound
  (about 30 bytes touched per parameter on the device; offloaded fractions at host bandwidth).
* memory per rank (:mod:`.memory`): 16-bit parameters, main gradients (4 bytes with bf16/fp32,
  2 with fp16), Adam state (fp32 master + m + v = 12 bytes, 8 in fp32 training; sharded over
  data parallelism with the distributed optimizer; minus the offloaded fraction), activations of
  the micro-batches in flight (stage ``s`` of ``p`` holds ``min(p - s, m)`` in 1F1B), fp32
  logits on the last stage, minus the module inputs a stage offloads to the host (fine-grained activation offloading:
  the LayerNorm and QKV inputs, Q/K/V and the projection input of every layer not recomputed;
  one layer's worth stays on the device; the copies run on side streams and cost a layer only
  what its own compute cannot hide at the host link's ``pcie_bandwidth_gb_s``),
  the transient activations of one recomputed chunk, and a fixed workspace reserve (CUDA context,
  communication buffers, allocator slack). A stage fits where this is at most its card's
  usable memory (:meth:`CostModel.capacity`): the memory the device reports less the memory
  headroom, a fraction (:data:`DEFAULT_MEMORY_HEADROOM`) kept for the caching allocator's gap
  above its peak and the model's error.
* host memory per rank (:meth:`CostModel.host_bytes`): the offloaded fraction of the
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

from functools import lru_cache
from typing import Literal, Mapping

from .. import models as M
from ..errors import HeteroError
from ..hardware.inventory import Inventory
from ..plan import ModelSpec, Offload, Plan, Recompute
from ..placement.host_path import DEFAULT_HOST_LINK_GB_S
from .experts import SEQUENTIAL_EXPERT_S, ExpertCosts, check_imbalance, per_stage_mix
from .memory import StageMemory
from ..placement.nodes import Placement, place
from .profile_protocol import DeviceProfile
from .stage import Memory, StageShape, StageTimes

__all__ = ["CostModel", "DEFAULT_MEMORY_HEADROOM", "check_memory_headroom", "usable_memory_text"]

DEFAULT_MEMORY_HEADROOM = 0.10
"""Fraction of each card's reported memory no stage's predicted peak may use. Calibrated on the
H200 of docs/gpu.md (run 4): the caching allocator reserved 5.3%, 9.2% and 28.9% beyond the
peak the model predicts (8.4% at most without full recompute, whose working set the model
under-counts), and the CUDA context sits outside both; 10% covers the first two."""


def check_memory_headroom(value: float, *, flag: str = "--memory-headroom") -> float:
    """``value`` when it is a fraction in [0, 1); else the user's mistake, named by ``flag``."""
    if not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
        raise HeteroError(f"{flag}: {value!r}; expected the fraction of each card's memory to "
                          f"keep free, at least 0 and below 1 (default "
                          f"{DEFAULT_MEMORY_HEADROOM:g})")
    return float(value)


def usable_memory_text(headroom: float) -> str:
    """What the memory figures are out of, for messages and summaries."""
    return (f"usable memory is {100 * (1 - headroom):g}% of what the device reports "
            f"(--memory-headroom {headroom:g})")


class CostModel(StageMemory, ExpertCosts):
    """Compute, memory and communication costs of a model on an inventory's device types."""

    def __init__(self, model: ModelSpec, inventory: Inventory, *,
                 profiles: Mapping[str, DeviceProfile] = {},
                 precision: Literal["bf16", "fp16", "fp32"] = "bf16",
                 use_distributed_optimizer: bool = True,
                 flash_attention: bool | None = None,
                 overlap_grad_reduce: bool = False,
                 workspace_gb: float = 2.0,
                 host_optimizer_gb_s: float = 5.0,
                 pcie_bandwidth_gb_s: float = DEFAULT_HOST_LINK_GB_S,
                 host_reserve_gb: float = 64.0,
                 p2p_latency_s: float = 20e-6,
                 pipeline_overhead_s: tuple[float, float] = (0.0, 0.0),
                 memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
                 moe_load_imbalance: float = 1.0,
                 sequential_expert_s: tuple[float, float] = SEQUENTIAL_EXPERT_S):
        """
        ``flash_attention``: core attention runs a fused kernel that stores no ``s x s``
        matrices (Megatron's default with Transformer Engine), so no-recompute activations
        exclude Korthikanti's ``5as^2b`` term. ``None``: per device type, what its profile's
        layers ran (megatron-core's local layers: unfused), else where the catalog entry has
        ``bf16`` (Ampere and later; V100 and T4 run unfused attention). A profile's measured
        activation bytes per layer replace the estimate of a layer without recompute at the
        shapes it measured (:meth:`layer_activation_bytes`).
        Sequence parallelism is not a setting of the model: each :class:`StageShape` says
        whether its stage runs it (activations, checkpoints and pipeline sends sharded over the
        tensor ranks; the tensor-parallel traffic is the same, an all-gather plus a
        reduce-scatter in place of each all-reduce), and the primitives take it as ``sp``.
        ``overlap_grad_reduce``: the gradient sync overlaps
        the last backward (``--overlap-grad-reduce``). ``workspace_gb``: memory reserved per
        device outside the model. ``host_optimizer_gb_s``: optimizer state one GPU's share of
        the host processes per second when offloaded (CPU Adam plus PCIe copies; a node's
        CPUs serve all its GPUs at once). ``pcie_bandwidth_gb_s``: one GPU's host link, for
        offloaded activations. ``host_reserve_gb``: host memory per node kept for the OS and
        the training processes (data loaders, CUDA and NCCL host buffers), beside what the GPUs
        offload (:meth:`host_bytes`), where the inventory gives ``host_memory_gb``.
        ``pipeline_overhead_s``: (forward, backward) seconds a stage of
        a pipeline pays per micro-batch beyond its parts (schedule, p2p handling) where no
        profile of the device type measured it (:meth:`pipeline_overhead`); default 0.
        ``memory_headroom``: fraction of each card's reported memory kept free
        (:meth:`capacity`, :data:`DEFAULT_MEMORY_HEADROOM`).
        ``moe_load_imbalance``: an MoE model's most loaded expert rank's tokens over the mean
        (at least 1) where no profile of the device type measured it (:mod:`.experts`).
        ``sequential_expert_s``: (forward, backward) seconds each local expert adds to an MoE
        layer's micro-batch without grouped GEMM (:data:`.experts.SEQUENTIAL_EXPERT_S`).
        """
        self.options = dict(profiles=profiles, precision=precision,
                            use_distributed_optimizer=use_distributed_optimizer,
                            flash_attention=flash_attention, overlap_grad_reduce=overlap_grad_reduce,
                            workspace_gb=workspace_gb, host_optimizer_gb_s=host_optimizer_gb_s,
                            pcie_bandwidth_gb_s=pcie_bandwidth_gb_s, host_reserve_gb=host_reserve_gb,
                            p2p_latency_s=p2p_latency_s, pipeline_overhead_s=pipeline_overhead_s,
                            memory_headroom=memory_headroom, moe_load_imbalance=moe_load_imbalance,
                            sequential_expert_s=sequential_expert_s)
        self._mixes = {}
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
        self.memory_headroom = check_memory_headroom(memory_headroom, flag="memory_headroom")
        self.moe_load_imbalance = check_imbalance(moe_load_imbalance, flag="moe_load_imbalance")
        self.sequential_expert_s = sequential_expert_s
        self.param_bytes = 4.0 if precision == "fp32" else 2.0
        self.grad_bytes = 2.0 if precision == "fp16" else 4.0
        self.optim_bytes = 8.0 if precision == "fp32" else 12.0
        # Cached primitives are per instance (the model and inventory are fixed).
        self._specs: dict = {}
        self.flops_rate = lru_cache(maxsize=None)(self.flops_rate)
        self.layer_times = lru_cache(maxsize=None)(self.layer_times)
        self.intra_node_bandwidth = lru_cache(maxsize=None)(self.intra_node_bandwidth)
        self._part_times = lru_cache(maxsize=None)(self._part_times)
        self._activations = lru_cache(maxsize=None)(self._activations)
        self._layer_bytes = lru_cache(maxsize=None)(self._layer_bytes)
        self._module_inputs = lru_cache(maxsize=None)(self._module_inputs)
        # the simulator prices every stage of every plan a search simulates: most repeat
        # (``chunk_times``: a local-search move leaves most stages' shapes as they were)
        self.chunk_sync_seconds = lru_cache(maxsize=None)(self.chunk_sync_seconds)
        self.grad_sync_seconds = lru_cache(maxsize=None)(self.grad_sync_seconds)
        self.optimizer_seconds = lru_cache(maxsize=None)(self.optimizer_seconds)
        self.memory = lru_cache(maxsize=None)(self.memory)
        self.chunk_times = lru_cache(maxsize=None)(self.chunk_times)
        self._params = lru_cache(maxsize=None)(self._params)
        self._chunk_activations = lru_cache(maxsize=None)(self._chunk_activations)
        self._alltoall = lru_cache(maxsize=None)(self._alltoall)
        self.expert_link_gb_s = lru_cache(maxsize=None)(self.expert_link_gb_s)
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
        """Bytes a stage may use on one card of this type: what the device reports
        (:attr:`~megatron_hetero.hardware.catalog.GPUSpec.visible_memory_bytes`) less the
        memory headroom."""
        return self.spec(device_type).visible_memory_bytes * (1.0 - self.memory_headroom)

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

    def layer_times(self, device_type: str, b: int, tp: int, *,
                    sp: bool = False) -> tuple[float, float]:
        """(forward, backward) seconds of one transformer layer on one micro-batch, TP included:
        the forward waits for its two all-reduces (with sequence parallelism ``sp`` all-gathers
        and reduce-scatters of the same traffic), the backward for what
        :meth:`_tp_backward_seconds` leaves exposed."""
        got = self._measured(device_type, "layer", b, tp)
        if got is not None:
            return got
        m = self.model
        if m.is_moe:  # the most loaded expert rank sets the pace
            extra = (self.load_imbalance(device_type) - 1.0) * M.expert_forward_flops(m, b)
            fwd = (M.layer_forward_flops(m, b) + extra) / tp / self.flops_rate(device_type)
        else:
            fwd = M.layer_forward_flops(m, b) / tp / self.flops_rate(device_type)
        ar = self._allreduce(M.layer_input_bytes(m, b), tp, self.intra_node_bandwidth(device_type))
        return fwd + 2 * ar, 2 * fwd + self._tp_backward_seconds(device_type, b, tp, sp, ar)

    def _tp_backward_seconds(self, device_type: str, b: int, tp: int, sp: bool,
                             ar: float) -> float:
        """The tensor-parallel traffic one layer's backward waits for, ``ar`` one all-reduce of
        its ``[s, b, h]`` output. megatron-core (0.17-0.19; its local layers and Transformer
        Engine's alike, with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` as the launcher sets) starts a
        column-parallel linear's (QKV, the dense MLP's fc1) input-gradient all-reduce
        asynchronously and computes the weight gradient meanwhile, so only the all-reduce's
        excess over that GEMM shows. With sequence parallelism it is a reduce-scatter (half the
        traffic) behind the weight gradient, the all-gather of the linear's input behind the
        input gradient's GEMM, and the row-parallel linears' (projection, fc2) output gradients
        are all-gathered synchronously: half an all-reduce each. An MoE layer's MLP pays an
        all-reduce in full (its experts' linears hide nothing)."""
        if tp <= 1:
            return 0.0
        x = M.moe_fraction(self.model)
        rate = self.flops_rate(device_type)
        gemm = [f / tp / rate for f in M.column_linear_forward_flops(self.model, b)]
        share = (1.0, 1.0 - x)  # of the layers whose linear hides its all-reduce
        if sp:
            hidden = sum(k * (2 * max(0.0, ar / 2 - g) + ar / 2) for k, g in zip(share, gemm))
        else:
            hidden = sum(k * max(0.0, ar - g) for k, g in zip(share, gemm))
        return hidden + x * ar

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

    def _recompute_extra(self, device_type: str, b: int, tp: int, n: int, r: Recompute) -> float:
        if r.granularity == "none" or n == 0:
            return 0.0
        fwd, _ = self.layer_times(device_type, b, tp)
        if r.granularity == "selective":
            share = M.core_attention_forward_flops(self.model, b) / M.layer_forward_flops(self.model, b)
            return n * fwd * share
        return r.recomputed_layers(n) * fwd

    @per_stage_mix
    def times(self, shape: StageShape) -> StageTimes:
        """Seconds of one micro-batch's forward and backward on the stage as a whole (the
        embedding, the output layer and the overheads counted once)."""
        return self._part_times(shape, None)

    @per_stage_mix
    def chunk_times(self, shape: StageShape) -> tuple[StageTimes, ...]:
        """:meth:`times` of each model chunk of the stage, in chunk order (each pays the
        per-micro-batch overheads); the stage's own when it has one chunk."""
        if shape.virtual_size == 1:
            return (self.times(shape),)
        return tuple(self._part_times(shape, c) for c in range(shape.virtual_size))

    def _part_times(self, shape: StageShape, chunk: int | None) -> StageTimes:
        device_type, b, tp = shape.device_type, shape.micro_batch_size, shape.tensor_parallel_size
        num_layers, first, last, recompute = self._part(shape, chunk)
        lf, lb = self.layer_times(device_type, b, tp, sp=shape.sp)
        fwd, bwd = num_layers * lf, num_layers * lb
        if self.model.is_moe:  # dispatch and combine, forward and backward; experts one by one
            a2a = num_layers * self.alltoall_seconds(shape)
            sf, sb = self.sequential_expert_seconds(shape)
            fwd, bwd = fwd + a2a + num_layers * sf, bwd + a2a + num_layers * sb
        if shape.offload.module_inputs:
            # copies on side streams: a layer waits only for what its own compute cannot hide
            n = num_layers - recompute.recomputed_layers(num_layers)
            moved = self.module_input_transfer_bytes(device_type, b, tp,
                                                     sp=shape.sp) / self.pcie_bandwidth
            fwd += n * max(0.0, moved - lf)
            bwd += n * max(0.0, moved - lb)
        if first:
            ef, eb = self.embedding_times(device_type, b, tp)
            fwd, bwd = fwd + ef, bwd + eb
        if last:
            of, ob = self.output_times(device_type, b, tp)
            fwd, bwd = fwd + of, bwd + ob
        bwd += self._recompute_extra(device_type, b, tp, num_layers, recompute)
        if self.model.is_moe and recompute.granularity == "full":  # the recompute's MoE part
            bwd += recompute.recomputed_layers(num_layers) * (
                self.alltoall_seconds(shape) + self.sequential_expert_seconds(shape)[0])
        sf, sb = self.step_overhead(device_type, b, tp)
        fwd, bwd = fwd + sf, bwd + sb
        if not (first and last):  # a pipeline stage (or an interleaved chunk)
            pf, pb = self.pipeline_overhead(device_type, b, tp)
            fwd, bwd = fwd + pf, bwd + pb
        if shape.offload.activations:
            moved = self._activations_per_microbatch(
                shape.but(offload=Offload(activations=True)), chunk)
            fwd += moved / self.pcie_bandwidth
            bwd += moved / self.pcie_bandwidth
        return StageTimes(fwd, bwd)

    # -- data-parallel sync and optimizer -------------------------------------------------------
    def chunk_sync_seconds(self, shape: StageShape, data_parallel: int,
                           bandwidth_gb_s: float) -> tuple[float, ...]:
        """Each model chunk's gradient sync over ``data_parallel`` replicas (overlapped with
        the backwards, each chunk's buckets go on their own)."""
        return tuple(self.dp_sync_seconds(self.chunk_params(shape, c), data_parallel,
                                          bandwidth_gb_s) for c in range(shape.virtual_size))

    def dp_sync_seconds(self, params_per_rank: float, data_parallel: int, bandwidth_gb_s: float) -> float:
        """Gradient sync of one rank's parameters over ``data_parallel`` replicas."""
        d = data_parallel
        if d <= 1:
            return 0.0
        bw = bandwidth_gb_s * 1e9
        if self.use_distributed_optimizer:
            return (d - 1) / d * params_per_rank * (self.grad_bytes + self.param_bytes) / bw
        return 2.0 * (d - 1) / d * params_per_rank * self.grad_bytes / bw

    @per_stage_mix
    def optimizer_seconds(self, shape: StageShape) -> float:
        """The stage's optimizer step: memory-bound on the device, the offloaded fraction at
        the host's rate."""
        return self._optimizer_seconds(shape, shape.offload.optimizer_fraction)

    @per_stage_mix
    def optimizer_offload_seconds(self, shape: StageShape) -> float:
        """What offloading all of the stage's optimizer state adds to its step."""
        return self._optimizer_seconds(shape, 1.0) - self._optimizer_seconds(shape, 0.0)

    def _optimizer_seconds(self, shape: StageShape, fraction: float) -> float:
        """On the device memory-bound at its bandwidth, times its profile's measured
        ``optimizer_factor``; the offloaded ``fraction`` at the host's rate."""
        shard = self.optimizer_params(shape)
        touched = shard * (self.grad_bytes + 2 * self.optim_bytes + self.param_bytes)
        dev_bw = self.spec(shape.device_type).memory_bandwidth_gb_s * 1e9
        factor = getattr(self.profiles.get(shape.device_type), "optimizer_factor", None) or 1.0
        return ((1 - fraction) * factor * touched / dev_bw
                + fraction * touched / self.host_optimizer_rate)

    def p2p_seconds(self, micro_batch_size: int, bandwidth_gb_s: float, *, tp: int = 1,
                    sp: bool = False) -> float:
        """One pipeline send of a micro-batch's activations (or their gradients)."""
        return self.p2p_latency_s + self.hidden_bytes(micro_batch_size, tp, sp=sp) / (bandwidth_gb_s * 1e9)

    # -- plan level -----------------------------------------------------------------------------
    def stage_times(self, plan: Plan, pipeline: int, stage: int) -> StageTimes:
        """Predicted forward and backward seconds of one micro-batch on (pipeline, stage)."""
        return self.times(StageShape.of(plan, pipeline, stage))

    def stage_memory(self, plan: Plan, pipeline: int, stage: int) -> Memory:
        """Peak memory of one tensor rank of (pipeline, stage)."""
        return self.memory(StageShape.of(plan, pipeline, stage))

    def stage_host_bytes(self, plan: Plan, pipeline: int, stage: int) -> float:
        """Host bytes one tensor rank of (pipeline, stage) keeps (:meth:`host_bytes`)."""
        return self.host_bytes(StageShape.of(plan, pipeline, stage))

    def placement(self, plan: Plan) -> Placement:
        """Where ``plan``'s tensor-parallel groups sit, every shape alike (cached per mesh's TP
        size and stage types: the search simulates many plans of one shape)."""
        key = tuple((m.tensor_model_parallel_size,
                     tuple(tuple(s.device_type for s in p.stages) for p in m.pipelines))
                    for m in plan.meshes)
        got = self._placements.get(key)
        if got is None:
            got = self._placements[key] = place(plan, self.inventory)
        return got



