"""Mesh plans (``format_version: 2``, :mod:`megatron_hetero.plan_mesh`) at run time.

They run under megatron-core's multimodule pipeline: one ``HyperCommGrid`` per mesh, a
``BridgeCommunicator`` per boundary, ``MultiModulePipelineCommunicator`` as the p2p
communicator of ``forward_backward_pipelining_without_interleaving`` with a
``MultiModuleProcessGroupCollection`` (docs/meshes.md). That schedule takes them from
megatron-core 0.17 on; 0.16.1 ships the grid and the communicators but not the schedule's
multimodule path. The runtime that builds them is not written yet, so every rank refuses a mesh
plan here, before the model is built, naming what it needs.
"""

from __future__ import annotations

import importlib

from .._schema import read_yaml
from ..errors import HeteroError
from ..plan_mesh import MESH_FORMAT_VERSION

__all__ = ["refuse_mesh_plan", "MULTIMODULE_SCHEDULE_VERSION"]

MULTIMODULE_SCHEDULE_VERSION = (0, 17)
"""The first megatron-core whose non-interleaved 1F1B runs a multimodule pipeline."""


def _installed() -> tuple[str, tuple[int, ...]]:
    text = importlib.import_module("megatron.core.package_info").__version__
    return text, tuple(int(x) for x in text.split(".")[:2] if x.isdigit())


def refuse_mesh_plan(path: str) -> None:
    """Raise :class:`HeteroError` if ``path`` holds a mesh plan: on megatron-core older than
    :data:`MULTIMODULE_SCHEDULE_VERSION` naming the version it needs, else saying that the mesh
    runtime is not built yet. Plans of format 1 pass."""
    data = read_yaml(path)
    if not (isinstance(data, dict) and data.get("format_version") == MESH_FORMAT_VERSION):
        return
    text, version = _installed()
    if version < MULTIMODULE_SCHEDULE_VERSION:
        need = ".".join(map(str, MULTIMODULE_SCHEDULE_VERSION))
        raise HeteroError(
            f"{path}: a mesh plan (format_version 2) needs megatron-core {need} or later, whose "
            f"forward_backward_pipelining_without_interleaving runs MultiModulePipelineCommunicator "
            f"with a MultiModuleProcessGroupCollection; megatron-core {text} is installed")
    raise HeteroError(
        f"{path}: mesh plans (format_version 2) do not run yet (megatron-core {text} has what "
        "they need; docs/meshes.md says how the runtime will build them): simulate it, or "
        "`tune` without `--meshes` for the best plan that runs")
