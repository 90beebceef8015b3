"""The heterogeneity-aware 1F1B: non-interleaved 1F1B with the plan's per-stage warm-up
(``Stage.warmup_microbatches``), built from megatron-core's own pieces.

:func:`schedule_for` picks the schedule of one replica: Megatron's own function, untouched,
unless the plan gives some stage of that replica more warm-up than Megatron's ``p - s - 1``;
then every stage of that replica runs :func:`warmup_forward_backward` (its stages must agree on
how they exchange messages; other replicas keep Megatron's schedule, and the data-parallel
gradient sync is the same collective under both). The runtime hooks
(``get_forward_backward_func``) and the CPU trainer both call it.

What runs is megatron-core's: ``schedules.forward_step`` (the loss, per-token or not, the token
count), ``schedules.backward_step`` (the loss scale, the output-gradient trick of
``deallocate_pipeline_outputs``), ``deallocate_output_tensor``, the embedding helpers,
``finalize_model_grads_func`` with the token count of every micro-batch, the DDP hooks of the
config (``no_sync_func`` until the last backward; ``grad_sync_func`` as Megatron's 1F1B calls
it), and ``P2PCommunicator`` for every message. What is ours is the order: each stage executes
:func:`megatron_hetero.schedule.rules.stage_program`, its 1F1B ops with ``w`` warm-up forwards
and, around them, when to post and wait for each message.

Messages: every send and every receive is posted without waiting
(``send_forward_recv_forward`` / ``send_backward_recv_backward`` with ``overlap_p2p_comm``, on
a communicator whose config has ``batch_p2p_comm`` off: one ``isend`` or ``irecv`` per call), and
a stage waits only for the data its next op needs; sends are waited for once, after the last
backward. A stage thus goes on with its warm-up forwards while its sends cross a slow link.
Both ends of a link post its messages in the same order (the upper stage's; the lower stage
posts receives ahead), which a transport that pairs each link's messages in posting order
(NCCL's two-rank communicators of single ``send``/``recv``; gloo) needs; with warm-ups that never
rise along the pipeline (the plan's rule: at least one more than the next stage) no stage waits
on another in a cycle. :func:`~megatron_hetero.schedule.rules.stage_program` has the argument,
and a test runs every stage's program against such a transport.

Evaluation (``forward_only``) runs Megatron's own schedule: without backwards the order of
forwards is the same. Not supported (:func:`unsupported`; the runtime refuses them at start,
the schedule again when called): variable sequence lengths, ``adjust_tensor_shapes_fn``,
ring-exchange p2p and local CUDA graphs.
"""

from __future__ import annotations

import contextlib
import copy
import inspect

from ..errors import HeteroError
from ..plan import Plan
from ..schedule.rules import has_extra_warmup, pipeline_warmups, stage_program

__all__ = ["schedule_for", "warmup_forward_backward", "unsupported", "refusal"]


def schedule_for(plan: Plan, pipeline: int, forward_backward):
    """The schedule replica ``pipeline`` of ``plan`` runs: ``forward_backward`` (Megatron's, as
    ``get_forward_backward_func`` returned it) unless the plan asks for extra warm-up on one of
    its stages (non-interleaved, more than one stage)."""
    if plan.virtual_pipeline_size > 1 or plan.pipeline_model_parallel_size == 1:
        return forward_backward
    pipe = plan.pipelines[pipeline]
    if not has_extra_warmup(pipe):
        return forward_backward
    return warmup_forward_backward(pipeline_warmups(pipe), megatron=forward_backward)


def warmup_forward_backward(warmups, *, megatron):
    """A schedule with the signature of Megatron's ``forward_backward_pipelining_without_
    interleaving`` whose stage ``s`` warms up ``warmups[s]`` micro-batches (at most the call's
    ``num_microbatches``); ``megatron`` runs the forward-only calls."""
    warmups = tuple(warmups)

    def forward_backward_with_warmup(**kw):
        if kw.get("forward_only"):
            return megatron(**kw)
        return _Step(warmups, **kw).run()

    forward_backward_with_warmup.warmups = warmups
    return forward_backward_with_warmup


