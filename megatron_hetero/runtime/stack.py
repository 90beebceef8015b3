"""Megatron-LM's training loop on the stack that is installed, on any device.

Two things Megatron-LM assumes of its stack that a pip-installed megatron-core, or an image
without Transformer Engine, does not have; :func:`prepare_stack` adapts both (idempotent), and
installs :mod:`.torch_optimizer`'s checkpoint fixes where neither Apex nor TE is installed.
``megatron_hetero.launch`` calls it on every rank, before the plan's hooks; the CPU backend's
:func:`megatron_hetero.runtime.cpu.prepare_cpu_run` too.

* **Module-input offload on the local layers.** megatron-core runs fine-grained activation
  offloading (``Offload.module_inputs``) on its local layers once
  :func:`megatron_hetero.mcore.local_offload.enable_local_module_input_offload` stands in for
  Transformer Engine's one flag. Megatron-LM's ``validate_args`` still asserts
  ``--transformer-impl transformer_engine`` for it: with ``--transformer-impl local`` the flag is
  hidden from ``validate_args`` (and set again right after); nothing else changes.
* **The dataset helpers of a pip-installed megatron-core.** Megatron-LM's ``initialize_megatron``
  runs ``make`` in ``megatron/core/datasets`` on rank 0 and exits when it fails. A Megatron-LM
  checkout has the Makefile there; megatron-core's wheel has no Makefile but ships the helpers
  built (``helpers_cpp``), so there is nothing to compile: the step is skipped where no Makefile
  is.
"""

from __future__ import annotations

import functools
import os

from ..mcore.local_offload import enable_local_module_input_offload
from ..mcore.rebind import rebind
from .torch_optimizer import prepare_torch_optimizer_checkpoints

__all__ = ["prepare_stack"]


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


def _wrap_compile_helpers(original):
    @functools.wraps(original)
    def compile_helpers(*a, **kw):
        import megatron.core.datasets as pkg

        if os.path.exists(os.path.join(os.path.dirname(pkg.__file__), "Makefile")):
            return original(*a, **kw)
        return None
    return compile_helpers


def prepare_stack() -> None:
    """Install the two adaptations above and, where megatron-core steps torch's own optimizers,
    their checkpoint fixes (:mod:`.torch_optimizer`); idempotent."""
    enable_local_module_input_offload()
    prepare_torch_optimizer_checkpoints()
    rebind("megatron.training.arguments", "validate_args", _wrap_validate_args, layer="stack")
    rebind("megatron.core.datasets.utils", "compile_helpers", _wrap_compile_helpers,
           layer="stack")
