"""Where each plan slot sits in the inventory, and which link two slots share.

The plan names device types, not hosts. The mapping here mirrors the runtime's
(:func:`megatron_hetero.runtime.placement.assign_ranks`): tensor-parallel groups are handed out
in rank order (mesh by mesh; inside a mesh stage by stage, and within a stage replica by
replica: Megatron's order for a plan of one grid), each to the next GPUs of its device type,
nodes taken in inventory order (group, node). A tensor-parallel group never straddles two
nodes. So a stage's data-parallel replicas sit side by side, and consecutive stages share a node
only when a node holds both. One placement for every plan shape: a plan of one grid is one mesh.

Between nodes of two vendors the link is the host path (:mod:`.host_path`): pipeline sends
and data-parallel groups that cross vendors are staged through the hosts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InfeasibleError
from ..hardware.inventory import Inventory
from ..plan import Plan
from .host_path import crosses_vendors, host_path, staged_ring_gb_s

__all__ = ["Node", "Placement", "place", "allocate", "between_groups_gb_s"]


@dataclass(frozen=True, slots=True, order=True)
class Node:
    """One node of the inventory: group index and node index inside the group."""

    group: int
    node: int


@dataclass(slots=True)
class Placement:
    """The node of every (mesh, stage, replica) tensor-parallel group of a plan (all its tensor
    ranks share it); a plan of one grid is one mesh, its replicas the pipelines."""

    inventory: Inventory
    nodes: list[list[list[Node]]]
    """``nodes[mesh][stage of the mesh][replica]``."""
    _links: dict = field(default_factory=dict, repr=False, compare=False)
    _dp: dict = field(default_factory=dict, repr=False, compare=False)

    def node(self, mesh: int, stage: int, replica: int) -> Node:
        return self.nodes[mesh][stage][replica]

    def row(self, mesh: int, replica: int) -> list[Node]:
        """The nodes of ``replica``'s stages of ``mesh``, stage by stage."""
        return [stage[replica] for stage in self.nodes[mesh]]

    def path_links(self, mesh: int, replica: int, wrap: bool) -> tuple[float, ...]:
        """GB/s of the links between consecutive stages of ``replica`` inside ``mesh`` and, with
        ``wrap`` (interleaved 1F1B), from its last stage back to its first."""
        key = (mesh, replica, wrap)
        got = self._links.get(key)
        if got is None:
            row = self.row(mesh, replica)
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

    def dp_bandwidth(self, mesh: int, stage: int) -> float:
        """:meth:`slowest_bandwidth` of the data-parallel group of (mesh, stage): its replicas."""
        key = (mesh, stage)
        got = self._dp.get(key)
        if got is None:
            got = self._dp[key] = self.slowest_bandwidth(self.nodes[mesh][stage])
        return got

    def dp_host_staged(self, mesh: int, stage: int) -> bool:
        """Whether the data-parallel group of (mesh, stage) spans vendors (syncs on the host
        path)."""
        return crosses_vendors(self.inventory, {n.group for n in self.nodes[mesh][stage]})

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


def place(plan: Plan, inventory: Inventory) -> Placement:
    """Place every tensor-parallel group of ``plan`` on ``inventory``'s nodes in rank order
    (:meth:`~megatron_hetero.plan.Plan.slot_of_rank`: mesh by mesh, inside a mesh stage by
    stage and, within a stage, replica by replica), each on its stage's device type
    (:class:`~megatron_hetero.errors.InfeasibleError`, naming the group, where the pool runs
    out)."""
    one = plan.one_grid
    order = [(k, j, r) for k, mesh in enumerate(plan.meshes) for j in range(mesh.num_stages)
             for r in range(mesh.data_parallel_size)]
    requests = []
    for k, j, r in order:
        mesh = plan.meshes[k]
        requests.append((mesh.pipelines[r].stages[j].device_type, mesh.tensor_model_parallel_size,
                         f"pipelines[{r}].stages[{j}]" if one
                         else f"meshes[{k}].stages[{j}] of replica {r}"))
    got = allocate(requests, inventory)
    nodes: list = [[[None] * m.data_parallel_size for _ in range(m.num_stages)]
                   for m in plan.meshes]
    for (k, j, r), node in zip(order, got):
        nodes[k][j][r] = node
    return Placement(inventory, nodes)
