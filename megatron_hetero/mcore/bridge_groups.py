"""A process group of its own for every ``BridgeCommunicator`` of a chain of meshes, on every
megatron-core the project supports, and the bridges' groups on a gloo world.

megatron-core 0.19 gives each bridge a group over its leaders
(``BridgeCommunicator._get_or_create_bridge_pg``, cached by their ranks in a class attribute:
:func:`chain_bridge_classes` gives the wrap-around bridge a cache of its own). 0.17 and 0.18
send a bridge's messages (``dist.send`` / ``dist.recv``, and the shapes before them in one
``batch_isend_irecv``) on the world's group, where two bridges between the same two ranks (a
chain's forward bridge and its wrap-around) would meet in one queue. There
:func:`own_group_bridge` makes the bridge class whose methods run megatron-core's own, unchanged,
with every point-to-point call that names no group taking the bridge's own group, made over its
leaders when the bridge is built (collectively, as 0.19 makes its one).

That works through :class:`BridgeDist`: ``torch.distributed`` as the bridge module sees it (its
``dist``, and ``torch.distributed`` of its ``torch``). A call that names no group takes the group
of the bridge whose method the calling thread runs (:meth:`BridgeDist.sending_on`, one value per
thread: the senders of several bridges, :class:`~.mesh_interleaved.Outbox`, run at once, each in
its own bridge's method); every other call goes to ``torch.distributed`` as it is. A group that
megatron-core asks of ``nccl`` by name (its broadcast groups, 0.19's leader group) is made on
the world's own backend on CPU ranks (:func:`bridge_dist` with ``gloo``).

**Bridges between vendors** (:func:`~megatron_hetero.plan.checks.host_bridges`: meshes of two
collective libraries, which no device communicator joins) are host-staged, on every
megatron-core: the bridge's own group is gloo (0.19's ``_get_or_create_bridge_pg`` is given
that group instead of its NCCL one), and inside its methods every message on it goes through
host memory: a tensor sent is copied to a host buffer (pinned for a device tensor, as the
format-1 pipeline edges across vendors do, :mod:`megatron_hetero.runtime.host_p2p`) and sent
from there; a tensor received arrives in a host buffer and is copied onto megatron-core's
(device) tensor before the call returns (gloo's ``send``/``recv`` take host memory only). The
shapes' ``P2POp``s go the same way, a receive copied once its request is waited
(:class:`HostRequest`, format 1's staged request too). The broadcasts inside each mesh stay
on the mesh's device groups; megatron-core's code and its messages are its own. On CPU ranks
every tensor is already on the host: the copies are made all the same (the path devices
take).
"""

from __future__ import annotations

import contextlib
import functools
import threading

__all__ = ["BridgeDist", "bridge_dist", "own_group_bridge", "chain_bridge_classes", "ROUTED",
           "host_buffer", "HostRequest"]

ROUTED = ("send_forward", "recv_forward", "send_backward", "recv_backward",
          "send_forward_recv_backward", "send_backward_recv_forward")
"""The ``BridgeCommunicator`` methods that send or receive: each runs on its bridge's group."""


def host_buffer(tensor):
    """An empty host tensor like ``tensor``: pinned where ``tensor`` is on a device."""
    import torch

    return torch.empty(tensor.shape, dtype=tensor.dtype,
                       pin_memory=tensor.device.type != "cpu")


class HostRequest:
    """A request whose ``wait()`` waits for its works, then copies a staged receive (``host``)
    onto its tensor (``target``); it holds every buffer until then."""

    def __init__(self, works, *, keep=(), host=None, target=None):
        self.works, self.keep, self.host, self.target = list(works), keep, host, target

    def wait(self, *args, **kwargs):
        for work in self.works:
            work.wait(*args, **kwargs)
        if self.target is not None:
            _copy_onto(self.target, self.host)
        self.works, self.keep, self.host, self.target = [], (), None, None
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


