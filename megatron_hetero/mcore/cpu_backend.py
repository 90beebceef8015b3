"""CPU execution backend for megatron-core: run real megatron-core on CPU processes over gloo.

Public API
----------
``enable_cpu_backend()``
    Explicit opt-in, once per process, before building Megatron models. Refuses (``RuntimeError``)
    when CUDA is available, so a GPU run is never changed. Idempotent.
``cpu_backend_enabled()``
    Whether this process has enabled it.
``cpu_mode()``, ``CPU_ENV``
    Whether this process was asked to run on the CPU backend (``MEGATRON_HETERO_CPU=1``: ``launch
    --cpu``, rehearsals, CI); the one place that reads the variable.
``REDIRECTS``
    The one table of what the backend redirects and why: ``(module, attribute, reason)`` rows.
``SAFE_CUDA_QUERIES``
    ``torch.cuda`` functions left as they are (they answer correctly without CUDA).
``CudaNotCoveredError``
    Raised when megatron-core calls a ``torch.cuda`` function the table does not cover.

``tests/mcore/cuda_coverage.py`` checks the table against the installed megatron-core's source: a scan of
the modules the supported features run, which fails when an upgrade adds a CUDA path that
neither :data:`REDIRECTS` nor its list of deliberate exceptions covers.

What it makes work (megatron-core 0.17.x and 0.19.x, torch 2.13 CPU): ``GPTModel`` on the local
spec, the 1F1B, interleaved 1F1B (virtual pipeline stages: its CUDA uses, the device-literal
token counter and the p2p receive buffers, fall under the device mode; its overlapped sends need
mechanism 5 below) and forward-only schedules, p2p (batched, and the interleaved schedule's
overlapped ``isend``/``irecv``), ``DistributedDataParallel`` (gradient reduction overlapped or not)
with grad buffers, ``finalize_model_grads`` (per-token loss too), the fp32 optimizer from
``get_megatron_optimizer`` (torch Adam or SGD; plain or Megatron's distributed optimizer) with
grad clipping, activation recompute (full and selective), the RNG tracker and TP=2; with
:mod:`megatron_hetero.mcore.cpu_offload` also megatron-core's CPU-offload optimizer and its
fine-grained activation offloading (pinned memory, ``record_stream`` and TE's ``cpu_offload``
flag are covered here); megatron-core's mixture-of-experts layer with expert parallelism over
gloo (router with its load-balancing loss, the all-to-all and all-gather token dispatchers,
sequential experts; the dispatcher's split sizes are the one redirect it needs).

How
---
Nothing in megatron-core is edited. Five mechanisms, all listed in :data:`REDIRECTS`:

1. A ``TorchFunctionMode`` (:class:`_CudaToCpuMode`) pushed for the rest of the process maps
   every CUDA device argument (``device="cuda"``, ``device=torch.cuda.current_device()``,
   ``.cuda()``, ``.to("cuda")``) to the CPU, makes ``Tensor.type()`` answer the CUDA type
   name that megatron-core's fp32 checks compare with, and drops pinned-memory requests.
2. ``torch.cuda`` attributes that megatron-core calls on the CPU path get CPU equivalents
   (streams and events become no-op objects, on which ``Tensor.record_stream`` is a no-op; the
   CUDA RNG state becomes the CPU generator's).
3. megatron-core's own CUDA RNG helpers (``_get_cuda_rng_state``/``_set_cuda_rng_state``) use the
   CPU generator, so ``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()``
   work: the tracker's streams become states of the CPU generator.
4. ``torch.autograd.function.BackwardCFunction.apply`` re-pushes the mode around custom autograd
   Functions' backward: the engine runs inside the mode's handler of ``torch.autograd.backward``,
   where a mode is popped, and megatron's recompute runs its forward there.
5. The overlapped p2p (``_p2p_ops``) keeps every send buffer alive until its request is waited:
   the interleaved schedule frees a pipeline output right after an asynchronous send, a GPU
   allocator pattern that races on gloo.

The mode is thread-local: it covers the thread that called ``enable_cpu_backend`` (CPU autograd
runs the backward on that thread too). It costs about 2.5 us per torch call.

Every other public ``torch.cuda`` function becomes a raiser for callers inside ``megatron``: it
raises :class:`CudaNotCoveredError` naming the megatron function and the ``torch.cuda`` function
("megatron_hetero CPU backend: megatron.core.x.f called torch.cuda.y, not covered"). Callers
outside megatron (torch itself) get the original function.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
import threading

__all__ = ["enable_cpu_backend", "cpu_backend_enabled", "join_cpu_backend", "cpu_mode", "CPU_ENV", "REDIRECTS",
           "CudaNotCoveredError", "SAFE_CUDA_QUERIES"]

CPU_ENV = "MEGATRON_HETERO_CPU"
"""Set to 1 to run on the CPU backend (gloo); a rank's emulated device type is then the plan's."""


def cpu_mode() -> bool:
    """Whether this process runs on the CPU backend: ``$MEGATRON_HETERO_CPU`` set and not 0."""
    return os.environ.get(CPU_ENV, "") not in ("", "0")


class CudaNotCoveredError(RuntimeError):
    """megatron-core reached a ``torch.cuda`` function the CPU backend does not redirect."""


#: ``(module, attribute, reason)``: everything the backend redirects. ``torch.cuda`` rows are
#: global patches of the ``torch.cuda`` namespace; the ``torch`` rows are the device mode.
REDIRECTS: tuple[tuple[str, str, str], ...] = (
    ("torch", "device arguments", "a TorchFunctionMode maps device='cuda'/'cuda:N'/int N and "
     "torch.device('cuda') arguments of every torch function and Tensor method to 'cpu' "
     "(schedules, p2p, grad buffers, finalize, optimizer found_inf, clip_grads, masks)"),
    ("torch.autograd.function", "BackwardCFunction.apply", "runs custom autograd Functions' "
     "backward (megatron's recompute forward among them) under the device mode: the engine "
     "runs inside the mode's handler of torch.autograd.backward, where the mode is popped"),
    ("torch", "Tensor.cuda", "the device mode returns the tensor itself (already on the CPU)"),
    ("torch", "Tensor.type", "the device mode answers 'torch.cuda.FloatTensor' for CPU float32 "
     "tensors, which megatron-core's fp32 optimizer and clip_grads assert"),
    ("torch", "pin_memory", "the device mode drops pin_memory=True from factory calls and "
     "Tensor.pin_memory() returns the tensor: torch without an accelerator has no pinned "
     "memory, and host memory is all there is (the CPU-offload optimizer's host copies and "
     "gradients, fine-grained activation offloading's host pool)"),
    ("torch", "Tensor.record_stream", "a no-op for the no-op stand-in streams below (CPU memory "
     "is not stream-ordered; fine-grained activation offloading records its copies' streams)"),
    ("torch.cuda", "current_device", "returns 0; the device mode maps device 0 to the CPU"),
    ("torch.cuda", "set_device", "no-op: one CPU per process"),
    ("torch.cuda", "synchronize", "no-op: CPU ops run synchronously"),
    ("torch.cuda", "empty_cache", "no-op: no caching allocator"),
    ("torch.cuda", "Stream", "no streams on CPU: an object whose wait/record/synchronize are "
     "no-ops"),
    ("torch.cuda", "Event", "an event whose record/wait/synchronize are no-ops"),
    ("torch.cuda", "stream", "context manager that does nothing"),
    ("torch.cuda", "current_stream", "the no-op stream"),
    ("torch.cuda", "default_stream", "the no-op stream"),
    ("torch.cuda", "set_stream", "no-op"),
    ("torch.cuda", "is_current_stream_capturing", "False: no CUDA graphs on CPU"),
    ("torch.cuda", "get_rng_state", "the CPU generator's state: the 'CUDA' RNG is the CPU one"),
    ("torch.cuda", "set_rng_state", "sets the CPU generator's state"),
    ("torch.cuda", "manual_seed", "seeds the CPU generator (RNG tracker add, "
     "model_parallel_cuda_manual_seed)"),
    ("torch.cuda.random", "get_rng_state", "as torch.cuda.get_rng_state"),
    ("torch.cuda.random", "set_rng_state", "as torch.cuda.set_rng_state"),
    ("torch.cuda.random", "manual_seed", "as torch.cuda.manual_seed"),
    ("torch.cuda.nvtx", "range_push", "no-op (profiling ranges)"),
    ("torch.cuda.nvtx", "range_pop", "no-op (profiling ranges)"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state",
     "reads the CPU generator (it indexes torch.cuda.default_generators otherwise)"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state",
     "sets the CPU generator (it indexes torch.cuda.default_generators otherwise)"),
    ("megatron.core.extensions.transformer_engine", "cpu_offload",
     "Transformer Engine's cpu_offload module, None without TE: fine-grained activation "
     "offloading raises without it, only to set its CPUOffloadEnabled flag, which only TE's own "
     "layers read. A stand-in object with that flag"),
    ("megatron.core.pipeline_parallel.p2p_communication", "_p2p_ops",
     "the overlapped p2p of the interleaved schedule: each isend's buffer is kept alive until "
     "its wait(). Megatron frees a pipeline output's storage right after sending it "
     "(deallocate_pipeline_outputs), which CUDA's stream-ordered allocator makes safe; gloo "
     "reads the buffer asynchronously, so the freed storage raced (wrong losses)"),
    ("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu",
     "the all-to-all token dispatcher's split sizes: on a GPU it copies them to the host as "
     "numpy arrays; it leaves a tensor that is not CUDA as it is, and gloo's all_to_all_single "
     "refuses a tensor as split sizes. The stand-in copies any tensor as the original copies a "
     "CUDA one"),
    ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
     "the dispatcher's own reference to the function above"),
)

#: ``torch.cuda`` functions that are left as they are: queries that answer correctly on a
#: machine without CUDA (``is_available`` is False, so megatron takes its CPU branches).
SAFE_CUDA_QUERIES: frozenset[str] = frozenset({
    "is_available", "device_count", "is_initialized", "manual_seed_all", "seed", "seed_all",
    "get_rng_state_all", "set_rng_state_all", "is_bf16_supported", "is_tf32_supported",
})

_lock = threading.Lock()
_enabled = False
_mode = None


def cpu_backend_enabled() -> bool:
    return _enabled


def join_cpu_backend() -> None:
    """Push the device mode in the calling thread where this process runs on the CPU backend
    (the mode is per thread; :func:`enable_cpu_backend` pushes it in the thread that enables
    it); nothing otherwise. For threads that run megatron-core code, such as the senders of
    :mod:`.mesh_interleaved`; the mode stays pushed for the thread's life."""
    if _enabled and _mode is not None:
        _mode.__enter__()


