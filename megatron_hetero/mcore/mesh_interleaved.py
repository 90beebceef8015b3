"""Interleaved 1F1B over a chain of meshes (:attr:`~megatron_hetero.plan.Plan.interleaved_chain`)
from megatron-core's own pieces: its ``forward_step`` and ``backward_step`` per (micro-batch,
model chunk), its ``P2PCommunicator`` between two stages of one mesh and its
``BridgeCommunicator`` between meshes. megatron-core has no interleaved multimodule schedule;
this module is the schedule, not a transport.

**Chunks.** A rank of global stage ``s`` (of ``P`` over all meshes) holds ``v`` model chunks,
one ``GPTModel`` each: chunk ``c`` is virtual stage ``c P + s`` of the model
(:attr:`~megatron_hetero.plan.Plan.virtual_stage_layers`), its layers named by their global
index. The embedding is on virtual stage 0 (mesh 0's first stage, chunk 0), the output layer and
loss on virtual stage ``P v - 1`` (the last mesh's last stage, chunk ``v - 1``).

**Links.** Every chunk of a stage takes its input over the same link and sends its output over
the same link: the stage before it in its mesh (the mesh's ``P2PCommunicator``), else the bridge
from the previous mesh, and on the model's first stage the **wrap-around bridge** from the last
mesh's last stage (chunk ``c`` there feeds chunk ``c + 1`` here); mirrored for the output.
Every bridge is built collectively on every rank, in chain order, the wrap-around last, and
sends on process groups of its own (:func:`~.bridge_groups.chain_bridge_classes`): with two
meshes of one stage the forward bridge and the wrap-around join the same two ranks, and on one
group their messages in one direction (activations of chunk ``c``, gradients of the
wrap-around) would meet in one queue in an order neither side controls. megatron-core 0.19
caches a bridge's group by its ranks (the wrap-around gets a cache of its own); 0.17 and 0.18
send on the world's group, and there each bridge's calls are given its own. A bridge between
two collective libraries (vendors) is host-staged on a gloo group of its own, as
:mod:`.bridge_groups` says.

**Sequence parallelism** (in a mesh of TP > 1 where the plan runs it): a bridge link cuts
each whole tensor it delivers into the rank's sequence shard and joins the TP group's shards of
what the rank sends (:meth:`Link.joined`, an all-gather on the schedule's thread, before the
send is handed to a sender), as :mod:`.mesh_stage` says; inside a mesh the shards travel as
they are.

**Order.** Each rank runs :func:`~megatron_hetero.schedule.order.rank_order` (the simulator's
order: Megatron's interleaved table in micro-batch groups of
:attr:`~megatron_hetero.plan.Plan.microbatch_group`, its warm-up at the rank's global stage).
A chain without model chunks whose plan warms a stage up beyond Megatron's ``P - s - 1``
(:attr:`~megatron_hetero.plan.Plan.own_chain_schedule`) runs here too, as one chunk a stage:
non-interleaved 1F1B with the stage's warm-up (:func:`~megatron_hetero.schedule.rules.
chain_warmup`); the plan's rule (each stage at least one more than the next) keeps that
order free of cycles, as the simulator's. With chunks a stage's warm-up (forward chunk-steps)
is one whose orders the plan's check walked to completion
(:func:`~megatron_hetero.schedule.chain.blocked_stage`, with this executor's dependencies).
On each link one direction carries one kind of message (activations forward, gradients back),
sent and received in the table's order on both ends, so the messages of a link pair up without
tags.

**No deadlock.** A forward waits for its input and a backward for its output's gradient
before computing; its own result is handed to a sender of its link and direction (one thread
each, :class:`Outbox`, in order), so a rank never waits on a send: ops then wait only for their
inputs, as in the simulator, whose order completes. The inputs come from the rank's receiver
(:class:`Inbox`: one thread for both links, in the table's order), which is asked for the next
op's input as soon as an op has its own, so that the receive runs while the op computes (a
bridge's receive is a chain of messages, the shapes, each tensor of a fan-in, the broadcast
in the TP group, that only starts once the receive is posted; megatron-core's schedules post
the next receive with the current op's send likewise). One receive ahead at most: an input
is held no longer than one op before its op. (Megatron's own interleaved schedule pairs
sends and receives in combined ops at each step instead; a chain's neighbours sit on different
communicators, which megatron-core cannot combine.) The step ends once every send has been
received. The numbers do not depend on the threads' timing.

Gradients: each chunk's last backward runs with DDP's gradient sync on (the others in
``no_sync``), then the finalize of :func:`~.mesh_train.mesh_finalize_model_grads` over every
chunk, with the step's tokens where the loss is per token, as megatron-core's schedules do.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from ..plan import Plan, Slot
from ..plan.checks import host_bridges
from ..schedule.order import rank_order
from ..schedule.rules import chain_warmup
from .bridge_groups import chain_bridge_classes
from .cpu_backend import cpu_mode, join_cpu_backend
from .mesh_grids import DIM_MAPPING, module_name
from .mesh_stage import sequence_group
from .mesh_train import (mesh_ddp, mesh_finalize_model_grads, mesh_optimizer, mesh_rank_groups,
                         wire_schedule)

__all__ = ["Link", "Outbox", "Inbox", "InterleavedMeshRank", "chain_bridges", "stage_links",
           "chunk_virtual_stage", "build_interleaved_mesh_rank", "interleaved_mesh_schedule"]


@dataclass(kw_only=True, slots=True)
class Link:
    """One boundary of a rank's stage, seen from the rank: megatron-core's ``P2PCommunicator``
    of its mesh or a ``BridgeCommunicator``, behind the four calls a chunk makes."""

    comm: Any
    """The communicator."""
    bridge: bool
    """A ``BridgeCommunicator`` (else a ``P2PCommunicator``)."""
    shape: tuple[int, int, int]
    """The ``[s, b, h]`` a message has (the ``P2PCommunicator`` asks for it; with variable
    sequence lengths the shapes travel with the messages)."""
    sequence_group: Any = None
    """On a bridge of a mesh that runs sequence parallelism, its TP group
    (:func:`~.mesh_stage.sequence_group`): a bridge carries whole tensors, the stage holds its
    shard of the sequence (what comes in is cut, what goes out :meth:`joined`)."""

    def recv_forward(self):
        """The activation of the stage before (on the link into the stage)."""
        if self.bridge:
            return self._shard(self.comm.recv_forward(), leaf=True)
        return self.comm.recv_forward(self.shape, is_first_stage=False)

    def joined(self, tensor):
        """What this rank sends of its ``tensor`` over the link: on a bridge under sequence
        parallelism, its TP group's shards joined (collective over the group: call in the
        schedule's order, never from a sender thread); else ``tensor``."""
        if self.sequence_group is None:
            return tensor
        import torch
        import torch.distributed as dist

        part = tensor.detach().contiguous()
        n = dist.get_world_size(self.sequence_group)
        whole = torch.empty((n * part.shape[0], *part.shape[1:]), dtype=part.dtype,
                            device=part.device)
        dist.all_gather_into_tensor(whole, part, group=self.sequence_group)
        return whole

    def _shard(self, tensor, *, leaf: bool):
        """This rank's sequence shard of the whole ``tensor`` a bridge delivered (a leaf that
        takes its gradient where ``leaf``)."""
        if self.sequence_group is None:
            return tensor
        import torch.distributed as dist

        n, r = dist.get_world_size(self.sequence_group), dist.get_rank(self.sequence_group)
        part = tensor.detach().chunk(n, dim=0)[r].clone()
        return part.requires_grad_() if leaf else part

    def send_forward(self, tensor) -> None:
        """The stage's activation to the stage after (on the link out of the stage)."""
        if self.bridge:
            self.comm.send_forward(tensor)
        else:
            self.comm.send_forward(tensor, is_last_stage=False)

    def recv_backward(self):
        """The gradient of the stage's output (on the link out of the stage)."""
        if self.bridge:
            return self._shard(self.comm.recv_backward(), leaf=False)
        return self.comm.recv_backward(self.shape, is_last_stage=False)

    def send_backward(self, grad) -> None:
        """The gradient of the stage's input to the stage before (on the link into it)."""
        if self.bridge:
            self.comm.send_backward(grad)
        else:
            self.comm.send_backward(grad, is_first_stage=False)


