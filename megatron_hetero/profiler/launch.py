"""Starting the profiler's ranks: in this process, under torchrun, or as spawned processes (CPU
backend or one per visible GPU)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..cost.profile_file import save_profile
from ..cost.profile_schema import ProfileData
from ..errors import HeteroError
from .device import pick_device
from .rank import rank_main
from .request import ProfileRequest


def run_profile(request: ProfileRequest, output: str | Path | None = None) -> ProfileData:
    """Measure, write ``output`` (when given) and return the profile. Starts max(TP) processes
    unless running under torchrun already (then uses the launched ranks)."""
    world = max(max(request.tensor_parallel_sizes), _pipeline_ranks(request))
    launched = launched_world()
    if launched > 1:
        if launched % world:
            raise HeteroError(f"torchrun started {launched} ranks; --tensor-parallel-sizes "
                              f"{request.tensor_parallel_sizes} needs a multiple of {world}")
        data = rank_main(int(os.environ["RANK"]), launched, request, None)
    elif world == 1:
        data = rank_main(0, 1, request, None)
    else:
        data = _spawn(world, request)
    if data is not None and output is not None:
        save_profile(data, output)
    return data


def _pipeline_ranks(request: ProfileRequest) -> int:
    """Ranks the pipeline measurement asks for when the profiler starts them: 2 on the CPU
    backend, 2 on a node with 2 visible GPUs, else 1 (no pipeline figures)."""
    if not request.pipeline or launched_world() > 1:
        return 1
    device = pick_device(request.device)
    if device == "cpu":
        return 2
    import torch
    return 2 if torch.cuda.device_count() >= 2 else 1


def launched_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


def _spawn(world: int, request: ProfileRequest) -> ProfileData:
    device = pick_device(request.device)
    if device == "cpu":
        from ..mcore.spawn import SpawnError, spawn
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
        from ..cost.profile_file import load_profile
        return load_profile(result).data


def request_timeout(request: ProfileRequest) -> float:
    """Generous wall-clock limit for a spawned CPU profile."""
    runs = len(request.micro_batch_sizes) * len(request.tensor_parallel_sizes)
    return 120.0 + 60.0 * runs * (request.warmup + request.repeats)


def _cpu_rank(rank: int, world: int, request: ProfileRequest):
    return rank_main(rank, world, request, None)


def _cuda_rank(rank: int, world: int, request: ProfileRequest, init: str, result: str) -> None:
    data = rank_main(rank, world, request, f"file://{init}")
    if rank == 0:
        save_profile(data, result)
