"""Memory emulation: cap each CPU rank's memory to its device's memory, scaled with the model.

What is counted (real bytes, cheaply):

- *static*: the elements of the model's parameters, of their ``main_grad`` views (Megatron's
  DDP grad buffers, without their bucket padding) and of the optimizer state once it exists,
  each distinct tensor once -- :meth:`MemoryMeter.count_static`;
- *activations*: the storages autograd saves for the backward pass, counted while they are
  alive through ``torch.autograd.graph.saved_tensors_hooks`` (parameters excluded; views of one
  storage counted once). In the 1F1B schedule, the micro-batches in flight on a stage keep
  their saved tensors alive together, so the peak is the real activation peak of that stage.

- *module inputs* a stage offloads (``offload.module_inputs``: megatron-core's fine-grained
  activation offloading saves them through its own hooks, which take the place of the meter's):
  counted from the moment autograd hands them to its offload manager until the manager copies
  them to its host pool, and again from their reload until the backward pass takes them
  (:func:`meter_module_input_offload`). The host pool is host memory: not counted.

Not counted: the optimizer state a stage keeps on the host (``offload.optimizer_fraction``:
megatron-core's CPU-offload optimizer; its device optimizer's state is static), temporaries
freed inside an op, pipeline receive buffers that no op saved, and allocator fragmentation; on a
GPU these last are the few percent of headroom a plan must leave anyway.

The cap. A shrunk model needs far less memory than the real one, so the device's memory is
scaled with the model, rank by rank::

    cap(rank) = device.memory_bytes x estimate(shrunk model as the CPU runs it, rank)
                                     / estimate(real model, rank)

where ``estimate`` is the tuner's cost model (weights, gradients, optimizer state, the
activations of the micro-batches in flight on the stage, in the units the CPU run measures; see
:func:`memory_caps`). A rank then fails exactly when the measured shrunk need exceeds its share
of the card as the real model would use it: a plan that would not fit the real card fails in
the rehearsal too, with :class:`MemoryCapError` naming the rank, the (pipeline, stage) slot, the
device, the bytes needed and the cap.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from ..cost.stage import StageShape
from ..errors import HeteroError
from ..hardware.catalog import Catalog, load_catalog
from ..plan import Plan

__all__ = ["MemoryCapError", "MemoryMeter", "memory_caps", "cpu_rank_bytes", "plan_cost_model",
           "meter_module_input_offload"]


class MemoryCapError(HeteroError):
    """A rank needed more memory than its emulated device has (scaled with the model)."""

    def __init__(self, *, rank: int, pipeline: int, stage: int, device_type: str, needed: float,
                 cap: float, device_bytes: float, scale: float, what: str,
                 static: float | None = None):
        self.rank, self.pipeline, self.stage, self.device_type = rank, pipeline, stage, device_type
        self.needed, self.cap = needed, cap
        real_need = needed / scale if scale > 0 else float("inf")
        super().__init__(
            f"rank {rank} (pipeline {pipeline}, stage {stage}, {device_type}) ran out of memory "
            f"{what}: it needed {_mib(needed)}"
            + (f" ({_mib(static)} weights, gradients and optimizer state, "
               f"{_mib(needed - static)} activations)" if static is not None else "")
            + f" of its {_mib(cap)} cap (the device's "
            f"{device_bytes / 1e9:.0f} GB scaled by {scale:.3g} with the model: the real card "
            f"would be past {real_need / 1e9:.1f} GB at that point). Give this stage fewer layers "
            f"or micro-batches in flight, recompute, offload, or a larger device")


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


# -- caps -----------------------------------------------------------------------------------------

def plan_cost_model(plan: Plan, catalog: Catalog, *, use_distributed_optimizer: bool,
                    **kwargs):
    """The tuner's cost model over an inventory of exactly the plan's devices (one node per
    device type); ``kwargs`` are further :class:`~megatron_hetero.cost.model.CostModel` options."""
    from ..cost.model import CostModel
    from ..hardware.inventory import GPUGroup, Inventory

    inventory = Inventory(groups=[GPUGroup(gpu=d, nodes=1, gpus_per_node=n)
                                  for d, n in sorted(plan.device_counts().items())],
                          catalog=catalog, source="<plan devices>")
    return CostModel(plan.model, inventory, use_distributed_optimizer=use_distributed_optimizer,
                     **kwargs)


def cpu_rank_bytes(shrunk: Plan, catalog: Catalog | None = None, *,
                   shards_optimizer: bool = False) -> dict[int, float]:
    """Bytes each CPU rank needs for ``shrunk`` (any shape: each rank's mesh stage,
    :func:`_rank_memory`) under the cost model (fp32, unfused attention)."""
    cost = plan_cost_model(shrunk, catalog or load_catalog(), precision="fp32",
                           flash_attention=False, workspace_gb=0.0,
                           use_distributed_optimizer=shards_optimizer)
    out = {}
    for rank in range(shrunk.world_size):
        m = _rank_memory(cost, shrunk, rank)[1]
        out[rank] = m.params + m.grads + m.optimizer + 2 * m.activations
    return out


def memory_caps(real: Plan, shrunk: Plan,
                catalog: Catalog | None = None, *,
                activation_scale: float = 1.0, cpu_shards_optimizer: bool = False
                ) -> dict[int, tuple[float, float, float]]:
    """For every rank: (cap bytes, device bytes, scale) under the rule in the module docstring
    (``real`` and ``shrunk`` of the same shape).

    ``estimate`` is the tuner's cost model (:meth:`CostModel.stage_memory`): for the real plan
    as the tuner sees it (its precision, fused attention, workspace reserve); for the shrunk
    model as the CPU ranks run it (fp32 weights, fp32 activations, unfused attention that keeps
    its score matrices, no workspace, the optimizer state sharded when ``cpu_shards_optimizer``
    says the CPU ranks run Megatron's distributed optimizer), its activations multiplied
    by ``activation_scale``: the measured over the estimated bytes one shrunk layer saves (the
    rehearsal's calibration measures it; CPU layers save intermediates fused GPU kernels do not,
    and the cap must compare like with like).
    """
    catalog = catalog or real.catalog or load_catalog()
    real_cost = plan_cost_model(real, catalog, precision=real.precision,
                                use_distributed_optimizer=real.use_distributed_optimizer)
    cpu_cost = plan_cost_model(shrunk, catalog, precision="fp32", flash_attention=False,
                               workspace_gb=0.0, use_distributed_optimizer=cpu_shards_optimizer)
    caps = {}
    for rank in range(real.world_size):
        device_type, r = _rank_memory(real_cost, real, rank)
        device = catalog.get(device_type).memory_bytes
        c = _rank_memory(cpu_cost, shrunk, rank)[1]
        # the cost model counts 16-bit activations; the CPU ranks keep fp32 ones
        cpu_need = c.params + c.grads + c.optimizer + 2 * activation_scale * c.activations
        scale = cpu_need / r.total
        caps[rank] = (device * scale, device, scale)
    return caps


def _rank_memory(cost, plan, rank: int):
    """(device type, the cost model's peak memory) of one tensor rank of ``plan`` (a format-1
    plan or a mesh plan: its mesh's TP, its replica's micro-batch, its global stage index)."""
    slot = plan.slot_of_rank(rank)
    return (plan.stage_of_slot(slot).device_type,
            cost.memory(StageShape.at(plan, slot.mesh, slot.stage, slot.replica)))


# -- measurement ----------------------------------------------------------------------------------

def _storage(t) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


class _Saved:
    """What autograd keeps instead of a saved tensor; releases its count when autograd drops it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


@dataclass(kw_only=True)
class MemoryMeter:
    """Live-byte accounting of one rank, checked against its cap."""

    rank: int
    pipeline: int
    stage: int
    device_type: str
    cap: float | None = None
    """Byte cap (None: measure only)."""
    device_bytes: float = 0.0
    scale: float = 1.0
    static_bytes: int = 0
    activation_bytes: int = 0
    """Bytes of saved activations alive now."""
    peak_bytes: int = 0
    """Peak of static + activation bytes."""
    _static_ptrs: set = field(default_factory=set)
    _live: dict = field(default_factory=dict)  # storage ptr -> [refs, nbytes]

    def count_static(self, model_chunks: Iterable, optimizer=None) -> int:
        """(Re)count parameters, their ``main_grad``/``grad`` and the optimizer state; checks the
        cap. Call it before the first step and after each optimizer step."""
        seen: dict[tuple[int, int], int] = {}
        storages: set[int] = set()

        def add(t) -> None:
            # the tensor's own elements, not its whole storage: Megatron's contiguous buffers
            # pad each bucket, which is negligible on a real model and large on a shrunk one
            if t is not None and hasattr(t, "untyped_storage") and t.numel():
                seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
                storages.add(_storage(t)[0])

        for chunk in model_chunks:
            for p in chunk.parameters():
                add(p)
                add(getattr(p, "main_grad", None))
                add(p.grad)
        for t in _optimizer_tensors(optimizer):
            add(t)
        self._static_ptrs = storages
        self.static_bytes = sum(seen.values())
        self._check("holding weights, gradients and optimizer state")
        return self.static_bytes

    @contextmanager
    def saved_activations(self) -> Iterator[None]:
        """Count what autograd saves for the backward pass inside this block."""
        import torch

        def pack(t):
            ptr = self.hold(t)
            if ptr is None:
                return t
            saved = _Saved(t)
            weakref.finalize(saved, self._release, ptr)
            return saved

        def unpack(saved):
            return saved.tensor if isinstance(saved, _Saved) else saved

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def hold(self, t) -> int | None:
        """Count ``t``'s storage as a saved activation (once per storage; parameters are
        static) and check the cap; its storage pointer for :meth:`_release`, None if not
        counted."""
        ptr, n = _storage(t)
        if ptr == 0 or ptr in self._static_ptrs:
            return None
        entry = self._live.get(ptr)
        if entry is None:
            self._live[ptr] = [1, n]
            self.activation_bytes += n
        else:
            entry[0] += 1
        self._check("saving activations for the backward pass")
        return ptr

    def _release(self, ptr: int) -> None:
        entry = self._live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[ptr]
            self.activation_bytes -= entry[1]

    def _check(self, what: str) -> None:
        total = self.static_bytes + self.activation_bytes
        self.peak_bytes = max(self.peak_bytes, total)
        if self.cap is not None and total > self.cap:
            raise MemoryCapError(rank=self.rank, pipeline=self.pipeline, stage=self.stage,
                                 device_type=self.device_type, needed=total, cap=self.cap,
                                 device_bytes=self.device_bytes, scale=self.scale, what=what,
                                 static=self.static_bytes)


def _optimizer_tensors(optimizer) -> Iterator:
    """Tensors of a torch optimizer's state, through Megatron's wrappers; of megatron-core's
    CPU-offload optimizer, its device optimizer's (the host optimizers' live on the host)."""
    if optimizer is None:
        return
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        opt = getattr(inner, "optimizer", inner)
        if hasattr(opt, "gpu_optimizer") and hasattr(opt, "cpu_optimizers"):  # hybrid device
            opt = opt.gpu_optimizer
        for state in getattr(opt, "state", {}).values():
            if isinstance(state, dict):
                for v in state.values():
                    if hasattr(v, "untyped_storage"):
                        yield v
        for group in getattr(inner, "shard_fp32_from_float16_groups", None) or []:
            yield from group
        for group in getattr(inner, "fp32_from_float16_groups", None) or []:
            yield from group


_offload_meter: list = [None]  # the meter of this process's rank (one rank per process)


def meter_module_input_offload(meter: MemoryMeter) -> None:
    """Count, in ``meter``, the module inputs megatron-core's fine-grained activation
    offloading holds on the device (see the module docstring): its chunk handlers' pushes,
    offloads, reloads and pops. Installed once per process; the last meter given counts."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    from ..mcore.rebind import wrap_method

    _offload_meter[0] = meter
    for name, make in (("tensor_push", _metered_push), ("tensor_pop", _metered_pop),
                       ("bulk_offload_group", _metered_offload),
                       ("bulk_reload_group", _metered_reload)):
        wrap_method(fgo.ChunkOffloadHandler, name, make, layer="rehearsal")


def _metered_push(push):
    def tensor_push(self, tensor):
        tag = push(self, tensor)
        _offload_meter[0].hold(tensor)  # saved by autograd, through the manager's hooks
        return tag
    return tensor_push


def _metered_pop(pop):
    def tensor_pop(self, tag):
        import torch

        if torch.is_tensor(tag):  # megatron-core 0.19: one it does not manage, passed through
            held = tag
        else:
            held = self.offload_groups[tag[0] - 1]._tensors.get(tag)
        tensor = pop(self, tag)
        if torch.is_tensor(held):  # on the device until now: the backward pass takes it
            _offload_meter[0]._release(_storage(held)[0])
        return tensor
    return tensor_pop


def _metered_offload(offload):
    def bulk_offload_group(self, *given):
        import torch

        # megatron-core 0.19 passes the group; 0.17 offloads the last one queued
        group = given[0] if given else self._groups_to_offload[-1]
        before = {tag: t for tag, t in group._tensors.items() if torch.is_tensor(t)}
        offload(self, *given)
        for tag, t in before.items():
            if not torch.is_tensor(group._tensors.get(tag)):  # copied to the host pool
                _offload_meter[0]._release(_storage(t)[0])
    return bulk_offload_group


def _metered_reload(reload):
    def bulk_reload_group(self):
        import torch

        group = self._groups_to_reload[-1]
        away = [tag for tag, t in group._tensors.items() if not torch.is_tensor(t)]
        reload(self)
        for tag in away:
            if torch.is_tensor(group._tensors.get(tag)):  # back on the device
                _offload_meter[0].hold(group._tensors[tag])
    return bulk_reload_group
