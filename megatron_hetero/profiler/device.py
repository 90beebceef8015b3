"""The device the profiler runs on: GPU or CPU backend, catalog name and precision, and the clock
that times a part."""

from __future__ import annotations

import time
from typing import Callable

from ..errors import HeteroError
from .request import CPU_DEVICE_TYPE, ProfileRequest


def pick_device(device: str) -> str:
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        raise HeteroError("--device cuda: this machine has no usable CUDA GPU; expected --device "
                          "cpu or auto")
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_type_and_precision(request: ProfileRequest, device: str) -> tuple[str, str]:
    from ..hardware.catalog import load_catalog

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


def make_timer(device: str, tp: int) -> tuple[str, Callable]:
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

