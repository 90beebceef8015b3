"""p2p send/recv between ranks 0 and 1 and all-reduce over all ranks."""

from __future__ import annotations

import statistics
import time

from ..cost.profile_schema import BandwidthSample, Communication
from .parts import sig
from .request import ProfileRequest


def measure_bandwidth(world: int, device: str, request: ProfileRequest) -> Communication:
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
                         p2p_latency_s=sig(p2p[0].seconds))

