"""The host path: how data moves between GPUs of two vendors.

NCCL (NVIDIA), RCCL (AMD) and HCCL (Ascend) cannot join one communicator, so a tensor going from
a GPU of one vendor to a GPU of another is staged through the hosts: device to pinned host
memory over the GPU's host link (PCIe), host to host over the NICs (RDMA, or TCP), host to
device. The three legs run one after another (the whole tensor is copied, then sent, then
copied: torch.distributed's gloo backend works on host tensors), so the path is slower than its
slowest leg: ``seconds = latency + bytes / host_link + bytes / network + bytes / host_link``.

* the host link: :data:`DEFAULT_HOST_LINK_GB_S` each way (pinned copies over PCIe 4 x16; it is
  also the default of the cost model's ``pcie_bandwidth_gb_s``, the rate of offloaded
  activations, which does not change the host path);
* the network: the slower NIC of the two nodes (inventory ``nic_bandwidth_gb_s``, default
  :data:`~megatron_hetero.hardware.inventory.DEFAULT_NIC_GB_S`), at most the inventory's
  ``inter_group_bandwidth_gb_s``; where either node has ``rdma: false``, at most
  :data:`TCP_STREAM_GB_S`, one TCP stream's rate with the kernel's copies (gloo opens one
  stream per peer pair);
* latency: two copy launches plus the NIC's: :data:`RDMA_LATENCY_S` or :data:`TCP_LATENCY_S`.

A data-parallel group whose members span vendors all-reduces over gloo on the host path: every
member copies its gradient buffer to the host and back once, and the ring runs over the NICs
(:meth:`HostPath.ring_gb_s`). Links and groups inside one vendor never take this path.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..hardware.inventory import Inventory

__all__ = ["HostPath", "host_path", "crosses_vendors", "staged_ring_gb_s", "DEFAULT_HOST_LINK_GB_S",
           "TCP_STREAM_GB_S", "RDMA_LATENCY_S", "TCP_LATENCY_S", "COPY_LATENCY_S"]

DEFAULT_HOST_LINK_GB_S = 25.0
"""Pinned device-to-host (and host-to-device) copy rate of one GPU, GB/s: PCIe 4 x16."""
TCP_STREAM_GB_S = 2.5
"""One TCP stream's rate between hosts, GB/s (about 20 Gb/s: a single stream with the
kernel's copies rarely fills a faster NIC)."""
RDMA_LATENCY_S = 5e-6
"""One message's latency over an RDMA NIC (host memory to host memory)."""
TCP_LATENCY_S = 50e-6
"""One message's latency over TCP (kernel network stack on both hosts)."""
COPY_LATENCY_S = 10e-6
"""Launch and synchronisation of one device-host copy."""


@dataclass(kw_only=True, slots=True, frozen=True)
class HostPath:
    """The host-staged path between GPUs of two vendors (or inside a cross-vendor group)."""

    host_link_gb_s: float
    """Device-to-host and host-to-device copy rate, GB/s each way."""
    network_gb_s: float
    """Host-to-host rate over the NICs, GB/s, one direction."""
    rdma: bool
    """The NICs move host memory by RDMA (else TCP)."""

    @property
    def latency_s(self) -> float:
        """Two copies plus one network message."""
        return 2 * COPY_LATENCY_S + (RDMA_LATENCY_S if self.rdma else TCP_LATENCY_S)

    @property
    def bandwidth_gb_s(self) -> float:
        """The path's rate for a large tensor: its legs one after another."""
        return 1.0 / (2.0 / self.host_link_gb_s + 1.0 / self.network_gb_s)

    def seconds(self, nbytes: float) -> float:
        """One tensor of ``nbytes`` from a device of one vendor to a device of the other."""
        return self.latency_s + nbytes / (self.bandwidth_gb_s * 1e9)

    def ring_gb_s(self, members: int) -> float:
        """The rate a ring collective over ``members`` ranks sees, in the cost model's ring
        formula (``(n-1)/n x bytes / rate``): each member's buffer crosses the host link
        once each way in full, and the ring's share over the network."""
        n = max(members, 2)
        return 1.0 / (2.0 / self.host_link_gb_s * n / (n - 1) + 1.0 / self.network_gb_s)


def crosses_vendors(inventory: Inventory, groups: Iterable[int]) -> bool:
    """Whether the inventory groups ``groups`` hold GPUs of more than one vendor."""
    return len({inventory.vendor(g) for g in groups}) > 1


def host_path(inventory: Inventory, groups: Iterable[int]) -> HostPath:
    """The host path between (or among) the nodes of inventory groups ``groups``: the slowest
    NIC of them, TCP where any lacks RDMA."""
    groups = sorted(set(groups))
    rdma = all(inventory.groups[g].rdma for g in groups)
    network = min([inventory.inter_group_bandwidth_gb_s]
                  + [inventory.nic_bandwidth(g) for g in groups])
    if not rdma:
        network = min(network, TCP_STREAM_GB_S)
    return HostPath(host_link_gb_s=DEFAULT_HOST_LINK_GB_S, network_gb_s=network, rdma=rdma)


def staged_ring_gb_s(inventory: Inventory, groups: Iterable[int], members: int) -> float | None:
    """The ring rate of a data-parallel group of ``members`` ranks on the nodes of inventory
    groups ``groups``, where they span vendors (gloo on the host path); None inside one vendor."""
    groups = set(groups)
    if not crosses_vendors(inventory, groups):
        return None
    return host_path(inventory, groups).ring_gb_s(members)
