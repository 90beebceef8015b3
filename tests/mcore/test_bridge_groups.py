"""Every bridge of a chain of meshes sends on a process group of its own
(megatron_hetero/mcore/bridge_groups.py): ``BridgeDist`` hands a thread's point-to-point calls
that name no group to the group of the bridge it runs, each thread its own; on gloo ranks, under
megatron-core 0.17.1 (whose bridges send on the world's group) and 0.19.2 (its own groups), the
forward bridge and the wrap-around between the same two ranks get distinct groups."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from megatron_hetero.mcore.bridge_groups import BridgeDist

from ..conftest import DEFAULT_STACK, OLD_STACK, evaluate_under, evaluated
from .tiny_mesh_plans import tiny_mesh_plan


class _Recorder:
    """A stand-in for ``torch.distributed`` that records the group each call got."""

    def __init__(self, backend: str) -> None:
        self.calls: list = []
        self.backend = backend
        self.isend = object()

    def get_backend(self):
        return self.backend

    def send(self, tensor, dst, group, **kw):
        self.calls.append(("send", tensor, group))

    def recv(self, tensor, src, group, **kw):
        self.calls.append(("recv", tensor, group))

    def P2POp(self, op, tensor, peer, group, **kw):  # noqa: N802
        self.calls.append(("op", tensor, group))

    def new_group(self, ranks, backend=None):
        return ("group", tuple(ranks), backend)


class _Bridge:
    """What BridgeDist reads of a bridge."""

    def __init__(self, group, host=False):
        self.bridge_pg, self.host, self.host_sends, self.host_recvs = group, host, 0, 0


def test_each_thread_sends_on_the_group_of_the_bridge_it_runs():
    """Two threads inside two bridges at once: each call that names no group takes its own
    thread's bridge group; a group named stays; outside a bridge the world's (None)."""
    rec = _Recorder("gloo")
    d = BridgeDist(rec)
    both_inside = threading.Barrier(2)

    def bridge(group, tag):
        with d.sending_on(_Bridge(group)):
            both_inside.wait()
            d.send(tag, dst=1)
            d.P2POp(d.isend, tag, 1)
            d.recv(tag, src=1)
            d.send(tag, dst=1, group="named")
            both_inside.wait()

    threads = [threading.Thread(target=bridge, args=(g, t)) for g, t in (("g1", 1), ("g2", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    d.send(0, dst=1)
    for tag, group in ((1, "g1"), (2, "g2")):
        assert [(c[0], c[2]) for c in rec.calls if c[1] == tag] == [
            ("send", group), ("op", group), ("recv", group), ("send", "named")]
    assert rec.calls[-1] == ("send", 0, None)
    assert d.isend is rec.isend  # everything else is torch.distributed's own


def test_a_host_bridge_stages_its_messages_through_host_buffers():
    """On a host bridge's group a send goes from a copy, a receive lands in a buffer copied
    onto the caller's tensor (a leaf that requires grad, as megatron-core allocates it) and a
    batch's received shape is copied once its request is waited; on another group nothing is
    staged."""
    import torch

    class Wire(_Recorder):
        def recv(self, tensor, src, group, **kw):
            tensor.fill_(7.0)
            self.calls.append(("recv", tensor, group))

        def P2POp(self, op, tensor, peer, group, **kw):  # noqa: N802
            self.calls.append(("op", tensor, group))
            return SimpleNamespace(op=op, tensor=tensor)

        def batch_isend_irecv(self, ops):
            for op in ops:
                if op.op is self.irecv:
                    op.tensor.fill_(5)
            return [SimpleNamespace(wait=lambda: True) for _ in ops]

    wire = Wire("gloo")
    wire.irecv = object()  # a function of torch.distributed: one object
    d = BridgeDist(wire)
    bridge = _Bridge("host-group", host=True)
    sent, got = torch.ones(2, 3), torch.zeros(2, 3, requires_grad=True)
    shape = torch.zeros(3, dtype=torch.int64)
    with d.sending_on(bridge):
        d.send(sent, dst=1)
        d.recv(got, src=1)
        reqs = d.batch_isend_irecv([d.P2POp(d.irecv, shape, 1), d.P2POp(d.isend, sent, 1)])
        d.send(sent, dst=1, group="other")
    assert shape.tolist() == [0, 0, 0]  # not before its request is waited
    for req in reqs:
        req.wait()
    staged = [c for c in wire.calls if c[2] == "host-group"]
    assert all(c[1] is not t for c, t in zip(staged, (sent, got, shape, sent)))
    assert torch.equal(staged[0][1], sent) and torch.equal(got, torch.full((2, 3), 7.0))
    assert shape.tolist() == [5, 5, 5]
    assert wire.calls[-1][1] is sent  # another group: as it is
    assert (bridge.host_sends, bridge.host_recvs) == (2, 2)


@pytest.mark.parametrize("cpu_ranks, made", [(True, None), (False, "nccl")])
def test_a_group_asked_of_nccl_is_made_on_gloo_on_cpu_ranks_only(cpu_ranks, made):
    """On CPU ranks (every group gloo) megatron-core's ``nccl`` becomes the world's backend;
    on devices it stays, also under a gloo world (a run across vendors: its meshes' groups are
    on their devices)."""
    d = BridgeDist(_Recorder("gloo"))
    d.gloo = cpu_ranks
    assert d.new_group([0, 1], backend="nccl")[2] == made
    assert d.new_group([0, 1], backend="gloo")[2] == "gloo"


@pytest.mark.slow
@pytest.mark.parametrize("stack", [OLD_STACK, DEFAULT_STACK])
def test_the_forward_and_wrap_around_bridges_get_groups_of_their_own(tmp_path, stack):
    """Two meshes of one rank each: both bridges join ranks 0 and 1, on two groups, neither
    the world's; an activation and a wrap-around gradient sent from rank 0 to rank 1 in one
    order and received in the other each arrive where they were sent."""
    plan = tiny_mesh_plan(tmp_path, [(1, 1), (1, 1)])
    got = evaluated(evaluate_under(
        "from megatron_hetero.mcore.spawn import spawn\n"
        "from tests.mcore.mesh_ranks import chain_bridge_groups",
        {"ranks": f"spawn(chain_bridge_groups, 2, args=({plan!r},), timeout_s=240)"},
        timeout=300, stack=stack), "ranks")
    assert [{k: r[k] for k in ("ranks", "distinct")} for r in got] == [
        {"ranks": [[0, 1], [0, 1]], "distinct": True}] * 2
    assert got[1]["crossed"] == [[2.0], [1.0]]  # the gradient, then the activation


@pytest.mark.slow
@pytest.mark.parametrize("stack", [OLD_STACK, DEFAULT_STACK])
def test_a_bridge_between_vendors_is_host_staged_on_a_gloo_group_of_its_own(tmp_path, stack):
    """A100 TP1 x DP2 -> MI300X TP2 x DP1 (NCCL beside RCCL), through the communicator the
    runtime builds: the bridge is a host bridge on a gloo group over its three leaders... the
    two senders of mesh 0 and the receiver of mesh 1, none of the meshes' groups; a micro-batch
    and its gradient cross it whole, the leaders staging every message (its shape, then its
    data) through host buffers, the TP peer of mesh 1 (a broadcast inside its mesh) none."""
    plan = tiny_mesh_plan(tmp_path, [(1, 2), (2, 1)],
                          device_types={0: "A100-SXM-80GB", 1: "MI300X-192GB"})
    got = evaluated(evaluate_under(
        "from megatron_hetero.mcore.spawn import spawn\n"
        "from tests.mcore.mesh_ranks import vendor_bridge_ranks",
        {"ranks": f"spawn(vendor_bridge_ranks, 4, args=({plan!r},), timeout_s=240)"},
        timeout=300, stack=stack), "ranks")
    assert {r["cls"] for r in got} == {"HostBridge"} and all(r["host"] for r in got)
    assert all(r["ok"] and r["own"] for r in got)
    assert [r["backend"] for r in got] == ["gloo", "gloo", "gloo", None]
    assert [r["group_ranks"] for r in got] == [[0, 1, 2]] * 3 + [None]
    # mesh 0's two senders: a shape and a tensor out, a shape and a gradient back; mesh 1's
    # leader the same from each of them
    assert [r["staged"] for r in got] == [[2, 2], [2, 2], [4, 4], [0, 0]]
