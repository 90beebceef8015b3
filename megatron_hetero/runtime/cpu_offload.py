"""megatron-core's offload paths on the CPU stack (``python -m megatron_hetero.launch --cpu``).

:func:`prepare_cpu_offload` is called by :func:`.cpu.prepare_cpu_run`. What every CPU run of
megatron-core's CPU-offload optimizer (``Offload.optimizer_fraction``) and fine-grained
activation offloading (``Offload.module_inputs``) needs is in
:mod:`megatron_hetero.mcore.cpu_offload` (the rehearsal's trainer runs them too); this module
adds what only Megatron-LM's training loop needs (module-input offload on the local layers,
as on a GPU without Transformer Engine, is :mod:`.stack`'s):

* ``pretrain`` pins the process to its GPU's NUMA node (``set_ideal_affinity_for_current_gpu``,
  cuda-python and NVML): a CPU rank has none.
"""

from __future__ import annotations

from ..mcore.cpu_offload import enable_cpu_offload
from ..mcore.rebind import rebind, skipped

__all__ = ["prepare_cpu_offload"]


def prepare_cpu_offload() -> None:
    """Install the shared fixes (:func:`megatron_hetero.mcore.cpu_offload.enable_cpu_offload`)
    and the one above (idempotent; the CPU backend is enabled already)."""
    enable_cpu_offload()
    rebind("megatron.core.pipeline_parallel.utils", "set_ideal_affinity_for_current_gpu",
           skipped, layer="cpu")
