"""Module-input offload under Megatron-LM's training loop with the local layers (no TE).

megatron-core runs fine-grained activation offloading (``Offload.module_inputs``) on its local
layers once :func:`megatron_hetero.mcore.local_offload.enable_local_module_input_offload` stands
in for Transformer Engine's one flag. Megatron-LM's ``validate_args`` still asserts
``--transformer-impl transformer_engine`` for it: with ``--transformer-impl local`` the flag is
hidden from ``validate_args`` (and set again right after), nothing else changes.

:func:`prepare_local_module_input_offload` installs both; ``megatron_hetero.launch`` calls it
where Transformer Engine is not installed (GPU images without TE, and every CPU rank).
"""

from __future__ import annotations

import functools

from ..mcore.local_offload import enable_local_module_input_offload
from ..mcore.rebind import rebind

__all__ = ["prepare_local_module_input_offload"]


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


def prepare_local_module_input_offload() -> None:
    """Install the stand-in flag and the ``validate_args`` pass-over above (idempotent)."""
    enable_local_module_input_offload()
    rebind("megatron.training.arguments", "validate_args", _wrap_validate_args,
           layer="local-offload")
