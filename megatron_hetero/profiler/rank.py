"""One rank of a profile run: the process group, the parts timed for each TP size and micro-batch
size, bandwidth and pipeline figures; rank 0 returns the profile."""

from __future__ import annotations

import os
import tempfile

from ..cost.profile_schema import ProfileEntry
from ..errors import HeteroError
from .assembly import assemble_profile
from .bandwidth import measure_bandwidth
from .build import build_parts
from .device import device_type_and_precision, make_timer, pick_device
from .parts import measure_entry
from .pipeline import measure_pipeline, runs_pipeline
from .request import ProfileRequest


def rank_main(rank: int, world: int, request: ProfileRequest, init_method: str | None):
    import torch
    import torch.distributed as dist

    device = pick_device(request.device)
    # Import megatron-core's modules before the CPU backend patches torch.cuda: their
    # import-time torch.compile decorators trip over the patched functions otherwise.
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.distributed  # noqa: F401
    if device == "cpu":
        from ..mcore.cpu_backend import enable_cpu_backend
        enable_cpu_backend()
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

    device_type, precision = device_type_and_precision(request, device)
    if device != "cpu" and request.idle_factor:
        raise HeteroError("--idle-factor is for the CPU backend (it reproduces the rehearsal's "
                          "speed emulation); a GPU is timed back to back")
    clock_name, timer = make_timer(device, 1)
    entries: list[ProfileEntry] = []
    jobs = [(tp, mbs) for tp in request.tensor_parallel_sizes for mbs in request.micro_batch_sizes]
    pipelined = runs_pipeline(request, world)
    steps = len(jobs) * 3 + (len(request.micro_batch_sizes) if pipelined else 0)
    with _progress(request.progress and rank == 0, steps) as advance:
        for tp in request.tensor_parallel_sizes:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
            try:
                # On CPU the ranks share the cores: only the first TP group times, so that a
                # TP=1 figure is one process's work alone, as in a 1-rank profile.
                if device == "cuda" or rank < tp:
                    parts = build_parts(request.model, tp, precision, device, request.layers)
                    tp_clock, tp_timer = make_timer(device, tp)
                    for mbs in request.micro_batch_sizes:
                        entry = measure_entry(parts, request, mbs, tp, tp_timer, device, advance)
                        if tp_clock != clock_name:
                            entry.clock = tp_clock
                        entries.append(entry)
                    del parts
            finally:
                parallel_state.destroy_model_parallel()
        comm = measure_bandwidth(world, device, request) if request.bandwidth and world > 1 \
            else None
        pipeline = (measure_pipeline(rank, request, precision, device, timer, entries, advance)
                    if pipelined else None)
    if rank != 0:
        dist.barrier()
        return None
    dist.barrier()
    return assemble_profile(request, entries, device=device, device_type=device_type,
                            precision=precision, world=world, clock_name=clock_name, comm=comm,
                            pipeline=pipeline)


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
