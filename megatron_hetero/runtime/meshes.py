"""Mesh plans (``format_version: 2``, :mod:`megatron_hetero.plan.format2`) at run time.

They run under megatron-core's multimodule pipeline: one ``HyperCommGrid`` per mesh, a
``BridgeCommunicator`` per boundary, ``MultiModulePipelineCommunicator`` as the p2p
communicator of ``forward_backward_pipelining_without_interleaving`` with a
``MultiModuleProcessGroupCollection`` (docs/meshes.md). That schedule takes them from
megatron-core 0.17 on; 0.16.1 ships the grid and the communicators but not the schedule's
multimodule path, so there every rank refuses a mesh plan here, before the model is built, naming
the version it needs. On 0.17 :mod:`.mesh_run` runs it.
"""

from __future__ import annotations

from .._schema import read_yaml
from ..errors import HeteroError
from ..plan import MESH_FORMAT_VERSION, Plan, mesh_plan_from_data
from . import releases

__all__ = ["mesh_plan_of", "MULTIMODULE_SCHEDULE_VERSION"]

MULTIMODULE_SCHEDULE_VERSION = releases.FEATURES["multimodule_schedule"]
"""The first megatron-core whose non-interleaved 1F1B runs a multimodule pipeline."""


def mesh_plan_of(path: str) -> Plan | None:
    """The mesh plan in ``path`` (None for a format-1 plan), checked; on megatron-core older
    than :data:`MULTIMODULE_SCHEDULE_VERSION` a :class:`HeteroError` naming the version it
    needs, before anything is built."""
    data = read_yaml(path)
    if not (isinstance(data, dict) and data.get("format_version") == MESH_FORMAT_VERSION):
        return None
    if not releases.has("multimodule_schedule"):
        text, need = releases.installed()[0], releases.describe("multimodule_schedule")
        raise HeteroError(
            f"{path}: a mesh plan (format_version 2) needs megatron-core {need} or later, whose "
            f"forward_backward_pipelining_without_interleaving runs MultiModulePipelineCommunicator "
            f"with a MultiModuleProcessGroupCollection; megatron-core {text} is installed")
    return mesh_plan_from_data(data, source=path)
