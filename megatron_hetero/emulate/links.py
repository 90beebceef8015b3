"""Link emulation: pipeline messages between the rehearsal's CPU ranks take the time of the link
the plan's inventory gives the two GPUs they play.

Rule. A message of ``n`` bytes from rank ``a`` to rank ``b`` arrives ``n / bandwidth + latency``
after it was sent, with the :class:`Link` of ``(a, b)``; messages on one link in one direction
queue behind each other (the next leaves when the previous has crossed). The receiver's wait for
it returns no earlier than its arrival, and so does the sender's wait for the send (NCCL's send
completes when the data is delivered): a schedule that waits for its sends at once (Megatron's
1F1B) pays the link on the sending stage too, one that waits later (the per-stage warm-up
schedule) computes meanwhile. The transfer itself still runs at gloo's speed.

How. :func:`emulate_links` wraps megatron-core's two p2p primitives
(``p2p_communication._p2p_ops`` and ``_batched_p2p_ops``, which every ``P2PCommunicator`` call
reaches) in this process. Beside each data message to or from a peer with a link it exchanges
one float64 with tag :data:`STAMP_TAG` on the default group: the sender's computed arrival time
(``time.monotonic``, one clock for every process of this machine). The returned requests'
``wait()`` waits for the message and its stamp, then sleeps until the arrival. Every rank must
install the same table (each pair must agree on exchanging stamps).

Which link. :func:`plan_links` places the plan on the inventory as the cost model does
(:func:`megatron_hetero.placement.nodes.place`) and takes, for every pair of ranks that exchange
pipeline messages (tensor rank ``t`` of consecutive stages of a pipeline, and the wrap from the
last stage to the first with interleaving), the bandwidth of the link their nodes share. The
rehearsal runs a shrunk model at an emulated speed, so the real link's seconds are scaled
the same way: ``time_stretch`` (emulated seconds per real second of compute) multiplies the
time, and ``bytes_ratio`` (the shrunk message's bytes over the real one's) divides the
bandwidth, so that a shrunk message takes ``time_stretch`` times what the real one takes on
the real link.

Across vendors. Where the two GPUs are of two vendors the link is the host path
(:mod:`megatron_hetero.placement.host_path`): device to host, the NIC, host to device, one after
another; its :class:`Link` keeps that :class:`~megatron_hetero.placement.host_path.HostPath` and
takes its rate, and the per-message latency is ``latency_s`` as on every link, which is how the
cost model prices a pipeline send over it (``CostModel.p2p_seconds`` at the host path's rate).
A staged message therefore takes ``time_stretch x (latency + bytes / host link + bytes / network
+ bytes / host link)`` of its real bytes, holding the sending stage until it has arrived as the
runtime's synchronous copies and Megatron's 1F1B do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..placement.host_path import HostPath, host_path
from ..placement.nodes import place
from ..plan import Plan, Slot

__all__ = ["Link", "plan_links", "rehearsal_links", "emulate_links", "STAMP_TAG"]

STAMP_TAG = 0x4854
"""gloo tag of the arrival stamps (the data messages use tag 0)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """One direction of the link between two ranks, in the rehearsal's units."""

    bandwidth_bytes_s: float
    """Bytes per second of a shrunk message."""
    latency_s: float
    """Seconds added to every message."""
    host_path: HostPath | None = None
    """Where the two GPUs are of two vendors: the host path the link plays (its legs' rates;
    ``bandwidth_bytes_s`` is their rate one after another, scaled); None inside one vendor."""

    def seconds(self, nbytes: float) -> float:
        return nbytes / self.bandwidth_bytes_s + self.latency_s


def plan_links(plan: Plan, inventory, *, latency_s: float, time_stretch: float = 1.0,
               bytes_ratio: float = 1.0) -> dict[tuple[int, int], Link]:
    """``(sender rank, receiver rank) -> Link`` for every pair of ranks of ``plan`` that exchange
    pipeline messages, both directions, from the link the inventory gives their nodes (GB/s,
    one direction) and ``latency_s`` per message, scaled by ``time_stretch`` and
    ``bytes_ratio`` (see the module docstring)."""
    tp, p = plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size
    placement = place(plan, inventory)
    pairs = [(s, s + 1) for s in range(p - 1)]
    if plan.virtual_pipeline_size > 1:
        pairs.append((p - 1, 0))  # the chunk boundary from the last stage back to the first
    out: dict[tuple[int, int], Link] = {}
    for d in range(plan.data_parallel_size):
        for a, b in pairs:
            na, nb = placement.node(0, a, d), placement.node(0, b, d)
            gb_s = placement.link_bandwidth(na, nb)
            staged = (host_path(inventory, (na.group, nb.group))
                      if placement.host_staged(na, nb) else None)
            assert staged is None or gb_s == staged.bandwidth_gb_s
            link = Link(bandwidth_bytes_s=gb_s * 1e9 * bytes_ratio / time_stretch,
                        latency_s=latency_s * time_stretch, host_path=staged)
            for t in range(tp):
                ra = plan.rank_of_slot(Slot(mesh=0, stage=a, replica=d, tensor_rank=t))
                rb = plan.rank_of_slot(Slot(mesh=0, stage=b, replica=d, tensor_rank=t))
                out[(ra, rb)] = out[(rb, ra)] = link
    return out


