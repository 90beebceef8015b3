"""Pipeline messages of a plan across vendors: each edge on its own group, an edge across
vendors staged through host memory (docs/vendors.md).

Megatron's ``P2PCommunicator`` sends every pipeline message through one of two primitives of
``megatron.core.pipeline_parallel.p2p_communication``, ``_p2p_ops`` (one ``isend``/``irecv`` per
tensor) and ``_batched_p2p_ops`` (``batch_isend_irecv``), on the pipeline group, with the peers'
global ranks. On a plan across vendors the pipeline group is gloo (it spans vendors), so
:func:`install_router` replaces both by a router that sends each tensor on the group of its
edge (:func:`megatron_hetero.runtime.vendors.pipeline_edges`):

* an edge inside one vendor: ``batch_isend_irecv`` of the device tensors on the edge's
  device-backend group, as Megatron's batched path does;
* an edge across vendors (gloo): the tensor is copied to a host buffer (pinned for a device
  tensor, so the copies run at the host link's speed) and sent with ``isend``; a received
  tensor arrives in a host buffer and is copied onto the device when its request is waited.
  gloo's ``send``/``recv`` take host memory only.

Messages forward (``send_next``/``recv_prev``) and backward (``send_prev``/``recv_next``) carry
their own tags, so a pair of stages that are each other's previous and next (two stages with
interleaving) never mix them up. Each returned request keeps its buffers alive until waited
(Megatron frees a sent activation's storage right after the send; the staging's request and
host buffer are :mod:`megatron_hetero.mcore.bridge_groups`', whose bridges between vendors stage
the same way). Nothing else of Megatron
changes: the schedules, the communicator and its shapes are its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..mcore.bridge_groups import HostRequest, host_buffer

__all__ = ["Edge", "Router", "install_router", "FORWARD_TAG", "BACKWARD_TAG"]

FORWARD_TAG = 0x4846
"""Tag of activations (``send_next`` -> the next stage's ``recv_prev``)."""
BACKWARD_TAG = 0x4842
"""Tag of gradients (``send_prev`` -> the previous stage's ``recv_next``)."""

_KINDS = ("send_prev", "recv_prev", "send_next", "recv_next")
"""Megatron's order of the four tensors (``_batched_p2p_ops`` returns its requests so)."""
_TAGS = {"send_next": FORWARD_TAG, "recv_prev": FORWARD_TAG,
         "send_prev": BACKWARD_TAG, "recv_next": BACKWARD_TAG}


@dataclass(frozen=True, kw_only=True, slots=True)
class Edge:
    """This rank's side of one pipeline edge."""

    group: object
    """The process group of the edge's two ranks."""
    staged: bool
    """The two ranks are of two vendors: gloo, through host buffers."""


class Router:
    """Sends this rank's pipeline messages on their edges' groups (see the module docstring).
    ``staged_sends`` and ``staged_recvs`` count the messages that went through host buffers."""

    def __init__(self, edges: dict[int, Edge]):
        self.edges = edges
        """Peer's global rank -> :class:`Edge`."""
        self.staged_sends = 0
        self.staged_recvs = 0

    def _edge(self, peer: int) -> Edge:
        try:
            return self.edges[peer]
        except KeyError:
            raise RuntimeError(f"megatron-hetero: a pipeline message to or from rank {peer}, "
                               f"which shares no pipeline edge with this rank (edges to "
                               f"{sorted(self.edges)})") from None

    def route(self, kw: dict) -> dict:
        """The requests of one primitive call (``kw``: its keyword arguments), by kind."""
        import torch.distributed as dist

        reqs: dict = {}
        device_ops: dict[int, list] = {}  # peer -> [(kind, P2POp)] on its device group
        for kind in _KINDS:
            tensor = kw.get(f"tensor_{kind}")
            if tensor is None:
                continue
            peer = kw["prev_pipeline_rank" if kind.endswith("prev") else "next_pipeline_rank"]
            edge, tag, send = self._edge(peer), _TAGS[kind], kind.startswith("send")
            if not edge.staged:
                op = dist.P2POp(dist.isend if send else dist.irecv, tensor, peer, edge.group, tag)
                device_ops.setdefault(peer, []).append((kind, op, tensor))
                continue
            host = host_buffer(tensor)
            if send:
                host.copy_(tensor)
                reqs[kind] = HostRequest([dist.isend(host, dst=peer, group=edge.group, tag=tag)],
                                      keep=(host,))
                self.staged_sends += 1
            else:
                reqs[kind] = HostRequest([dist.irecv(host, src=peer, group=edge.group, tag=tag)],
                                      host=host, target=tensor)
                self.staged_recvs += 1
        for ops in device_ops.values():
            works = dist.batch_isend_irecv([op for _, op, _ in ops])
            if len(works) != len(ops):  # one coalesced work for the batch (NCCL)
                works = [works] * len(ops)
            for (kind, _, tensor), work in zip(ops, works):
                # detach() shares the storage; Megatron's ``out.data = ...`` replaces only out's
                reqs[kind] = HostRequest(work if isinstance(work, list) else [work],
                                      keep=(tensor.detach(),))
        return reqs

    def p2p_ops(self, **kw) -> dict:
        """Stands in for ``_p2p_ops`` (requests by kind)."""
        return self.route(kw)

    def batched_p2p_ops(self, **kw) -> list:
        """Stands in for ``_batched_p2p_ops`` (requests in Megatron's order of the tensors)."""
        reqs = self.route(kw)
        return [reqs[k] for k in _KINDS if k in reqs]


def install_router(edges: dict[int, Edge]) -> Router:
    """Route this process's pipeline messages over ``edges`` (peer's global rank -> edge);
    returns the router."""
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    router = Router(edges)
    for name, method in (("_p2p_ops", router.p2p_ops),
                         ("_batched_p2p_ops", router.batched_p2p_ops)):
        def primitive(*, _method=method, **kw):
            return _method(**kw)

        primitive.__wrapped__ = getattr(p2p, name)
        primitive._megatron_hetero_router = True
        setattr(p2p, name, primitive)
    return router
