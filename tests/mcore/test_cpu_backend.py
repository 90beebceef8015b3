"""The CPU backend: its refusal next to CUDA and its behaviour in a rank process."""

from __future__ import annotations

import pytest

from megatron_hetero.mcore import cpu_backend
from megatron_hetero.mcore.spawn import spawn


@pytest.mark.parametrize("value, on", [(None, False), ("", False), ("0", False), ("1", True)])
def test_cpu_mode_reads_the_one_variable(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(cpu_backend.CPU_ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_backend.CPU_ENV, value)
    assert cpu_backend.CPU_ENV == "MEGATRON_HETERO_CPU" and cpu_backend.cpu_mode() is on


def test_refuses_when_cuda_is_available(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is available"):
        cpu_backend.enable_cpu_backend()
    assert not cpu_backend.cpu_backend_enabled()


# -- behaviour in a rank process ------------------------------------------------------------------
def _backend_checks(rank, world_size):
    import torch

    from megatron_hetero.mcore.cpu_backend import (CudaNotCoveredError, cpu_backend_enabled,
                                                   enable_cpu_backend)
    enable_cpu_backend()
    enable_cpu_backend()  # idempotent
    out = {"enabled": cpu_backend_enabled()}
    out["devices"] = sorted({str(t.device) for t in [
        torch.empty(2, device="cuda"), torch.zeros(1, device=torch.cuda.current_device()),
        torch.tensor([1.0], device="cuda:0"), torch.ones(1).cuda(), torch.ones(1).to("cuda"),
        torch.ones(1).to(torch.device("cuda", 0)), torch.ones(1).new_zeros(2, device="cuda")]})
    out["type"] = torch.ones(1).type()
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda.current_stream().wait_stream(torch.cuda.default_stream())
    torch.cuda.synchronize()

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    with get_cuda_rng_tracker().fork():
        a = torch.rand(3)
    outside = torch.rand(3)
    with get_cuda_rng_tracker().fork():
        b = torch.rand(3)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    with get_cuda_rng_tracker().fork():
        a2 = torch.rand(3)
    out["tracker_repeats"] = torch.equal(a, a2)
    out["tracker_streams_differ"] = not torch.equal(a, b) and not torch.equal(outside, b)

    from megatron.core.utils import StragglerDetector
    detector = StragglerDetector()
    detector._off = False
    try:
        detector.elapsed()
        out["uncovered"] = "no error"
    except CudaNotCoveredError as e:
        out["uncovered"] = str(e)
    try:  # callers outside megatron get torch's own function (and its own error)
        torch.cuda.temperature()
        out["outside"] = "no error"
    except CudaNotCoveredError:
        out["outside"] = "backend error"
    except Exception:  # noqa: BLE001 - torch's own complaint about a missing CUDA
        out["outside"] = "torch error"
    return out


@pytest.mark.slow
def test_backend_in_a_rank_process():
    (out,) = spawn(_backend_checks, 1, timeout_s=120)
    assert out["enabled"]
    assert out["devices"] == ["cpu"]
    assert out["type"] == "torch.cuda.FloatTensor"
    assert out["tracker_repeats"] and out["tracker_streams_differ"]
    assert ("megatron.core.utils.elapsed called torch.cuda.temperature, not covered"
            in out["uncovered"])
    assert out["outside"] == "torch error"


def _send_then_free(rank, world_size):
    """The interleaved schedule's pattern: an overlapped isend, then the output's storage freed
    (Megatron's deallocate_output_tensor) before the request is waited."""
    import gc

    import torch
    import torch.distributed as dist

    from megatron_hetero.mcore.cpu_backend import enable_cpu_backend
    enable_cpu_backend()
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    group = dist.new_group([0, 1])
    if rank == 0:
        out = torch.arange(4096, dtype=torch.float32)
        address = out.data_ptr()
        reqs = p2p._p2p_ops(tensor_send_prev=None, tensor_recv_prev=None, tensor_send_next=out,
                            tensor_recv_next=None, group=group, prev_pipeline_rank=1,
                            next_pipeline_rank=1)
        req = reqs["send_next"]
        kept = req._buffer.data_ptr() == address
        out.data = torch.empty((1,))  # what deallocate_output_tensor does
        gc.collect()
        junk = [torch.full((4096,), -1.0) for _ in range(64)]  # reuse freed memory if any
        dist.barrier()
        req.wait()
        return kept and req._buffer is None and len(junk) == 64
    buffer = torch.zeros(4096)
    dist.barrier()  # rank 0 freed its output before this receive is posted
    reqs = p2p._p2p_ops(tensor_send_prev=None, tensor_recv_prev=buffer, tensor_send_next=None,
                        tensor_recv_next=None, group=group, prev_pipeline_rank=0,
                        next_pipeline_rank=0)
    reqs["recv_prev"].wait()
    return torch.equal(buffer, torch.arange(4096, dtype=torch.float32))


@pytest.mark.slow
def test_overlapped_send_keeps_its_buffer_until_waited():
    assert spawn(_send_then_free, 2, timeout_s=120) == [True, True]
