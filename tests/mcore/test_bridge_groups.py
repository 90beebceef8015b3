"""Every bridge of a chain of meshes sends on a process group of its own
(megatron_hetero/mcore/bridge_groups.py): ``BridgeDist`` hands a thread's point-to-point calls
that name no group to the group of the bridge it runs, each thread its own; on gloo ranks, under
megatron-core 0.17.1 (whose bridges send on the world's group) and 0.19.2 (its own groups), the
forward bridge and the wrap-around between the same two ranks get distinct groups."""

from __future__ import annotations

import threading

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


def test_each_thread_sends_on_the_group_of_the_bridge_it_runs():
    """Two threads inside two bridges at once: each call that names no group takes its own
    thread's bridge group; a group named stays; outside a bridge the world's (None)."""
    rec = _Recorder("gloo")
    d = BridgeDist(rec)
    both_inside = threading.Barrier(2)

    def bridge(group, tag):
        with d.sending_on(group):
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


@pytest.mark.parametrize("world, made", [("gloo", None), ("nccl", "nccl"),
                                         ("cpu:gloo,cuda:nccl", "nccl")])
def test_a_group_asked_of_nccl_is_made_on_the_worlds_backend_off_nccl(world, made):
    assert BridgeDist(_Recorder(world)).new_group([0, 1], backend="nccl")[2] == made
    assert BridgeDist(_Recorder(world)).new_group([0, 1], backend="gloo")[2] == "gloo"


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
