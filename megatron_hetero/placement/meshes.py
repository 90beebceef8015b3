"""Where each mesh's ranks sit (mesh plans, :mod:`megatron_hetero.plan.format2`).

Placement: tensor-parallel groups are handed out in rank order (:meth:`Plan.slot_of_rank`):
mesh by mesh, inside a mesh stage by stage and, within a stage, replica by replica, each to
the next GPUs of its type that hold it inside one node (:func:`.placement.allocate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..plan import Plan
from .nodes import Node, Placement, allocate

__all__ = ["MeshPlacement", "place_meshes"]


@dataclass(slots=True)
class MeshPlacement:
    """The node of every (mesh, stage, replica) tensor-parallel group of a mesh plan."""

    links: Placement
    """Answers which link two nodes share (its own ``nodes`` grid is unused)."""
    nodes: list[list[list[Node]]]
    """``nodes[mesh][stage][replica]``."""
    _dp: dict = field(default_factory=dict, repr=False, compare=False)

    def node(self, mesh: int, stage: int, replica: int) -> Node:
        return self.nodes[mesh][stage][replica]

    def dp_bandwidth(self, mesh: int, stage: int) -> float:
        """GB/s of the slowest link inside the data-parallel group of (mesh, stage)."""
        key = (mesh, stage)
        got = self._dp.get(key)
        if got is None:
            got = self._dp[key] = self.links.slowest_bandwidth(self.nodes[mesh][stage])
        return got

    def link(self, a: Node, b: Node) -> float:
        return self.links.link_bandwidth(a, b)


def place_meshes(plan: Plan, inventory) -> MeshPlacement:
    """Place ``plan``'s meshes on ``inventory``'s nodes in rank order
    (:class:`~megatron_hetero.errors.InfeasibleError` where the pool runs out)."""
    order = [(k, j, r) for k, mesh in enumerate(plan.meshes) for j in range(len(mesh.stages))
             for r in range(mesh.data_parallel_size)]
    got = allocate([(plan.meshes[k].device_type, plan.meshes[k].tensor_model_parallel_size,
                     f"meshes[{k}].stages[{j}] of replica {r}") for k, j, r in order], inventory)
    nodes = [[[None] * m.data_parallel_size for _ in m.stages] for m in plan.meshes]
    for (k, j, r), node in zip(order, got):
        nodes[k][j][r] = node
    return MeshPlacement(links=Placement(inventory, []), nodes=nodes)  # type: ignore[arg-type]
