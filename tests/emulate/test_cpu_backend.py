"""The CPU backend's redirect table against the installed megatron-core, its behaviour in a
rank process, and the spawn helper."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from megatron_hetero.emulate import cpu_backend
from megatron_hetero.emulate.cpu_backend import (CPU_PATH_MODULES, cuda_uses, is_covered,
                                                 uncovered_cuda_uses)
from megatron_hetero.emulate.spawn import SpawnError, SpawnTimeout, spawn


# -- the table is pinned against megatron-core's source --------------------------------------------
def test_table_covers_every_cuda_use_of_installed_megatron_core():
    total = sum(len(cuda_uses(m)) for m in CPU_PATH_MODULES)
    assert total > 50  # the scan sees megatron-core's CUDA sites at all
    uncovered = uncovered_cuda_uses()
    assert uncovered == [], "CUDA uses the CPU backend does not cover:\n" + "\n".join(
        f"  megatron.core.{u.module}:{u.line} in {u.function or '<module>'}: {u.use}"
        for u in uncovered)


def test_interleaved_schedule_is_scanned_and_covered():
    """The interleaved (virtual pipeline) schedule's CUDA uses are on the scanned path and
    covered; its helper modules are scanned too."""
    assert {"pipeline_parallel.schedules", "pipeline_parallel.p2p_communication",
            "pipeline_parallel.utils", "transformer.pipeline_parallel_layer_layout"} <= set(
        CPU_PATH_MODULES)
    uses = [u for u in cuda_uses("pipeline_parallel.schedules")
            if u.function == "forward_backward_pipelining_with_interleaving"]
    assert uses and all(is_covered(u) for u in uses)
    p2p = [u for u in cuda_uses("pipeline_parallel.p2p_communication")
           if u.function.startswith("P2PCommunicator.")]
    assert p2p and all(is_covered(u) for u in p2p)


@pytest.mark.slow
def test_table_covers_megatron_core_017(mcore017_env):
    script = ("import megatron.core; from megatron_hetero.emulate.cpu_backend import "
              "uncovered_cuda_uses as u; print(megatron.core.__version__, u())")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", script], env=mcore017_env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "0.17.1 []"


def test_scan_flags_a_new_cuda_path():
    source = textwrap.dedent("""
        import torch
        def new_feature(x):
            torch.cuda.memory_reserved()          # a torch.cuda function not in the table
            if x.is_cuda:                          # a branch that differs on CPU
                pass
            torch.autocast("cuda")                 # a literal outside a device argument
            y = torch.zeros(1, device="cuda")      # mapped by the device mode
            torch.cuda.synchronize()               # redirected
            return x.to("cuda"), torch.device("cuda:0"), y, x.cuda()
    """)
    uses = cuda_uses("new_module", source=source)
    flagged = sorted(u.use for u in uses if not is_covered(u))
    assert flagged == [".is_cuda", "torch.autocast('cuda')", "torch.cuda.memory_reserved"]
    assert all(u.function == "new_feature" for u in uses)
    assert "Tensor.cuda" in {u.use for u in uses}


def test_refuses_when_cuda_is_available(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is available"):
        cpu_backend.enable_cpu_backend()
    assert not cpu_backend.cpu_backend_enabled()


# -- behaviour in a rank process ------------------------------------------------------------------
def _backend_checks(rank, world_size):
    import torch

    from megatron_hetero.emulate.cpu_backend import (CudaNotCoveredError, cpu_backend_enabled,
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

    from megatron_hetero.emulate.cpu_backend import enable_cpu_backend
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


# -- spawn ----------------------------------------------------------------------------------------
def _all_reduce_rank(rank, world_size, scale):
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, world_size, scale * float(t)


def _fail_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    time.sleep(30)  # the others would outlive the failure: spawn must not wait for them
    return rank


def _sleep(rank, world_size):
    time.sleep(60)


def _env_rank(rank, world_size):
    import os
    return os.environ.get("HETERO_SPAWN_TEST"), os.environ.get("HETERO_SPAWN_EXTRA"), \
        os.environ["RANK"]


@pytest.mark.slow
def test_spawn_returns_values_in_rank_order():
    assert spawn(_all_reduce_rank, 3, args=(2.0,), timeout_s=60) == [
        (0, 3, 12.0), (1, 3, 12.0), (2, 3, 12.0)]


@pytest.mark.slow
def test_spawn_ranks_see_the_callers_environment(monkeypatch):
    spawn(_env_rank, 1, init_process_group=False)  # the forkserver runs before the variable
    monkeypatch.setenv("HETERO_SPAWN_TEST", "set later")
    assert spawn(_env_rank, 2, init_process_group=False, env={"HETERO_SPAWN_EXTRA": "x"}) == [
        ("set later", "x", "0"), ("set later", "x", "1")]


@pytest.mark.slow
def test_spawn_propagates_first_failure_with_rank_and_traceback():
    t0 = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(_fail_on_rank_1, 2, timeout_s=60, init_process_group=False)
    assert info.value.rank == 1
    assert "ValueError: boom on purpose" in info.value.remote_traceback
    assert "_fail_on_rank_1" in info.value.remote_traceback
    assert time.monotonic() - t0 < 30  # the sleeping rank was killed, not waited for


@pytest.mark.slow
def test_spawn_hard_timeout():
    with pytest.raises(SpawnTimeout) as info:
        spawn(_sleep, 2, timeout_s=2, init_process_group=False)
    assert info.value.pending == [0, 1]