def rank_device() -> int | None:
    """This rank's CUDA device, the calling thread's (None without CUDA, and on the CPU
    backend, whose device mode stands in for CUDA)."""
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() and not cpu_mode() else None


def join_rank(device: int | None) -> None:
    """Make the calling thread run megatron-core's code as the rank's own thread does: the
    CPU backend's device mode where it runs, and ``device`` as its CUDA device (the current
    device is per thread, and megatron-core's bridges allocate their shape messages on it; a
    new thread starts on device 0)."""
    join_cpu_backend()
    if device is not None:
        import torch

        torch.cuda.set_device(device)


class Outbox:
    """The sends of one link in one direction, run in order on a thread of their own, which
    runs as the rank's thread that builds it (:func:`join_rank`)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, initializer=join_rank,
                                        initargs=(rank_device(),))
        self._pending: list[Future] = []
        self._abandoned = False

    def post(self, send: Callable[[Any], None], tensor) -> None:
        """Send ``tensor`` with ``send`` after the sends posted before; raises the error of an
        earlier send that failed."""
        while self._pending and self._pending[0].done():
            self._pending.pop(0).result()
        self._pending.append(self._pool.submit(send, tensor))

    def drain(self) -> None:
        """Wait until every posted send is received."""
        while self._pending:
            self._pending.pop(0).result()

    def abandon(self) -> None:
        """Forget the posted sends (after an error: their peers may never take them); the
        thread is then left to its blocked send rather than waited for."""
        self._pending.clear()
        self._abandoned = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Drain and stop the thread (unless abandoned)."""
        if not self._abandoned:
            self.drain()
            self._pool.shutdown(wait=True)


