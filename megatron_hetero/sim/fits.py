"""A simulated plan against its cards and hosts: does every stage fit its GPU, every node its
host memory? (no torch)

:func:`check_fits` reads the memory the simulator computes (:attr:`SimResult.stages`,
:attr:`SimResult.host_nodes`): the first stage over its card, else the first node over its host
memory, is one error naming the stage, its card, its layers and the figures.
"""

from __future__ import annotations

from ..errors import Described, SchemaError
from ..plan.checks import stage_layers, stage_path
from ..plan import Plan
from .step import SimResult

__all__ = ["check_fits"]


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f}"


def check_fits(plan: Plan, sim: SimResult, *, source: str, skip_hint: str) -> None:
    """Raise :class:`SchemaError` when a stage of ``sim`` (the simulation of ``plan``) needs
    more memory than its card, or a node more host memory than it has. ``skip_hint`` says how
    to turn the check off."""
    over = [st for st in sim.stages if not st.memory.fits]
    if over:
        st, m = over[0], over[0].memory
        where = stage_path(plan, st.pipeline, st.stage)
        more = f"; {len(over) - 1} more stage(s) over" if len(over) > 1 else ""
        raise SchemaError(source, where, Described(
            f"stage {st.stage} ({st.device_type}, {stage_layers(plan, st.stage)}) needs "
            f"{_gb(m.total)} GB of {m.capacity / 1e9:g} GB (weights {_gb(m.params)}, gradients "
            f"{_gb(m.grads)}, optimizer {_gb(m.optimizer)}, activations {_gb(m.activations)}, "
            f"workspace {_gb(m.workspace)} GB){more}"),
            f"a stage that fits its card under the cost model (the runtime would run out of "
            f"memory): more recompute or offload, more stages, or `tune`; {skip_hint}")
    hosts = [h for h in sim.host_nodes if not h.fits]
    if hosts:
        h = hosts[0]
        raise SchemaError(source, "pipelines", Described(
            f"{h.node} needs {_gb(h.used_bytes)} GB of host memory of "
            f"{h.capacity_bytes / 1e9:g} GB (offloaded optimizer state and module inputs plus "
            f"the host reserve)"),
            f"what the inventory's host_memory_gb holds: offload less on that node's stages; "
            f"{skip_hint}")
