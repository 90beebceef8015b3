"""``megatron-hetero profile``: measure per-layer costs of real megatron-core modules on this device.

For each tensor-parallel size, the profiler builds a one-layer megatron-core ``GPTModel`` (the
Transformer Engine layer spec when TE is installed, the local spec otherwise) and times its parts
one at a time, for each micro-batch size:

- ``embedding``: ``model.embedding`` (word and, if any, position embeddings);
- ``layer``: ``model.decoder.layers[0]``, with the model's rotary embedding;
- ``output``: ``model.decoder.final_layernorm``, ``model.output_layer`` and the model's own
  ``compute_language_model_loss``.

Each part runs ``warmup`` untimed iterations, then ``repeats`` timed ones, forward and backward
timed separately; the file keeps the median (on a GPU from CUDA events; on CPU from the
calling thread's CPU time when torch computes on one thread, else from wall-clock time). With TP
> 1 every rank of the group times the part and the slowest rank's median is kept.

Memory: on a GPU, ``torch.cuda`` allocator figures (bytes allocated by one layer's forward, and
the peak over its forward and backward). On CPU there is no allocator peak to read; the
profiler counts the bytes autograd saves for backward through
``torch.autograd.graph.saved_tensors_hooks`` (each storage once, parameters excluded) and
reports ``peak_bytes`` as parameters + gradients + those saved bytes.

With more than one rank it also times p2p send/recv between ranks 0 and 1 and an all-reduce over
all ranks. TP > 1 needs that many processes: the profiler starts them itself (``torch.multiprocessing``
on the CPU backend, or on the visible GPUs), unless it runs under ``torchrun`` already.

torch and megatron are imported inside the functions, never at module import.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from .cost.profile_file import (
    FORMAT_VERSION, BandwidthSample, Communication, DeviceInfo, MemoryFigures, PartTimes,
    PipelineEntry, PipelineFigures, PipelineStageTimes, ProfileData, ProfileEntry, Software,
    StepPenalty, Timing,
    save_profile,
)
from .errors import HeteroError
from .plan import ModelSpec

__all__ = ["ProfileRequest", "run_profile", "layer_flops", "profile_main"]

CPU_DEVICE_TYPE = "CPU"


@dataclass(kw_only=True, slots=True)
class ProfileRequest:
    """What to measure."""

    model: ModelSpec
    micro_batch_sizes: list[int]
    tensor_parallel_sizes: list[int] = field(default_factory=lambda: [1])
    warmup: int = 2
    """Untimed iterations per part before the timed ones."""
    repeats: int = 5
    """Timed iterations per part; the median is kept."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """``auto``: bf16 on a GPU (fp16 where the catalog says the card has no bf16), fp32 on CPU."""
    device_type: str | None = None
    """Catalog name to record; detected from the device name when None (``CPU`` on CPU)."""
    cpu_threads: int | None = None
    """torch intra-op threads per CPU rank (None: torch's default)."""
    layers: int = 2
    """Transformer layers timed in sequence; per-layer figures are the total over this count,
    so that each layer meets caches holding the other layer's weights, as in a real stack."""
    bandwidth: bool = True
    """Measure p2p and all-reduce bandwidth when more than one rank runs."""
    pipeline: bool = True
    """Also run a 2-stage pipeline through Megatron's own 1F1B schedule and record how much
    longer each stage's forward and backward of a micro-batch take there than the sum of its
    parts timed alone (:func:`_measure_pipeline`). Needs 2 ranks: on the CPU backend the profiler
    starts them; on GPUs, 2 visible GPUs or torchrun with at least 2 ranks."""
    pipeline_microbatches: int = 4
    """Micro-batches per step of that pipeline (1F1B: warm-up, steady state and cool-down)."""
    idle_factor: float = 0.0
    """CPU backend only: also measure what a step costs more when it follows an idle gap of
    ``idle_factor`` times its duration, as every step of a rehearsal rank that plays a device
    ``idle_factor + 1`` times slower than the CPU does (:func:`_time_idle_penalty`; the entries'
    ``idle_penalty``). The parts themselves are always timed back to back. 0: not measured."""
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.micro_batch_sizes or min(self.micro_batch_sizes) < 1:
            raise HeteroError(f"micro_batch_sizes: {self.micro_batch_sizes}; expected positive integers")
        if not self.tensor_parallel_sizes or min(self.tensor_parallel_sizes) < 1:
            raise HeteroError(f"tensor_parallel_sizes: {self.tensor_parallel_sizes}; "
                             "expected positive integers")
        for tp in self.tensor_parallel_sizes:
            m = self.model
            if m.num_attention_heads % tp or m.num_query_groups % tp:
                raise HeteroError(
                    f"--tensor-parallel-sizes: {tp} does not divide the model's attention heads "
                    f"({m.num_attention_heads}) and query groups ({m.num_query_groups})")
        if self.layers < 1:
            raise HeteroError(f"--layers {self.layers}: expected at least 1")
        if not self.idle_factor >= 0:
            raise HeteroError(f"--idle-factor {self.idle_factor}: expected a number >= 0")
        if self.pipeline_microbatches < 2:
            raise HeteroError(f"pipeline_microbatches {self.pipeline_microbatches}: expected at "
                              "least 2 (a 2-stage pipeline)")
        if self.warmup < 0 or self.repeats < 1:
            raise HeteroError(f"--warmup {self.warmup} --repeats {self.repeats}: expected "
                              "warmup >= 0 and repeats >= 1")


def layer_flops(model: ModelSpec, micro_batch_size: int, tensor_parallel_size: int = 1) -> float:
    """Model FLOPs of one transformer layer's forward and backward (backward = 2 x forward) for
    one micro-batch, per rank of the TP group: the tuner's own formula
    (:func:`megatron_hetero.models.layer_forward_flops`)."""
    from .models import layer_forward_flops
    return 3.0 * layer_forward_flops(model, micro_batch_size) / tensor_parallel_size


# --------------------------------------------------------------------------------------------
# launching


def run_profile(request: ProfileRequest, output: str | Path | None = None) -> ProfileData:
    """Measure, write ``output`` (when given) and return the profile. Starts max(TP) processes
    unless running under torchrun already (then uses the launched ranks)."""
    world = max(max(request.tensor_parallel_sizes), _pipeline_ranks(request))
    launched = _launched_world()
    if launched > 1:
        if launched % world:
            raise HeteroError(f"torchrun started {launched} ranks; --tensor-parallel-sizes "
                              f"{request.tensor_parallel_sizes} needs a multiple of {world}")
        data = _rank_main(int(os.environ["RANK"]), launched, request, None)
    elif world == 1:
        data = _rank_main(0, 1, request, None)
    else:
        data = _spawn(world, request)
    if data is not None and output is not None:
        save_profile(data, output)
    return data


def _pipeline_ranks(request: ProfileRequest) -> int:
    """Ranks the pipeline measurement asks for when the profiler starts them: 2 on the CPU
    backend, 2 on a node with 2 visible GPUs, else 1 (no pipeline figures)."""
    if not request.pipeline or _launched_world() > 1:
        return 1
    device = _pick_device(request.device)
    if device == "cpu":
        return 2
    import torch
    return 2 if torch.cuda.device_count() >= 2 else 1


def _launched_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


def _spawn(world: int, request: ProfileRequest) -> ProfileData:
    device = _pick_device(request.device)
    if device == "cpu":
        from .emulate.spawn import SpawnError, spawn
        try:
            results = spawn(_cpu_rank, world, args=(request,), timeout_s=request_timeout(request),
                            threads_per_rank=request.cpu_threads or 1)
        except SpawnError as exc:
            raise HeteroError(f"profiling rank {exc.rank} failed:\n{exc.remote_traceback}") from None
        return results[0]
    import torch
    import torch.multiprocessing as mp
    if torch.cuda.device_count() < world:
        raise HeteroError(f"--tensor-parallel-sizes {max(request.tensor_parallel_sizes)} needs "
                          f"{world} GPUs; this node shows {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="mh-profile-") as tmp:
        init = Path(tmp) / "store"
        result = Path(tmp) / "profile.yaml"
        mp.start_processes(_cuda_rank, args=(world, request, str(init), str(result)),
                           nprocs=world, join=True, start_method="spawn")
        from .cost.profile_file import load_profile
        return load_profile(result).data


def request_timeout(request: ProfileRequest) -> float:
    """Generous wall-clock limit for a spawned CPU profile."""
    runs = len(request.micro_batch_sizes) * len(request.tensor_parallel_sizes)
    return 120.0 + 60.0 * runs * (request.warmup + request.repeats)


def _cpu_rank(rank: int, world: int, request: ProfileRequest):
    return _rank_main(rank, world, request, None)


def _cuda_rank(rank: int, world: int, request: ProfileRequest, init: str, result: str) -> None:
    data = _rank_main(rank, world, request, f"file://{init}")
    if rank == 0:
        save_profile(data, result)


def _pick_device(device: str) -> str:
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        raise HeteroError("--device cuda: this machine has no usable CUDA GPU; expected --device "
                          "cpu or auto")
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------------------------
# one rank


def _rank_main(rank: int, world: int, request: ProfileRequest, init_method: str | None):
    import torch
    import torch.distributed as dist

    device = _pick_device(request.device)
    # Import megatron-core's modules before the CPU backend patches torch.cuda: their
    # import-time torch.compile decorators trip over the patched functions otherwise.
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.distributed  # noqa: F401
    if device == "cpu":
        _enable_cpu_backend()
        if request.cpu_threads:
            torch.set_num_threads(request.cpu_threads)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        if init_method is None and "MASTER_ADDR" not in os.environ:
            init_method = f"file://{tempfile.mkdtemp(prefix='mh-profile-')}/store"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)

    from megatron.core import parallel_state

    device_type, precision = _device_type_and_precision(request, device)
    if device != "cpu" and request.idle_factor:
        raise HeteroError("--idle-factor is for the CPU backend (it reproduces the rehearsal's "
                          "speed emulation); a GPU is timed back to back")
    clock_name, timer = _timer(device, 1)
    entries: list[ProfileEntry] = []
    jobs = [(tp, mbs) for tp in request.tensor_parallel_sizes for mbs in request.micro_batch_sizes]
    pipelined = _runs_pipeline(request, world)
    steps = len(jobs) * 3 + (len(request.micro_batch_sizes) if pipelined else 0)
    with _progress(request.progress and rank == 0, steps) as advance:
        for tp in request.tensor_parallel_sizes:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
            try:
                # On CPU the ranks share the cores: only the first TP group times, so that a
                # TP=1 figure is one process's work alone, as in a 1-rank profile.
                if device == "cuda" or rank < tp:
                    parts = _build_parts(request.model, tp, precision, device, request.layers)
                    tp_clock, tp_timer = _timer(device, tp)
                    for mbs in request.micro_batch_sizes:
                        entry = _measure_entry(parts, request, mbs, tp, tp_timer, device, advance)
                        if tp_clock != clock_name:
                            entry.clock = tp_clock
                        entries.append(entry)
                    del parts
            finally:
                parallel_state.destroy_model_parallel()
        comm = _measure_bandwidth(world, device, request) if request.bandwidth and world > 1 \
            else None
        pipeline = (_measure_pipeline(rank, request, precision, device, timer, entries, advance)
                    if pipelined else None)
    if rank != 0:
        dist.barrier()
        return None
    dist.barrier()
    best = _efficiency(entries, device, device_type, precision)
    return ProfileData(
        format_version=FORMAT_VERSION,
        device=_device_info(device, device_type, world),
        software=_software(),
        timing=Timing(method=clock_name, warmup=request.warmup, repeats=request.repeats,
                      layer_spec=_layer_spec_name(device), precision=precision,
                      layers=request.layers, idle_factor=request.idle_factor),
        model=request.model,
        entries=entries,
        created=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        efficiency=best,
        communication=comm,
        pipeline=pipeline,
    )


def _enable_cpu_backend() -> None:
    try:
        from .emulate.cpu_backend import enable_cpu_backend
    except ImportError as exc:  # pragma: no cover - the backend ships with this package
        raise HeteroError("profiling on CPU needs megatron_hetero.emulate.cpu_backend "
                          f"(import failed: {exc})") from None
    enable_cpu_backend()


def _device_type_and_precision(request: ProfileRequest, device: str) -> tuple[str, str]:
    from .hardware.catalog import load_catalog

    catalog = load_catalog()
    if device == "cpu":
        dtype = request.device_type or CPU_DEVICE_TYPE
        precision = "fp32" if request.precision == "auto" else request.precision
        return dtype, precision
    import torch
    name = torch.cuda.get_device_name()
    dtype = request.device_type or catalog.resolve(name)
    if dtype is None:
        raise HeteroError(f"this GPU reports itself as {name!r}, which the catalog does not know; "
                          "pass --device-type NAME (a catalog name, or one your inventory adds)")
    resolved = catalog.resolve(dtype)
    precision = request.precision
    if precision == "auto":
        precision = "bf16" if resolved is None or catalog.get(resolved).bf16 else "fp16"
    return resolved or dtype, precision


def _timer(device: str, tp: int) -> tuple[str, Callable]:
    """A function ``timer(fn) -> (seconds, fn())`` and the name of its method. On CPU: the
    thread's CPU time with one torch thread and TP=1, else wall clock (TP > 1 waits for gloo
    all-reduces, which CPU time would not count)."""
    import torch

    if device == "cuda":
        def cuda_timer(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3, out
        return "cuda-events", cuda_timer
    clock = time.thread_time if torch.get_num_threads() == 1 and tp == 1 else time.perf_counter
    name = "thread-cpu-time" if clock is time.thread_time else "synchronize-wall-clock"

    def cpu_timer(fn):
        t0 = clock()
        out = fn()
        return clock() - t0, out
    return name, cpu_timer


@dataclass(slots=True)
class _Parts:
    model: object
    rope: object
    dtype: object
    device: str
    tp_group: object
    ddp: object
    """Megatron's DDP around ``model``: kept alive so its gradient hooks stay registered."""


def _dtype(precision: str):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def _transformer_config(model: ModelSpec, tp: int, precision: str, device: str, layers: int,
                        pp: int = 1):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    dtype = _dtype(precision)
    extra = {"pipeline_model_parallel_size": pp, "pipeline_dtype": dtype} if pp > 1 else {}
    return TransformerConfig(
        num_layers=layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        normalization=model.normalization,
        add_bias_linear=model.add_bias_linear,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=device == "cpu",
        params_dtype=dtype,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        **extra,
    )


def _build_parts(model: ModelSpec, tp: int, precision: str, device: str, layers: int = 1) -> _Parts:
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    dtype = _dtype(precision)
    config = _transformer_config(model, tp, precision, device, layers)
    torch.manual_seed(1234)
    from megatron.core import tensor_parallel
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(model, device),
        vocab_size=model.vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type,
    )
    if device == "cuda":
        gpt = gpt.cuda()
    gpt = gpt.to(dtype)
    # Training wraps the model in Megatron's DDP, whose hooks accumulate every gradient into
    # its fp32 buffers during backward: a cost per layer that the profile must include.
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    ddp = DistributedDataParallel(config=config, module=gpt,
                                  ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    rope = getattr(gpt, "rotary_pos_emb", None)
    rope_emb = rope(model.seq_length) if rope is not None and model.position_embedding_type == "rope" \
        else None
    return _Parts(model=gpt, rope=rope_emb, dtype=dtype, device=device,
                  tp_group=parallel_state.get_tensor_model_parallel_group(), ddp=ddp)


def _layer_spec_name(device: str) -> str:
    from .optional import have_transformer_engine
    return "transformer_engine" if device == "cuda" and have_transformer_engine() else "local"


def _layer_spec(model: ModelSpec, device: str):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec,
    )
    if _layer_spec_name(device) == "transformer_engine":
        return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec(normalization=model.normalization)


def _measure_entry(parts: _Parts, request: ProfileRequest, mbs: int, tp: int, timer, device,
                   advance) -> ProfileEntry:
    import torch

    m, gpt = request.model, parts.model
    s, h = m.seq_length, m.hidden_size
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    gen = torch.Generator(device="cpu").manual_seed(mbs)
    tokens = torch.randint(0, m.vocab_size, (mbs, s), generator=gen).to(dev)
    labels = torch.randint(0, m.vocab_size, (mbs, s), generator=gen).to(dev)
    positions = torch.arange(s, device=dev).unsqueeze(0).expand(mbs, s)
    hidden = torch.randn(s, mbs, h, generator=gen).to(dev, parts.dtype)
    layers = list(gpt.decoder.layers)

    def embedding_fwd():
        return gpt.embedding(input_ids=tokens, position_ids=positions)

    def layer_fwd():
        x = hidden.detach().requires_grad_()
        for layer in layers:
            out = layer(x, attention_mask=None, rotary_pos_emb=parts.rope)
            x = out[0] if isinstance(out, tuple) else out
        return x

    def output_fwd():
        x = hidden.detach().requires_grad_()
        y = gpt.decoder.final_layernorm(x) if gpt.decoder.final_layernorm is not None else x
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
            else None
        logits, _ = gpt.output_layer(y, weight=weight)
        return gpt.compute_language_model_loss(labels, logits).sum()

    times = {}
    for name, fwd in (("embedding", embedding_fwd), ("layer", layer_fwd), ("output", output_fwd)):
        times[name] = _time_part(fwd, timer, request.warmup, request.repeats, parts.tp_group,
                                 per=len(layers) if name == "layer" else 1)
        advance(f"TP={tp} mbs={mbs} {name}")
    penalty = None
    if request.idle_factor > 0 and tp == 1 and device == "cpu":
        penalty = _time_idle_penalty(layer_fwd, timer, request.warmup, request.repeats,
                                     request.idle_factor)
    memory = _measure_memory(layers, layer_fwd, device)
    flops = layer_flops(m, mbs, tp)
    layer_t = times["layer"]
    return ProfileEntry(micro_batch_size=mbs, tensor_parallel_size=tp, layer=layer_t,
                        embedding=times["embedding"], output=times["output"], memory=memory,
                        idle_penalty=penalty,
                        achieved_tflops=round(flops / (layer_t.forward_s + layer_t.backward_s) / 1e12, 6))


def _time_part(fwd, timer, warmup: int, repeats: int, tp_group, per: int = 1) -> PartTimes:
    """Median forward and backward seconds of ``fwd`` (divided by ``per``), slowest TP rank."""
    import torch
    import torch.distributed as dist

    fwd_s, bwd_s = [], []
    for i in range(warmup + repeats):
        tf, out = timer(fwd)
        grad = torch.ones_like(out)
        tb, _ = timer(lambda: torch.autograd.backward(out, grad))
        del out
        if i >= warmup:
            fwd_s.append(tf)
            bwd_s.append(tb)
    medians = torch.tensor([statistics.median(fwd_s) / per, statistics.median(bwd_s) / per],
                           dtype=torch.float64)
    if dist.get_world_size(tp_group) > 1:
        if torch.cuda.is_available() and dist.get_backend(tp_group) == "nccl":
            medians = medians.cuda()
        dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=tp_group)
    f, b = medians.tolist()
    return PartTimes(forward_s=_sig(max(f, 1e-9)), backward_s=_sig(max(b, 1e-9)))