# -- 1. the device mode ---------------------------------------------------------------------------
def _is_cuda(device) -> bool:
    import torch
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def _make_mode():
    import torch
    from torch.overrides import TorchFunctionMode

    cpu = torch.device("cpu")
    to_methods = {torch.Tensor.to}

    type_names = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
                  torch.bfloat16: "torch.cuda.BFloat16Tensor"}

    class _CudaToCpuMode(TorchFunctionMode):
        """Maps CUDA device arguments to the CPU (see REDIRECTS)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            dev = kwargs.get("device")
            if dev is not None and _is_cuda(dev):
                kwargs = dict(kwargs, device=cpu)
            if kwargs.get("pin_memory"):
                kwargs = dict(kwargs, pin_memory=False)
            if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
                return args[0]
            if func in to_methods and len(args) > 1:
                a = args[1]
                if (isinstance(a, (str, torch.device)) and _is_cuda(a)) or (
                        isinstance(a, int) and not isinstance(a, bool)):
                    args = (args[0], cpu) + tuple(args[2:])
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = type_names.get(args[0].dtype)
                if name is not None:
                    return name
            return func(*args, **kwargs)

    return _CudaToCpuMode()


# -- 2. torch.cuda stand-ins ----------------------------------------------------------------------
class _NoStream:
    """Stands in for ``torch.cuda.Stream``/``Event`` on the CPU: every operation is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *a, **k): pass
    def wait_event(self, *a, **k): pass
    def record_event(self, *a, **k): return _NoStream()
    def record(self, *a, **k): pass
    def wait(self, *a, **k): pass
    def synchronize(self): pass
    def query(self): return True
    def elapsed_time(self, other): return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_STREAM = _NoStream()


