"""Hooks that apply ``--hetero-plan`` inside an unchanged Megatron-LM training script: the one
runtime entry, reached from ``python -m megatron_hetero.launch`` and from a patched script.

:func:`install` wraps Megatron-LM's own functions (rebinding every module-level name that
refers to them, so ``from megatron.training.arguments import validate_args`` done before or
after installing sees the wrapper) and returns this process's :class:`Runtime`, the one object
that holds what the hooks decide. Nothing of Megatron is copied; each wrapper calls the
original. ``parse_args`` gets ``--hetero-plan`` / ``--hetero-device-type`` in the script's
``extra_args_provider``. In ``validate_args`` a command line with ``--hetero-plan`` picks this
rank's backend from the plan's shape (:func:`backend_class`) and starts it (placement, the
plan's arguments, the stage's policies); from then on every other wrapper hands its call to
that backend (:class:`.backend.Backend`: what each does at each point is documented in
:mod:`.core_run` and :mod:`.mesh_run`). With no ``--hetero-plan`` every wrapper calls straight
through.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Sequence

from ..errors import HeteroError
from ..mcore.cpu_backend import cpu_mode
from ..mcore.rebind import is_wrapper, rebind
from ..plan import load_plan
from .arguments import add_hetero_args
from . import releases
from .backend import Backend
from .builders import wrap_builders
from .core_run import CoreBackend
from .cpu import prepare_cpu_run
from .mesh_chunks import InterleavedMeshBackend
from .mesh_run import MeshBackend
from .meshes import mesh_plan_of
from .stack import prepare_stack
from .telemetry import POINTS as TELEMETRY_POINTS
from .telemetry import Telemetry
from .rebalance import LiveShares

__all__ = ["install", "installed", "Runtime", "backend_class", "LAUNCHER_RANK_ENV"]

LAUNCHER_RANK_ENV = "MEGATRON_HETERO_LAUNCHER_RANK"
"""Set by the hooks to the launcher's rank; ``RANK`` becomes the placed Megatron rank."""

_RUNTIME_MARK = "_megatron_hetero_runtime"
"""The attribute of the ``validate_args`` wrapper that holds its :class:`Runtime`."""


def backend_class(plan) -> type[Backend]:
    """The backend that runs ``plan``: megatron-core's own schedules where the plan is one grid
    (one mesh: every stage shares TP and DP and each replica runs one pipeline through all of
    them), the multimodule backend for a chain of meshes, with the chain's own schedule where
    its stages run model chunks or warm up other than Megatron's
    (:attr:`~megatron_hetero.plan.Plan.own_chain_schedule`). The one choice of backend."""
    if plan.one_grid:
        return CoreBackend
    return InterleavedMeshBackend if plan.own_chain_schedule else MeshBackend


def _load(path: str):
    """The plan in ``path``; a mesh plan is refused on a megatron-core that cannot run it."""
    mesh = mesh_plan_of(path)
    return mesh if mesh is not None else load_plan(path)


@dataclass(kw_only=True, slots=True)
class Runtime:
    """This process's megatron-hetero state: :func:`install` makes one and its wrappers hold it."""

    backend: Backend | None = None
    """This rank's backend once ``validate_args`` ran with ``--hetero-plan``; None before, or
    without a plan (every wrapper then calls straight through)."""
    telemetry: Telemetry | None = None
    """This rank's telemetry collector where ``--hetero-telemetry`` asks for one."""

    @property
    def state(self):
        """This rank's placement and plan (the backend's rank state), or None."""
        return None if self.backend is None else self.backend.state

    def start(self, args, argv: Sequence[str] | None = None) -> Backend | None:
        """Apply the plan of ``args.hetero_plan`` to this rank's parsed ``args`` (before
        Megatron's ``validate_args``): the backend of the plan's shape, started; None without
        a plan. ``argv``: the command line (default ``sys.argv[1:]``)."""
        self.backend = self.telemetry = None
        path = getattr(args, "hetero_plan", None)
        if not path:
            return None
        argv = sys.argv[1:] if argv is None else argv
        plan = _load(path)
        backend = backend_class(plan).start(args, plan, path=path, argv=argv)
        os.environ[LAUNCHER_RANK_ENV] = str(backend.state.launcher_rank)
        self.backend = backend
        self.telemetry = Telemetry.start(args, backend.state)
        live = LiveShares.start(args, backend, source=path)
        if live is not None:
            self.telemetry.live = live
        return backend

    def validate_args(self, original, args, *a, **kw):
        """Megatron's ``validate_args`` on the plan's arguments for this rank."""
        backend = self.start(args)
        if backend is None:
            return original(args, *a, **kw)
        return backend.validate_args(original, args, *a, **kw)

    def wrap(self, point: str, original):
        """``original`` (Megatron's function of hook point ``point``: a :class:`.Backend`
        method's name) handed to this rank's backend, or called straight through."""
        if point == "validate_args":
            @functools.wraps(original)
            def validate_args(*a, **kw):
                return self.validate_args(original, *a, **kw)
            return validate_args

        if point in _TELEMETRY_ONLY:
            @functools.wraps(original)
            def timed(*a, **kw):
                if self.telemetry is None:
                    return original(*a, **kw)
                return getattr(self.telemetry, point)(original, *a, **kw)
            return timed

        @functools.wraps(original)
        def wrapper(*a, **kw):
            if self.backend is None:
                return original(*a, **kw)
            call = functools.partial(getattr(self.backend, point), original)
            if self.telemetry is not None and point == "finalize_model_grads":
                return self.telemetry.finalize_model_grads(call, *a, **kw)
            return call(*a, **kw)
        return wrapper