def _time_idle_penalty(fwd, timer, warmup: int, repeats: int, idle_factor: float) -> StepPenalty:
    """What one step (forward or backward of the layer stack, as one call) costs more when it
    follows an idle gap of ``idle_factor`` times its duration than when it follows other work.

    The rehearsal's speed emulation sleeps ``factor - 1`` times each step right after it, so
    every step of a rank starts after such a gap, in which other processes may use the core and
    its caches. Each round times, in this order: a forward after a sleep, its backward after a
    sleep, then a forward and its backward back to back (each right after the previous call's
    work); the medians' differences are returned, once per step (not per layer)."""
    import torch

    idle_f, idle_b, warm_f, warm_b = [], [], [], []
    for i in range(warmup + repeats):
        tf, out = timer(fwd)
        time.sleep(idle_factor * tf)
        tb, _ = timer(lambda o=out: torch.autograd.backward(o, torch.ones_like(o)))
        del out
        time.sleep(idle_factor * tb)
        tf2, out = timer(fwd)  # the forward above, slept after: this one is idle-timed
        time.sleep(idle_factor * tf2)
        tb2, _ = timer(lambda o=out: torch.autograd.backward(o, torch.ones_like(o)))
        del out
        tf3, out = timer(fwd)  # right after the backward's work: back to back
        tb3, _ = timer(lambda o=out: torch.autograd.backward(o, torch.ones_like(o)))
        del out
        time.sleep(idle_factor * tb3)
        if i >= warmup:
            idle_f.append(tf2)
            idle_b.append(tb2)
            warm_f.append(tf3)
            warm_b.append(tb3)
    return StepPenalty(
        forward_s=_sig(statistics.median(idle_f) - statistics.median(warm_f)),
        backward_s=_sig(statistics.median(idle_b) - statistics.median(warm_b)))


