"""megatron-core 0.17's offload paths on the CPU stack (``python -m megatron_hetero.launch --cpu``).

:func:`prepare_cpu_offload` is called by :func:`.cpu.prepare_cpu_run`. Each fix below answers one
fault seen when a plan's stage offloads on CPU ranks (torch's AdamW, fp32, no Transformer Engine);
nothing here runs on a GPU.

Optimizer offload (``Offload.optimizer_fraction``: ``--optimizer-cpu-offload
--optimizer-offload-fraction F --use-precision-aware-optimizer``, megatron-core's
``HybridDeviceOptimizer``, HDO):

* The HDO splits its parameters by ``param.is_cuda``: the first fraction F of the device's
  parameters get host copies updated by per-parameter host optimizers, the rest stay with the
  "GPU" optimizer. On a CPU rank no parameter is CUDA, so nothing would be offloaded and its
  host optimizers would look for device parameters that do not exist (``KeyError`` in
  ``_set_sub_optimizer_grads``). While it splits, the parameters it was given count as this
  rank's device parameters (the rank plays a GPU), so the fraction is honoured as on a GPU.
* A rank whose stage does not offload still has ``--use-precision-aware-optimizer`` (a flag
  common to all ranks), and megatron-core's ``OptimizerConfig`` then requires TE's FusedAdam
  ("--use-precision-aware-optimizer requires FusedAdam from TransformerEngine"). Without TE,
  such a rank runs the usual distributed optimizer over torch's AdamW, which is what it means.
* With fp32 parameters (the CPU stack's only precision) megatron-core 0.17.1's HDO cannot run
  under the distributed optimizer, on any device: the optimizer's fp32 shards are views of the
  model's parameters (``model_param.view(-1)[...]``, not detached), which a new HDO refuses
  (``ValueError: can't optimize a non-leaf Tensor``); the shards that stay with the "GPU"
  optimizer get their gradient as ``decoupled_grad`` only (the 16-bit path gives their fp32
  copies ``.grad``), which torch's AdamW does not read, so they would never move; and a loaded
  state's ``master_param`` is copied through ``param_to_fp32_param``, which has no fp32 entry
  (``KeyError``). On the CPU stack the fp32 shards are detached views (the same storage), the
  "GPU" optimizer reads ``decoupled_grad`` as ``.grad``, and a loaded ``master_param`` goes to
  the parameter that the HDO updates (the host copy, or the shard itself).
* A fresh HDO has no state, which the distributed optimizer's ``state_dict()`` asserts on the
  torch-AdamW stack (the checkpoint load builds it first): :func:`allocate_hdo_state` allocates
  its AdamW state as AdamW does on its first step, as :mod:`.cpu` does without offload.

Module-input offload (``Offload.module_inputs``: megatron-core's fine-grained activation
offloading) needs from Transformer Engine only a flag its manager sets on TE's ``cpu_offload``
module, which only TE layers read (:mod:`megatron_hetero.mcore.cpu_backend` stands in for it,
for pinned memory and for ``record_stream``). Megatron-LM's ``validate_args`` asserts
``--transformer-impl transformer_engine`` for it: on the CPU stack the local layers run it, so
``validate_args`` does not see the flag (set again right after). ``pretrain`` pins the process
to its GPU's NUMA node (``set_ideal_affinity_for_current_gpu``, cuda-python and NVML): a CPU rank
has none.
"""

from __future__ import annotations

import contextlib
import functools

from ._rebind import is_wrapper, mark_wrapper, rebind

__all__ = ["prepare_cpu_offload", "allocate_hdo_state"]


@contextlib.contextmanager
def _as_device_params(params):
    """``Tensor.is_cuda`` is True for ``params`` (and only them) inside the block."""
    import torch

    ids = {id(p) for p in params}
    base = torch._C.TensorBase.is_cuda
    torch.Tensor.is_cuda = property(lambda t: id(t) in ids or base.__get__(t))
    try:
        yield
    finally:
        del torch.Tensor.is_cuda


def _wrap_split(original):
    @functools.wraps(original)
    def _get_sub_optimizer_param_groups(self, offload_fraction):
        with _as_device_params(p for g in self.param_groups for p in g["params"]):
            return original(self, offload_fraction)
    return _get_sub_optimizer_param_groups


def _wrap_step(original):
    @functools.wraps(original)
    def step(self, closure=None):
        if self.gpu_optimizer is not None:
            copies = {id(p) for p in self.param_to_fp32_param.values()}
            for group in self.gpu_optimizer.param_groups:
                for p in group["params"]:
                    if id(p) not in copies:  # fp32 copies of 16-bit params get theirs from HDO
                        p.grad = getattr(p, "decoupled_grad", None)
        return original(self, closure)
    return step


