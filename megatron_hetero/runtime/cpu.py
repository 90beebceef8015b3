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
* the distributed optimizer over torch's own AdamW (no Apex, no Transformer Engine: the CPU
  stack) reads Adam's ``step`` from every parameter's state in ``state_dict()`` and asserts
  there is exactly one (megatron-core 0.17.1 ``DistributedOptimizer.state_dict``). Before the
  first step the state is empty, so loading a checkpoint (which builds the sharded state dict
  of the fresh optimizer first) fails with a bare ``AssertionError``. The state is allocated
  first as Megatron's own optimizer would (``init_state_fn``) with ``step`` 0, which is what a
  fresh AdamW does on its first step; loading then overwrites all of it. Loading the fully
  reshardable format (``--dist-ckpt-optim-fully-reshardable``) then copies every tensor of a
  parameter's AdamW state from the checkpoint, ``step`` included, which that format keeps
  apart (``KeyError: 'step'`` in ``_set_main_param_and_optimizer_states``); the default
  ``dp_reshardable`` format copies a ``step`` that is the fresh optimizer's (0: every resumed
  step then takes Adam's first-step bias correction). The step, already set from the
  checkpoint's parameter groups, is left as it is in both. And ``load_state_dict`` gives
  every parameter's state the *same* ``step`` tensor, which torch's AdamW then advances once
  per parameter in every step (a wrong bias correction after any resume): each parameter gets
  its own copy. In fp32 the main parameters are views of the model's (which require grad), and
  the default ``dp_reshardable`` format copies into them outside ``no_grad`` (``RuntimeError: a
  view of a leaf Variable that requires grad is being used in an in-place operation``): the copy
  runs under ``no_grad``, as the fully reshardable format's already does.
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

from ..mcore.rebind import rebind, skipped, wrap_method
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


def _wrap_optimizer_state_dict(original):
    @functools.wraps(original)
    def state_dict(self, *a, **kw):
        import torch
        from megatron.core.optimizer import distrib_optimizer

        from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

        from ..mcore.cpu_offload import allocate_hdo_state

        inner = self.optimizer
        if (not distrib_optimizer.HAVE_APEX_OR_TE and isinstance(inner, HybridDeviceOptimizer)
                and len(inner.state) == 0):
            allocate_hdo_state(inner)
        elif (not distrib_optimizer.HAVE_APEX_OR_TE and isinstance(inner, torch.optim.Optimizer)
                and len(inner.state) == 0 and callable(getattr(self, "init_state_fn", None))):
            self.init_state_fn(inner, self.config)
            for group in inner.param_groups:
                for param in group["params"]:
                    inner.state[param].setdefault("step", torch.tensor(0.0))
        return original(self, *a, **kw)
    return state_dict


def _wrap_set_states(original):
    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        import torch

        # the step comes from the checkpoint's parameter groups (load_state_dict set it); a
        # "step" here is the fresh optimizer's. Megatron skips what is not a tensor.
        tensors = {**tensors, "step": None}
        with torch.no_grad():
            return original(self, model_param, tensors)
    return _set_main_param_and_optimizer_states


def _wrap_load_state_dict(original):
    @functools.wraps(original)
    def load_state_dict(self, *a, **kw):
        import torch

        result = original(self, *a, **kw)
        inner = self.optimizer
        if isinstance(inner, torch.optim.Optimizer):
            for state in inner.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()
        return result
    return load_state_dict


def _patch_torch_optimizer_checkpoints() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for name, wrap in (("state_dict", _wrap_optimizer_state_dict),
                       ("load_state_dict", _wrap_load_state_dict),
                       ("_set_main_param_and_optimizer_states", _wrap_set_states)):
        wrap_method(DistributedOptimizer, name, wrap, layer="cpu")


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
    _patch_torch_optimizer_checkpoints()
    prepare_cpu_offload()
    prepare_stack()
    import megatron.training.arguments as margs

    if hasattr(margs, "get_device_arch_version"):
        margs.get_device_arch_version = lambda: 0  # asked for a TP > 1 performance hint only