class _Step:
    """One training step of one rank under :func:`warmup_forward_backward`."""

    def __init__(self, warmups, *, forward_step_func, data_iterator, model, num_microbatches,
                 seq_length, micro_batch_size, decoder_seq_length=None, forward_only=False,
                 collect_non_loss_data=False, first_val_step=None, adjust_tensor_shapes_fn=None,
                 p2p_communicator=None, pg_collection=None, force_all_reduce=False):
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.utils import get_model_config

        model = _one(model, "model")
        self.data_iterator = _one(data_iterator, "data_iterator")
        self.model, self.forward_step_func = model, forward_step_func
        self.m, self.collect, self.first_val_step = num_microbatches, collect_non_loss_data, first_val_step
        self.force_all_reduce = force_all_reduce
        self.config = config = get_model_config(model)
        _refuse_unsupported(config, adjust_tensor_shapes_fn)
        self.pp, self.tp, self.cp, self.pgs = _groups(p2p_communicator, pg_collection)
        self.comm = schedules.P2PCommunicator(pp_group=self.pp, config=_unbatched(config))
        self.stage, p = self.pp.rank(), self.pp.size()
        if p != len(warmups):
            raise HeteroError(f"the plan's pipeline has {len(warmups)} stages; this pipeline-"
                              f"parallel group has {p} ranks")
        self.first, self.last = self.stage == 0, self.stage == p - 1
        self.warmup = min(warmups[self.stage], num_microbatches)
        self.program = stage_program([min(w, num_microbatches) for w in warmups], self.stage,
                                     num_microbatches)
        (self.shape,) = schedules.get_tensor_shapes(
            seq_length=seq_length, micro_batch_size=micro_batch_size,
            decoder_seq_length=decoder_seq_length, config=config, tp_group=self.tp,
            cp_group=self.cp)
        # posted receives, received inputs and output gradients, (input, output) of forwards
        # awaiting their backward, input gradients awaiting their send
        self.recv_prev, self.recv_next, self.inputs, self.output_grads = {}, {}, {}, {}
        self.saved, self.input_grads = {}, {}
        self.sends, self.store = [], []

    # -- the step --------------------------------------------------------------------------------
    def run(self) -> list:
        import torch
        from megatron.core.pipeline_parallel import schedules

        config = self.config
        embedding = None
        if config.finalize_model_grads_func is not None:
            embedding = schedules.clear_embedding_activation_buffer(config, self.model, self.last)
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(
                barrier=config.barrier_with_L1_time)
        self.tokens = torch.zeros([], dtype=torch.int, device="cuda")
        self.no_sync = (config.no_sync_func or contextlib.nullcontext)()
        self.no_sync.__enter__()
        actions = {"post_recv_prev": self._post_recv_prev, "wait_prev": self._wait_prev,
                   "forward": self._forward, "send_next": self._send_next,
                   "post_recv_next": self._post_recv_next, "wait_next": self._wait_next,
                   "backward": self._backward, "send_prev": self._send_prev}
        for kind, index in self.program:
            actions[kind](index)
        for handles in self.sends:
            _wait(handles)
        if self.no_sync is not None:  # stages that did not sync in their last backward
            self._enable_grad_sync()
            if config.grad_sync_func is not None:
                config.grad_sync_func(self.model.parameters())
        if config.finalize_model_grads_func is not None:
            schedules.finish_embedding_wgrad_compute(config, embedding, self.last, self.tp)
            config.finalize_model_grads_func(
                [self.model], self.tokens if config.calculate_per_token_loss else None,
                pg_collection=self.pgs, force_all_reduce=self.force_all_reduce)
        if getattr(config, "fine_grained_activation_offloading", False):
            schedules.off_interface.reset()
        if config.timers is not None:
            config.timers("forward-backward").stop()
        return self.store

    def _enable_grad_sync(self) -> None:
        """Leave ``no_sync``: as in Megatron's 1F1B, the first stage (every stage when the config
        has no ``grad_sync_func``) does it before its last backward, so DDP reduces gradients
        during it; the other stages launch their reduction after it (``run``)."""
        self.no_sync.__exit__(None, None, None)
        self.no_sync = None

    # -- the actions of stage_program ------------------------------------------------------------
    def _post_recv_prev(self, j: int) -> None:
        self.recv_prev[j] = self.comm.send_forward_recv_forward(
            None, recv_prev=True, tensor_shape=self.shape, overlap_p2p_comm=True)

    def _wait_prev(self, j: int) -> None:
        tensor, handles = self.recv_prev.pop(j)
        _wait(handles)
        self.inputs[j] = tensor

    def _forward(self, j: int) -> None:
        from megatron.core.pipeline_parallel import schedules

        config = self.config
        partial = config.num_microbatches_with_partial_activation_checkpoints
        checkpoint = None if partial is None else j % (self.warmup + 1) >= partial
        input_tensor = self.inputs.pop(j, None)  # None on the first stage
        output, tokens = schedules.forward_step(
            self.forward_step_func, self.data_iterator, self.model, self.m, input_tensor,
            self.store, config, self.cp.size(), collect_non_loss_data=self.collect,
            checkpoint_activations_microbatch=checkpoint,
            is_first_microbatch=schedules.check_first_val_step(self.first_val_step, False, j == 0),
            current_microbatch=j, is_last_stage=self.last)
        self.tokens += tokens
        self.saved[j] = (input_tensor, output)
        if self.last:
            schedules.deallocate_output_tensor(output, config.deallocate_pipeline_outputs)

    def _send_next(self, j: int) -> None:
        from megatron.core.pipeline_parallel import schedules

        output = self.saved[j][1]
        self.sends.append(self.comm.send_forward_recv_forward(
            output, recv_prev=False, tensor_shape=self.shape, overlap_p2p_comm=True)[1])
        schedules.deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)

    def _post_recv_next(self, i: int) -> None:
        self.recv_next[i] = self.comm.send_backward_recv_backward(
            None, recv_next=True, tensor_shape=self.shape, overlap_p2p_comm=True)

    def _wait_next(self, i: int) -> None:
        tensor, handles = self.recv_next.pop(i)
        _wait(handles)
        self.output_grads[i] = tensor

    def _backward(self, i: int) -> None:
        from megatron.core.pipeline_parallel import schedules

        if i == self.m - 1 and (self.config.grad_sync_func is None or self.first):
            self._enable_grad_sync()
        input_tensor, output = self.saved.pop(i)
        grad = self.output_grads.pop(i, None)  # None on the last stage
        backward = schedules.backward_step  # looked up now: wrappers of it are seen
        if "model_type" in inspect.signature(backward).parameters:  # megatron-core 0.16
            from megatron.core.utils import get_model_type

            input_grad = backward(input_tensor, output, grad, get_model_type(self.model),
                                  self.config)
        else:
            input_grad = backward(input_tensor, output, grad, self.config)
        if not self.first:
            self.input_grads[i] = input_grad

    def _send_prev(self, i: int) -> None:
        self.sends.append(self.comm.send_backward_recv_backward(
            self.input_grads.pop(i), recv_next=False, tensor_shape=self.shape, overlap_p2p_comm=True)[1])


