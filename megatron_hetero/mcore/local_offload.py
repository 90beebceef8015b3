"""Module-input offload on megatron-core's local layers, without Transformer Engine.

megatron-core's fine-grained activation offloading (``Offload.module_inputs``) moves the tensors
that autograd saves inside the offloaded modules to pinned host memory through saved-tensor
hooks of its own, on a side stream, and brings them back before the backward needs them; the
model's parameters are marked not to be offloaded (``GPTModel``). From Transformer Engine it
needs only one thing: around each offloaded group it sets the ``CPUOffloadEnabled`` flag of TE's
``cpu_offload`` module, which only TE's own layers read. Without TE that module is None in
megatron-core's TE extension, and the manager raises "TE CPU offload is not available" although
the local layers need no flag.

:func:`enable_local_module_input_offload` gives the extension a stand-in with that flag (where
TE is installed nothing changes). Every megatron-core stack without TE uses it: the CPU backend
(:mod:`.cpu_backend` redirects the same attribute to :class:`TeCpuOffloadFlag`), and a GPU whose
image has no TE (measured on an H200 with the local layers: docs/gpu.md).
"""

from __future__ import annotations

__all__ = ["TeCpuOffloadFlag", "enable_local_module_input_offload", "te_cpu_offload_module"]


class TeCpuOffloadFlag:
    """Stands in for Transformer Engine's ``cpu_offload`` module: the one flag megatron-core's
    offload manager sets, read by no local layer."""

    CPUOffloadEnabled = False


def te_cpu_offload_module():
    """TE's ``cpu_offload`` module as megatron-core's extension imported it, else a stand-in."""
    from megatron.core.extensions import transformer_engine as te_extensions
    return te_extensions.cpu_offload or TeCpuOffloadFlag()


def enable_local_module_input_offload() -> None:
    """Let megatron-core's fine-grained activation offloading run without Transformer Engine
    (idempotent; nothing changes where TE is installed)."""
    from megatron.core.extensions import transformer_engine as te_extensions
    if te_extensions.cpu_offload is None:
        te_extensions.cpu_offload = TeCpuOffloadFlag()