class _SendKeepAlive:
    """A send request that holds its buffer's storage until ``wait()`` (see REDIRECTS)."""

    __slots__ = ("_work", "_buffer")

    def __init__(self, work, buffer):
        self._work, self._buffer = work, buffer

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._buffer = None
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


def _keep_send_buffers(original):
    def _p2p_ops(*, tensor_send_prev=None, tensor_send_next=None, **kwargs):
        reqs = original(tensor_send_prev=tensor_send_prev, tensor_send_next=tensor_send_next,
                        **kwargs)
        for key, tensor in (("send_prev", tensor_send_prev), ("send_next", tensor_send_next)):
            if key in reqs and tensor is not None:
                # detach() shares the storage; ``out.data = ...`` later replaces only out's
                reqs[key] = _SendKeepAlive(reqs[key], tensor.detach())
        return reqs

    _p2p_ops.__wrapped__ = original
    return _p2p_ops


def _cuda_standins() -> dict[tuple[str, str], object]:
    import torch
    from megatron.core.pipeline_parallel import p2p_communication

    from .local_offload import te_cpu_offload_module

    def get_rng_state(device="cuda"):
        return torch.get_rng_state()

    def set_rng_state(new_state, device="cuda"):
        torch.set_rng_state(new_state)

    def manual_seed(seed):
        torch.default_generator.manual_seed(int(seed))

    def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if not torch.is_tensor(tensor):
            return tensor
        host = tensor.detach().clone()
        return host.numpy() if as_numpy else host

    nop = lambda *a, **k: None  # noqa: E731
    return {
        ("torch.cuda", "current_device"): lambda: 0,
        ("torch.cuda", "set_device"): nop,
        ("torch.cuda", "synchronize"): nop,
        ("torch.cuda", "empty_cache"): nop,
        ("torch.cuda", "Stream"): _NoStream,
        ("torch.cuda", "Event"): _NoStream,
        ("torch.cuda", "stream"): lambda s=None: contextlib.nullcontext(),
        ("torch.cuda", "current_stream"): lambda device=None: _NO_STREAM,
        ("torch.cuda", "default_stream"): lambda device=None: _NO_STREAM,
        ("torch.cuda", "set_stream"): nop,
        ("torch.cuda", "is_current_stream_capturing"): lambda: False,
        ("torch.cuda", "get_rng_state"): get_rng_state,
        ("torch.cuda", "set_rng_state"): set_rng_state,
        ("torch.cuda", "manual_seed"): manual_seed,
        ("torch.cuda.random", "get_rng_state"): get_rng_state,
        ("torch.cuda.random", "set_rng_state"): set_rng_state,
        ("torch.cuda.random", "manual_seed"): manual_seed,
        ("torch.cuda.nvtx", "range_push"): nop,
        ("torch.cuda.nvtx", "range_pop"): nop,
        ("megatron.core.extensions.transformer_engine", "cpu_offload"):
            te_cpu_offload_module(),
        ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"): _get_cuda_rng_state,
        ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"): _set_cuda_rng_state,
        ("megatron.core.pipeline_parallel.p2p_communication", "_p2p_ops"):
            _keep_send_buffers(p2p_communication._p2p_ops),
        ("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu"):
            maybe_move_tensor_to_cpu,
        ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu"):
            maybe_move_tensor_to_cpu,
    }


