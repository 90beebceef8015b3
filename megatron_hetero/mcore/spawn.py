"""Run one function on N CPU processes joined in a gloo process group.

Public API
----------
``spawn(fn, world_size, *, args=(), kwargs=None, timeout_s=180, ...) -> list``
    Starts ``world_size`` processes. Each sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
    ``MASTER_PORT``, joins a gloo process group through a TCP rendezvous on a free port of
    127.0.0.1 (unless ``init_process_group=False``), calls ``fn(rank, world_size, *args,
    **kwargs)`` and sends back its return value (plain-pickled, so tensors travel by value).
    Returns the values in rank order. The first rank that fails makes the call raise
    :class:`SpawnError` carrying that rank and its traceback; the other ranks are killed. When
    ``timeout_s`` passes first, every process is killed and :class:`SpawnTimeout` names the
    ranks that had not finished.

``fn`` must be importable by name (a module-level function): the processes are started with the
``forkserver`` method, whose server imports torch and megatron-core once (``preload``), so each
rank starts in well under a second instead of re-importing them. The server is started by the
first call and lives as long as this process: the ``preload`` of later calls is ignored, and
each rank gets the caller's environment at the time of the call (plus ``env``), not the
server's. A script that calls ``spawn`` needs the ``if __name__ == "__main__":`` guard. Each
rank runs torch with ``threads_per_rank`` intra-op threads (default 1: ranks share this
machine's cores).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable, Sequence

__all__ = ["spawn", "SpawnError", "SpawnTimeout", "free_port", "DEFAULT_PRELOAD"]

#: Modules the forkserver imports once, before it forks ranks.
DEFAULT_PRELOAD: tuple[str, ...] = (
    "torch", "torch.distributed",
    "megatron.core.models.gpt", "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed", "megatron.core.optimizer",
    "megatron_hetero.mcore.cpu_backend",
)


class SpawnError(RuntimeError):
    """A rank raised (or died). ``rank`` and ``remote_traceback`` say which and where."""

    def __init__(self, rank: int, remote_traceback: str):
        self.rank = rank
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")


class SpawnTimeout(SpawnError):
    """The hard timeout passed before every rank finished."""

    def __init__(self, timeout_s: float, pending: Sequence[int]):
        self.pending = list(pending)
        RuntimeError.__init__(self, f"timed out after {timeout_s:g} s; ranks still running: "
                                    f"{self.pending}")
        self.rank = self.pending[0] if self.pending else -1
        self.remote_traceback = ""


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_forkserver_ignoring_sigint() -> None:
    """Start the forkserver (once per process) with SIGINT ignored, which it keeps and the ranks
    it forks inherit. Ctrl-C on a terminal reaches its whole process group: a rank still
    starting would print its own ``KeyboardInterrupt`` traceback. The caller alone takes the
    signal, and :func:`spawn` kills the ranks on the way out."""
    import signal
    from multiprocessing import forkserver

    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals are the main thread's to change
        forkserver.ensure_running()
        return
    try:
        forkserver.ensure_running()  # forks and execs the server: milliseconds
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _sigint_held():
    """Hold SIGINT back while the ranks start, then hand it to the handler found. A rank whose
    start was interrupted is still forked by the server (it may be busy importing torch) after
    this process has gone, and prints a traceback as it reads the queue's lock; once started,
    the caller's ``finally`` kills it."""
    import signal

    held: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held and callable(previous):
        previous(signal.SIGINT, None)
    elif held and previous == signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGINT)


def _worker(fn, rank, world_size, port, args, kwargs, results, init_pg, threads, env):
    os.environ.clear()  # the forkserver's environment is the one it started with
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        import torch
        torch.set_num_threads(threads)
        if init_pg:
            import datetime
            import torch.distributed as dist
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    init_method=f"tcp://127.0.0.1:{port}",
                                    timeout=datetime.timedelta(seconds=300))
        try:
            value = fn(rank, world_size, *args, **kwargs)
        finally:
            if init_pg:
                import torch.distributed as dist
                if dist.is_initialized():
                    dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def spawn(fn: Callable[..., Any], world_size: int, *, args: Sequence = (),
          kwargs: dict | None = None, timeout_s: float = 180.0, init_process_group: bool = True,
          threads_per_rank: int = 1, env: dict[str, str] | None = None,
          start_method: str = "forkserver",
          preload: Sequence[str] = DEFAULT_PRELOAD) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; see the
    module docstring. ``env`` adds environment variables in every rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        if preload:
            ctx.set_forkserver_preload(list(preload))
        _start_forkserver_ignoring_sigint()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, name=f"rank{r}", daemon=True,
                         args=(fn, r, world_size, port, tuple(args), dict(kwargs or {}), results,
                               init_process_group, threads_per_rank,
                               {**os.environ, **(env or {})}))
             for r in range(world_size)]
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        with _sigint_held():  # a rank asked for is started, then killed below on Ctrl-C
            for p in procs:
                p.start()
        while len(values) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise SpawnTimeout(timeout_s, [r for r in range(world_size)
                                                   if r not in values]) from None
                for r, p in enumerate(procs):
                    if r not in values and p.exitcode is not None:
                        # give a report sent just before exiting the time to arrive
                        try:
                            rank, ok, payload = results.get(timeout=1.0)
                            break
                        except queue.Empty:
                            raise SpawnError(r, f"process exited with code {p.exitcode} "
                                                "without reporting") from None
                else:
                    continue
            if not ok:
                raise SpawnError(rank, payload)
            values[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=0.5 if len(values) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return [values[r] for r in range(world_size)]