def _one(x, name: str):
    if isinstance(x, list):
        if len(x) != 1:
            raise HeteroError(f"the per-stage warm-up schedule runs one model chunk; got {len(x)} "
                              f"in {name}")
        return x[0]
    return x


def _wait(handles) -> None:
    for req in (handles.values() if isinstance(handles, dict) else handles or ()):
        req.wait()


def _unbatched(config):
    """``config`` for a communicator that posts one ``isend``/``irecv`` per call."""
    out = copy.copy(config)
    out.batch_p2p_comm = False
    out.batch_p2p_sync = False
    return out


def _groups(p2p_communicator, pg_collection):
    """(pp, tp, cp groups, the collection ``finalize_model_grads`` takes), as Megatron's 1F1B
    takes them: from the caller, else from ``parallel_state``."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    if (p2p_communicator is None) != (pg_collection is None):
        raise ValueError("give both p2p_communicator and pg_collection, or neither")
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups(
            required_pgs=["tp", "pp", "cp", "embd", "pos_embd", "dp_cp"])
        pp = pg_collection.pp
    else:
        if not isinstance(pg_collection, ProcessGroupCollection):
            raise HeteroError("the per-stage warm-up schedule runs one model on one pipeline "
                              f"grid; got a {type(pg_collection).__name__}")
        pp = p2p_communicator.pp_group
    return pp, pg_collection.tp, pg_collection.cp, pg_collection


def unsupported(*, variable_seq_lengths: bool = False, adjust_tensor_shapes: bool = False,
                ring_exchange: bool = False, cuda_graph_impl: str | None = None) -> list[str]:
    """What of these settings the per-stage warm-up schedule cannot run (empty: all fine)."""
    problems = []
    if variable_seq_lengths:
        problems.append("variable sequence lengths (variable_seq_lengths, MTP standalone)")
    if adjust_tensor_shapes:
        problems.append("adjusted tensor shapes (adjust_tensor_shapes_fn)")
    if ring_exchange:
        problems.append("ring-exchange p2p (use_ring_exchange_p2p)")
    if cuda_graph_impl == "local":
        problems.append("local CUDA graphs (cuda_graph_impl local)")
    return problems


def refusal(problems: list[str]) -> HeteroError:
    return HeteroError("the plan's per-stage warm-up (warmup_microbatches) runs a schedule that "
                       "does not support " + "; ".join(problems) + "; leave the warm-up to "
                       "Megatron (remove warmup_microbatches) or turn these off")


def _refuse_unsupported(config, adjust_tensor_shapes_fn) -> None:
    problems = unsupported(
        variable_seq_lengths=bool(config.variable_seq_lengths
                                  or getattr(config, "mtp_standalone", False)),
        adjust_tensor_shapes=adjust_tensor_shapes_fn is not None,
        ring_exchange=bool(config.use_ring_exchange_p2p),
        cuda_graph_impl=getattr(config, "cuda_graph_impl", None))
    if problems:
        raise refusal(problems)
