"""megatron-core's offload paths on the CPU backend: what every CPU run of them needs (the
runtime's ``python -m megatron_hetero.launch --cpu`` and the rehearsal's trainer alike).

:func:`enable_cpu_offload` installs the fixes below (after
:func:`~.cpu_backend.enable_cpu_backend`); :mod:`megatron_hetero.runtime.cpu_offload` adds what
only Megatron-LM's training loop needs (``validate_args``, GPU affinity). Each fix answers one
fault seen when a plan's stage offloads on CPU ranks (torch's AdamW, fp32, no Transformer
Engine); nothing here runs on a GPU. megatron-core 0.16.1 and 0.17.1 both have the two paths
(:func:`optimizer_offload_supported`, :func:`module_input_offload_supported`).

Optimizer offload (``Offload.optimizer_fraction``: ``optimizer_cpu_offload``,
``optimizer_offload_fraction`` F and ``use_precision_aware_optimizer`` in ``OptimizerConfig``,
megatron-core's ``HybridDeviceOptimizer``, HDO):

* The HDO splits its parameters by ``param.is_cuda``: the first fraction F of the device's
  parameters get host copies updated by per-parameter host optimizers, the rest stay with the
  "GPU" optimizer. On a CPU rank no parameter is CUDA, so nothing would be offloaded and its
  host optimizers would look for device parameters that do not exist (``KeyError`` in
  ``_set_sub_optimizer_grads``). While it splits, the parameters it was given count as this
  rank's device parameters (the rank plays a GPU), so the fraction is honoured as on a GPU.
* A rank whose stage does not offload still has ``use_precision_aware_optimizer`` when Megatron-LM
  sets it for all ranks, and megatron-core's ``OptimizerConfig`` then requires TE's FusedAdam
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
* megatron-core 0.16.1's ``OptimizerConfig`` asks for Transformer Engine's version with the
  precision-aware optimizer, which is None without TE (``TypeError`` comparing it): it is
  version 0.0.0 there, as megatron-core 0.17 answers.
* A fresh HDO has no state, which the distributed optimizer's ``state_dict()`` asserts on the
  torch-AdamW stack (a checkpoint load builds it first): :func:`allocate_hdo_state` allocates
  its AdamW state as AdamW does on its first step.

Module-input offload (``Offload.module_inputs``: megatron-core's fine-grained activation
offloading) needs from Transformer Engine only a flag its manager sets on TE's ``cpu_offload``
module, which only TE layers read (:mod:`.local_offload` stands in for it, on a GPU too;
:mod:`.cpu_backend` for pinned memory and ``record_stream``), so the local layers run it. Megatron assumes every rank offloads or none
does: after the first step an offloading rank prints its offload summary through world-wide
collectives (``print_offload_summary_table``: two ``all_gather_object`` and a barrier). With a
plan that offloads on some stages only, the other ranks join those collectives once, with
nothing to report, after their first ``forward_backward`` call (:func:`join_offload_summary`),
so nobody waits forever. From megatron-core 0.19 its offload hooks manage only tensors on a
``cuda`` device (``ChunkOffloadHandler._can_manage_tensor_for_offload``): on a CPU rank, which
plays a GPU, a CPU tensor is asked about as if it were on that device (:func:`_wrap_can_manage`).
"""

from __future__ import annotations

import contextlib
import functools
from functools import cache

from ..plan import MeshStage, Plan, Stage
from .rebind import is_wrapper, mark_wrapper, wrap_method

__all__ = ["enable_cpu_offload", "allocate_hdo_state", "join_offload_summary",
           "optimizer_offload_supported", "module_input_offload_supported"]


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


@contextlib.contextmanager
def _reported_on_device(tensor):
    """``Tensor.device`` is ``cuda`` for ``tensor`` (and only it) inside the block."""
    import torch

    base = torch._C.TensorBase.device
    device = torch.device("cuda")
    torch.Tensor.device = property(lambda t: device if t is tensor else base.__get__(t))
    try:
        yield
    finally:
        del torch.Tensor.device


def _wrap_can_manage(original):
    @functools.wraps(original)
    def can_manage(tensor):
        if tensor.device.type != "cpu":
            return original(tensor)
        with _reported_on_device(tensor):
            return original(tensor)
    return can_manage


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
    moments); called by the runtime's wrapper of the distributed optimizer's ``state_dict``
    (:mod:`megatron_hetero.runtime.cpu`)."""
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


def enable_cpu_offload() -> None:
    """Install the fixes above (idempotent; the CPU backend is enabled already). Nothing
    without megatron-core's CPU-offload optimizer."""
    if not optimizer_offload_supported():
        return
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    wrap_method(HybridDeviceOptimizer, "_get_sub_optimizer_param_groups", _wrap_split,
                layer="cpu")
    wrap_method(HybridDeviceOptimizer, "step", _wrap_step, layer="cpu")
    wrap_method(HybridDeviceOptimizer, "_update_fp32_params_by_new_state", _wrap_update_fp32,
                layer="cpu")
    wrap_method(DistributedOptimizer, "_build_model_and_main_param_groups", _wrap_build_groups,
                layer="cpu", as_classmethod=True)
    wrap_method(OptimizerConfig, "__post_init__", _wrap_post_init, layer="cpu")
    try:
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
            ChunkOffloadHandler,
        )
    except ImportError:
        ChunkOffloadHandler = None
    check = getattr(ChunkOffloadHandler, "_can_manage_tensor_for_offload", None)
    if check is not None and not is_wrapper(check, "cpu"):  # megatron-core 0.19 and later
        wrapper = _wrap_can_manage(check)
        mark_wrapper(wrapper, check, "cpu")
        ChunkOffloadHandler._can_manage_tensor_for_offload = staticmethod(wrapper)
    from megatron.core import utils

    if getattr(utils, "_te_version", "absent") is None and not utils.get_te_version():
        from packaging.version import Version

        utils._te_version = Version("0.0.0")  # as megatron-core 0.17 answers without TE


@cache
def optimizer_offload_supported() -> bool:
    """Whether megatron-core has its CPU-offload (hybrid device) optimizer."""
    try:
        from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer  # noqa: F401
    except ImportError:
        return False
    return True


def module_input_offload_supported() -> bool:
    """Whether the installed megatron-core has fine-grained activation offloading (its
    ``TransformerConfig`` field and the summary collective :func:`join_offload_summary` joins)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "fine_grained_activation_offloading" not in TransformerConfig.__dataclass_fields__:
        return False
    try:
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import (  # noqa: F401
            print_offload_summary_table)
    except ImportError:
        return False
    return True


def join_offload_summary(forward_backward, plan: Plan, stage: Stage | MeshStage):
    """``forward_backward`` for a rank of ``plan`` (a format-1 or a mesh plan; ``stage`` the
    rank's) that does not offload module inputs while others do: after its first call it joins
    megatron-core's offload summary collectives once (see the module docstring). Otherwise
    ``forward_backward`` itself."""
    if stage.offload.module_inputs or not plan.offloads_module_inputs:
        return forward_backward
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    @functools.wraps(forward_backward)
    def joined(*a, **kw):
        result = forward_backward(*a, **kw)
        if not _joined[0]:
            _joined[0] = True
            fgo.print_offload_summary_table({})  # this rank offloads nothing
        return result
    return joined


_joined = [False]  # this process joined the offload summary (once per process, as Megatron)
