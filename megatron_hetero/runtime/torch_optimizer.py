"""megatron-core's distributed optimizer over torch's own optimizers: checkpoint fixes.

Where neither Apex nor Transformer Engine is installed (every CPU rank; a GPU image without
them) megatron-core's ``DistributedOptimizer`` steps torch's own AdamW, and its checkpoints
break in the ways below, fixed here on any device (:func:`prepare_torch_optimizer_checkpoints`,
which :func:`.stack.prepare_stack` calls; with Apex or TE nothing is changed). These were CPU-only
fixes (``MEGATRON_HETERO_CPU=1``) until issue 33: they follow the stack, not the device.

It reads Adam's ``step`` from every parameter's state in ``state_dict()`` and asserts there is
exactly one (megatron-core 0.17.1 ``DistributedOptimizer.state_dict``). Before the
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
"""

from __future__ import annotations

import functools

from ..mcore.cpu_offload import allocate_hdo_state
from ..mcore.rebind import wrap_method

__all__ = ["prepare_torch_optimizer_checkpoints", "runs_torch_optimizers"]


def runs_torch_optimizers() -> bool:
    """Whether megatron-core's distributed optimizer steps torch's own optimizers here (it found
    neither Apex nor Transformer Engine)."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def _wrap_optimizer_state_dict(original):
    @functools.wraps(original)
    def state_dict(self, *a, **kw):
        import torch
        from megatron.core.optimizer import distrib_optimizer

        from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

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


def prepare_torch_optimizer_checkpoints() -> None:
    """Install the fixes (idempotent) where :func:`runs_torch_optimizers`; else nothing."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not runs_torch_optimizers():
        return
    for name, wrap in (("state_dict", _wrap_optimizer_state_dict),
                       ("load_state_dict", _wrap_load_state_dict),
                       ("_set_main_param_and_optimizer_states", _wrap_set_states)):
        wrap_method(DistributedOptimizer, name, wrap, layer="stack")
