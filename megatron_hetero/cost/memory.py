"""The memory half of the cost model (:class:`~megatron_hetero.cost.model.CostModel`): the
parameters, optimizer state and activations one tensor rank of a stage holds at its peak, and
what it keeps on the host.

:class:`StageMemory` holds the methods; :class:`~megatron_hetero.cost.model.CostModel` inherits
them with the figures they read (the model, the precision's bytes per parameter, the
workspace reserve, the device specs) and caches them per instance. What memory counts is in
:mod:`megatron_hetero.cost.model`'s docstring.

A stage's memory is asked for thousands of times a search (every stage table, every policy
the local search weighs): :meth:`StageMemory.memory` reads the shape's fields once and looks
its parts up in caches keyed by plain tuples, with the same operations in the same order as
the parts' own methods (the same floats).
"""

from __future__ import annotations

from functools import lru_cache

from .. import models as M
from ..plan import ModelSpec, Offload, Recompute, chunk_recompute
from ..schedule.order import peak_activations
from .experts import per_stage_mix
from .stage import Memory, StageShape

__all__ = ["StageMemory"]


class StageMemory:
    """Bytes of one pipeline stage; a base of :class:`~megatron_hetero.cost.model.CostModel`,
    which sets the attributes below and caches the methods it names (``_params``,
    ``_layer_bytes``, ``_module_inputs``, ``_activations``, ``_chunk_activations``,
    ``memory``)."""

    model: ModelSpec
    profiles: dict
    use_distributed_optimizer: bool
    flash_attention: bool | None
    param_bytes: float
    grad_bytes: float
    optim_bytes: float
    workspace_bytes: float

    def _part(self, shape: StageShape, chunk: int | None) -> tuple[int, bool, bool, Recompute]:
        """(layers, first, last, recompute) of the whole stage (``chunk`` None) or one chunk."""
        if chunk is None:
            return shape.num_layers, shape.first, shape.last, shape.recompute
        v = shape.virtual_size
        return (shape.chunk_layers[chunk], shape.first and chunk == 0,
                shape.last and chunk == v - 1,
                _chunk_recompute(shape.recompute, shape.chunk_layers)[chunk])

    # -- parameters -----------------------------------------------------------------------------
    def params(self, num_layers: int, *, first: bool, last: bool, tp: int) -> float:
        """Parameters one tensor rank of a stage (or model chunk) of ``num_layers`` holds, with
        the embedding (``first``) and the output layer (``last``)."""
        return self._params(num_layers, first, last, tp)

    def _params(self, num_layers: int, first: bool, last: bool, tp: int,
                shards: int | None = None) -> float:
        """... with an MoE model's routed experts split over ``shards`` ranks (expert TP x EP;
        None: ``tp``) and the rest of its layers over ``tp``."""
        m = self.model
        if m.is_moe:
            rest, experts = M.layer_param_parts(m)
            n = num_layers * (rest + experts * tp / (shards or tp))
        else:
            n = num_layers * M.layer_params(m)
        if first:
            n += M.embedding_params(m, tp)
        if last:
            n += M.output_params(m, tp, single_stage=first)
        return n / tp

    @per_stage_mix
    def stage_params(self, shape: StageShape) -> float:
        """Parameters one tensor rank of the stage holds."""
        return self._params(shape.num_layers, shape.first, shape.last,
                            shape.tensor_parallel_size, shape.expert_shards)

    @per_stage_mix
    def chunk_params(self, shape: StageShape, chunk: int) -> float:
        """Parameters one tensor rank holds in model chunk ``chunk`` of the stage."""
        layers, first, last, _ = self._part(shape, chunk)
        return self._params(layers, first, last, shape.tensor_parallel_size, shape.expert_shards)

    @per_stage_mix
    def expert_params(self, shape: StageShape) -> float:
        """The routed-expert parameters one rank of the stage holds (0 for a dense model)."""
        return shape.num_layers * M.layer_param_parts(self.model)[1] / shape.expert_shards

    @per_stage_mix
    def optimizer_params(self, shape: StageShape) -> float:
        """Parameters whose optimizer state one rank of the stage holds: with the distributed
        optimizer its dense parameters over the ``D`` replicas and its expert shard over the
        ``T D / (ETP EP)`` expert-data-parallel replicas, which comes to the stage's parameters
        over ``T D`` whatever the expert split; else all it holds."""
        if not self.use_distributed_optimizer:
            return self.stage_params(shape)
        return self._params(shape.num_layers, shape.first, shape.last,
                            shape.tensor_parallel_size) / shape.data_parallel_size

    def optimizer_shard(self, params: float, data_parallel: int) -> float:
        """Parameters whose optimizer state one rank holds: sharded over the data-parallel
        replicas with the distributed optimizer."""
        return params / data_parallel if self.use_distributed_optimizer else params

    # -- activations ----------------------------------------------------------------------------
    def uses_flash_attention(self, device_type: str) -> bool:
        """The ``flash_attention`` setting; else what the device type's profile ran (its layer
        spec); else whether the catalog entry has ``bf16`` (Ampere and later)."""
        if self.flash_attention is not None:
            return self.flash_attention
        unfused = getattr(self.profiles.get(device_type), "unfused_attention", None)
        if unfused is not None:
            return not unfused
        return self.spec(device_type).bf16

    def layer_activation_bytes(self, device_type: str, b: int, tp: int, policy: str, *,
                               sp: bool = False) -> float:
        """Bytes one tensor rank keeps per layer and micro-batch (:mod:`megatron_hetero.models`);
        ``sp``: sequence parallelism (ignored at TP = 1)."""
        return self._layer_bytes(device_type, b, tp, policy, sp)

    def _layer_bytes(self, device_type: str, b: int, tp: int, policy: str, sp: bool) -> float:
        if policy == "none" and not (sp and tp > 1):
            # what the device type's profile measured the layer keeping (the allocator's view
            # on a GPU), where it has this shape and micro-batch size
            measured = getattr(self.profiles.get(device_type), "activation_bytes", None)
            got = measured and measured(model=self.model, micro_batch_size=b,
                                        tensor_parallel_size=tp)
            if got:
                return got
        return M.layer_activation_bytes(self.model, b, tp, policy,
                                        flash_attention=self.uses_flash_attention(device_type),
                                        sequence_parallel=sp and tp > 1)

    def hidden_bytes(self, b: int, tp: int, *, sp: bool = False) -> float:
        """One rank's ``[s, b, h]`` 16-bit tensor: a pipeline send, a full-recompute checkpoint
        (``[s/t, b, h]`` with sequence parallelism)."""
        return M.layer_input_bytes(self.model, b) / (tp if sp and tp > 1 else 1)

    def module_input_bytes(self, b: int, tp: int, *, sp: bool = False) -> float:
        """Bytes per layer and micro-batch that fine-grained activation offloading moves to
        the host (:func:`megatron_hetero.models.module_input_bytes`)."""
        return self._module_inputs(b, tp, sp)

    def _module_inputs(self, b: int, tp: int, sp: bool) -> float:
        return M.module_input_bytes(self.model, b, tp, sequence_parallel=sp and tp > 1)

    def module_input_transfer_bytes(self, device_type: str, b: int, tp: int, *,
                                    sp: bool = False) -> float:
        """Bytes per layer and micro-batch that fine-grained activation offloading copies to
        the host and back: the module inputs, and where attention is unfused (megatron-core's
        local layers; cards without bf16) everything ``core_attn`` saves as well, its ``s x s``
        matrices: the measured activation bytes beyond the fused estimate where the device
        type's profile has this shape, else Korthikanti's ``5as^2b / t``. On an H200 with the
        local layers that made the step 3.7x slower (docs/gpu.md). What the peak loses is
        counted as the module inputs only (:meth:`module_input_bytes`): the reloads come back
        before the backward needs them, which the measured peak showed."""
        moved = self._module_inputs(b, tp, sp)
        if self.uses_flash_attention(device_type):
            return moved
        fused = M.layer_activation_bytes(self.model, b, tp, "none", flash_attention=True,
                                         sequence_parallel=sp and tp > 1)
        kept = self._layer_bytes(device_type, b, tp, "none", sp)
        return moved + max(0.0, kept - fused)

    def _activations_per_microbatch(self, shape: StageShape, chunk: int | None) -> float:
        """Bytes one micro-batch leaves on one tensor rank of the stage (or of its model
        chunk) until its backward."""
        n, first, last, r = self._part(shape, chunk)
        return self._activations((shape.device_type, shape.micro_batch_size,
                                  shape.tensor_parallel_size, shape.sp,
                                  shape.offload.module_inputs, n, first, last, r))

    def _activations(self, part: tuple) -> float:
        """:meth:`_activations_per_microbatch` of ``part``: (device type, micro-batch size,
        TP, sequence parallelism, module inputs offloaded, layers, first, last, recompute),
        all that it depends on."""
        device_type, b, tp, sp, module_inputs, layers, first, last, recompute = part
        n, r = layers, recompute
        ckpt = self.hidden_bytes(b, tp, sp=sp)
        kept = self._layer_bytes(device_type, b, tp,
                                 "none" if r.granularity == "full" else r.granularity, sp)
        if module_inputs:
            kept -= self._module_inputs(b, tp, sp)
        if r.granularity == "full":
            if r.method == "uniform":
                out = -(-n // r.num_layers) * ckpt
            else:
                kk = min(r.num_layers, n)
                out = kk * ckpt + (n - kk) * kept
        else:
            out = n * kept
        if first:
            out += ckpt / 2  # embedding dropout mask (1 byte per element)
        if last:
            out += ckpt + M.logits_bytes(self.model, b, tp)  # final norm input, fp32 logits
        return out

    def _chunk_activations(self, device_type: str, b: int, tp: int, sp: bool,
                           module_inputs: bool, chunk_layers: tuple[int, ...], first: bool,
                           last: bool, recompute: Recompute) -> tuple[list[float], int]:
        """Per chunk, one micro-batch's bytes; and a recompute's most layers at once (cached)."""
        v = len(chunk_layers)
        keys = _chunk_recompute(recompute, chunk_layers)
        per_chunk = [self._activations((device_type, b, tp, sp, module_inputs, n,
                                        first and c == 0, last and c == v - 1, keys[c]))
                     for c, n in enumerate(chunk_layers)]
        return per_chunk, max(_transient_layers(r, n) for r, n in zip(keys, chunk_layers))

    def _module_input_margin(self, shape: StageShape) -> float:
        """What fine-grained offloading keeps on the device after all: megatron-core leaves the
        last group of each offloaded module in place so that reloading it never stalls the
        backward, about one layer's module inputs of one micro-batch."""
        n = shape.num_layers
        if not shape.offload.module_inputs or n - shape.recompute.recomputed_layers(n) <= 0:
            return 0.0
        return self._module_inputs(shape.micro_batch_size, shape.tensor_parallel_size, shape.sp)

    # -- the stage ------------------------------------------------------------------------------
    @per_stage_mix
    def memory(self, shape: StageShape) -> Memory:
        """Peak memory of one tensor rank of the stage: in 1F1B stage ``s`` of ``p`` holds
        ``min(p - s, m)`` micro-batches in flight (its warm-up plus one,
        :attr:`StageShape.in_flight`); interleaved, the peak over the rank's order
        of the summed activations of the chunks run forward and not yet backward; plus the
        module inputs a stage that offloads them keeps (:meth:`_module_input_margin`) and the
        layers a full recompute rebuilds at once."""
        return self.memory_of(shape, shape.chunk_layers, shape.recompute, shape.offload)

    def memory_of(self, shape: StageShape, chunk_layers: tuple[int, ...], recompute: Recompute,
                  offload: Offload) -> Memory:
        """:meth:`memory` of ``shape`` with these chunks, recompute and offload instead of its
        own, without building that shape (nor caching it): for the stage tables and the local
        search's policies, which weigh each once."""
        p, s, v = shape.pipeline_size, shape.stage, len(chunk_layers)
        device_type, b, tp = shape.device_type, shape.micro_batch_size, shape.tensor_parallel_size
        sp, n, r = shape.sequence_parallel and tp > 1, sum(chunk_layers), recompute
        first, last = s == 0, s == p - 1
        shards = shape.expert_shards
        params = self._params(n, first, last, tp, shards)
        if shards != tp and self.use_distributed_optimizer:  # :meth:`optimizer_params`
            shard = self._params(n, first, last, tp) / shape.data_parallel_size
        else:
            shard = params / shape.data_parallel_size if self.use_distributed_optimizer else params
        margin = 0.0
        if offload.module_inputs and n - r.recomputed_layers(n) > 0:
            margin = self._module_inputs(b, tp, sp)
        layer = self._layer_bytes(device_type, b, tp, "none", sp)
        if v == 1:
            in_flight = 1 if offload.activations else shape.in_flight
            acts = in_flight * self._activations((device_type, b, tp, sp, offload.module_inputs,
                                                  n, first, last, r))
            acts += margin
            acts += _transient_layers(r, n) * layer
        else:
            per_chunk, transient = self._chunk_activations(
                device_type, b, tp, sp, offload.module_inputs, chunk_layers, first, last, r)
            if offload.activations:
                acts = max(per_chunk)
            else:
                acts = peak_activations(p, s, shape.num_microbatches, v, per_chunk,
                                        shape.microbatch_group,
                                        warmup=shape.warmup_microbatches)
            acts += transient * layer
            acts += margin
        return Memory(params=params * self.param_bytes, grads=params * self.grad_bytes,
                      optimizer=shard * self.optim_bytes * (1.0 - offload.optimizer_fraction),
                      activations=acts, workspace=self.workspace_bytes,
                      capacity=self.capacity(device_type))

    @per_stage_mix
    def host_bytes(self, shape: StageShape) -> float:
        """Host bytes one tensor rank of the stage keeps: the offloaded fraction of its
        optimizer shard (fp32 master weights and Adam state, as :meth:`memory` counts them,
        plus the fp32 copy of those parameters' gradients the CPU optimizer steps on) and, with
        ``module_inputs``, the module inputs of the micro-batches in flight at the stage's peak
        (its activations without the offload less those with it)."""
        shard = self.optimizer_params(shape)
        offload = shape.offload
        host = offload.optimizer_fraction * shard * (self.optim_bytes + 4.0)
        if offload.module_inputs:
            kept = self.memory(shape.but(offload=_without_module_inputs(offload))).activations
            host += max(0.0, kept - self.memory(shape).activations)
        return host


def _transient_layers(r: Recompute, n: int) -> int:
    """Layers whose activations a full recompute of a stage (or chunk) of ``n`` layers
    rebuilds at once in the backward: a uniform group, or one layer of a block."""
    if r.granularity != "full" or not n:
        return 0
    return min(r.num_layers if r.method == "uniform" else 1, n)


_chunk_recompute = lru_cache(maxsize=4096)(chunk_recompute)
""":func:`~megatron_hetero.plan.chunk_recompute`, once per stage shape."""


def _without_module_inputs(offload: Offload) -> Offload:
    return Offload(optimizer_fraction=offload.optimizer_fraction, activations=offload.activations)
