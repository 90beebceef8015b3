"""Run Megatron-LM's own training loop (``megatron.training.pretrain``) on the CPU backend.

``python -m megatron_hetero.launch --cpu`` (or ``MEGATRON_HETERO_CPU=1``) calls
:func:`prepare_cpu_run` before the training script starts. On top of
:func:`megatron_hetero.mcore.cpu_backend.enable_cpu_backend` (megatron-core on CPU over gloo),
it adapts the few places where Megatron-LM's *training* package insists on a GPU:

* ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda``: it is called with it;
* ``_initialize_distributed`` builds the model-parallel groups and the RNG tracker only when
  ``torch.cuda.device_count() > 0``: the process group is made over gloo with this rank's
  (placed) Megatron rank before it runs, and it sees one device while it runs;
* the memory report (``torch.cuda.memory_*``) answers zeros;
* what any device needs of the installed stack (the dataset helpers of a pip-installed
  megatron-core, module-input offload on the local layers): :mod:`.stack`;
* megatron-core's distributed optimizer over torch's own AdamW (no Apex, no Transformer
  Engine, as on every CPU rank) needs checkpoint fixes on any device: :mod:`.torch_optimizer`,
  which :func:`.stack.prepare_stack` installs wherever the stack lacks Apex and TE;
* ``pretrain`` warms up the fused bias-GeLU/SwiGLU and bias-dropout-add kernels
  (``set_jit_fusion_options`` → ``_warmup_jit_function``, torch.compile on torch 2.2 and later)
  on random tensors of the training shapes placed on ``"cuda"``. On a CPU rank that is seconds
  of compiling per rank (about 4 s of CPU each on this project's 2-core machine, every launch)
  for kernels a GPU would use, and its ``torch.rand`` draws from the CPU generator that
  ``--use-cpu-initialization`` then initialises the weights from (on a GPU they come from the
  CUDA generator): the warmup is skipped, and a fusion the model does use compiles on its
  first call instead;
* building the data iterators draws from the CPU generator (a DataLoader iterator takes its
  base seed from it), which on a CPU rank is also the one dropout draws from (the CUDA
  generator's stand-in): a resumed run, which builds them after the checkpoint restored the
  RNG state, would shift every later mask. The generator's state is given back after
  ``build_train_valid_test_data_iterators``, as a GPU's CUDA generator never sees that draw;
* megatron-core's optimizer offload and fine-grained activation offloading (a plan's
  ``offload.optimizer_fraction`` and ``offload.module_inputs``): :mod:`.cpu_offload`.

Nothing here is used on a GPU run; :func:`prepare_cpu_run` refuses when CUDA is available.
"""

from __future__ import annotations

import contextlib
import functools
import os

from ..mcore.rebind import rebind, skipped
from .cpu_offload import prepare_cpu_offload
from .stack import prepare_stack

__all__ = ["prepare_cpu_run", "init_cpu_process_group"]


@contextlib.contextmanager
def _one_device():
    import torch

    saved = torch.cuda.device_count
    torch.cuda.device_count = lambda: 1
    try:
        yield
    finally:
        torch.cuda.device_count = saved


def init_cpu_process_group(args) -> None:
    """The default process group over gloo with the (placed) Megatron rank in ``args.rank``."""
    from datetime import timedelta

    import torch.distributed as dist

    args.distributed_backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size,
                                timeout=timedelta(minutes=args.distributed_timeout_minutes))


def _wrap_initialize_megatron(original):
    @functools.wraps(original)
    def initialize_megatron(*a, **kw):
        kw["allow_no_cuda"] = True
        return original(*a, **kw)
    return initialize_megatron


def _wrap_initialize_distributed(original):
    @functools.wraps(original)
    def _initialize_distributed(*a, **kw):
        from megatron.training.global_vars import get_args

        init_cpu_process_group(get_args())
        with _one_device():
            return original(*a, **kw)
    return _initialize_distributed


def _wrap_set_random_seed(original):
    @functools.wraps(original)
    def _set_random_seed(*a, **kw):
        with _one_device():
            return original(*a, **kw)
    return _set_random_seed


def _wrap_data_iterators(original):
    @functools.wraps(original)
    def build_train_valid_test_data_iterators(*a, **kw):
        import torch

        state = torch.get_rng_state()
        try:
            return original(*a, **kw)
        finally:
            torch.set_rng_state(state)
    return build_train_valid_test_data_iterators


def prepare_cpu_run() -> None:
    """Make ``megatron.training.pretrain`` run on this process's CPU (see the module docstring)."""
    import torch

    from ..mcore.cpu_backend import enable_cpu_backend

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    enable_cpu_backend()
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *a, **k: 0)
    torch.cuda.memory_stats = lambda *a, **k: {}
    rebind("megatron.training.initialize", "initialize_megatron", _wrap_initialize_megatron,
           layer="cpu")
    rebind("megatron.training.initialize", "_initialize_distributed",
           _wrap_initialize_distributed, layer="cpu")
    rebind("megatron.training.initialize", "_set_random_seed", _wrap_set_random_seed,
           layer="cpu")
    rebind("megatron.training.initialize", "_warmup_jit_function", skipped, layer="cpu")
    rebind("megatron.training.training", "build_train_valid_test_data_iterators",
           _wrap_data_iterators, layer="cpu")
    prepare_cpu_offload()
    prepare_stack()
    import megatron.training.arguments as margs

    if hasattr(margs, "get_device_arch_version"):
        margs.get_device_arch_version = lambda: 0  # asked for a TP > 1 performance hint only
