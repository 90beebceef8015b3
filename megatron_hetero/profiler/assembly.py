"""The profile file's contents from one run's figures: device, software, timing method and the
layer efficiency against the device's peak."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import time
from pathlib import Path

from ..cost.profile_schema import (
    FORMAT_VERSION, Communication, DeviceInfo, PipelineFigures, ProfileData, ProfileEntry, Software,
    Timing,
)
from ..mcore.model import layer_spec_name
from .request import ProfileRequest


def assemble_profile(request: ProfileRequest, entries: list[ProfileEntry], *, device: str,
                     device_type: str, precision: str, world: int, clock_name: str,
                     comm: Communication | None, pipeline: PipelineFigures | None) -> ProfileData:
    """The profile of this run (rank 0), with ``entries``, ``comm`` and ``pipeline`` measured."""
    best = efficiency(entries, device, device_type, precision)
    return ProfileData(
        format_version=FORMAT_VERSION,
        device=device_info(device, device_type, world),
        software=software(),
        timing=Timing(method=clock_name, warmup=request.warmup, repeats=request.repeats,
                      layer_spec=layer_spec_name(device), precision=precision,
                      layers=request.layers, idle_factor=request.idle_factor),
        model=request.model,
        entries=entries,
        created=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        efficiency=best,
        communication=comm,
        pipeline=pipeline,
    )


def efficiency(entries: list[ProfileEntry], device: str, device_type: str, precision: str):
    tp1 = [e.achieved_tflops for e in entries if e.tensor_parallel_size == 1 and e.achieved_tflops]
    if not tp1:
        return None
    if device == "cpu":
        peak = _cpu_peak_tflops()
    else:
        from ..hardware.catalog import load_catalog
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


def device_info(device: str, device_type: str, world: int) -> DeviceInfo:
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


def software() -> Software:
    import torch
    from importlib.metadata import PackageNotFoundError, version

    from .._version import __version__

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