def _wrap_update_fp32(original):
    @functools.wraps(original)
    def _update_fp32_params_by_new_state(self):
        import torch

        if not self.param_update_in_fp32:
            return original(self)
        sixteen_bit = {}
        with torch.no_grad():
            for param, state in list(self.state.items()):
                if param in self.param_to_fp32_param:
                    sixteen_bit[param] = state
                elif "master_param" in state:
                    inner = self.param_to_inner_param.get(param, param)
                    inner.copy_(state["master_param"])
        saved, self.state = self.state, sixteen_bit
        try:
            return original(self)
        finally:
            self.state = saved
    return _update_fp32_params_by_new_state


def _wrap_build_groups(original):
    def _build_model_and_main_param_groups(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges,
                                           config):
        from megatron.core import tensor_parallel

        groups = original(gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        if not getattr(config, "optimizer_cpu_offload", False):
            return groups
        _, model_fp32_groups, _, shard_fp32_groups, _ = groups
        for models, shards, ranges in zip(model_fp32_groups, shard_fp32_groups, opt_group_ranges):
            params = ranges["orig_group"]["params"]
            for i, (model_param, shard) in enumerate(zip(models, shards)):
                leaf = shard.detach()
                tensor_parallel.copy_tensor_model_parallel_attributes(leaf, model_param)
                if hasattr(model_param, "shared"):
                    leaf.shared = model_param.shared
                shards[i] = leaf
                params[:] = [leaf if p is shard else p for p in params]
        return groups
    return _build_model_and_main_param_groups


def allocate_hdo_state(hdo) -> None:
    """A fresh HDO's AdamW state as AdamW allocates it on its first step (step 0, zero
    moments); called by :mod:`.cpu`'s wrapper of the distributed optimizer's ``state_dict``."""
    import torch

    for sub in hdo.sub_optimizers:
        if not isinstance(sub, torch.optim.AdamW):
            return
        for group in sub.param_groups:
            for p in group["params"]:
                state = sub.state[p]
                state.setdefault("step", torch.tensor(0.0))
                state.setdefault("exp_avg", torch.zeros_like(p))
                state.setdefault("exp_avg_sq", torch.zeros_like(p))
    hdo._sync_sub_optimizers_state_to_hdo()


def _wrap_post_init(original):
    @functools.wraps(original)
    def __post_init__(self):
        from megatron.core.optimizer import distrib_optimizer

        if (self.use_precision_aware_optimizer and not self.optimizer_cpu_offload
                and not distrib_optimizer.HAVE_APEX_OR_TE):
            self.use_precision_aware_optimizer = False
        return original(self)
    return __post_init__


def _wrap_validate_args(original):
    @functools.wraps(original)
    def validate_args(args, *a, **kw):
        offloading = getattr(args, "fine_grained_activation_offloading", False)
        if offloading and getattr(args, "transformer_impl", None) == "local":
            args.fine_grained_activation_offloading = False
            try:
                return original(args, *a, **kw)
            finally:
                args.fine_grained_activation_offloading = offloading
        return original(args, *a, **kw)
    return validate_args


def _no_gpu_affinity(original):
    @functools.wraps(original)
    def set_ideal_affinity_for_current_gpu(*a, **kw):
        return None
    return set_ideal_affinity_for_current_gpu


def _patch(cls, name: str, wrap, *, as_classmethod: bool = False) -> None:
    original = getattr(cls, name, None)
    if original is None or is_wrapper(original, "cpu"):
        return
    wrapper = wrap(original)
    mark_wrapper(wrapper, original, "cpu")
    setattr(cls, name, classmethod(wrapper) if as_classmethod else wrapper)


def prepare_cpu_offload() -> None:
    """Install the fixes above (idempotent; the CPU backend is enabled already)."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    _patch(HybridDeviceOptimizer, "_get_sub_optimizer_param_groups", _wrap_split)
    _patch(HybridDeviceOptimizer, "step", _wrap_step)
    _patch(HybridDeviceOptimizer, "_update_fp32_params_by_new_state", _wrap_update_fp32)
    _patch(DistributedOptimizer, "_build_model_and_main_param_groups", _wrap_build_groups,
           as_classmethod=True)
    _patch(OptimizerConfig, "__post_init__", _wrap_post_init)
    rebind("megatron.training.arguments", "validate_args", _wrap_validate_args, layer="cpu")
    rebind("megatron.core.pipeline_parallel.utils", "set_ideal_affinity_for_current_gpu",
           _no_gpu_affinity, layer="cpu")