def _sig(x: float) -> float:
    return float(f"{x:.6g}")


def _measure_memory(layers, layer_fwd, device: str) -> MemoryFigures:
    """Memory of one layer: the figures of ``layers`` run in sequence, divided by their count;
    ``peak_bytes`` is the peak of the whole stack's forward and backward."""
    import torch

    n = len(layers)
    params = [p for layer in layers for p in layer.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params) // n
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = layer_fwd()
        torch.cuda.synchronize()
        act = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return MemoryFigures(method="cuda-max-memory-allocated", parameter_bytes_per_layer=param_bytes,
                             activation_bytes_per_layer=max(act, 0) // n, peak_bytes=peak)
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in param_storages and ptr not in saved:
            saved[ptr] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer_fwd()
    out.backward(torch.ones_like(out))
    act = sum(saved.values())
    return MemoryFigures(method="saved-tensors", parameter_bytes_per_layer=param_bytes,
                         activation_bytes_per_layer=act // n, peak_bytes=n * 2 * param_bytes + act)


def _runs_pipeline(request: ProfileRequest, world: int) -> bool:
    """Whether this run measures the 2-stage pipeline: asked, an even number of ranks (two per
    pipeline) and TP=1 among the profiled sizes (the parts it is compared with)."""
    return (request.pipeline and world >= 2 and world % 2 == 0
            and 1 in request.tensor_parallel_sizes)


def _measure_pipeline(rank: int, request: ProfileRequest, precision: str, device: str, timer,
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
            forward_s=_sig(f0), backward_s=_sig(b0),
            parts_forward_s=_sig(e.embedding.forward_s + n * e.layer.forward_s),
            parts_backward_s=_sig(e.embedding.backward_s + n * e.layer.backward_s))
        last = PipelineStageTimes(
            forward_s=_sig(f1), backward_s=_sig(b1),
            parts_forward_s=_sig(n * e.layer.forward_s + e.output.forward_s),
            parts_backward_s=_sig(n * e.layer.backward_s + e.output.backward_s))
        rows.append(PipelineEntry(
            micro_batch_size=mbs, tensor_parallel_size=1, first=first, last=last,
            forward_overhead_s=_sig(((f0 - first.parts_forward_s)
                                     + (f1 - last.parts_forward_s)) / 2),
            backward_overhead_s=_sig(((b0 - first.parts_backward_s)
                                      + (b1 - last.parts_backward_s)) / 2)))
    return PipelineFigures(stages=2, layers_per_stage=n,
                           microbatches=request.pipeline_microbatches, entries=rows)


class _PipelineStage:
    """One stage of the profiler's 2-stage pipeline (see :func:`_measure_pipeline`)."""

    def __init__(self, request: ProfileRequest, precision: str, device: str, stage: int):
        import torch
        from megatron.core import tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel

        m = request.model
        self.request, self.device, self.model_spec = request, device, m
        self.dtype = _dtype(precision)
        config = _transformer_config(m, 1, precision, device, 2 * request.layers, pp=2)
        torch.manual_seed(1234)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        gpt = GPTModel(config=config, transformer_layer_spec=_layer_spec(m, device),
                       vocab_size=m.vocab_size, max_sequence_length=m.seq_length,
                       pre_process=stage == 0, post_process=stage == 1,
                       share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
                       position_embedding_type=m.position_embedding_type)
        if device == "cuda":
            gpt = gpt.cuda()
        gpt = gpt.to(self.dtype)
        self.ddp = DistributedDataParallel(
            config=config, module=gpt,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))

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


def _measure_bandwidth(world: int, device: str, request: ProfileRequest) -> Communication:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    # the smallest message gives the per-message latency (alpha); the others the bandwidth
    sizes = [4096, 1 << 20, 16 << 20, 64 << 20] if device == "cuda" else \
        [4096, 1 << 18, 1 << 20, 4 << 20]
    reps = max(request.repeats, 3)

    def wall(fn):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    p2p, allreduce = [], []
    for nbytes in sizes:
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)

        def exchange():
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        samples = [wall(exchange) for _ in range(reps + 1)][1:]
        t = statistics.median(samples) / 2  # one direction
        p2p.append(BandwidthSample(bytes=nbytes, seconds=t, gb_s=round(nbytes / t / 1e9, 4)))
        dist.barrier()
        samples = [wall(lambda: dist.all_reduce(buf)) for _ in range(reps + 1)][1:]
        t = statistics.median(samples)
        bus = 2 * (world - 1) / world * nbytes
        allreduce.append(BandwidthSample(bytes=nbytes, seconds=t, gb_s=round(bus / t / 1e9, 4)))
    return Communication(ranks=world, backend=dist.get_backend(), p2p=p2p, all_reduce=allreduce,
                         p2p_latency_s=_sig(p2p[0].seconds))