def _raiser(name: str, original):
    def raiser(*args, **kwargs):
        frame = sys._getframe(1)
        module = frame.f_globals.get("__name__", "?")
        if module.split(".")[0] != "megatron":
            return original(*args, **kwargs)
        raise CudaNotCoveredError(
            f"megatron_hetero CPU backend: {module}.{frame.f_code.co_name} called "
            f"torch.cuda.{name}, not covered (see megatron_hetero.mcore.cpu_backend.REDIRECTS)")

    raiser.__name__ = name
    raiser.__wrapped__ = original
    return raiser


def _install_raisers() -> None:
    import torch

    covered = {attr for mod, attr, _ in REDIRECTS if mod == "torch.cuda"}
    for name, value in list(vars(torch.cuda).items()):
        if (name.startswith("_") or name in covered or name in SAFE_CUDA_QUERIES
                or not inspect.isfunction(value)):
            continue
        setattr(torch.cuda, name, _raiser(name, value))


def _patch_record_stream() -> None:
    import torch

    original = torch.Tensor.record_stream

    def record_stream(self, stream):
        if isinstance(stream, _NoStream):
            return None
        return original(self, stream)

    record_stream.__wrapped__ = original
    torch.Tensor.record_stream = record_stream


def _patch_backward_apply(mode) -> None:
    from torch.autograd.function import BackwardCFunction
    from torch.overrides import _get_current_function_mode_stack

    original = BackwardCFunction.apply

    def apply(self, *args):
        if mode in _get_current_function_mode_stack():
            return original(self, *args)
        with mode:
            return original(self, *args)

    apply.__wrapped__ = original
    BackwardCFunction.apply = apply