def with_hetero_args(provider):
    """An ``extra_args_provider`` that adds ``--hetero-plan`` / ``--hetero-device-type`` (once)
    after ``provider``'s arguments."""
    def provide(parser):
        if provider is not None:
            parser = provider(parser)
        if "--hetero-plan" not in parser._option_string_actions:
            parser = add_hetero_args(parser)
        return parser
    return provide


def _wrap_parse_args(original):
    @functools.wraps(original)
    def parse_args(extra_args_provider=None, *a, **kw):
        return original(with_hetero_args(extra_args_provider), *a, **kw)
    return parse_args


_TARGETS = (  # (module, function, hook point: the Backend method it goes to)
    ("megatron.training.arguments", "validate_args", "validate_args"),
    ("megatron.training.arguments", "core_transformer_config_from_args", "transformer_config"),
    ("megatron.training.training", "get_model", "get_model"),
    ("megatron.training.training", "get_forward_backward_func", "forward_backward_func"),
    ("megatron.training.training", "build_pretraining_data_loader", "data_loader"),
    ("megatron.core.parallel_state", "initialize_model_parallel", "initialize_model_parallel"),
    ("megatron.core.parallel_state", "create_group", "create_group"),
    ("megatron.core.parallel_state", "is_pipeline_first_stage", "is_pipeline_first_stage"),
    ("megatron.core.parallel_state", "is_pipeline_last_stage", "is_pipeline_last_stage"),
    ("megatron.training.training", "finalize_model_grads", "finalize_model_grads"),
    ("megatron.training.training", "get_megatron_optimizer", "get_megatron_optimizer"),
    ("megatron.core.dist_checkpointing.validation", "_validate_sharding_for_key",
     "validate_sharding_for_key"),
    ("megatron.training.checkpointing", "get_rng_state", "get_rng_state"),
    ("megatron.training.checkpointing", "_load_base_checkpoint", "load_base_checkpoint"),
)


_TELEMETRY_ONLY = frozenset(TELEMETRY_POINTS.values())
"""Hook points that only the telemetry uses (no backend method)."""


def installed() -> Runtime | None:
    """The :class:`Runtime` whose hooks wrap Megatron in this process, or None."""
    module = sys.modules.get("megatron.training.arguments")
    validate_args = getattr(module, "validate_args", None)
    if not is_wrapper(validate_args, "hooks"):
        return None
    return getattr(validate_args, _RUNTIME_MARK, None)


def _import_megatron_training() -> None:
    try:
        importlib.import_module("megatron.training")
    except ImportError as exc:
        if getattr(exc, "name", None) in ("megatron", "megatron.training"):
            raise HeteroError("megatron-hetero hooks need Megatron-LM's megatron.training "
                              "(megatron-core >= 0.17 ships it; or run a Megatron-LM checkout's "
                              "script, or put the checkout on PYTHONPATH)") from exc
        raise HeteroError(f"importing Megatron-LM's megatron.training failed: {exc}") from exc


def install() -> Runtime:
    """Install the hooks and return this process's :class:`Runtime` (the one already installed
    when called again). Needs Megatron-LM's ``megatron.training``. With
    ``MEGATRON_HETERO_CPU=1`` it also prepares the CPU backend (:mod:`.cpu`)."""
    _import_megatron_training()
    runtime = installed()
    if runtime is not None:
        return runtime
    if cpu_mode():
        prepare_cpu_run()
    prepare_stack()  # inside the hooks' validate_args: it sees the stage's offload settings
    runtime = Runtime()
    rebind("megatron.training.arguments", "parse_args", _wrap_parse_args)
    for module_name, attr, point in _TARGETS:
        rebind(module_name, attr, functools.partial(runtime.wrap, point))
    for (module_name, attr), point in TELEMETRY_POINTS.items():
        if hasattr(importlib.import_module(module_name), attr):
            rebind(module_name, attr, functools.partial(runtime.wrap, point))
    validate_args = sys.modules["megatron.training.arguments"].validate_args
    setattr(validate_args, _RUNTIME_MARK, runtime)
    if releases.has("model_builders"):  # megatron-core 0.19's pretrain_gpt.py builds through them
        wrap_builders(functools.partial(runtime.wrap, "get_model"))
    _install_excepthook()
    return runtime


def _install_excepthook() -> None:
    """A plan mistake ends the job with its one-line message, not a traceback."""
    previous = sys.excepthook
    if getattr(previous, "_megatron_hetero_hook", False):
        return

    def excepthook(kind, value, tb):
        if isinstance(value, HeteroError):
            print(f"megatron-hetero: error: {value}", file=sys.stderr, flush=True)
            return
        previous(kind, value, tb)

    excepthook._megatron_hetero_hook = True
    sys.excepthook = excepthook
