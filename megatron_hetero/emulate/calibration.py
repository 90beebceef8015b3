"""Calibration of the emulated cluster: what the CPU and gloo achieve on the shrunk model.

:func:`calibrate` runs on two CPU processes: gloo's point-to-point latency and bandwidth and
all-reduce bandwidth between them, then the CPU seconds of one forward and backward of the
shrunk layer, embedding and output layer, the bytes a layer saves for the backward pass and the
optimizer step's rate (:class:`Calibration`), optionally after the idle gaps of a stretched rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field

from ..models import layer_forward_flops, mixed_model, moe_fraction
from ..plan import Mesh, ModelSpec, Pipeline, Plan, Stage

__all__ = ["Calibration", "calibrate", "activation_scale", "idle_gap"]


@dataclass(kw_only=True, slots=True)
class Calibration:
    """What the CPU achieves on the shrunk model: the base of every emulated device."""

    parts: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    """(part, micro-batch size) -> CPU seconds of (forward, backward) of one micro-batch."""
    layer_flops_per_s: float = 0.0
    """FLOP/s the CPU achieves on the shrunk layer (forward + backward)."""
    p2p_latency_s: float = 50e-6
    """One gloo point-to-point message, one way (measured by the ranks at start)."""
    bandwidth_gb_s: float = 1.0
    """gloo point-to-point bandwidth between two ranks of this machine (measured at start)."""
    allreduce_gb_s: float = 1.0
    """Bus bandwidth of a 2-rank gloo all-reduce (bytes / seconds): what gradient sync sees."""
    layer_activation_bytes: dict[int, float] = field(default_factory=dict)
    """Micro-batch size -> bytes one shrunk layer saves for the backward pass, as measured."""
    optimizer_gb_s: float = 5.0
    """Bytes the optimizer step touches per second (24 per fp32 Adam parameter, clipping and
    megatron's bookkeeping included): the emulated devices' memory bandwidth."""
    pipeline_overhead: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Micro-batch size -> CPU seconds of (forward, backward) a pipeline stage pays per
    micro-batch beyond its parts (a profile's ``pipeline`` figures); empty: none measured."""
    step_overhead: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Micro-batch size -> CPU seconds of (forward, backward) every stage step pays once per
    micro-batch for following an idle gap (the rank's stretch sleep) rather than other work;
    empty: none measured."""


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _ping_pong(rank: int, size_bytes: int, reps: int) -> float:
    """Seconds of one one-way gloo message of ``size_bytes`` between ranks 0 and 1."""
    import time

    import torch
    import torch.distributed as dist

    buf = torch.zeros(max(1, size_bytes // 4))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append((time.perf_counter() - t0) / 2)
    return min(times)  # the uncontended figure: other processes may share these cores


def _calibrate_rank(rank: int, world_size: int, shrunk: Plan, reps: int, seed: int,
                    meter: bool, nice: int = 0, idle_factor: float = 0.0) -> Calibration | None:
    """Runs in a 2-rank gloo group: both measure gloo p2p, then rank 0 times the model parts."""
    _renice(nice)
    import torch.distributed as dist

    out = Calibration()
    _measure_gloo(rank, out)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    from ..mcore.cpu_backend import enable_cpu_backend
    from ..mcore.spawn import free_port

    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    enable_cpu_backend()
    for b in sorted({p.micro_batch_size for m in shrunk.meshes for p in m.pipelines}):
        timed = [(share, *(_time_layers(shrunk, kind, b, n, reps=reps, seed=seed, meter=meter,
                                        idle_factor=idle_factor) for n in (1, 3)))
                 for kind, share in layer_kinds(shrunk.model)]
        _, one, three = timed[0]  # the embedding, the output layer, the optimizer: the first
        out.optimizer_gb_s = three.optimizer_gb_s
        if three.idle is not None:
            out.step_overhead[b] = (three.idle[0] - three.times[0],
                                    three.idle[1] - three.times[1])
        emb = out.parts[("embedding", b)] = one.embedding
        per = [(share, [max(1e-6, (t3.times[i] - t1.times[i]) / 2) for i in (0, 1)],
                (t3.saved_bytes - t1.saved_bytes) / 2) for share, t1, t3 in timed]
        lf, lb = (sum(share * layer[i] for share, layer, _ in per) for i in (0, 1))
        out.parts[("layer", b)] = (lf, lb)
        own = per[0][1]  # the first kind's own layer, inside its one-layer model
        out.parts[("output", b)] = (max(0.0, one.times[0] - own[0] - emb[0]),
                                    max(0.0, one.times[1] - own[1] - emb[1]))
        out.layer_flops_per_s = 3 * layer_forward_flops(shrunk.model, b) / (lf + lb)
        if meter:
            out.layer_activation_bytes[b] = max(0, sum(share * saved for share, _, saved in per))
    return out


def layer_kinds(model: ModelSpec) -> list[tuple[ModelSpec, float]]:
    """The kinds of layer calibration times, each as a model of those layers alone, with its
    share of the model's layers: the model's own layer, or of a model that mixes MoE and dense
    layers (``moe_layer_freq`` other than 1) its MoE layer and its dense layer (a layer is
    priced at their mean)."""
    if not model.is_moe:
        return [(model, 1.0)]
    moe = dataclasses.replace(model, moe_layer_freq=1)
    f = moe_fraction(model)
    return [(moe, 1.0)] if f == 1.0 else [(moe, f), (mixed_model(model, 0, 1), 1.0 - f)]


def _measure_gloo(rank: int, out: Calibration) -> None:
    """gloo's point-to-point latency and bandwidth and its all-reduce bandwidth between the two
    ranks, into ``out``."""
    import torch

    small, large = 4096, 4 << 20
    _ping_pong(rank, large, 2)
    lat = _ping_pong(rank, small, 30)
    big = _ping_pong(rank, large, 7)
    out.p2p_latency_s = lat
    out.bandwidth_gb_s = large / max(big - lat, 1e-7) / 1e9
    out.allreduce_gb_s = large / _all_reduce_seconds(torch.zeros(large // 4), 6) / 1e9


@dataclass(frozen=True, kw_only=True, slots=True)
class _Timed:
    """What :func:`_time_layers` measured on a model of ``n`` layers (medians past 2 warm-ups)."""

    times: tuple[float, float]
    """CPU seconds of (forward, backward) of one micro-batch through the whole model."""
    saved_bytes: float
    """Bytes the forward saved for the backward (0 unless metered)."""
    idle: tuple[float, float] | None
    """The same after an idle gap as on a stretched rank (3 layers with an idle factor)."""
    embedding: tuple[float, float] | None
    """(forward, backward) of the embedding alone (1 layer)."""
    optimizer_gb_s: float | None
    """Bytes the Adam step touches per second (3 layers)."""


def _time_layers(shrunk: Plan, kind: ModelSpec, b: int, n: int, *, reps: int, seed: int,
                 meter: bool, idle_factor: float) -> _Timed:
    """Time ``n`` layers of ``kind`` (of :func:`layer_kinds` of the shrunk model), micro-batch
    size ``b``, on this single rank."""
    import time

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from ..mcore.config import plan_transformer_config
    from ..mcore.model import gpt_model, wrap_ddp
    from .memory import MemoryMeter
    from .trainer import micro_batches

    device = shrunk.meshes[0].pipelines[0].stages[0].device_type
    plan = dataclasses.replace(  # one process: n layers of the shrunk model, TP 1
        shrunk, model=dataclasses.replace(kind, num_layers=n), global_batch_size=b,
        sequence_parallel=False, virtual_pipeline_size=1, microbatch_group_size=None,
        meshes=[Mesh(tensor_model_parallel_size=1, pipelines=[Pipeline(
            micro_batch_size=b, num_microbatches=1,
            stages=[Stage(device_type=device, num_layers=n)])])])
    clock = time.thread_time
    fw, bw, ef, eb, idle_fw, idle_bw = [], [], [], [], [], []
    optimizer_gb_s = None
    ps.initialize_model_parallel(1, 1)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        model = gpt_model(plan.model, plan_transformer_config(plan, plan.pipelines[0].stages[0]))
        (ddp,) = wrap_ddp([model])
        meter_of = MemoryMeter(rank=0, pipeline=0, stage=0, device_type="")
        batch = next(micro_batches(plan, plan.slot_of_rank(0), 0, seed))
        metered = meter_of.saved_activations if meter else contextlib.nullcontext
        held = [0]  # bytes the forward saved for the backward (read before it runs)

        def timed_step(idle_after: float | None = None) -> tuple[float, float]:
            """(forward, backward) CPU seconds of one micro-batch; with ``idle_after``, each
            of the two follows an idle gap as on a stretched rank (the first gap
            ``idle_factor`` times ``idle_after``, the second times the forward)."""
            if idle_after is not None:
                idle_gap(idle_factor, idle_after)
            t0 = clock()
            with metered():
                loss = ddp(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            t1 = clock()
            held[0] = meter_of.activation_bytes
            if idle_after is not None:
                idle_gap(idle_factor, t1 - t0)
            t1b = clock()
            loss.sum().backward()
            return t1 - t0, clock() - t1b

        for _ in range(reps + 2):
            f, k = timed_step()
            saved = held[0]
            fw.append(f)
            bw.append(k)
            if n == 3 and idle_factor > 0:
                # the same step after an idle gap, as a stretched rank runs it; the next
                # round's back-to-back step follows this one's work
                f, k = timed_step(idle_after=k)
                idle_fw.append(f)
                idle_bw.append(k)
            if n == 1:
                t0 = clock()
                with metered():
                    emb = model.embedding(input_ids=batch["tokens"],
                                          position_ids=batch["position_ids"])
                t1 = clock()
                emb.sum().backward()
                eb.append(clock() - t1)
                ef.append(t1 - t0)
                del emb
        if n == 3:
            optimizer_gb_s = _optimizer_gb_s(model, ddp, reps)
    finally:
        ps.destroy_model_parallel()
    return _Timed(times=(_median(fw[2:]), _median(bw[2:])), saved_bytes=saved,
                  idle=(_median(idle_fw[2:]), _median(idle_bw[2:])) if idle_fw else None,
                  embedding=(_median(ef[2:]), _median(eb[2:])) if ef else None,
                  optimizer_gb_s=optimizer_gb_s)


def _optimizer_gb_s(model, ddp, reps: int) -> float:
    """Bytes per second of Megatron's fp32 Adam step on ``model`` (24 bytes a parameter)."""
    import time

    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0, bf16=False, fp16=False,
                        params_dtype=torch.float32, use_distributed_optimizer=False), [ddp])
    steps = []
    for _ in range(reps + 2):
        t0 = time.thread_time()
        optimizer.step()
        steps.append(time.thread_time() - t0)
    params = sum(p.numel() for p in model.parameters())
    return 24 * params / _median(steps[2:]) / 1e9