def _efficiency(entries: list[ProfileEntry], device: str, device_type: str, precision: str):
    tp1 = [e.achieved_tflops for e in entries if e.tensor_parallel_size == 1 and e.achieved_tflops]
    if not tp1:
        return None
    if device == "cpu":
        peak = _cpu_peak_tflops()
    else:
        from .hardware.catalog import load_catalog
        cat = load_catalog()
        name = cat.resolve(device_type)
        if name is None:
            return None
        spec = cat.get(name)
        peak = spec.fp32_tflops if precision == "fp32" else spec.bf16_tflops
    return round(min(max(tp1) / peak, 1.0), 6) if peak else None


_CPU_PEAK: list[float] = []


def _cpu_peak_tflops() -> float:
    """Dense fp32 matmul rate of this CPU with torch's current thread count (median of 5)."""
    if _CPU_PEAK:
        return _CPU_PEAK[0]
    import torch
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    for _ in range(3):
        a @ b
    samples = []
    for _ in range(7):
        t0 = clock()
        for _ in range(4):
            a @ b
        samples.append((clock() - t0) / 4)
    _CPU_PEAK.append(2 * n**3 / statistics.median(samples) / 1e12)
    return _CPU_PEAK[0]


def _device_info(device: str, device_type: str, world: int) -> DeviceInfo:
    import torch
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return DeviceInfo(name=props.name, type=device_type, backend="cuda", ranks=world,
                          memory_bytes=int(props.total_memory))
    return DeviceInfo(name=_cpu_name(), type=device_type, backend="cpu", ranks=world,
                      peak_matmul_tflops=round(_cpu_peak_tflops(), 6),
                      memory_bytes=_host_memory())


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _software() -> Software:
    import torch
    from importlib.metadata import PackageNotFoundError, version

    from ._version import __version__

    def ver(dist_name):
        try:
            return version(dist_name)
        except PackageNotFoundError:
            return None

    try:
        import megatron.core as mc
        mcore = getattr(mc, "__version__", None) or ver("megatron-core") or "unknown"
    except ImportError:
        mcore = "missing"
    te = ver("transformer-engine") or ver("transformer_engine")
    return Software(megatron_hetero=__version__, python=platform.python_version(),
                    torch=str(torch.__version__), megatron_core=str(mcore), transformer_engine=te,
                    cuda=torch.version.cuda)


