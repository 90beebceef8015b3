"""``spawn``: N gloo processes, their values in rank order, their environment, the first failure
and the hard timeout."""

from __future__ import annotations

import time

import pytest

from megatron_hetero.mcore.spawn import SpawnError, SpawnTimeout, spawn


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


def _sigint_ignored(rank, world_size):
    import signal
    return signal.getsignal(signal.SIGINT) == signal.SIG_IGN


@pytest.mark.slow
def test_ranks_ignore_sigint_and_the_caller_keeps_its_handler():
    """Ctrl-C on a terminal reaches every process of its group; only the caller takes it (and
    kills the ranks), so a rank that is starting prints no traceback of its own."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    assert spawn(_sigint_ignored, 2, init_process_group=False) == [True, True]
    assert signal.getsignal(signal.SIGINT) is before