def rehearsal_links(plan: Plan, shrunk: Plan, inventory, *, calibration, factor: float,
                    latency_s: float) -> tuple[dict[tuple[int, int], Link], float]:
    """(:func:`plan_links` of ``shrunk``, the time stretch) for a rehearsal of ``plan`` as
    ``shrunk`` whose fastest emulated device runs ``factor`` times the CPU times of
    ``calibration``: the stretch is the emulated forward and backward of one shrunk layer on
    that device over the cost model's for one real layer on it, and the bytes ratio the shrunk
    message's fp32 bytes over the real one's (the cost model's 16-bit ``[s, b, h]`` per tensor
    rank)."""
    from ..cost.model import CostModel
    from .speed import device_slowdowns

    cost = CostModel(plan.model, inventory, precision=plan.precision)
    slowdowns = device_slowdowns(plan, inventory.catalog)
    fastest = min(slowdowns, key=lambda d: (slowdowns[d], d))
    b, tp = plan.pipelines[0].micro_batch_size, plan.tensor_model_parallel_size
    real = sum(cost.layer_times(fastest, b, tp, sp=plan.sequence_parallel))
    emulated = sum(calibration.parts[("layer", b)]) * factor / tp
    stretch = emulated / real
    real_bytes = cost.hidden_bytes(b, tp, sp=plan.sequence_parallel)
    shrunk_bytes = 4.0 * b * shrunk.model.seq_length * shrunk.model.hidden_size
    links = plan_links(shrunk, inventory, latency_s=latency_s, time_stretch=stretch,
                       bytes_ratio=shrunk_bytes / real_bytes)
    return links, stretch


class _Arrival:
    """A p2p request whose ``wait()`` also waits until the message's emulated arrival."""

    def __init__(self, req, stamp_req, *, arrival: float | None = None, stamp=None):
        self.req, self.stamp_req, self.arrival, self.stamp = req, stamp_req, arrival, stamp

    def wait(self, *args, **kwargs):
        out = self.req.wait(*args, **kwargs)
        self.stamp_req.wait()
        arrival = self.arrival if self.stamp is None else float(self.stamp[0])
        delay = arrival - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return out

    def is_completed(self) -> bool:
        return (self.req.is_completed() and self.stamp_req.is_completed()
                and time.monotonic() >= (self.arrival if self.stamp is None
                                         else float(self.stamp[0])))


class _Emulation:
    """The link table of this rank and when each outgoing link is next free."""

    def __init__(self, links: dict[tuple[int, int], Link], rank: int):
        self.links, self.rank = links, rank
        self.free_at: dict[int, float] = {}
        self.sent = 0

    def send(self, req, tensor, peer: int):
        import torch
        import torch.distributed as dist

        link = self.links.get((self.rank, peer))
        if link is None:
            return req
        nbytes = tensor.numel() * tensor.element_size()
        leave = max(time.monotonic(), self.free_at.get(peer, 0.0))
        self.free_at[peer] = leave + nbytes / link.bandwidth_bytes_s
        arrival = self.free_at[peer] + link.latency_s
        stamp = torch.tensor([arrival], dtype=torch.float64, device="cpu")
        self.sent += 1
        return _Arrival(req, dist.isend(stamp, peer, tag=STAMP_TAG), arrival=arrival)

    def recv(self, req, peer: int):
        import torch
        import torch.distributed as dist

        if (peer, self.rank) not in self.links:
            return req
        stamp = torch.zeros(1, dtype=torch.float64, device="cpu")
        return _Arrival(req, dist.irecv(stamp, peer, tag=STAMP_TAG), stamp=stamp)

    def wrap(self, kw: dict, reqs):
        """Wrap the requests one primitive returned (a dict by kind, or a list in the order
        send_prev, recv_prev, send_next, recv_next of the tensors given)."""
        kinds = [k for k in ("send_prev", "recv_prev", "send_next", "recv_next")
                 if kw.get(f"tensor_{k}") is not None]
        keyed = dict(reqs) if isinstance(reqs, dict) else dict(zip(kinds, reqs))
        for kind in kinds:
            peer = kw["prev_pipeline_rank" if kind.endswith("prev") else "next_pipeline_rank"]
            if kind.startswith("send"):
                keyed[kind] = self.send(keyed[kind], kw[f"tensor_{kind}"], peer)
            else:
                keyed[kind] = self.recv(keyed[kind], peer)
        return keyed if isinstance(reqs, dict) else [keyed[k] for k in kinds]


def emulate_links(links: dict[tuple[int, int], Link], rank: int) -> _Emulation:
    """Make this process's pipeline messages take their link's time (see the module
    docstring); ``rank`` is this process's global rank. Returns the emulation (its ``sent``
    counts the delayed sends)."""
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    emulation = _Emulation(links, rank)
    for name in ("_p2p_ops", "_batched_p2p_ops"):
        original = getattr(p2p, name)
        while getattr(original, "_link_emulation", False):  # installed before: replace it
            original = original.__wrapped__

        def primitive(*, _original=original, **kw):
            return emulation.wrap(kw, _original(**kw))

        primitive.__wrapped__ = original
        primitive._link_emulation = True
        setattr(p2p, name, primitive)
    return emulation