class _progress:
    """A rich progress bar (or nothing), yielding ``advance(description)``."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total
        self._bar = None

    def __enter__(self):
        if not self.enabled:
            return lambda desc: None
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn)
        self._bar = Progress(TextColumn("profile"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), TextColumn("{task.description}"),
                             transient=False, redirect_stdout=False, redirect_stderr=False)
        self._bar.start()
        task = self._bar.add_task("", total=self.total)
        return lambda desc: self._bar.update(task, advance=1, description=desc)

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.stop()
        return False


# --------------------------------------------------------------------------------------------
# CLI


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise HeteroError(f"{option}: {text!r}; expected comma-separated integers such as 1,2,4") \
            from None
    if not values or min(values) < 1:
        raise HeteroError(f"{option}: {text!r}; expected positive integers such as 1,2,4")
    return sorted(set(values))


def resolve_model(name: str, *, seq_length: int | None = None,
                  hidden_size: int | None = None) -> ModelSpec:
    """A model preset or a YAML file of ModelSpec fields (:func:`megatron_hetero.models.load_model`),
    optionally shrunk in width to ``hidden_size`` by the rehearsal's rule (so that a CPU profile
    and a CPU rehearsal of the same model have the same shape)."""
    from .models import load_model

    model = load_model(name, seq_length=seq_length)
    if hidden_size is not None and hidden_size < model.hidden_size:
        from .emulate.rehearse import shrink_model
        model = shrink_model(model, hidden_size)
        if seq_length is not None:
            model = dataclasses.replace(model, seq_length=seq_length)
    return model


def profile_main(args) -> int:
    """Handler of ``megatron-hetero profile``."""
    model = resolve_model(args.model, seq_length=args.seq_length, hidden_size=args.hidden_size)
    if args.vocab_size is not None:
        if args.vocab_size < 1:
            raise HeteroError(f"--vocab-size {args.vocab_size}: expected a positive integer")
        model = dataclasses.replace(model, vocab_size=args.vocab_size)
    if args.output is not None and not Path(args.output).resolve().parent.is_dir():
        raise HeteroError(f"-o {args.output}: the directory {Path(args.output).parent} does not "
                          "exist; expected a path in an existing directory")
    _pick_device(args.device)  # refuse --device cuda without CUDA before starting any rank
    request = ProfileRequest(
        model=model,
        micro_batch_sizes=_int_list(args.micro_batch_sizes, "--micro-batch-sizes"),
        tensor_parallel_sizes=_int_list(args.tensor_parallel_sizes, "--tensor-parallel-sizes"),
        warmup=args.warmup, repeats=args.repeats, device=args.device, precision=args.precision,
        device_type=args.device_type, cpu_threads=args.cpu_threads, layers=args.layers,
        bandwidth=not args.no_bandwidth, pipeline=not getattr(args, "no_pipeline", False),
        idle_factor=getattr(args, "idle_factor", 0.0), progress=not args.quiet,
    )
    data = run_profile(request, args.output)
    if data is None:  # a non-zero torchrun rank
        return 0
    eff = f"; layer efficiency {data.efficiency:.3f}" if data.efficiency else ""
    print(f"{args.output}: profile of {data.device.type} ({data.device.name}) for "
          f"{model.name} h={model.hidden_size} s={model.seq_length}: {len(data.entries)} "
          f"entries{eff}")
    for e in data.entries:
        print(f"  TP={e.tensor_parallel_size} mbs={e.micro_batch_size}: layer fwd "
              f"{e.layer.forward_s * 1e3:.3f} ms bwd {e.layer.backward_s * 1e3:.3f} ms; "
              f"activations {e.memory.activation_bytes_per_layer / 2**20:.2f} MiB/layer"
              + (f"; after an idle gap of {data.timing.idle_factor:g}x a step costs "
                 f"{e.idle_penalty.forward_s * 1e3:+.3f} / {e.idle_penalty.backward_s * 1e3:+.3f} ms"
                 if e.idle_penalty else ""))
    if data.pipeline is not None:
        for e in data.pipeline.entries:
            print(f"  2-stage 1F1B pipeline, mbs={e.micro_batch_size}: per micro-batch and stage "
                  f"{e.forward_overhead_s * 1e3:+.3f} ms fwd, {e.backward_overhead_s * 1e3:+.3f} ms "
                  f"bwd beyond the parts")
    if data.device.backend == "cpu":
        import yaml

        from .cost.profile_file import inventory_entry
        entry = yaml.safe_dump({data.device.type: inventory_entry(data)}, default_flow_style=True,
                               width=10_000).strip()
        print(f"to plan with this CPU, add under the inventory's `gpus:` key: {entry}")
    return 0