class Inbox(Outbox):
    """The receives of one rank, over both its links, run in the schedule's order on a thread
    of their own, so that an op's receive can be posted before the op before it computes
    (:func:`interleaved_mesh_schedule` keeps one ahead). One thread for both links: a bridge's
    receive ends in a broadcast inside the receiving mesh's TP group, and the two links of a
    mesh's boundary stage broadcast in the same group, so the TP peers must run them in one
    order, the schedule's."""

    def ask(self, recv: Callable[[], Any]) -> None:
        """Receive with ``recv`` after the receives asked for before."""
        self._pending.append(self._pool.submit(recv))

    def take(self):
        """What the oldest receive asked for delivered (waiting for it); raises its error."""
        return self._pending.pop(0).result()


def chain_bridges(plan: Plan, grids: list, config) -> list:
    """megatron-core's ``BridgeCommunicator`` of every boundary between meshes, in chain order,
    then the wrap-around bridge (last mesh -> mesh 0), each on process groups of its own (see
    the module docstring). Collective: call on every rank."""
    def bridge(cls, src: int, dest: int):
        return cls(grids[src], grids[dest], dim_mapping=dict(DIM_MAPPING),
                   comm_dtype=config.pipeline_dtype, src_module_name=module_name(src),
                   dest_module_name=module_name(dest))

    n = len(grids)
    classes = chain_bridge_classes(host_bridges(plan), wrap_around=True)
    return [bridge(classes[k], k, (k + 1) % n) for k in range(n)]


def stage_links(plan: Plan, slot: Slot, grids: list, bridges: list, config) -> tuple[Link, Link]:
    """(into, out of) ``slot``'s stage: its mesh's ``P2PCommunicator`` inside the mesh, the
    bridges (:func:`chain_bridges`) at its ends."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    mesh = plan.meshes[slot.mesh]
    group = sequence_group(plan, slot.mesh, grids[slot.mesh].get_pg("tp"))
    seq = plan.model.seq_length // (1 if group is None else mesh.tensor_model_parallel_size)
    shape = (seq, mesh.pipelines[slot.replica].micro_batch_size, plan.model.hidden_size)
    p2p = (P2PCommunicator(grids[slot.mesh].get_pg("pp"), config)
           if mesh.num_stages > 1 else None)
    into = (Link(comm=p2p, bridge=False, shape=shape) if slot.stage > 0 else
            Link(comm=bridges[slot.mesh - 1], bridge=True, shape=shape,  # [-1]: wrap-around
                 sequence_group=group))
    out = (Link(comm=p2p, bridge=False, shape=shape) if slot.stage < mesh.num_stages - 1 else
           Link(comm=bridges[slot.mesh], bridge=True, shape=shape,  # the last: wrap-around
                sequence_group=group))
    return into, out


def chunk_virtual_stage(plan: Plan, slot: Slot, chunk: int) -> int:
    """The virtual pipeline stage (of ``P v``, model order) of ``slot``'s chunk ``chunk``."""
    return chunk * plan.pipeline_model_parallel_size + plan.global_stage(slot)