def _distinct(fn, name):
    """A fresh function object per redirect: torch.compile's rule map rejects one object that
    appears under two ``torch.cuda`` names with different rules."""
    def standin(*args, **kwargs):
        return fn(*args, **kwargs)

    standin.__name__ = standin.__qualname__ = name
    return standin


def _build_dynamo_rules() -> None:
    """Build torch.compile's (cached) map of torch functions before ``torch.cuda`` is patched,
    so megatron-core modules that decorate with ``torch.compile`` at import still import."""
    try:
        from torch._dynamo import trace_rules
        trace_rules.get_torch_obj_rule_map()
    except Exception:  # noqa: BLE001 - an optional cache warm-up; compile is not on the CPU path
        pass


# -- enable ---------------------------------------------------------------------------------------
def enable_cpu_backend() -> None:
    """Make megatron-core run on this process's CPU (see the module docstring). Call it before
    building models; calling it again does nothing. Raises ``RuntimeError`` when CUDA is
    available: a GPU run must never be changed."""
    global _enabled, _mode
    import torch

    with _lock:
        if _enabled:
            return
        if torch.cuda.is_available():
            raise RuntimeError("megatron_hetero CPU backend refused: CUDA is available in this "
                               "process, and the backend must never change a GPU run")
        import megatron.core.tensor_parallel.random  # noqa: F401  (patched below)

        keys = {(m, a) for m, a, _ in REDIRECTS if m not in ("torch", "torch.autograd.function")}
        standins = _cuda_standins()
        assert keys == set(standins), keys ^ set(standins)
        _build_dynamo_rules()
        for (module, attr), value in standins.items():
            if inspect.isfunction(value):
                value = _distinct(value, attr)
            setattr(importlib.import_module(module), attr, value)
        _install_raisers()
        _patch_record_stream()
        _mode = _make_mode()
        _patch_backward_apply(_mode)
        _mode.__enter__()  # stays pushed for the rest of the process (this thread)
        _enabled = True
