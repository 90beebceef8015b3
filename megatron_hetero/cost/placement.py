"""Where each plan slot sits in the inventory, and which link two slots share.

The plan names device types, not hosts. The mapping here is deterministic: pipelines are taken
in data-parallel order and stages in pipeline order; each stage's tensor-parallel group goes to
one node of its device type, preferring (1) the node of the previous stage of the same
pipeline, (2) a node that pipeline already uses, (3) the first node with room, in inventory
order (group, node). The launcher orders ranks the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InfeasibleError
from ..hardware.inventory import Inventory

__all__ = ["Node", "Placement", "place"]


@dataclass(frozen=True, slots=True, order=True)
class Node:
    """One node of the inventory: group index and node index inside the group."""

    group: int
    node: int


@dataclass(slots=True)
class Placement:
    """The node of every (pipeline, stage) of a plan (all its tensor ranks share it)."""

    inventory: Inventory
    nodes: list[list[Node]]
    """``nodes[pipeline][stage]``."""

    def node(self, pipeline: int, stage: int) -> Node:
        return self.nodes[pipeline][stage]

    def link_bandwidth(self, a: Node, b: Node) -> float:
        """GB/s (one direction) of the link two nodes share."""
        inv = self.inventory
        if a == b:
            return inv.intra_node_bandwidth(a.group)
        if a.group == b.group:
            return inv.inter_node_bandwidth(a.group)
        return inv.inter_group_bandwidth_gb_s

    def slowest_bandwidth(self, nodes: list[Node]) -> float:
        """GB/s of the slowest link inside a set of nodes (a data-parallel group)."""
        distinct = sorted(set(nodes))
        if len(distinct) == 1:
            return self.inventory.intra_node_bandwidth(distinct[0].group)
        groups = {n.group for n in distinct}
        if len(groups) == 1:
            return self.inventory.inter_node_bandwidth(distinct[0].group)
        return min([self.inventory.inter_group_bandwidth_gb_s]
                   + [self.inventory.inter_node_bandwidth(g) for g in sorted(groups)
                      if sum(1 for n in distinct if n.group == g) > 1])


def place(stage_types: list[list[str]], tp: int, inventory: Inventory) -> Placement:
    """Place stages (``stage_types[pipeline][stage]`` = device type) on the inventory's nodes."""
    free: dict[Node, int] = {}
    by_type: dict[str, list[Node]] = {}
    for gi, g in enumerate(inventory.groups):
        for ni in range(g.nodes):
            node = Node(gi, ni)
            free[node] = g.gpus_per_node
            by_type.setdefault(g.gpu, []).append(node)
    out: list[list[Node]] = []
    for d, types in enumerate(stage_types):
        row: list[Node] = []
        used: list[Node] = []
        for s, gpu in enumerate(types):
            candidates = by_type.get(gpu, [])
            pick = None
            if row and row[-1] in candidates and free[row[-1]] >= tp:
                pick = row[-1]
            if pick is None:
                pick = next((n for n in used if n in candidates and free[n] >= tp), None)
            if pick is None:
                pick = next((n for n in candidates if free[n] >= tp), None)
            if pick is None:
                have = sum(free[n] for n in candidates)
                raise InfeasibleError(
                    f"cannot place pipelines[{d}].stages[{s}] ({tp} GPUs of type {gpu} in one "
                    f"node): {inventory.source} has {have} {gpu} GPUs left, none {tp} in one node")
            free[pick] -= tp
            row.append(pick)
            if pick not in used:
                used.append(pick)
        out.append(row)
    return Placement(inventory, out)
