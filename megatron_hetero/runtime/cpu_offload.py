"""megatron-core's offload paths on the CPU stack (``python -m megatron_hetero.launch --cpu``).

:func:`prepare_cpu_offload` is called by :func:`.cpu.prepare_cpu_run`. What every CPU run of
megatron-core's CPU-offload optimizer (``Offload.optimizer_fraction``) and fine-grained
activation offloading (``Offload.module_inputs``) needs is in
:mod:`megatron_hetero.mcore.cpu_offload` (the rehearsal's trainer runs them too); this module
adds what only Megatron-LM's training loop needs:

* Megatron-LM's ``validate_args`` asserts ``--transformer-impl transformer_engine`` for
  fine-grained activation offloading: on the CPU stack the local layers run it, so
  ``validate_args`` does not see the flag (set again right after).
* ``pretrain`` pins the process to its GPU's NUMA node (``set_ideal_affinity_for_current_gpu``,
  cuda-python and NVML): a CPU rank has none.
"""

from __future__ import annotations

import functools

from ..mcore.cpu_offload import enable_cpu_offload
from ..mcore.rebind import rebind, skipped

__all__ = ["prepare_cpu_offload"]


def _wrap_validate_args(original):
    @functools.wraps(original)
    def validate_args(args, *a, **kw):
        offloading = getattr(args, "fine_grained_activation_offloading", False)
        if offloading and getattr(args, "transformer_impl", None) == "local":
            args.fine_grained_activation_offloading = False
            try:
                return original(args, *a, **kw)
            finally:
                args.fine_grained_activation_offloading = offloading
        return original(args, *a, **kw)
    return validate_args


def prepare_cpu_offload() -> None:
    """Install the shared fixes (:func:`megatron_hetero.mcore.cpu_offload.enable_cpu_offload`)
    and the two above (idempotent; the CPU backend is enabled already)."""
    enable_cpu_offload()
    rebind("megatron.training.arguments", "validate_args", _wrap_validate_args, layer="cpu")
    rebind("megatron.core.pipeline_parallel.utils", "set_ideal_affinity_for_current_gpu",
           skipped, layer="cpu")
