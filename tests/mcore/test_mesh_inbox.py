"""The interleaved mesh schedule's receiver (megatron_hetero/mcore/mesh_interleaved.py
``Inbox``): each op's receive runs on one receiver thread, in the schedule's order, while the
op before it computes, so that a crossing's messages (a bridge's shapes, tensors and TP
broadcast) are not exchanged only once the op needs its input. The schedule runs here on
stub links and stub compute (megatron-core's ``forward_step`` and ``backward_step`` replaced):
each op's compute waits until the receive of the next op that takes one has started, which a
schedule that receives only when an op starts never does (a 30 s guard turns that into a
failure instead of a hang)."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest

from megatron_hetero.mcore.mesh_interleaved import (Inbox, InterleavedMeshRank, Outbox,
                                                   interleaved_mesh_schedule)
from megatron_hetero.plan import load_any_plan

from .tiny_mesh_plans import tiny_mesh_plan

GUARD_S = 30.0


class _Log:
    """What the stub links and compute saw, in order, from every thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple] = []
        self.started: dict[int, threading.Event] = {}

    def add(self, *event) -> None:
        with self.lock:
            self.events.append(event)

    def started_event(self, n: int) -> threading.Event:
        with self.lock:
            return self.started.setdefault(n, threading.Event())


class _Link:
    """A link whose receives log their thread and count themselves."""

    def __init__(self, log: _Log, counter: list[int]) -> None:
        self.log, self.counter = log, counter

    def _recv(self, kind: str):
        import torch

        with self.log.lock:
            n = self.counter[0]
            self.counter[0] += 1
        self.log.add("recv", n, kind, threading.current_thread().name)
        self.log.started_event(n).set()
        return torch.zeros(1, requires_grad=True)

    def recv_forward(self):
        return self._recv("forward")

    def recv_backward(self):
        return self._recv("backward")

    def joined(self, tensor):
        return tensor

    def send_forward(self, tensor) -> None:
        pass

    def send_backward(self, tensor) -> None:
        pass


def _middle_rank(tmp_path, log: _Log) -> InterleavedMeshRank:
    """The middle mesh's rank of three meshes of one stage and two chunks: every op of it
    takes a receive (forwards from mesh 0, backwards from mesh 2)."""
    plan = load_any_plan(tiny_mesh_plan(tmp_path, [(1, 1), (1, 1), (1, 1)],
                                    chunks={0: [[1, 1]], 1: [[1, 1]], 2: [[1, 1]]},
                                    replicas=[{"micro_batch_size": 1, "num_microbatches": 4}],
                                    fields={"microbatch_group_size": 4}))
    counter = [0]
    link = _Link(log, counter)
    config = SimpleNamespace(finalize_model_grads_func=None, calculate_per_token_loss=False)
    ddp = SimpleNamespace(no_sync=contextlib.nullcontext)
    return InterleavedMeshRank(plan=plan, slot=plan.slot_of_rank(1), grids=[], into=link,
                               out=link, pgs=None, gpts=[SimpleNamespace(config=config)] * 2,
                               ddps=[ddp, ddp], optimizer=None, layer_offsets=[1, 4])


def test_each_receive_runs_while_the_op_before_computes(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    log = _Log()
    rank = _middle_rank(tmp_path, log)
    ops = [0]
    waited: list[bool] = []

    def compute(kind: str):
        k = ops[0]
        ops[0] += 1
        log.add("compute", k, kind)
        # op k took receive k (every op of this rank takes one): receive k + 1 must be under
        # way before op k's compute ends
        if k + 1 < 16:
            waited.append(log.started_event(k + 1).wait(GUARD_S))

    def forward_step(func, it, model, m, x, store, config, *args, **kwargs):
        assert x is not None
        compute("forward")
        return x * 2, torch.tensor(1)

    def backward_step(x, y, dy, config):
        assert dy is not None
        compute("backward")
        return torch.ones(1)

    monkeypatch.setattr(schedules, "forward_step", forward_step)
    monkeypatch.setattr(schedules, "backward_step", backward_step)
    try:
        interleaved_mesh_schedule(rank, None, [iter(()), iter(())])
    finally:
        rank.close()
    assert ops[0] == 16  # 4 micro-batches x 2 chunks, forward and backward
    assert waited == [True] * 15
    recvs = [e for e in log.events if e[0] == "recv"]
    computes = [e for e in log.events if e[0] == "compute"]
    # the receives in the schedule's order, each of the kind its op takes, on one thread of
    # their own
    assert [e[2] for e in recvs] == [e[2] for e in computes]
    assert len({e[3] for e in recvs}) == 1 and recvs[0][3] != threading.current_thread().name
    # no receive ran more than one op ahead: receive k + 2 started after op k computed
    order = [(e[0], e[1]) for e in log.events]
    for k in range(14):
        assert order.index(("compute", k)) < order.index(("recv", k + 2))


def test_inbox_delivers_in_order_and_raises_a_receive_error():
    inbox = Inbox()
    release = threading.Event()
    inbox.ask(lambda: release.wait(GUARD_S) and "first")
    inbox.ask(lambda: "second")
    release.set()  # asked for without waiting: the receives run on the inbox's thread
    assert inbox.take() == "first"
    assert inbox.take() == "second"

    def fails():
        raise RuntimeError("peer gone")

    inbox.ask(fails)
    with pytest.raises(RuntimeError, match="peer gone"):
        inbox.take()
    inbox.close()


def test_the_schedules_threads_run_on_the_ranks_cuda_device(monkeypatch):
    """The sender and receiver threads take the CUDA device of the rank's thread that builds
    them (megatron-core's bridges allocate on the current device, which is per thread and
    starts at 0 in a new thread): torch.cuda replaced by a fake with a current device per
    thread, as CUDA keeps it."""
    import torch

    monkeypatch.delenv("MEGATRON_HETERO_CPU", raising=False)
    per_thread = threading.local()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(per_thread, "device", 0))
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: setattr(per_thread, "device", d))
    torch.cuda.set_device(3)  # the rank's device, set on its main thread
    seen = {}
    for box in (Outbox(), Inbox()):
        box.post(lambda _: seen.setdefault(type(box).__name__, torch.cuda.current_device()),
                 None)
        box.close()
    assert seen == {"Outbox": 3, "Inbox": 3}
    # and a thread that does not join the rank stays on device 0
    other = threading.Thread(target=lambda: seen.setdefault("other", torch.cuda.current_device()))
    other.start()
    other.join()
    assert seen["other"] == 0
