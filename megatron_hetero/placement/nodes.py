"""Where each plan slot sits in the inventory, and which link two slots share.

The plan names device types, not hosts. The mapping here mirrors the runtime's
(:func:`megatron_hetero.runtime.placement.assign_ranks`): tensor-parallel groups are handed out
in Megatron rank order (stage by stage, and within a stage pipeline by pipeline), each to the
next GPUs of its device type, nodes taken in inventory order (group, node). A tensor-parallel
group never straddles two nodes. So a stage's data-parallel replicas sit side by side, and
consecutive stages share a node only when a node holds both.

Between nodes of two vendors the link is the host path (:mod:`.host_path`): pipeline sends
and data-parallel groups that cross vendors are staged through the hosts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InfeasibleError
from ..hardware.inventory import Inventory
from .host_path import crosses_vendors, host_path, staged_ring_gb_s

__all__ = ["Node", "Placement", "place", "allocate", "between_groups_gb_s"]


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
    _links: dict = field(default_factory=dict, repr=False, compare=False)
    _dp: dict = field(default_factory=dict, repr=False, compare=False)

    def node(self, pipeline: int, stage: int) -> Node:
        return self.nodes[pipeline][stage]

    def pipeline_links(self, pipeline: int, wrap: bool) -> tuple[float, ...]:
        """GB/s of the links between consecutive stages of ``pipeline`` and, with ``wrap``
        (interleaved 1F1B), from its last stage back to its first."""
        key = (pipeline, wrap)
        got = self._links.get(key)
        if got is None:
            row = self.nodes[pipeline]
            pairs = list(zip(row, row[1:])) + ([(row[-1], row[0])] if wrap else [])
            got = self._links[key] = tuple(self.link_bandwidth(a, b) for a, b in pairs)
        return got

    def link_bandwidth(self, a: Node, b: Node) -> float:
        """GB/s (one direction) of the link two nodes share."""
        inv = self.inventory
        if a == b:
            return inv.intra_node_bandwidth(a.group)
        if a.group == b.group:
            return inv.inter_node_bandwidth(a.group)
        return between_groups_gb_s(inv, a.group, b.group)

    def host_staged(self, a: Node, b: Node) -> bool:
        """Whether the link between two nodes is the host path (their GPUs' vendors differ)."""
        return a.group != b.group and crosses_vendors(self.inventory, (a.group, b.group))

    def stage_bandwidth(self, stage: int) -> float:
        """:meth:`slowest_bandwidth` of the data-parallel group of ``stage`` (its replicas)."""
        got = self._dp.get(stage)
        if got is None:
            got = self._dp[stage] = self.slowest_bandwidth([row[stage] for row in self.nodes])
        return got

    def stage_host_staged(self, stage: int) -> bool:
        """Whether the data-parallel group of ``stage`` spans vendors (syncs on the host path)."""
        return crosses_vendors(self.inventory, {row[stage].group for row in self.nodes})

    def slowest_bandwidth(self, nodes: list[Node]) -> float:
        """GB/s of the slowest link inside a set of nodes (a data-parallel group)."""
        distinct = sorted(set(nodes))
        if len(distinct) == 1:
            return self.inventory.intra_node_bandwidth(distinct[0].group)
        groups = {n.group for n in distinct}
        if len(groups) == 1:
            return self.inventory.inter_node_bandwidth(distinct[0].group)
        staged = staged_ring_gb_s(self.inventory, groups, len(nodes))  # gloo on the host path
        if staged is not None:
            return staged
        return min([self.inventory.inter_group_bandwidth_gb_s]
                   + [self.inventory.inter_node_bandwidth(g) for g in sorted(groups)
                      if sum(1 for n in distinct if n.group == g) > 1])


def between_groups_gb_s(inventory: Inventory, a: int, b: int) -> float:
    """GB/s (one direction) between nodes of two different inventory groups: the host path's
    where their vendors differ, else the inventory's ``inter_group_bandwidth_gb_s``."""
    if crosses_vendors(inventory, (a, b)):
        return host_path(inventory, (a, b)).bandwidth_gb_s
    return inventory.inter_group_bandwidth_gb_s


def allocate(requests: list[tuple[str, int, str]], inventory: Inventory) -> list[Node]:
    """The node of each tensor-parallel group ``(device type, size, label)`` in ``requests``,
    handed out in the given order, each to the next GPUs of its type that fit it inside one
    node (nodes in inventory order); ``label`` names the group when the pool runs out."""
    nodes_of: dict[str, list[tuple[Node, int]]] = {}
    for gi, g in enumerate(inventory.groups):
        for ni in range(g.nodes):
            nodes_of.setdefault(g.gpu, []).append((Node(gi, ni), g.gpus_per_node))
    cursor: dict[str, list[int]] = {}  # per type: node index, GPUs used on it
    out = []
    for gpu, tp, label in requests:
        nodes = nodes_of.get(gpu, [])
        cur = cursor.setdefault(gpu, [0, 0])
        while cur[0] < len(nodes) and nodes[cur[0]][1] - cur[1] < tp:
            cur[0], cur[1] = cur[0] + 1, 0
        if cur[0] >= len(nodes):
            have = sum(n // tp for _, n in nodes) * tp
            raise InfeasibleError(
                f"cannot place {label} ({tp} GPUs of type {gpu} in one node): "
                f"{inventory.source} holds {have} {gpu} GPUs in whole groups of {tp}, and the "
                "plan needs more")
        out.append(nodes[cur[0]][0])
        cur[1] += tp
    return out


def place(stage_types: list[list[str]], tp: int, inventory: Inventory) -> Placement:
    """Place stages (``stage_types[pipeline][stage]`` = device type) on the inventory's nodes."""
    D = len(stage_types)
    p = len(stage_types[0]) if stage_types else 0
    order = [(d, s) for s in range(p) for d in range(D)]
    nodes = allocate([(stage_types[d][s], tp, f"pipelines[{d}].stages[{s}]") for d, s in order],
                     inventory)
    out: list[list[Node | None]] = [[None] * p for _ in range(D)]
    for (d, s), node in zip(order, nodes):
        out[d][s] = node
    return Placement(inventory, out)  # type: ignore[arg-type]