@dataclass(kw_only=True, slots=True)
class InterleavedMeshRank:
    """What :func:`build_interleaved_mesh_rank` builds on one rank."""

    plan: Plan
    slot: Slot
    """The rank's mesh, stage, replica and tensor rank."""
    grids: list
    """Every mesh's ``HyperCommGrid``."""
    into: Link
    """The link the stage's chunks take their inputs over."""
    out: Link
    """The link the stage's chunks send their outputs over."""
    pgs: Any
    """The rank's ``ProcessGroupCollection`` (its mesh's)."""
    gpts: list
    """The ``GPTModel`` of each chunk."""
    ddps: list
    """``DistributedDataParallel`` around each of ``gpts``: the schedule's model chunks."""
    optimizer: Any
    """The Megatron optimizer over ``ddps``."""
    layer_offsets: list[int]
    """Per chunk, the model's layers before its first."""
    outboxes: tuple[Outbox, Outbox] = field(default_factory=lambda: (Outbox(), Outbox()))
    """The senders of activations (on ``out``) and of gradients (on ``into``)."""
    inbox: Inbox = field(default_factory=Inbox)
    """The receiver of activations (on ``into``) and of gradients (on ``out``)."""

    def chunk_ends(self, chunk: int) -> tuple[bool, bool]:
        """(holds the embedding, holds the output layer) of chunk ``chunk``."""
        vs = chunk_virtual_stage(self.plan, self.slot, chunk)
        return vs == 0, vs == self.plan.pipeline_model_parallel_size * len(self.gpts) - 1

    def close(self) -> None:
        """Stop the senders and the receiver."""
        for box in (*self.outboxes, self.inbox):
            box.close()


def build_interleaved_mesh_rank(plan: Plan, rank: int, optimizer_config, *, configs: list,
                                init: Callable[[Any, Slot, int], None] | None = None,
                                overlap_grad_reduce: bool = False,
                                gloo: bool = False) -> InterleavedMeshRank:
    """Build rank ``rank`` of the interleaved chain ``plan`` (collective: call on every rank):
    the grids, the bridges and the rank's links, one ``GPTModel`` per chunk on ``configs[c]``
    (:func:`~.mesh_train.mesh_transformer_config` with the chunk's layers), each in DDP over
    its mesh, the optimizer over them and the schedule's hooks on every chunk's config (as
    :func:`~.mesh_train.build_mesh_rank`). ``init(gpt, slot, layer_offset)`` sets a chunk's
    weights; ``gloo``: the world is gloo (CPU ranks)."""
    from .model import gpt_model

    slot = plan.slot_of_rank(rank)
    grids, pgs = mesh_rank_groups(plan, slot, gloo=gloo)
    first = plan.chunk_first_layers(slot)
    last = plan.pipeline_model_parallel_size * plan.virtual_pipeline_size - 1
    gpts, ddps, offsets = [], [], []
    for c, config in enumerate(configs):
        vs = chunk_virtual_stage(plan, slot, c)
        gpt = gpt_model(plan.model, config, pre_process=vs == 0, post_process=vs == last,
                        pg_collection=pgs)
        offsets.append(first[c])
        if init is not None:
            init(gpt, slot, offsets[-1])
        gpts.append(gpt)
        ddps.append(mesh_ddp(gpt, pgs, overlap_grad_reduce=overlap_grad_reduce,
                             use_distributed_optimizer=optimizer_config.use_distributed_optimizer))
    optimizer = mesh_optimizer(plan, slot, ddps, pgs, optimizer_config)
    finalize = mesh_finalize_model_grads(plan, slot, pgs)
    for config, ddp in zip(configs, ddps):
        wire_schedule(config, ddp, optimizer, finalize, overlap_grad_reduce=overlap_grad_reduce)
    into, out = stage_links(plan, slot, grids, chain_bridges(plan, grids, configs[0]),
                            configs[0])
    return InterleavedMeshRank(plan=plan, slot=slot, grids=grids, into=into, out=out, pgs=pgs,
                               gpts=gpts, ddps=ddps, optimizer=optimizer, layer_offsets=offsets)


