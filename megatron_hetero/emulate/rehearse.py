"""Rehearse a plan on this machine: one CPU process per plan rank, each playing its GPU type.

``megatron-hetero rehearse PLAN`` (see :func:`rehearse_main`):

1. *Shrink* the model in width (:func:`shrink_model`): hidden size, heads, FFN, vocabulary and
   sequence scale down together (FFN, vocabulary and sequence keep their ratio to the hidden
   size, so layers, output layer and attention keep their relative costs); the layer count, the
   layer split, the micro-batch sizes and counts stay as in the plan.
2. *Refuse* a plan this machine cannot host (:func:`check_host_capacity`): more than
   :data:`MAX_RANKS` ranks, or more estimated memory than is available.
3. *Calibrate*, on two CPU processes, what the emulated cluster is made of: the CPU time of one
   forward and backward of the shrunk layer, embedding and output layer, the bytes a layer
   saves for the backward pass, the optimizer step's rate, and gloo's point-to-point latency and
   bandwidth and all-reduce bandwidth; the emulated device ``d`` then computes at
   ``cpu speed / factor(d)`` (:mod:`.speed`).
4. *Run* N steps on the CPU ranks under the speed and memory emulation (:mod:`.speed`,
   :mod:`.memory`); the first step is a warm-up and is not reported.
5. *Predict* the same emulated setup with the tuner's cost model and simulator, over an
   inventory whose custom GPU entries are these emulated devices, and print both side by side.
   The CPU's speed drifts between the calibration and the run on a shared machine, so the
   calibrated compute is rescaled by one factor, the CPU time the ranks' compute measured over
   what the calibration expected for it (both predictions are reported).

``--verify`` also trains the same model, data and seed in one process and compares losses and
final parameters (fp32, rtol 1e-5, atol 1e-5: 1% of an Adam step); it names the first diverging
step and tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from dataclasses import dataclass, field

from ..errors import HeteroError
from ..hardware.catalog import Catalog, load_catalog
from ..plan import ModelSpec, Pipeline, Plan, Stage, plan_from_data

__all__ = ["RehearsalConfig", "Calibration", "shrink_model", "shrink_plan", "check_host_capacity",
           "calibrate", "predict", "emulated_cluster", "emulated_name", "rehearse",
           "format_report", "rehearse_main", "RehearsalResult", "StageReport", "MAX_RANKS",
           "RANK_OVERHEAD_BYTES"]

MAX_RANKS = 16
"""Most CPU ranks a rehearsal starts on one machine."""
RANK_OVERHEAD_BYTES = 0.6e9
"""Host memory of one rank before its model: Python, torch, megatron-core, gloo."""


@dataclass(kw_only=True, slots=True)
class RehearsalConfig:
    """How to rehearse a plan."""

    steps: int = 3
    """Training steps; the first is a warm-up and is not reported."""
    hidden_size: int = 64
    """Hidden size of the shrunk model (heads, FFN, vocabulary and sequence follow)."""
    time_scale: float | None = None
    """Extra slowdown of every emulated device (see :mod:`.speed`); None picks the smallest
    that keeps the ranks' compute within 70% of this machine's cores (:func:`auto_time_scale`)."""
    memory_cap: bool = True
    """Cap each rank's memory to its device's memory scaled with the model (see :mod:`.memory`)."""
    meter_memory: bool = True
    """Count each rank's saved activations (the report's memory peak; needed by the cap). The
    accounting is Python work inside every stretched step (about 4 us per saved tensor);
    calibration runs turn it off, with the cap, so that the ranks run only the model."""
    seed: int = 1234
    nice: int = 0
    """``os.nice`` increment of the rank processes (negative, as root, shields the emulated
    timing from other work on a busy machine)."""
    max_ranks: int = MAX_RANKS
    timeout_s: float = 600.0
    """Hard limit on the whole multi-process run."""

    def __post_init__(self) -> None:
        if self.steps < 2:
            raise ValueError(f"steps must be at least 2 (the first is a warm-up), got {self.steps}")
        if self.hidden_size < 8:
            raise ValueError(f"hidden_size must be at least 8, got {self.hidden_size}")
        if self.time_scale is not None and self.time_scale < 1:
            raise ValueError(f"time_scale must be >= 1, got {self.time_scale}")


# -- shrinking ------------------------------------------------------------------------------------

def _round_to(x: float, unit: int) -> int:
    return max(unit, int(round(x / unit)) * unit)


def shrink_model(m: ModelSpec, hidden_size: int, tp: int = 1) -> ModelSpec:
    """``m`` shrunk in width to ``hidden_size``: heads keep a head size of at least 8 and the
    model's query-group ratio where they can; FFN, vocabulary and sequence keep their ratio to the
    hidden size. Layer count and everything else stay. A model no wider than ``hidden_size``
    is returned unchanged."""
    if hidden_size >= m.hidden_size:
        return m
    h = hidden_size
    r = h / m.hidden_size
    gqa = m.num_attention_heads // m.num_query_groups
    heads = groups = None
    for n in range(min(m.num_attention_heads, max(h // 8, 1)), 0, -1):
        if h % n or n % tp or (h // n) % 2:  # rope needs an even size per head
            continue
        g = n // gqa if n % gqa == 0 and (n // gqa) % tp == 0 else n
        heads, groups = n, g
        break
    if heads is None:
        raise HeteroError(f"--hidden-size {h}: no head count divides it into even head sizes "
                          f"and is divisible by the tensor-parallel size {tp}; use a multiple of "
                          f"{8 * tp}")
    return dataclasses.replace(
        m, name=f"{m.name}-shrunk-h{h}", hidden_size=h, num_attention_heads=heads,
        num_query_groups=groups, ffn_hidden_size=_round_to(m.ffn_hidden_size * r, 8 * tp),
        vocab_size=_round_to(m.vocab_size * r, 16 * tp),
        seq_length=min(m.seq_length, max(16, _round_to(m.seq_length * r, 8))))


def shrink_plan(plan: Plan, hidden_size: int, catalog: Catalog | None = None) -> Plan:
    """The same plan (devices, layer split, micro-batches, policies) on the shrunk model."""
    data = plan.to_data()
    data["model"] = dataclasses.asdict(shrink_model(plan.model, hidden_size,
                                                    plan.tensor_model_parallel_size))
    data.pop("prediction", None)
    return plan_from_data(data, source="<shrunk plan>", catalog=catalog)


def without_module_inputs(plan: Plan, catalog: Catalog | None = None
                          ) -> tuple[Plan, list[tuple[int, int]]]:
    """``plan`` with every stage's ``offload.module_inputs`` off, and the (pipeline, stage) slots
    that had it. megatron-core's fine-grained activation offloading copies on CUDA streams and
    runs through Transformer Engine: the CPU ranks keep those tensors. (Their memory caps still
    count them as offloaded: :func:`.memory.memory_caps` scales the real plan's estimate, with
    the offload, to the shrunk plan's as the CPU runs it, without.)"""
    slots = [(d, s) for d, pipe in enumerate(plan.pipelines)
             for s, stage in enumerate(pipe.stages) if stage.offload.module_inputs]
    if not slots:
        return plan, []
    data = plan.to_data()
    for d, s in slots:
        data["pipelines"][d]["stages"][s]["offload"]["module_inputs"] = False
    return (plan_from_data(data, source="<rehearsed plan>", catalog=catalog or plan.catalog),
            slots)


# -- what this machine can host -------------------------------------------------------------------

def _available_bytes() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def check_host_capacity(shrunk: Plan, *, max_ranks: int = MAX_RANKS, source: str = "PLAN",
                        catalog: Catalog | None = None) -> float:
    """Refuse a plan this machine cannot host; returns the estimated host bytes."""
    from .memory import cpu_rank_bytes

    n = shrunk.world_size
    hint = ("rehearse a smaller plan (fewer pipelines or stages: the layer split and micro-batch "
            "shares are what the rehearsal checks), or a lower --hidden-size")
    if n > max_ranks:
        raise HeteroError(f"{source}: the plan has {n} ranks; this rehearsal starts at most "
                          f"{max_ranks} CPU processes on one machine: {hint}")
    need = n * RANK_OVERHEAD_BYTES + sum(cpu_rank_bytes(shrunk, catalog).values())
    have = _available_bytes()
    if need > have:
        raise HeteroError(f"{source}: rehearsing {n} ranks at hidden size "
                          f"{shrunk.model.hidden_size} needs about {need / 1e9:.1f} GB of host "
                          f"memory; {have / 1e9:.1f} GB is available: {hint}")
    return need


# -- calibration of the emulated cluster ----------------------------------------------------------

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
    import time

    import torch
    import torch.distributed as dist

    out = Calibration()
    small, large = 4096, 4 << 20
    _ping_pong(rank, large, 2)
    lat = _ping_pong(rank, small, 30)
    big = _ping_pong(rank, large, 7)
    out.p2p_latency_s = lat
    out.bandwidth_gb_s = large / max(big - lat, 1e-7) / 1e9
    out.allreduce_gb_s = large / _all_reduce_seconds(torch.zeros(large // 4), 6) / 1e9
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    from .spawn import free_port
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from ..models import layer_forward_flops
    from . import trainer
    from .cpu_backend import enable_cpu_backend
    from .memory import MemoryMeter

    enable_cpu_backend()
    m = shrunk.model
    clock = time.thread_time
    for b in sorted({p.micro_batch_size for p in shrunk.pipelines}):
        totals, acts = {}, {}
        for n in (1, 3):
            plan = dataclasses.replace(
                shrunk, model=dataclasses.replace(m, num_layers=n), tensor_model_parallel_size=1,
                sequence_parallel=False, virtual_pipeline_size=1,
                global_batch_size=b, pipelines=[Pipeline(
                    micro_batch_size=b, num_microbatches=1,
                    stages=[Stage(device_type=shrunk.pipelines[0].stages[0].device_type,
                                  num_layers=n)])])
            fw, bw, ef, eb, idle_fw, idle_bw = [], [], [], [], [], []
            ps.initialize_model_parallel(1, 1)
            try:
                tensor_parallel.model_parallel_cuda_manual_seed(seed)
                tconf = trainer._transformer_config(plan, plan.pipelines[0].stages[0])
                model = GPTModel(config=tconf, transformer_layer_spec=get_gpt_layer_local_spec(
                                     normalization=m.normalization),
                                 vocab_size=m.vocab_size, max_sequence_length=m.seq_length,
                                 pre_process=True, post_process=True,
                                 share_embeddings_and_output_weights=(
                                     not m.untie_embeddings_and_output_weights),
                                 position_embedding_type=m.position_embedding_type)
                ddp = DistributedDataParallel(
                    config=tconf, module=model,
                    ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                             use_distributed_optimizer=False))
                mm = MemoryMeter(rank=0, pipeline=0, stage=0, device_type="")
                batch = next(trainer._micro_batches(plan, 0, 0, seed))

                def timed_step(idle_after: float | None = None) -> tuple[float, float]:
                    """(forward, backward) CPU seconds of one micro-batch; with ``idle_after``,
                    each of the two follows an idle gap as on a stretched rank (the first gap
                    ``idle_factor`` times ``idle_after``, the second times the forward)."""
                    if idle_after is not None:
                        _idle(idle_factor, idle_after)
                    ctx = mm.saved_activations() if meter else contextlib.nullcontext()
                    t0 = clock()
                    with ctx:
                        loss = ddp(batch["tokens"], batch["position_ids"], None,
                                   labels=batch["labels"])
                    t1 = clock()
                    if idle_after is not None:
                        _idle(idle_factor, t1 - t0)
                    t1b = clock()
                    loss.sum().backward()
                    t2 = clock()
                    return t1 - t0, t2 - t1b

                for _ in range(reps + 2):
                    f, k = timed_step()
                    saved = mm.activation_bytes
                    fw.append(f)
                    bw.append(k)
                    if n == 3 and idle_factor > 0:
                        # the same step after an idle gap, as a stretched rank runs it; the
                        # next round's back-to-back step follows this one's work
                        f, k = timed_step(idle_after=k)
                        idle_fw.append(f)
                        idle_bw.append(k)
                    if n == 1:
                        t0 = clock()
                        with (mm.saved_activations() if meter else contextlib.nullcontext()):
                            emb = model.embedding(input_ids=batch["tokens"],
                                                  position_ids=batch["position_ids"])
                        t1 = clock()
                        emb.sum().backward()
                        t2 = clock()
                        del emb
                        ef.append(t1 - t0)
                        eb.append(t2 - t1)
                if n == 3:
                    optimizer = get_megatron_optimizer(
                        OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0, bf16=False,
                                        fp16=False, params_dtype=torch.float32,
                                        use_distributed_optimizer=False), [ddp])
                    steps = []
                    for _ in range(reps + 2):
                        t0 = clock()
                        optimizer.step()
                        steps.append(clock() - t0)
                    params = sum(p.numel() for p in model.parameters())
                    out.optimizer_gb_s = 24 * params / _median(steps[2:]) / 1e9
            finally:
                ps.destroy_model_parallel()
            totals[n] = (_median(fw[2:]), _median(bw[2:]))
            if idle_fw:
                out.step_overhead[b] = (_median(idle_fw[2:]) - totals[n][0],
                                        _median(idle_bw[2:]) - totals[n][1])
            acts[n] = saved
            if n == 1:
                out.parts[("embedding", b)] = (_median(ef[2:]), _median(eb[2:]))
        lf = max(1e-6, (totals[3][0] - totals[1][0]) / 2)
        lb = max(1e-6, (totals[3][1] - totals[1][1]) / 2)
        out.parts[("layer", b)] = (lf, lb)
        ef_, eb_ = out.parts[("embedding", b)]
        out.parts[("output", b)] = (max(0.0, totals[1][0] - lf - ef_),
                                    max(0.0, totals[1][1] - lb - eb_))
        out.layer_flops_per_s = 3 * layer_forward_flops(m, b) / (lf + lb)
        if meter:
            out.layer_activation_bytes[b] = max(0, acts[3] - acts[1]) / 2
    return out


def _idle(idle_factor: float, seconds: float) -> None:
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
    from .spawn import spawn

    return spawn(_calibrate_rank, 2, args=(shrunk, reps, seed, meter, nice, idle_factor),
                 timeout_s=timeout_s)[0]

# -- prediction of the emulated cluster -----------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class _EmulatedProfile:
    """A :class:`~megatron_hetero.cost.profile_protocol.DeviceProfile` of one emulated device:
    the CPU's calibrated times stretched by the device's factor."""

    device_type: str
    factor: float
    calibration: Calibration
    efficiency: float | None = None

    def times(self, part, *, model, micro_batch_size, tensor_parallel_size):
        got = self.calibration.parts.get((part, micro_batch_size))
        if got is None:
            return None
        return (got[0] * self.factor / tensor_parallel_size,
                got[1] * self.factor / tensor_parallel_size)

    def pipeline_overhead(self, *, model, micro_batch_size, tensor_parallel_size):
        got = self.calibration.pipeline_overhead.get(micro_batch_size)
        if got is None:
            return None
        return (max(0.0, got[0]) * self.factor, max(0.0, got[1]) * self.factor)

    def step_overhead(self, *, model, micro_batch_size, tensor_parallel_size):
        got = self.calibration.step_overhead.get(micro_batch_size)
        if got is None:
            return None
        return (max(0.0, got[0]) * self.factor, max(0.0, got[1]) * self.factor)


def trainer_shards_optimizer(plan: Plan) -> bool:
    """Whether the mini trainer runs ``plan`` with Megatron's distributed optimizer (the CPU
    ranks then shard the optimizer state; the prediction and the caps must know)."""
    from .trainer import TrainConfig

    if "use_distributed_optimizer" not in TrainConfig.__dataclass_fields__:
        return False  # a trainer that always runs the plain optimizer
    choice = TrainConfig().use_distributed_optimizer  # the rehearsal keeps the trainer's default
    return plan.use_distributed_optimizer if choice is None else bool(choice)


def emulated_name(device_type: str) -> str:
    return f"CPU-as-{device_type}"


def _per_device(calibration, devices, factors: dict[str, float]) -> tuple[dict, Calibration]:
    """(device -> Calibration, the fastest device's) from one Calibration for all devices or a
    mapping with one per device type (each timed with that device's idle gaps)."""
    if isinstance(calibration, Calibration):
        per = {d: calibration for d in devices}
    else:
        per = {d: calibration[d] for d in devices}
    fastest = min(per, key=lambda d: (factors[d], d))
    return per, per[fastest]


def emulated_cluster(device_counts: dict[str, int], calibration,
                     factors: dict[str, float], *, gpus_per_node: int | None = None):
    """(inventory, profiles, cost-model options) of the emulated cluster: one GPU type
    ``CPU-as-<device>`` per device type, at the calibrated CPU speed over the device's factor,
    linked by gloo as measured (all-reduce bandwidth; point-to-point latency), optimizer steps at
    the measured rate; ``device_counts`` GPUs of each, ``gpus_per_node`` to a node (all in one
    node by default; 1 keeps a search from using tensor parallelism). The optimizer step and
    the gradient sync are not stretched: the ranks run them at CPU speed. ``calibration``: one
    :class:`Calibration`, or one per device type (its compute figures are that device's; links
    and the optimizer's rate are the fastest device's)."""
    from ..hardware.inventory import inventory_from_data

    per_device, calibration = _per_device(calibration, device_counts, factors)
    bw = calibration.allreduce_gb_s
    memory_bandwidth_gb_s = calibration.optimizer_gb_s
    gpus, groups = {}, []
    for device, count in sorted(device_counts.items()):
        name = emulated_name(device)
        flops = per_device[device].layer_flops_per_s / factors[device] / 1e12
        gpus[name] = {"vendor": "CPU", "bf16_tflops": flops, "bf16": True, "fp32_tflops": flops,
                      "memory_gb": 1e3, "memory_bandwidth_gb_s": memory_bandwidth_gb_s,
                      "intra_node_link": "gloo", "intra_node_bandwidth_gb_s": bw,
                      "efficiency": 1.0}
        per = min(gpus_per_node or count, count)
        groups.append({"gpu": name, "nodes": -(-count // per), "gpus_per_node": per,
                       "inter_node_bandwidth_gb_s": bw})
    inventory = inventory_from_data({"groups": groups, "gpus": gpus,
                                     "inter_group_bandwidth_gb_s": bw},
                                    source="<emulated cluster>")
    profiles = {emulated_name(d): _EmulatedProfile(device_type=emulated_name(d), factor=f,
                                                   calibration=per_device[d])
                for d, f in factors.items() if d in device_counts}
    options = {"flash_attention": False, "workspace_gb": 0.0,
               "p2p_latency_s": calibration.p2p_latency_s}
    return inventory, profiles, options


def predict(shrunk: Plan, calibration, factors: dict[str, float]):
    """The tuner's cost model and simulator on the emulated cluster (:func:`emulated_cluster`)
    for ``shrunk`` as the CPU ranks run it (fp32); ``calibration``: one :class:`Calibration` or
    one per device type. Returns a ``SimResult``."""
    from ..cost.model import CostModel
    from ..simulate import simulate

    inventory, profiles, options = emulated_cluster(dict(shrunk.device_counts()), calibration,
                                                    factors)
    data = shrunk.to_data()
    data["precision"] = "fp32"
    for pipe in data["pipelines"]:
        for st in pipe["stages"]:
            st["device_type"] = emulated_name(st["device_type"])
    emu = plan_from_data(data, source="<emulated plan>", catalog=inventory.catalog)
    cost = CostModel(emu.model, inventory, profiles=profiles, precision="fp32",
                     use_distributed_optimizer=trainer_shards_optimizer(shrunk), **options)
    return simulate(emu, cost, record_events=False)


# -- the ranks ------------------------------------------------------------------------------------

_CORRUPT_ENV = "MEGATRON_HETERO_TEST_CORRUPT_PIPELINE"
"""Test-only hook: when set to ``d``, data-parallel replica ``d`` reads wrong labels from step 1
on, so that ``--verify`` has a real divergence to catch."""


class _RankEmulation:
    """Speed and memory emulation of one rank, as :class:`~.trainer.RankHooks`."""

    def __init__(self, speed, meter):
        self.speed, self.meter = speed, meter
        self.busy: list[float] = []
        self.cpu: list[float] = []
        self.drift: list[float] = []
        self.sync: list[float] = []
        self._last = (0.0, 0.0, 0.0)

    @contextlib.contextmanager
    def compute(self, kind: str):
        # backward too: a recomputing stage saves its recomputed activations there
        ctx = self.meter.saved_activations() if self.meter is not None else contextlib.nullcontext()
        with self.speed.step(), ctx:
            yield

    def on_step_end(self, step: int, wall_s: float) -> None:
        sp = self.speed
        self.busy.append(sp.busy_s - self._last[0])
        self.cpu.append(sp.cpu_s - self._last[1])
        self.drift.append(sp.drift_s)
        if step == 0:
            sp.drift_s = 0.0  # one-time costs of the warm-up are not carried into the next steps
        self.sync.append(self._sync_total - self._last[2])
        self._last = (sp.busy_s, sp.cpu_s, self._sync_total)
        if self.meter is not None and self._built is not None:
            self.meter.count_static(*self._built)  # the optimizer state exists after a step

    _built = None
    allreduce_gb_s = None

    def on_built(self, model_chunks, optimizer) -> None:
        self._built = (model_chunks, optimizer)
        if self.meter is not None:
            self.meter.count_static(model_chunks, optimizer)
        # time the gradient sync and the optimizer step (neither is stretched)
        for chunk in model_chunks:
            chunk.finish_grad_sync = self._timed(chunk.finish_grad_sync)
        optimizer.step = self._timed(optimizer.step)

    _sync_total = 0.0

    def _timed(self, fn):
        import time

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync_total += time.perf_counter() - t0
        return timed

    def report(self) -> dict:
        meter = self.meter
        return {"busy": self.busy, "cpu": self.cpu, "drift": self.drift, "sync": self.sync,
                "factor": self.speed.factor,
                "slept_s": self.speed.slept_s,
                "peak_bytes": meter.peak_bytes if meter else None,
                "cap_bytes": meter.cap if meter else None,
                "static_bytes": meter.static_bytes if meter else None,
                "allreduce_gb_s": self.allreduce_gb_s}


def _corrupt_pipeline(pipeline: int) -> None:
    from . import trainer

    original = getattr(trainer._micro_batches, "_hetero_original", trainer._micro_batches)

    def micro_batches(plan, d, step, seed):
        for batch in original(plan, d, step, seed):
            if d == pipeline and step >= 1:
                batch = dict(batch, labels=(batch["labels"] + 1) % plan.model.vocab_size)
            yield batch

    micro_batches._hetero_original = original
    trainer._micro_batches = micro_batches


def _world_allreduce_gb_s(plan: Plan) -> float:
    """Bus bandwidth (``2 (n-1)/n x bytes / s``) of an all-reduce of one stage's gradients over
    every rank of the rehearsal: what gradient sync sees with this many processes on this
    machine. Runs on every rank before training (a collective of the whole world)."""
    import torch
    import torch.distributed as dist

    from .. import models as M

    n = dist.get_world_size()
    if n < 2:
        return float("inf")
    params = max(M.layer_params(plan.model) * max(plan.layer_split)
                 + M.embedding_params(plan.model), 1 << 16)
    buf = torch.zeros(int(params))
    return 2 * (n - 1) / n * buf.numel() * 4 / _all_reduce_seconds(buf, 4) / 1e9


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


def _rank_hooks(plan: Plan, rank: int, *, factors: dict[str, float], time_scale: float,
                caps: dict[int, tuple[float, float, float]] | None, enforce_caps: bool = True,
                corrupt_pipeline: int | None = None, nice: int = 0):
    """``hooks_factory`` of the rehearsal (runs inside each rank process)."""
    from .memory import MemoryMeter
    from .speed import SpeedEmulation
    from .trainer import RankHooks

    _renice(nice)
    allreduce_gb_s = _world_allreduce_gb_s(plan)
    slot = plan.slot_of_rank(rank)
    device = plan.stage(slot.pipeline, slot.stage).device_type
    speed = SpeedEmulation(slowdown=factors[device] / time_scale, time_scale=time_scale,
                           device_type=device, absorb_contention=True)
    meter = None
    if caps is not None:
        cap, device_bytes, scale = caps[rank]
        meter = MemoryMeter(rank=rank, pipeline=slot.pipeline, stage=slot.stage,
                            device_type=device, cap=cap if enforce_caps else None,
                            device_bytes=device_bytes, scale=scale)
    emu = _RankEmulation(speed, meter)
    emu.allreduce_gb_s = allreduce_gb_s
    if corrupt_pipeline is not None:
        _corrupt_pipeline(corrupt_pipeline)
    return RankHooks(compute=emu.compute, on_step_end=emu.on_step_end, report=emu.report,
                     on_built=emu.on_built)


# -- the rehearsal --------------------------------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class StageReport:
    """Measured and predicted figures of one (pipeline, stage), seconds per step."""

    pipeline: int
    stage: int
    device_type: str
    num_layers: int
    num_microbatches: int
    factor: float
    step_s: float
    busy_s: float
    """Forward and backward compute, stretched: the emulated device's busy time."""
    cpu_s: float
    """CPU seconds of real work inside the busy time."""
    drift_s: float = 0.0
    """Largest lag, at a step's end, of this rank's compute behind its emulated duration (other
    processes held the cores): emulation error, included in busy_s."""
    peak_bytes: float | None
    cap_bytes: float | None
    sync_s: float = 0.0
    """Gradient sync and optimizer step, with the wait there for slower replicas (wall
    seconds; not stretched)."""
    predicted_busy_s: float | None = None
    predicted_idle_s: float | None = None
    """Predicted bubble, gradient sync, optimizer and waiting for others."""
    predicted_sync_s: float | None = None
    """The simulator's gradient sync, optimizer step and end-of-step wait for slower ranks."""

    @property
    def idle_s(self) -> float:
        return max(0.0, self.step_s - self.busy_s)

    @property
    def bubble_fraction(self) -> float:
        return self.idle_s / self.step_s if self.step_s else 0.0


@dataclass(kw_only=True, slots=True)
class RehearsalResult:
    plan: Plan
    """The shrunk plan that ran."""
    stages: list[StageReport]
    step_s: float
    """Measured step time: the mean over the reported steps of the slowest rank (a rank that fell
    behind its emulated time in one step makes it up in the next, so the mean is the figure)."""
    step_times: list[float]
    """Per reported step, the slowest rank's wall seconds."""
    predicted_step_s: float | None
    """The cost model's step time for the emulated cluster, its compute calibrated at start-up
    and rescaled by the CPU time the ranks measured (``cpu_drift``)."""
    a_priori_step_s: float | None
    """The same from the start-up calibration alone."""
    cpu_drift: float
    """CPU time the ranks' compute took over what the start-up calibration predicted."""
    cpu_drifts: dict[str, float] = field(default_factory=dict)
    """The same per device type (what the prediction is rescaled by)."""
    losses: list[float]
    calibration: Calibration
    time_scale: float = 1.0
    """The extra slowdown every emulated device ran at."""
    verify_message: str | None = None
    """With ``verify``: None when the run matched the single-process reference, else the first
    divergence."""
    kept_module_inputs: list[tuple[int, int]] = field(default_factory=list)
    """(pipeline, stage) slots whose ``offload.module_inputs`` the CPU ranks did not run
    (:func:`without_module_inputs`)."""

    @property
    def ratio(self) -> float | None:
        """Measured over predicted step time."""
        return self.step_s / self.predicted_step_s if self.predicted_step_s else None


def _activation_scale(shrunk: Plan, calibration: Calibration) -> float:
    """Measured over estimated (fp32, unfused attention) activation bytes of one shrunk layer."""
    from ..models import layer_activation_bytes

    ratios = [measured / (2 * layer_activation_bytes(shrunk.model, b, 1, "none",
                                                     flash_attention=False))
              for b, measured in calibration.layer_activation_bytes.items() if measured > 0]
    return max(ratios) if ratios else 1.0


def auto_time_scale(plan: Plan, slowdowns: dict[str, float], *, utilization: float = 0.7) -> float:
    """The smallest extra slowdown (>= 1) at which the ranks' compute, each busy 1/factor of the
    time at most, asks for no more than ``utilization`` of this machine's cores."""
    demand = sum(1.0 / slowdowns[plan.device_type_of_rank(r)] for r in range(plan.world_size))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1.0, round(demand / (utilization * (cores or 1)), 2))


def _spawn_failure(exc) -> HeteroError | None:
    """The user error a rank raised (e.g. MemoryCapError), from its remote traceback."""
    tb = getattr(exc, "remote_traceback", "") or ""
    for line in reversed(tb.strip().splitlines()):
        head, sep, message = line.partition(": ")
        if sep and head.startswith("megatron_hetero.") and head.rsplit(".", 1)[-1] in (
                "MemoryCapError", "HeteroError", "SchemaError", "InfeasibleError"):
            return HeteroError(message)
    return None


def rehearse(plan: Plan, config: RehearsalConfig | None = None, *, catalog: Catalog | None = None,
             verify: bool = False, source: str = "PLAN", progress=None,
             calibration: Calibration | None = None) -> RehearsalResult:
    """Shrink, check, calibrate, run and predict ``plan`` (see the module docstring)."""
    from .memory import memory_caps
    from .spawn import SpawnError
    from .speed import device_slowdowns
    from .trainer import TrainConfig, compare_results, reference_plan, train_plan

    config = config or RehearsalConfig()
    catalog = catalog or plan.catalog or load_catalog()
    say = progress or (lambda msg: None)
    shrunk, kept_inputs = without_module_inputs(shrink_plan(plan, config.hidden_size, catalog),
                                                catalog)
    check_host_capacity(shrunk, max_ranks=config.max_ranks, source=source, catalog=catalog)
    slowdowns = device_slowdowns(plan, catalog)
    time_scale = config.time_scale or auto_time_scale(plan, slowdowns)
    factors = {d: s * time_scale for d, s in slowdowns.items()}
    if calibration is None:
        say("calibrating the CPU and gloo")
        # each device's rank sleeps factor - 1 times every step after it, and a CPU step that
        # follows such an idle gap costs more than one run back to back: measure that penalty
        # per device (none at factor 1; docs/calibration.md)
        by_idle: dict[float, Calibration] = {}
        for d in sorted(factors, key=lambda d: factors[d]):
            idle = round(max(0.0, factors[d] - 1.0), 3)
            if idle not in by_idle:
                by_idle[idle] = calibrate(shrunk, seed=config.seed, nice=config.nice,
                                          idle_factor=idle,
                                          meter=config.meter_memory or config.memory_cap)
        calibrations = {d: by_idle[round(max(0.0, f - 1.0), 3)] for d, f in factors.items()}
        calibration = calibrations[min(factors, key=lambda d: (factors[d], d))]
    else:
        calibrations = calibration
    caps = memory_caps(plan, shrunk, catalog,
                       activation_scale=_activation_scale(shrunk, calibration),
                       cpu_shards_optimizer=trainer_shards_optimizer(shrunk))
    say(f"running {config.steps} steps on {shrunk.world_size} CPU ranks")
    tconf = TrainConfig(steps=config.steps, seed=config.seed, gather_params=verify,
                        eval_forward_only=verify, timeout_s=config.timeout_s)
    corrupt = os.environ.get(_CORRUPT_ENV)
    metered = config.meter_memory or config.memory_cap
    hooks = functools.partial(_rank_hooks, factors=factors, time_scale=time_scale,
                              caps=caps if metered else None, enforce_caps=config.memory_cap,
                              corrupt_pipeline=int(corrupt) if corrupt else None,
                              nice=config.nice)
    try:
        result = train_plan(shrunk, tconf, hooks_factory=hooks)
    except SpawnError as exc:
        user = _spawn_failure(exc)
        if user is not None:
            raise user from None
        raise
    verify_message = None
    if verify:
        say("training the same model, data and seed in one process")
        ref = train_plan(reference_plan(shrunk), tconf)
        # atol: 1% of one Adam step (lr 1e-3); see tests/emulate/test_equivalence.py
        verify_message = compare_results(result, ref, rtol=1e-5, atol=1e-5)

    steps = range(1, config.steps)  # step 0 is the warm-up
    step_times = [max(r.step_times[k] for r in result.ranks) for k in steps]
    a_priori = predict(shrunk, calibrations, factors)
    # The CPU's speed drifts between the start-up calibration and the run (other processes,
    # caches, frequency): rescale the calibrated compute by the CPU time the ranks measured.
    # Per device type: each type's ranks sleep their own gaps between steps, and the CPU speed
    # after a gap differs with its length, so one drift for all types over-corrects one and
    # under-corrects the other (seen: A100 ranks at 1.6x their calibration, V100 ranks at 1.0x).
    leads = [r for r in result.ranks if r.tensor_rank == 0]
    measured_cpu: dict[str, float] = {}
    calibrated_cpu: dict[str, float] = {}
    for r in leads:
        dev = shrunk.stage(r.pipeline, r.stage).device_type
        measured_cpu[dev] = measured_cpu.get(dev, 0.0) + _mean([r.extra["cpu"][k] for k in steps])
        calibrated_cpu[dev] = (calibrated_cpu.get(dev, 0.0)
                               + a_priori.stage(r.pipeline, r.stage).busy_s / r.extra["factor"])
    drifts = {d: (measured_cpu[d] / calibrated_cpu[d] if calibrated_cpu[d] > 0 else 1.0)
              for d in measured_cpu}
    total_cal = sum(calibrated_cpu.values())
    drift = sum(measured_cpu.values()) / total_cal if total_cal > 0 else 1.0
    # ... and take the gloo all-reduce bandwidth the ranks measured among themselves
    world_bw = min((r.extra["allreduce_gb_s"] for r in result.ranks
                    if r.extra.get("allreduce_gb_s")), default=calibration.allreduce_gb_s)
    def rescaled(c: Calibration, drift: float) -> Calibration:
        return dataclasses.replace(
            c, layer_flops_per_s=c.layer_flops_per_s / drift,
            parts={k: (f * drift, b * drift) for k, (f, b) in c.parts.items()},
            pipeline_overhead={k: (f * drift, b * drift)
                               for k, (f, b) in c.pipeline_overhead.items()},
            step_overhead={k: (f * drift, b * drift) for k, (f, b) in c.step_overhead.items()},
            allreduce_gb_s=world_bw if world_bw < float("inf") else c.allreduce_gb_s)

    per_device = (calibrations if not isinstance(calibrations, Calibration)
                  else {d: calibrations for d in drifts})
    in_run = {d: rescaled(c, drifts.get(d, drift)) for d, c in per_device.items()}
    sim = predict(shrunk, in_run, factors)
    stages = []
    for r in leads:
        extra = r.extra
        st = shrunk.stage(r.pipeline, r.stage)
        pred = sim.stage(r.pipeline, r.stage)
        stages.append(StageReport(
            pipeline=r.pipeline, stage=r.stage, device_type=st.device_type,
            num_layers=st.num_layers,
            num_microbatches=shrunk.pipelines[r.pipeline].num_microbatches,
            factor=extra["factor"], step_s=_mean([r.step_times[k] for k in steps]),
            busy_s=_mean([extra["busy"][k] for k in steps]),
            cpu_s=_mean([extra["cpu"][k] for k in steps]),
            drift_s=max(extra["drift"][k] for k in steps),
            sync_s=_mean([extra["sync"][k] for k in steps]),
            peak_bytes=extra["peak_bytes"], cap_bytes=caps[r.rank][0],
            predicted_busy_s=pred.busy_s, predicted_idle_s=sim.step_time_s - pred.busy_s,
            predicted_sync_s=pred.sync_s + pred.idle_s))
    stages.sort(key=lambda s: (s.pipeline, s.stage))
    return RehearsalResult(plan=shrunk, stages=stages, step_s=_mean(step_times),
                           step_times=step_times, predicted_step_s=sim.step_time_s,
                           a_priori_step_s=a_priori.step_time_s, cpu_drift=drift,
                           cpu_drifts=drifts,
                           losses=result.losses, calibration=calibration, time_scale=time_scale,
                           verify_message=verify_message, kept_module_inputs=kept_inputs)


# -- report ---------------------------------------------------------------------------------------

def module_inputs_note(slots: list[tuple[int, int]]) -> str:
    """The report's line on module-input offload the CPU ranks did not run."""
    where = ", ".join(f"pipeline {d} stage {s}" for d, s in slots)
    return (f"note: offload.module_inputs (megatron-core's fine-grained activation offloading: "
            f"CUDA streams, Transformer Engine) is not rehearsed on {where}: those ranks keep the "
            f"tensors, their memory caps count them as offloaded, and neither the measured nor "
            f"the predicted times include the host copies")


def format_report(result: RehearsalResult, *, source: str = "PLAN",
                  real: ModelSpec | None = None) -> str:
    """The rehearsal's table: measured and predicted time per pipeline and stage."""
    m = result.plan.model
    c = result.calibration
    n_steps = len(result.step_times)
    plan = result.plan
    split = (f"{plan.layer_split}, interleaved: {plan.virtual_pipeline_size} model chunks per "
             f"stage of {[s.chunk_layers for s in plan.pipelines[0].stages]} layers"
             if plan.virtual_pipeline_size > 1 else f"{plan.layer_split}")
    lines = [
        f"rehearsal of {source}: {real.name if real else m.name}, {m.num_layers} layers "
        f"{split}, shrunk to hidden {m.hidden_size} "
        f"(heads {m.num_attention_heads}, "
        f"ffn {m.ffn_hidden_size}, vocab {m.vocab_size}, seq {m.seq_length}); "
        f"{result.plan.world_size} CPU ranks; {n_steps} measured steps after 1 warm-up; every "
        f"device slowed {result.time_scale:g}x more (time scale)",
        f"calibrated: shrunk layer fwd+bwd "
        f"{1e3 * sum(next(v for k, v in c.parts.items() if k[0] == 'layer')):.2f} ms of CPU "
        f"({c.layer_flops_per_s / 1e9:.2f} GFLOP/s); gloo p2p {c.p2p_latency_s * 1e6:.0f} us, "
        f"{c.bandwidth_gb_s:.2f} GB/s, all-reduce {c.allreduce_gb_s:.2f} GB/s; optimizer "
        f"{c.optimizer_gb_s:.2f} GB/s",
        "",
        f"{'pipe':>4} {'stage':>5}  {'device':<18} {'layers':>6} {'micro':>5} {'slow':>6}"
        f" | {'step s':>7} {'busy s':>7} {'idle s':>7} {'bubble':>6} {'sync s':>6}"
        f" | {'pred busy':>9} {'pred idle':>9} {'bubble':>6} {'sync s':>6}"
        f" | {'memory peak/cap':>17}",
    ]
    for st in result.stages:
        pred_bubble = (st.predicted_idle_s / result.predicted_step_s
                       if result.predicted_step_s else float("nan"))
        mem = ("-" if st.peak_bytes is None else
               f"{st.peak_bytes / 2**20:.2f}/{st.cap_bytes / 2**20:.2f} MiB"
               + ("!" if st.peak_bytes > st.cap_bytes else ""))
        lines.append(
            f"{st.pipeline:>4} {st.stage:>5}  {st.device_type:<18} {st.num_layers:>6} "
            f"{st.num_microbatches:>5} {st.factor:>5.2f}x"
            f" | {st.step_s:>7.3f} {st.busy_s:>7.3f} {st.idle_s:>7.3f} {st.bubble_fraction:>6.1%}"
            f" {st.sync_s:>6.3f}"
            f" | {st.predicted_busy_s:>9.3f} {st.predicted_idle_s:>9.3f} {pred_bubble:>6.1%}"
            f" {st.predicted_sync_s:>6.3f}"
            f" | {mem:>17}")
    lines.append("")
    if result.kept_module_inputs:
        lines.append(module_inputs_note(result.kept_module_inputs))
    worst = max((st.drift_s for st in result.stages), default=0.0)
    if worst > 0.02 * result.step_s:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        lines.append(f"note: other processes held the cores: a rank's compute ran up to "
                     f"{worst:.3f} s behind its emulated time at a step's end (load average "
                     f"{load:.1f} on {os.cpu_count()} cores); measured times are too long by "
                     f"up to that much")
    if result.predicted_step_s:
        lines.append(f"step time: measured {result.step_s:.3f} s (mean of {n_steps}), predicted "
                     f"{result.predicted_step_s:.3f} s by the tuner's cost model for this emulated "
                     f"cluster; measured/predicted {result.ratio:.2f}")
        per = (" (" + ", ".join(f"{d} {x:.2f}x" for d, x in sorted(result.cpu_drifts.items()))
               + ")" if len(result.cpu_drifts) > 1 else "")
        lines.append(f"  (the ranks' compute took {result.cpu_drift:.2f}x the CPU time the "
                     f"start-up calibration measured{per}; from that calibration alone the "
                     f"prediction is {result.a_priori_step_s:.3f} s)")
    lines.append("losses: " + ", ".join(f"{x:.4f}" for x in result.losses))
    return "\n".join(lines)


def rehearse_main(args) -> int:
    """Handler of ``megatron-hetero rehearse``."""
    import sys

    from ..hardware.inventory import load_inventory
    from ..plan import check_plan_against_inventory, load_plan

    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # megatron's Apex/TE notices, per rank
    inventory = load_inventory(args.inventory) if args.inventory else None
    plan = load_plan(args.plan, catalog=inventory.catalog if inventory else None)
    catalog = plan.catalog  # the built-in (or the inventory's) catalog plus the plan's gpus
    if inventory is not None:
        check_plan_against_inventory(plan, inventory, source=args.plan)
    try:
        config = RehearsalConfig(steps=args.steps, hidden_size=args.hidden_size,
                                 time_scale=args.time_scale, memory_cap=not args.no_memory_cap,
                                 seed=args.seed, max_ranks=args.max_ranks, nice=args.nice)
    except ValueError as exc:
        raise HeteroError(str(exc)) from None
    result = rehearse(plan, config, catalog=catalog, verify=args.verify, source=args.plan,
                      progress=lambda msg: print(f"[rehearse] {msg}", file=sys.stderr, flush=True))
    print(format_report(result, source=args.plan, real=plan.model))
    if args.verify:
        if result.verify_message is not None:
            print(f"verify: FAILED: the {plan.world_size}-rank run diverges from the "
                  f"single-process run: {result.verify_message}")
            return 1
        print(f"verify: losses and final parameters match the single-process run "
              f"(fp32, rtol 1e-5, atol 1e-5) over {config.steps} steps")
    return 0
