"""The inventory (``inventory.yaml``): which GPUs the pool has and how they are linked.

Minimal form::

    groups:
      - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 8}
      - {gpu: V100-SXM2-32GB, nodes: 1, gpus_per_node: 8}

Optional per group: ``name``, ``hosts``, ``intra_node_bandwidth_gb_s``,
``inter_node_bandwidth_gb_s``, ``partition``, ``constraint`` and ``host_memory_gb`` (host RAM
per node in GB: when given, the simulator checks that what a node's GPUs offload to the host,
optimizer state and module inputs, fits in it beside a reserve for the OS and processes, and
the tuner keeps only plans that fit), ``nic_bandwidth_gb_s`` and ``rdma`` (the node's NIC
as seen from host memory, for links between GPUs of two vendors, which are staged through the
hosts: see :mod:`megatron_hetero.placement.host_path`); at the top:
``inter_group_bandwidth_gb_s``, ``gpus``, ``name``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .._schema import from_data, read_yaml
from ..errors import Described, SchemaError
from ..limits import check_gpus, quantity
from .catalog import Catalog, GPUOverride, GPUSpec, load_catalog

__all__ = ["GPUGroup", "Inventory", "load_inventory", "inventory_from_data",
           "DEFAULT_INTER_NODE_GB_S", "DEFAULT_INTER_GROUP_GB_S", "DEFAULT_NIC_GB_S"]

DEFAULT_INTER_NODE_GB_S = 25.0
"""Default bandwidth between nodes of one group, one direction: 200 Gb/s InfiniBand."""
DEFAULT_INTER_GROUP_GB_S = 12.5
"""Default bandwidth between nodes of different groups: 100 Gb/s."""
DEFAULT_NIC_GB_S = 25.0
"""Default NIC bandwidth per node from host memory, one direction: 200 Gb/s (RDMA-capable
InfiniBand or RoCE, as datacenter NVIDIA, AMD and Ascend nodes have)."""


@dataclass(kw_only=True, slots=True)
class GPUGroup:
    """Identical nodes of one GPU type."""

    gpu: str
    """Catalog name or alias (resolved to the canonical name on load)."""
    nodes: int
    gpus_per_node: int
    name: str | None = None
    """Label for reports and Slurm partitions; defaults to the GPU name."""
    hosts: list[str] | None = None
    """Host names, one per node, for the torchrun launcher."""
    intra_node_bandwidth_gb_s: float | None = field(default=None, metadata=quantity("bandwidth_gb_s"))
    """Overrides the catalog's intra-node link bandwidth (GB/s, one direction)."""
    inter_node_bandwidth_gb_s: float | None = field(default=None, metadata=quantity("bandwidth_gb_s"))
    """Bandwidth between two nodes of this group (GB/s, one direction)."""
    partition: str | None = None
    """Slurm partition of these nodes."""
    constraint: str | None = None
    """Slurm --constraint feature of these nodes."""
    host_memory_gb: float | None = field(default=None, metadata=quantity("memory_gb"))
    """Host RAM per node (GB); absent: host memory is not checked."""
    nic_bandwidth_gb_s: float | None = field(default=None, metadata=quantity("bandwidth_gb_s"))
    """The node's NIC bandwidth from host memory (GB/s, one direction), used by links to GPUs of
    another vendor (staged through the hosts); absent: :data:`DEFAULT_NIC_GB_S`."""
    rdma: bool = True
    """Whether the NIC moves host memory by RDMA (InfiniBand, RoCE); false: TCP, a single
    stream's rate and a higher latency (:mod:`megatron_hetero.placement.host_path`)."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise SchemaError("", "nodes", self.nodes, "at least 1")
        if self.gpus_per_node < 1:
            raise SchemaError("", "gpus_per_node", self.gpus_per_node, "at least 1")
        check_gpus(self.nodes * self.gpus_per_node, path="nodes", found=self.nodes)
        if self.hosts is not None and len(self.hosts) != self.nodes:
            raise SchemaError("", "hosts", self.hosts, f"{self.nodes} host names (one per node)")
        for key in ("intra_node_bandwidth_gb_s", "inter_node_bandwidth_gb_s",
                    "nic_bandwidth_gb_s"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise SchemaError("", key, value, "a positive bandwidth in GB/s")
        if self.host_memory_gb is not None and not 0 < self.host_memory_gb < float("inf"):
            raise SchemaError("", "host_memory_gb", self.host_memory_gb,
                              "a positive host memory per node in GB")

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(kw_only=True, slots=True)
class Inventory:
    """A pool of GPU groups. ``catalog`` is the built-in catalog plus this file's ``gpus``."""

    groups: list[GPUGroup]
    inter_group_bandwidth_gb_s: float = field(default=DEFAULT_INTER_GROUP_GB_S,
                                              metadata=quantity("bandwidth_gb_s"))
    """Bandwidth between nodes of different groups (GB/s, one direction)."""
    gpus: dict[str, GPUOverride] = field(default_factory=dict)
    """Custom catalog entries, or overrides of built-in ones."""
    name: str | None = None
    catalog: Catalog = field(default=None, metadata={"internal": True})  # type: ignore[assignment]
    source: str = field(default="<inventory>", metadata={"internal": True})

    def __post_init__(self) -> None:
        if not self.groups:
            raise SchemaError("", "groups", self.groups, "at least one group")
        if self.inter_group_bandwidth_gb_s <= 0:
            raise SchemaError("", "inter_group_bandwidth_gb_s", self.inter_group_bandwidth_gb_s,
                              "a positive bandwidth in GB/s")
        check_gpus(self.num_gpus, path="groups", found=Described(f"{len(self.groups)} groups"))

    @property
    def num_gpus(self) -> int:
        return sum(g.num_gpus for g in self.groups)

    def gpu_counts(self) -> Counter[str]:
        """GPUs per canonical catalog name."""
        counts: Counter[str] = Counter()
        for g in self.groups:
            counts[g.gpu] += g.num_gpus
        return counts

    def spec(self, gpu: str) -> GPUSpec:
        return self.catalog.get(gpu, source=self.source)

    def group_label(self, index: int) -> str:
        g = self.groups[index]
        return g.name or g.gpu

    def intra_node_bandwidth(self, index: int) -> float:
        g = self.groups[index]
        return g.intra_node_bandwidth_gb_s or self.spec(g.gpu).intra_node_bandwidth_gb_s

    def inter_node_bandwidth(self, index: int) -> float:
        return self.groups[index].inter_node_bandwidth_gb_s or DEFAULT_INTER_NODE_GB_S

    def nic_bandwidth(self, index: int) -> float:
        """GB/s a node of group ``index`` sends from host memory
        (:attr:`GPUGroup.nic_bandwidth_gb_s`)."""
        return self.groups[index].nic_bandwidth_gb_s or DEFAULT_NIC_GB_S

    def vendor(self, index: int) -> str:
        """The vendor of group ``index``'s GPUs (its catalog entry's)."""
        return self.spec(self.groups[index].gpu).vendor


def inventory_from_data(data: object, *, source: str = "<inventory>") -> Inventory:
    inv = from_data(Inventory, data, source=source)
    inv.source = source
    inv.catalog = load_catalog().with_overrides(inv.gpus, source=source)
    for i, g in enumerate(inv.groups):
        g.gpu = inv.catalog.get(g.gpu, source=source, path=f"groups[{i}].gpu").name
    return inv


def load_inventory(path: str | Path) -> Inventory:
    """Load and check an inventory file; errors are :class:`SchemaError` naming the field."""
    return inventory_from_data(read_yaml(path), source=str(path))
