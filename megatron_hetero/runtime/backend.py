"""What a runtime backend does at each of the hook points (:mod:`.hooks`).

:func:`megatron_hetero.runtime.hooks.install` wraps Megatron's functions once; each wrapper
calls straight through while no plan is applied, and otherwise hands the call, with Megatron's
``original`` function, to this rank's :class:`Backend`. Two backends implement it:

* :class:`megatron_hetero.runtime.core_run.CoreBackend`: megatron-core's own schedules (every
  stage shares TP and DP: interleaving, per-stage warm-ups, vendors, sequence parallelism);
* :class:`megatron_hetero.runtime.mesh_run.MeshBackend`: megatron-core's multimodule pipeline
  (meshes of different TP and DP); its :class:`megatron_hetero.runtime.mesh_chunks.InterleavedMeshBackend`
  runs a chain whose stages hold model chunks on our interleaved schedule over the meshes.

The abstract methods are the points every backend changes; the others call ``original``
unchanged unless a backend needs them. A backend is made by :meth:`Backend.start` inside
``validate_args``, once per process, and holds that rank's state (``state``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

__all__ = ["Backend"]


class Backend(ABC):
    """One rank's plan inside Megatron's training loop (see the module docstring)."""

    __slots__ = ()

    state: object
    """This rank's placement and plan (its plan, ``plan_path``, ``launcher_rank``, ``slot``,
    ``device_type`` and ``describe()``)."""

    @classmethod
    @abstractmethod
    def start(cls, args, plan, *, path: str, argv: Sequence[str]) -> "Backend":
        """Before Megatron's ``validate_args``: check the command line against ``plan`` (read
        from ``path``), place this process on a rank of the plan (``args.rank`` becomes it) and
        set that rank's arguments; refuse, before anything is built, what cannot run."""

    # -- the points every backend changes ---------------------------------------------------

    @abstractmethod
    def validate_args(self, original, args, *a, **kw):
        """``megatron.training.arguments.validate_args``: Megatron's own checks, then this
        backend's of what they computed."""

    @abstractmethod
    def transformer_config(self, original, *a, **kw):
        """``core_transformer_config_from_args``: the config of this rank's stage."""

    @abstractmethod
    def get_model(self, original, model_provider_func, *a, **kw):
        """``megatron.training.training.get_model``: this rank's model chunks."""

    @abstractmethod
    def forward_backward_func(self, original, *a, **kw):
        """``get_forward_backward_func``: the schedule this rank runs every step."""

    @abstractmethod
    def data_loader(self, original, dataset, consumed_samples, *a, **kw):
        """``build_pretraining_data_loader``: what this rank's replica reads."""

    # -- points a backend may change (straight through by default) ---------------------------

    def initialize_model_parallel(self, original, *a, **kw):
        """``parallel_state.initialize_model_parallel``: this rank's process groups."""
        return original(*a, **kw)

    def create_group(self, original, *a, **kw):
        """``parallel_state.create_group``: one process group (its backend)."""
        return original(*a, **kw)

    def is_pipeline_first_stage(self, original, *a, **kw):
        """``parallel_state.is_pipeline_first_stage``."""
        return original(*a, **kw)

    def is_pipeline_last_stage(self, original, *a, **kw):
        """``parallel_state.is_pipeline_last_stage``."""
        return original(*a, **kw)

    def finalize_model_grads(self, original, *a, **kw):
        """``megatron.training.training.finalize_model_grads``."""
        return original(*a, **kw)

    def get_megatron_optimizer(self, original, *a, **kw):
        """``megatron.training.training.get_megatron_optimizer``."""
        return original(*a, **kw)

    def validate_sharding_for_key(self, original, *a, **kw):
        """``dist_checkpointing.validation._validate_sharding_for_key``: a checkpoint's
        sharding check of one key."""
        return original(*a, **kw)

    def get_rng_state(self, original, *a, **kw):
        """``megatron.training.checkpointing.get_rng_state``: the RNG state a checkpoint keeps."""
        return original(*a, **kw)

    def load_base_checkpoint(self, original, *a, **kw):
        """``megatron.training.checkpointing._load_base_checkpoint``: a checkpoint's state
        read (``(state_dict, name, release, type)``), before Megatron restores from it."""
        return original(*a, **kw)
