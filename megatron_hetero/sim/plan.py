"""One entry to the simulator for every plan: :func:`simulate_plan` picks the implementation by
the plan's shape (:attr:`megatron_hetero.plan.Plan.one_grid`): :func:`.step.simulate` where the
plan is one grid, :func:`.mesh.simulate_mesh` for a chain of meshes."""

from __future__ import annotations

from ..cost.model import CostModel
from ..plan import Plan
from .mesh import simulate_mesh
from .step import SimResult, simulate

__all__ = ["simulate_plan"]


def simulate_plan(plan: Plan, cost: CostModel, *, record_events: bool = True) -> SimResult:
    """Simulate one training step of ``plan`` under ``cost``, whatever its shape."""
    run = simulate if plan.one_grid else simulate_mesh
    return run(plan, cost, record_events=record_events)
