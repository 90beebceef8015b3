"""The per-micro-batch overhead of a 2-stage pipeline run through megatron-core's 1F1B schedule."""

from __future__ import annotations

import statistics

from ..cost.profile_schema import PipelineEntry, PipelineFigures, PipelineStageTimes, ProfileEntry
from ..mcore.config import torch_dtype, transformer_config
from ..mcore.model import gpt_model, wrap_ddp
from .parts import sig
from .request import ProfileRequest


def runs_pipeline(request: ProfileRequest, world: int) -> bool:
    """Whether this run measures the 2-stage pipeline: asked, an even number of ranks (two per
    pipeline) and TP=1 among the profiled sizes (the parts it is compared with)."""
    return (request.pipeline and world >= 2 and world % 2 == 0
            and 1 in request.tensor_parallel_sizes)


def measure_pipeline(rank: int, request: ProfileRequest, precision: str, device: str, timer,
                     entries: list[ProfileEntry], advance) -> PipelineFigures | None:
    """Per-micro-batch cost of running inside a pipeline, beyond the parts timed alone.

    Megatron's parallel state with PP=2, TP=1; the ranks of the first data-parallel replica build
    the two stages of a ``2 x layers`` model (the first with the embedding, the last with the
    final norm, the output layer and the loss; Megatron's DDP around each) and train them with
    megatron-core's own non-interleaved 1F1B schedule: its p2p sends and receives, its handling
    of received tensors and of outputs, ``pipeline_microbatches`` micro-batches a step, ``warmup``
    untimed and ``repeats`` timed steps. Every forward (the model call) and backward
    (``schedules.backward_step``) of a micro-batch is timed with the parts' clock. Returned on
    rank 0, per micro-batch size: each stage's median against the sum of its parts from
    ``entries`` (TP=1), and their mean difference: the overhead per micro-batch and stage."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    measured = []
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             pipeline_model_parallel_size=2)
    try:
        stage = parallel_state.get_pipeline_model_parallel_rank()
        runner = (_PipelineStage(request, precision, device, stage)
                  if parallel_state.get_data_parallel_rank() == 0 else None)
        for mbs in request.micro_batch_sizes:
            vals = torch.zeros(4, dtype=torch.float64)
            if runner is not None:
                vals[2 * stage], vals[2 * stage + 1] = runner.run(mbs, timer)
            if device == "cuda":
                vals = vals.cuda()
            dist.all_reduce(vals)  # each stage fills its own two slots
            measured.append((mbs, vals.tolist()))
            advance(f"pipeline mbs={mbs}")
        del runner
    finally:
        parallel_state.destroy_model_parallel()
    if rank != 0:
        return None
    tp1 = {e.micro_batch_size: e for e in entries if e.tensor_parallel_size == 1}
    n = request.layers
    rows = []
    for mbs, (f0, b0, f1, b1) in measured:
        e = tp1[mbs]
        first = PipelineStageTimes(
            forward_s=sig(f0), backward_s=sig(b0),
            parts_forward_s=sig(e.embedding.forward_s + n * e.layer.forward_s),
            parts_backward_s=sig(e.embedding.backward_s + n * e.layer.backward_s))
        last = PipelineStageTimes(
            forward_s=sig(f1), backward_s=sig(b1),
            parts_forward_s=sig(n * e.layer.forward_s + e.output.forward_s),
            parts_backward_s=sig(n * e.layer.backward_s + e.output.backward_s))
        rows.append(PipelineEntry(
            micro_batch_size=mbs, tensor_parallel_size=1, first=first, last=last,
            forward_overhead_s=sig(((f0 - first.parts_forward_s)
                                     + (f1 - last.parts_forward_s)) / 2),
            backward_overhead_s=sig(((b0 - first.parts_backward_s)
                                      + (b1 - last.parts_backward_s)) / 2)))
    return PipelineFigures(stages=2, layers_per_stage=n,
                           microbatches=request.pipeline_microbatches, entries=rows)


class _PipelineStage:
    """One stage of the profiler's 2-stage pipeline (see :func:`measure_pipeline`)."""

    def __init__(self, request: ProfileRequest, precision: str, device: str, stage: int):
        import torch
        from megatron.core import tensor_parallel

        m = request.model
        self.request, self.device, self.model_spec = request, device, m
        self.dtype = torch_dtype(precision)
        config = transformer_config(m, num_layers=2 * request.layers, pipeline_parallel_size=2,
                                    precision=precision, cpu_initialization=device == "cpu")
        torch.manual_seed(1234)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        gpt = gpt_model(m, config, pre_process=stage == 0, post_process=stage == 1,
                        device=device)
        if device == "cuda":
            gpt = gpt.cuda()
        gpt = gpt.to(self.dtype)
        (self.ddp,) = wrap_ddp([gpt])

    def run(self, mbs: int, timer) -> tuple[float, float]:
        """Median (forward, backward) seconds of one micro-batch on this stage."""
        import torch
        from megatron.core.pipeline_parallel import schedules

        m, r = self.model_spec, self.request
        dev = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" \
            else torch.device("cpu")
        gen = torch.Generator(device="cpu").manual_seed(mbs)
        tokens = torch.randint(0, m.vocab_size, (mbs, m.seq_length), generator=gen).to(dev)
        labels = torch.randint(0, m.vocab_size, (mbs, m.seq_length), generator=gen).to(dev)
        positions = torch.arange(m.seq_length, device=dev).unsqueeze(0).expand(mbs, -1)
        fwd: list[float] = []
        bwd: list[float] = []

        def loss_func(output):
            loss = output.float().sum()
            return loss, {"loss": loss.detach()}

        def forward_step(data_iterator, model_chunk):
            next(data_iterator)
            t, out = timer(lambda: model_chunk(tokens, positions, None, labels=labels))
            fwd.append(t)
            return out, loss_func

        original = schedules.backward_step

        def backward_step(*args, **kwargs):
            t, out = timer(lambda: original(*args, **kwargs))
            bwd.append(t)
            return out

        schedules.backward_step = backward_step
        try:
            n = r.pipeline_microbatches
            for i in range(r.warmup + r.repeats):
                if i == r.warmup:
                    fwd.clear()
                    bwd.clear()
                self.ddp.zero_grad_buffer()
                schedules.forward_backward_pipelining_without_interleaving(
                    forward_step_func=forward_step, data_iterator=iter(range(n)),
                    model=[self.ddp], num_microbatches=n, seq_length=m.seq_length,
                    micro_batch_size=mbs, forward_only=False)
        finally:
            schedules.backward_step = original
        return statistics.median(fwd), statistics.median(bwd)