def interleaved_mesh_schedule(rank: InterleavedMeshRank, forward_step_func: Callable,
                              data_iterators: list, *, forward_only: bool = False,
                              config=None) -> list:
    """One step of ``rank`` (its replica's micro-batches) in interleaved 1F1B over the chain
    (module docstring); ``data_iterators``: one iterator of the replica's micro-batches per
    chunk; ``config``: the one config of every chunk's steps (Megatron's training sets the
    schedule's hooks on model chunk 0's, as its own interleaved schedule takes it), else each
    chunk's own. Returns what the loss function reported on the model's last virtual stage
    (empty elsewhere)."""
    import torch
    from megatron.core.pipeline_parallel import schedules

    plan, slot = rank.plan, rank.slot
    v = len(rank.ddps)
    p, s = plan.pipeline_model_parallel_size, plan.global_stage(slot)
    m = plan.meshes[slot.mesh].pipelines[slot.replica].num_microbatches
    order = rank_order(p, s, m, v, plan.microbatch_group, warmup=chain_warmup(plan, slot))
    if forward_only:
        order = [op for op in order if op[0] == 0]
    last_backward = {c: k for k, (kind, _, c) in enumerate(order) if kind == 1}
    ends = [rank.chunk_ends(c) for c in range(v)]
    configs = [gpt.config if config is None else config for gpt in rank.gpts]
    send_fwd, send_bwd = rank.outboxes
    # each op's receive, if it takes one; the next is asked for once the op before has its own
    recvs = [(None if ends[c][0] else rank.into.recv_forward) if kind == 0 else
             (None if ends[c][1] else rank.out.recv_backward) for kind, _, c in order]
    asks = iter([recv for recv in recvs if recv is not None])

    def ask_next() -> None:
        recv = next(asks, None)
        if recv is not None:
            rank.inbox.ask(recv)

    store: list = []
    held: dict = {}
    tokens = torch.zeros((), dtype=torch.int)
    try:
        ask_next()
        for k, (kind, i, c) in enumerate(order):
            first, final = ends[c]
            got = None
            if recvs[k] is not None:
                got = rank.inbox.take()
                ask_next()
            if kind == 0:
                x = got
                y, n = schedules.forward_step(
                    forward_step_func, data_iterators[c], rank.ddps[c], m, x, store, configs[c],
                    1, is_first_microbatch=i == 0, current_microbatch=i, is_last_stage=final)
                tokens = tokens + n
                if not final:
                    send_fwd.post(rank.out.send_forward, rank.out.joined(y))
                if not forward_only:
                    held[(i, c)] = (x, y)
                continue
            dy = got
            x, y = held.pop((i, c))
            sync = contextlib.nullcontext() if last_backward[c] == k else rank.ddps[c].no_sync()
            with sync:
                dx = schedules.backward_step(x, y, dy, configs[c])
            if not first:
                send_bwd.post(rank.into.send_backward, rank.into.joined(dx))
        send_fwd.drain()
        send_bwd.drain()
    except BaseException:
        # the error, not a wait on a send or receive that will never be taken
        for box in (*rank.outboxes, rank.inbox):
            box.abandon()
        raise
    if not forward_only and configs[0].finalize_model_grads_func is not None:
        configs[0].finalize_model_grads_func(
            rank.ddps, tokens if configs[0].calculate_per_token_loss else None)
    return store
