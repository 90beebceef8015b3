"""What the installed megatron-core offers, by release: the one place the runtime asks for a
version. Each feature is named by the first release that has it; callers ask :func:`has`.

========================  =======  ==========================================================
feature                   first    what changes here
========================  =======  ==========================================================
``multimodule_schedule``  0.17     mesh plans run (``forward_backward_pipelining_without_
                                   interleaving`` takes a ``MultiModuleProcessGroupCollection``)
``model_builders``        0.19     Megatron-LM's ``pretrain_gpt.py`` builds the model with
                                   ``GPTModelBuilder.build_distributed_models`` instead of
                                   ``get_model``: the hooks of ``get_model`` hook it too
                                   (:mod:`.builders`)
========================  =======  ==========================================================

Changes met by the code that meets them, without a version test: megatron-core 0.19 gave
``get_forward_backward_func`` a ``schedule_pg_collection`` parameter (the hooks pass every
argument through); ``BridgeCommunicator`` a leader group made with ``backend='nccl'``
(:func:`megatron_hetero.mcore.mesh_grids.gloo_bridges`), a group of its own per bridge (before,
:mod:`megatron_hetero.mcore.bridge_groups` gives each bridge of a chain its own); the optimizers'
``get_main_grads_for_grad_norm`` became ``get_grads_for_grad_norm``
(:func:`megatron_hetero.mcore.mesh_train.use_whole_model_grad_norm`); fine-grained activation
offloading takes only ``cuda`` tensors (the CPU backend: :mod:`megatron_hetero.mcore.cpu_offload`)
and its ``ChunkOffloadHandler.bulk_offload_group`` takes the group to offload (the rehearsal's
memory meter: :mod:`megatron_hetero.emulate.memory`).
"""

from __future__ import annotations

import importlib
from functools import cache

__all__ = ["FEATURES", "installed", "has", "describe"]

FEATURES = {"multimodule_schedule": (0, 17), "model_builders": (0, 19)}
"""Feature -> the first megatron-core (major, minor) that has it."""


@cache
def installed() -> tuple[str, tuple[int, int]]:
    """The installed megatron-core's version: its text and ``(major, minor)``."""
    text = importlib.import_module("megatron.core.package_info").__version__
    major, minor = (int("".join(c for c in part if c.isdigit()) or 0)
                    for part in text.split(".")[:2])
    return text, (major, minor)


def has(feature: str) -> bool:
    """Whether the installed megatron-core has ``feature`` (a key of :data:`FEATURES`)."""
    return installed()[1] >= FEATURES[feature]


def describe(feature: str) -> str:
    """``"0.17"``: the first release with ``feature``."""
    return ".".join(map(str, FEATURES[feature]))
