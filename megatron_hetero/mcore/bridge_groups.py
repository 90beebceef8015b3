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
the world's own backend where the world is not NCCL: gloo on CPU ranks.
"""

from __future__ import annotations

import contextlib
import functools
import threading

__all__ = ["BridgeDist", "bridge_dist", "own_group_bridge", "chain_bridge_classes", "ROUTED"]

ROUTED = ("send_forward", "recv_forward", "send_backward", "recv_backward",
          "send_forward_recv_backward", "send_backward_recv_forward")
"""The ``BridgeCommunicator`` methods that send or receive: each runs on its bridge's group."""


class BridgeDist:
    """``torch.distributed`` as megatron-core's bridge module sees it (module docstring)."""

    __slots__ = ("_dist", "_routes")

    def __init__(self, dist) -> None:
        self._dist = dist
        self._routes = threading.local()

    def __getattr__(self, name):
        return getattr(self._dist, name)

    @contextlib.contextmanager
    def sending_on(self, group):
        """Point-to-point calls of this thread that name no group take ``group``."""
        before = getattr(self._routes, "group", None)
        self._routes.group = group
        try:
            yield
        finally:
            self._routes.group = before

    def _group(self, group):
        return group if group is not None else getattr(self._routes, "group", None)

    def send(self, tensor, dst=None, group=None, **kw):
        return self._dist.send(tensor, dst, self._group(group), **kw)

    def recv(self, tensor, src=None, group=None, **kw):
        return self._dist.recv(tensor, src, self._group(group), **kw)

    def P2POp(self, op, tensor, peer=None, group=None, **kw):  # noqa: N802 (torch's name)
        return self._dist.P2POp(op, tensor, peer, self._group(group), **kw)

    def _backend(self, backend):
        """``backend``, but the world's own where megatron-core asks for NCCL off an NCCL
        world."""
        nccl_world = "nccl" in str(self._dist.get_backend())
        return None if backend == "nccl" and not nccl_world else backend

    def new_group(self, *a, backend=None, **kw):
        return self._dist.new_group(*a, backend=self._backend(backend), **kw)

    def new_subgroups_by_enumeration(self, ranks_per_subgroup_list, timeout=None, backend=None,
                                     pg_options=None):
        return self._dist.new_subgroups_by_enumeration(
            ranks_per_subgroup_list, timeout=timeout, backend=self._backend(backend),
            pg_options=pg_options)


class _TorchView:
    """``torch`` as the bridge module sees it: its ``distributed`` the :class:`BridgeDist`."""

    __slots__ = ("_torch", "distributed")

    def __init__(self, torch, distributed: BridgeDist) -> None:
        self._torch, self.distributed = torch, distributed

    def __getattr__(self, name):
        return getattr(self._torch, name)


def bridge_dist() -> BridgeDist:
    """The :class:`BridgeDist` of megatron-core's bridge module, installed there (as its
    ``dist`` and its ``torch.distributed``) on the first call."""
    import torch
    from megatron.core.pipeline_parallel import bridge_communicator as module

    if not isinstance(module.dist, BridgeDist):
        module.dist = BridgeDist(torch.distributed)
    if not isinstance(module.torch, _TorchView):
        module.torch = _TorchView(torch, module.dist)
    return module.dist


def own_group_bridge(base: type) -> type:
    """A subclass of megatron-core's ``BridgeCommunicator`` ``base`` whose every bridge sends
    and receives on a process group of its own over the bridge's leaders (module docstring).
    Its constructor is collective: call it on every rank, in one order."""
    dist = bridge_dist()

    def __init__(self, *a, **kw):
        base.__init__(self, *a, **kw)
        self.bridge_pg = dist.new_group(sorted(set(self.src_tp_leaders)
                                               | set(self.dest_tp_leaders)))

    def routed(name: str):
        original = getattr(base, name)

        @functools.wraps(original)
        def method(self, *a, **kw):
            with dist.sending_on(self.bridge_pg):
                return original(self, *a, **kw)
        return method

    return type("OwnGroupBridge", (base,),
                {"__init__": __init__, **{name: routed(name) for name in ROUTED}})


def chain_bridge_classes() -> tuple[type, type]:
    """(the class of a chain's bridges, the class of its wrap-around bridge): megatron-core's
    own and a subclass with a group cache of its own where the bridges have groups of their
    own (0.19), else :func:`own_group_bridge` for both."""
    from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

    bridge_dist()
    if hasattr(BridgeCommunicator, "_get_or_create_bridge_pg"):
        return BridgeCommunicator, type("WrapAroundBridge", (BridgeCommunicator,),
                                        {"_bridge_pg_cache": {}})
    own = own_group_bridge(BridgeCommunicator)
    return own, own