def idle_gap(idle_factor: float, seconds: float) -> None:
    """Sleep ``idle_factor`` times ``seconds``: the gap a rank stretched by ``idle_factor + 1``
    leaves after a step of ``seconds``."""
    if idle_factor > 0 and seconds > 0:
        import time
        time.sleep(idle_factor * seconds)


def calibrate(shrunk: Plan, *, reps: int = 5, seed: int = 1234, meter: bool = True,
              timeout_s: float = 120.0, nice: int = 0, idle_factor: float = 0.0) -> Calibration:
    """Measure what the emulated cluster is made of, on two CPU processes: the gloo
    point-to-point latency and bandwidth between them, and the CPU seconds (thread CPU time, one
    thread, as the ranks run, under the same activation accounting when ``meter``) of one
    micro-batch's forward and backward through the shrunk layer (difference of a 1-layer and a
    3-layer model), embedding and output layer with its loss, at each micro-batch size of the
    plan. ``idle_factor`` > 0: also the CPU seconds a step (the 3-layer model's forward, its
    backward) costs more after an idle gap of that many times its duration than back to back,
    as the speed emulation runs every step of a rank (``Calibration.step_overhead``; see
    docs/calibration.md)."""
    from ..mcore.spawn import spawn

    return spawn(_calibrate_rank, 2, args=(shrunk, reps, seed, meter, nice, idle_factor),
                 timeout_s=timeout_s)[0]


def _all_reduce_seconds(buf, tries: int) -> float:
    """Fastest of ``tries - 1`` timed all-reduces of ``buf`` over the world (the first warms up)."""
    import time

    import torch.distributed as dist

    times = []
    for _ in range(tries):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def _renice(nice: int) -> None:
    if nice:
        try:
            os.nice(nice)
        except OSError:  # lowering the nice value needs privileges; run at the default then
            pass


def activation_scale(shrunk: Plan, calibration: Calibration) -> float:
    """Measured over estimated (fp32, unfused attention) activation bytes of one shrunk layer."""
    from ..models import layer_activation_bytes

    ratios = [measured / (2 * layer_activation_bytes(shrunk.model, b, 1, "none",
                                                     flash_attention=False))
              for b, measured in calibration.layer_activation_bytes.items() if measured > 0]
    return max(ratios) if ratios else 1.0