class BridgeDist:
    """``torch.distributed`` as megatron-core's bridge module sees it (module docstring);
    ``gloo``: the world is gloo (CPU ranks), where a group asked of ``nccl`` is made on gloo."""

    __slots__ = ("_dist", "_routes", "gloo")

    def __init__(self, dist) -> None:
        self._dist = dist
        self._routes = threading.local()
        self.gloo = False

    def __getattr__(self, name):
        return getattr(self._dist, name)

    @contextlib.contextmanager
    def sending_on(self, bridge):
        """Point-to-point calls of this thread that name no group take ``bridge.bridge_pg``;
        those on it go through host memory where ``bridge.host`` (counted in its
        ``host_sends`` and ``host_recvs``)."""
        before = getattr(self._routes, "bridge", None)
        self._routes.bridge = bridge
        try:
            yield
        finally:
            self._routes.bridge = before

    def _route(self, group):
        """(the group a call takes, the bridge that stages it through the host or None)."""
        bridge = getattr(self._routes, "bridge", None)
        if bridge is None:
            return group, None
        if group is None:
            group = bridge.bridge_pg
        return group, (bridge if bridge.host and group is bridge.bridge_pg else None)

    def send(self, tensor, dst=None, group=None, **kw):
        group, staged = self._route(group)
        if staged is not None:
            host = host_buffer(tensor)
            host.copy_(tensor.detach())
            tensor, staged.host_sends = host, staged.host_sends + 1
        return self._dist.send(tensor, dst, group, **kw)

    def recv(self, tensor, src=None, group=None, **kw):
        group, staged = self._route(group)
        if staged is None:
            return self._dist.recv(tensor, src, group, **kw)
        host = host_buffer(tensor)
        got = self._dist.recv(host, src, group, **kw)
        _copy_onto(tensor, host)
        staged.host_recvs += 1
        return got

    def P2POp(self, op, tensor, peer=None, group=None, **kw):  # noqa: N802 (torch's name)
        group, staged = self._route(group)
        if staged is None:
            return self._dist.P2POp(op, tensor, peer, group, **kw)
        host = host_buffer(tensor)
        if op is self._dist.irecv:
            staged.host_recvs += 1
        else:
            host.copy_(tensor.detach())
            staged.host_sends += 1
        p2p = self._dist.P2POp(op, host, peer, group, **kw)
        self._routes.copies = {**getattr(self._routes, "copies", {}), id(p2p): (p2p, tensor)}
        return p2p

    def batch_isend_irecv(self, p2p_op_list):
        """torch's; a host-staged op's request copies a receive onto its tensor once waited
        (gloo gives a request per op)."""
        works = self._dist.batch_isend_irecv(p2p_op_list)
        copies, self._routes.copies = getattr(self._routes, "copies", {}), {}
        if not any(id(op) in copies for op in p2p_op_list):
            return works
        assert len(works) == len(p2p_op_list), "a request per op on a host group"
        out = []
        for op, work in zip(p2p_op_list, works):
            _, tensor = copies.get(id(op), (None, None))
            received = tensor is not None and op.op is self._dist.irecv
            out.append(HostRequest([work], keep=(op.tensor,),
                                   host=op.tensor if received else None,
                                   target=tensor if received else None))
        return out

    def _backend(self, backend):
        """``backend``, but the world's own where megatron-core asks for NCCL on a gloo world
        (CPU ranks)."""
        return None if backend == "nccl" and self.gloo else backend
    def new_group(self, *a, backend=None, **kw):
        return self._dist.new_group(*a, backend=self._backend(backend), **kw)

    def new_subgroups_by_enumeration(self, ranks_per_subgroup_list, timeout=None, backend=None,
                                     pg_options=None):
        return self._dist.new_subgroups_by_enumeration(
            ranks_per_subgroup_list, timeout=timeout, backend=self._backend(backend),
            pg_options=pg_options)


def _copy_onto(tensor, host) -> None:
    """``host``'s values into ``tensor`` (a received leaf may require grad)."""
    import torch

    with torch.no_grad():
        tensor.copy_(host)


class _TorchView:
    """``torch`` as the bridge module sees it: its ``distributed`` the :class:`BridgeDist`."""

    __slots__ = ("_torch", "distributed")

    def __init__(self, torch, distributed: BridgeDist) -> None:
        self._torch, self.distributed = torch, distributed

    def __getattr__(self, name):
        return getattr(self._torch, name)


def bridge_dist(*, gloo: bool = False) -> BridgeDist:
    """The :class:`BridgeDist` of megatron-core's bridge module, installed there (as its
    ``dist`` and its ``torch.distributed``) on the first call; ``gloo``: the world is gloo (CPU
    ranks)."""
    import torch
    from megatron.core.pipeline_parallel import bridge_communicator as module

    if not isinstance(module.dist, BridgeDist):
        module.dist = BridgeDist(torch.distributed)
    if not isinstance(module.torch, _TorchView):
        module.torch = _TorchView(torch, module.dist)
    module.dist.gloo = module.dist.gloo or gloo
    return module.dist


def own_group_bridge(base: type, *, host: bool = False) -> type:
    """A subclass of megatron-core's ``BridgeCommunicator`` ``base`` whose every bridge sends
    and receives on a process group of its own over the bridge's leaders, where ``host`` a gloo
    group through host memory (module docstring). Its constructor is collective: call it on
    every rank, in one order."""
    dist = bridge_dist()

    def own_group(cls, ranks):
        return dist.new_group(sorted(ranks), backend="gloo" if host else "nccl")

    def __init__(self, *a, **kw):
        self.bridge_pg, self.host_sends, self.host_recvs = None, 0, 0
        base.__init__(self, *a, **kw)  # megatron-core 0.19 makes its group here (own_group)
        if self.bridge_pg is None:
            self.bridge_pg = own_group(type(self), set(self.src_tp_leaders)
                                       | set(self.dest_tp_leaders))

    def routed(name: str):
        original = getattr(base, name)

        @functools.wraps(original)
        def method(self, *a, **kw):
            with dist.sending_on(self):
                return original(self, *a, **kw)
        return method

    namespace = {"__init__": __init__, "host": host, **{name: routed(name) for name in ROUTED}}
    if hasattr(base, "_get_or_create_bridge_pg"):
        namespace["_get_or_create_bridge_pg"] = classmethod(own_group)
    return type("HostBridge" if host else "OwnGroupBridge", (base,), namespace)


def chain_bridge_classes(host: list[bool], *, wrap_around: bool) -> list[type]:
    """The class of each bridge of a chain (``host``: per bridge, whether it joins two
    collective libraries, :func:`~megatron_hetero.plan.checks.host_bridges`; ``wrap_around``:
    the last one is an interleaved chain's wrap-around): :func:`own_group_bridge` for a bridge
    between libraries, and for every bridge of an interleaved chain where megatron-core's
    bridges have no groups of their own (before 0.19); else megatron-core's own, the
    wrap-around a subclass with a group cache of its own."""
    from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

    bridge_dist()
    native = hasattr(BridgeCommunicator, "_get_or_create_bridge_pg")
    classes = []
    for k, staged in enumerate(host):
        if staged or (wrap_around and not native):
            classes.append(own_group_bridge(BridgeCommunicator, host=staged))
        elif wrap_around and k == len(host) - 1:
            classes.append(type("WrapAroundBridge", (BridgeCommunicator,),
                                {"_bridge_pg_cache": {}}))
        else:
            classes.append(BridgeCommunicator)
    return classes
