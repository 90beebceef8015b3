"""Hooks that apply ``--hetero-plan`` inside an unchanged Megatron-LM training script.

:func:`install` wraps Megatron-LM's own functions (rebinding every module-level name that
refers to them, so ``from megatron.training.arguments import validate_args`` done before or
after installing sees the wrapper). Nothing of Megatron is copied; each wrapper calls the
original. A mesh plan (``format_version: 2``) goes to :mod:`.mesh_run` from the same wrappers
and from six more that call straight through otherwise (``initialize_model_parallel``,
``is_pipeline_first_stage``/``is_pipeline_last_stage``, ``finalize_model_grads``,
``get_megatron_optimizer``, and the checkpoint's sharding check and RNG state:
:mod:`.mesh_checkpoint`); on megatron-core 0.16 it is refused before anything is built
(:mod:`.meshes`). For a format-1 plan:

``megatron.training.arguments.parse_args``
    adds ``--hetero-plan`` / ``--hetero-device-type`` to the script's ``extra_args_provider``.
``megatron.training.arguments.validate_args``
    before Megatron's own checks: checks the command line against the plan and fills in what the
    plan implies (:mod:`.plan_args`), refuses policies this megatron-core cannot apply,
    places this process (:mod:`.placement`: ``args.rank`` becomes its Megatron rank, so
    Megatron's process groups follow the plan), and sets this rank's stage policies
    (recompute, optimizer offload) on its own ``args``; on a plan across vendors, makes the
    world group gloo and installs the per-group backends and pipeline-edge routing
    (:mod:`.vendors`, :mod:`.host_p2p`).
``megatron.training.arguments.core_transformer_config_from_args``
    this rank's stage policies on its own ``TransformerConfig`` (an interleaved plan's model
    chunks each get theirs: see ``get_model``).
``megatron.training.training.get_model``
    notes which model chunk (``vp_stage``) the model provider is building, so the config hook
    applies the stage's policies to that chunk
    (:func:`megatron_hetero.mcore.stage_policies.stage_config_kwargs`).
``megatron.training.training.get_forward_backward_func``
    (uneven plans) runs this replica's ``num_microbatches`` x ``micro_batch_size`` in every
    step while Megatron's step accounting keeps counting the global batch (the interleaved
    schedule too: every replica's count fills the schedule's micro-batch groups, of the
    pipeline size or of the plan's ``microbatch_group_size``); on a replica whose plan stages ask for more warm-up than Megatron's
    (``warmup_microbatches``), the schedule is the per-stage warm-up one built from
    megatron-core's pieces (:mod:`megatron_hetero.mcore.warmup_schedule`).
``megatron.training.training.build_pretraining_data_loader``
    (uneven plans) reads this replica's share of every global batch (:mod:`.sampler`).

With no ``--hetero-plan`` on the command line every wrapper calls straight through.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from dataclasses import dataclass

from ..errors import HeteroError
from ..mcore.cpu_offload import join_offload_summary
from ..mcore.stage_policies import stage_config_kwargs
from ..mcore.warmup_schedule import refusal, schedule_for, unsupported
from ..plan import Plan, Slot, Stage, load_plan
from ..schedule.rules import has_extra_warmup, stage_schedule
from . import mesh_model, mesh_run, plan_args, policies, releases, vendors
from ..mcore.rebind import is_wrapper, rebind
from .arguments import add_hetero_args
from .meshes import mesh_plan_of
from .placement import CPU_ENV, check_device_stacks, detect_device_type, place_this_rank

__all__ = ["install", "installed", "RankState", "state", "mesh_state", "reset",
           "LAUNCHER_RANK_ENV"]

LAUNCHER_RANK_ENV = "MEGATRON_HETERO_LAUNCHER_RANK"
"""Set by the hooks to the launcher's rank; ``RANK`` becomes the placed Megatron rank."""


@dataclass(kw_only=True, slots=True)
class RankState:
    """What the hooks decided for this process."""

    plan: Plan
    plan_path: str
    launcher_rank: int
    megatron_rank: int
    device_type: str
    slot: Slot
    virtual_num_microbatches: int | None = None
    """Megatron's own (global-accounting) micro-batch count; set after ``validate_args``."""
    args: object = None

    @property
    def stage(self) -> Stage:
        return self.plan.stage(self.slot.pipeline, self.slot.stage)

    @property
    def pipeline(self):
        return self.plan.pipelines[self.slot.pipeline]

    def describe(self) -> str:
        s, p = self.stage, self.pipeline
        rec = s.recompute.granularity + (f"/{s.recompute.method}/{s.recompute.num_layers}"
                                         if s.recompute.granularity == "full" else "")
        chunks = (f" in chunks {'+'.join(map(str, s.chunk_layers))}"
                  if self.plan.virtual_pipeline_size > 1 else "")
        sched = (stage_schedule(self.plan, self.slot.pipeline, self.slot.stage)
                 if self.plan.virtual_pipeline_size == 1 else None)
        warmup = (f"; warm-up {sched.warmup} micro-batches (Megatron's {sched.megatron_warmup})"
                  if sched is not None and s.warmup_microbatches is not None else "")
        return (f"megatron-hetero: launcher rank {self.launcher_rank} ({self.device_type}) -> "
                f"Megatron rank {self.megatron_rank}: pipeline {self.slot.pipeline} stage "
                f"{self.slot.stage} tp {self.slot.tensor_rank}; {s.num_layers} layers{chunks}; "
                f"{p.num_microbatches} micro-batches of {p.micro_batch_size}{warmup}; "
                f"recompute {rec}; "
                f"optimizer offload {s.offload.optimizer_fraction:g}"
                + ("; module inputs offloaded to host" if s.offload.module_inputs else ""))


_state: RankState | None = None
_mesh: mesh_run.MeshRankState | None = None


def state() -> RankState | None:
    """This process's placement and plan, once ``validate_args`` ran with ``--hetero-plan``."""
    return _state


def mesh_state() -> mesh_run.MeshRankState | None:
    """This process's slot in a mesh plan, once ``validate_args`` ran with one."""
    return _mesh


def reset() -> None:
    """Forget this process's state (tests)."""
    global _state, _mesh
    _state = _mesh = None


# -- the wrappers ------------------------------------------------------------------------------

def _with_hetero_args(provider):
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
        return original(_with_hetero_args(extra_args_provider), *a, **kw)
    return parse_args


def _emulated_device(plan: Plan, launcher_rank: int) -> str | None:
    """On the CPU backend, a rank with no override plays the plan's type of its own rank."""
    if os.environ.get(CPU_ENV, "") not in ("", "0"):
        return plan.device_type_of_rank(launcher_rank) if launcher_rank < plan.world_size else None
    return None


def before_validate(args, argv=None) -> RankState | mesh_run.MeshRankState | None:
    """Apply the plan to this rank's parsed ``args`` (see the module docstring)."""
    global _state, _mesh
    path = getattr(args, "hetero_plan", None)
    if not path:
        return None
    argv = sys.argv[1:] if argv is None else argv
    mesh_plan = mesh_plan_of(path)  # refused on megatron-core 0.16
    if mesh_plan is not None:
        _mesh = mesh_run.before_validate(args, mesh_plan, path=path, argv=argv)
        os.environ[LAUNCHER_RANK_ENV] = str(_mesh.launcher_rank)
        return _mesh
    plan = load_plan(path)
    plan_args.check_and_apply(args, plan, argv, source=path)
    policies.check_supported(plan, source=path, use_precision_aware_optimizer=getattr(
        args, "use_precision_aware_optimizer", None),
        transformer_impl=getattr(args, "transformer_impl", None))
    _check_warmup_args(plan, args, source=path)
    check_device_stacks(plan, source=path)
    launcher_rank, world = int(args.rank), int(args.world_size)
    device = detect_device_type(override=getattr(args, "hetero_device_type", None),
                                catalog=plan.catalog,  # the built-in one plus the plan's gpus
                                emulated=_emulated_device(plan, launcher_rank),
                                where=f"launcher rank {launcher_rank}: ", unknown_ok=True)
    megatron_rank = place_this_rank(plan, launcher_rank=launcher_rank, world_size=world,
                                    device_type=device, source=path,
                                    timeout_minutes=getattr(args, "distributed_timeout_minutes", 10))
    args.rank = megatron_rank
    os.environ["RANK"] = str(megatron_rank)
    vendors.prepare(plan, args, source=path,
                    cpu_backend=os.environ.get(CPU_ENV, "") not in ("", "0"))
    os.environ[LAUNCHER_RANK_ENV] = str(launcher_rank)
    slot = plan.slot_of_rank(megatron_rank)
    st = RankState(plan=plan, plan_path=path, launcher_rank=launcher_rank,
                   megatron_rank=megatron_rank, device_type=device, slot=slot, args=args)
    policies.apply_stage_args(args, st.stage)
    _state = st
    return st


def _check_warmup_args(plan: Plan, args, *, source: str) -> None:
    """Refuse, before anything is built, what the per-stage warm-up schedule cannot run when
    some replica of ``plan`` runs it."""
    if plan.virtual_pipeline_size > 1 or not any(has_extra_warmup(p) for p in plan.pipelines):
        return
    problems = unsupported(
        variable_seq_lengths=bool(getattr(args, "variable_seq_lengths", False)),
        ring_exchange=bool(getattr(args, "use_ring_exchange_p2p", False)),
        cuda_graph_impl=getattr(args, "cuda_graph_impl", None))
    if problems:
        raise HeteroError(f"{source}: {refusal(problems)}")


def after_validate(args) -> None:
    st = _state
    if st is None:
        return
    plan = st.plan
    if args.data_parallel_size != plan.data_parallel_size:
        raise HeteroError(f"{st.plan_path}: Megatron computed data-parallel size "
                          f"{args.data_parallel_size}; the plan has {plan.data_parallel_size} "
                          f"pipelines")
    st.virtual_num_microbatches = plan.global_batch_size // (
        args.micro_batch_size * args.data_parallel_size)
    if not plan.uniform_data_parallel and getattr(args, "dataloader_type", "single") not in (
            "single", None):
        raise HeteroError(f"{st.plan_path}: an uneven plan reads each replica's share of every "
                          f"global batch in order; --dataloader-type {args.dataloader_type} is "
                          f"not supported with it (use single)")
    if os.environ.get("MEGATRON_HETERO_VERBOSE") or st.megatron_rank == 0:
        print(st.describe(), flush=True)


def _wrap_validate_args(original):
    @functools.wraps(original)
    def validate_args(args, *a, **kw):
        st = before_validate(args)
        if isinstance(st, mesh_run.MeshRankState):
            with mesh_run.mesh_view(args, st):
                result = original(args, *a, **kw)
            mesh_run.after_validate(args, st)
            return result
        result = original(args, *a, **kw)
        after_validate(args)
        return result
    return validate_args


_building_chunk: list[int | None] = [None]  # the vp_stage get_model's provider is building


def apply_stage_config(config, chunk: int | None = None) -> object:
    """This rank's stage policies on a ``TransformerConfig`` (returned, changed in place); for an
    interleaved plan, on model chunk ``chunk`` (default: the one being built)."""
    st = _state
    if st is None:
        return config
    if chunk is None:
        chunk = _building_chunk[0]
    if st.plan.virtual_pipeline_size == 1:
        chunk = None
    for key, value in stage_config_kwargs(st.stage, chunk).items():
        setattr(config, key, value)
    return config


def _wrap_get_model(original):
    @functools.wraps(original)
    def get_model(model_provider_func, *a, **kw):
        if _mesh is not None:
            return mesh_model.get_model(original, _mesh, model_provider_func, *a, **kw)

        @functools.wraps(model_provider_func)
        def provider(*pa, **pkw):
            _building_chunk[0] = pkw.get("vp_stage")
            try:
                return model_provider_func(*pa, **pkw)
            finally:
                _building_chunk[0] = None
        return original(provider, *a, **kw)
    return get_model


def _wrap_config(original):
    @functools.wraps(original)
    def core_transformer_config_from_args(*a, **kw):
        if _mesh is not None:
            config = mesh_model.mesh_config(original, _mesh, *a, **kw)
            for key, value in stage_config_kwargs(_mesh.stage, None).items():
                setattr(config, key, value)
            return config
        return apply_stage_config(original(*a, **kw))
    return core_transformer_config_from_args


def replica_forward_backward(fb):
    """Wrap a schedule so that it runs this replica's micro-batches when called with Megatron's
    global-accounting count (training and evaluation steps both are)."""
    st = _state

    @functools.wraps(fb)
    def forward_backward(*a, **kw):
        if st is None or kw.get("num_microbatches") != st.virtual_num_microbatches:
            return fb(*a, **kw)
        pipe = st.pipeline
        kw["num_microbatches"] = pipe.num_microbatches
        kw["micro_batch_size"] = pipe.micro_batch_size
        args, saved = st.args, st.args.micro_batch_size
        args.micro_batch_size = pipe.micro_batch_size  # get_batch_on_this_tp_rank reads it
        try:
            return fb(*a, **kw)
        finally:
            args.micro_batch_size = saved
    return forward_backward


def _uneven() -> bool:
    return _state is not None and not _state.plan.uniform_data_parallel


def _wrap_get_fb(original):
    @functools.wraps(original)
    def get_forward_backward_func(*a, **kw):
        if _mesh is not None:
            return mesh_run.mesh_schedule(_mesh)
        fb = original(*a, **kw)
        if _state is not None:
            # the plan's per-stage warm-up where it asks for more than Megatron's on this replica
            fb = schedule_for(_state.plan, _state.slot.pipeline, fb)
            # ranks that offload nothing join the others' offload summary
            fb = join_offload_summary(fb, _state.plan, _state.stage)
        return replica_forward_backward(fb) if _uneven() else fb
    return get_forward_backward_func


def build_replica_data_loader(dataset, consumed_samples, *, num_workers: int = 0):
    """A DataLoader reading this replica's share of every global batch of ``dataset``."""
    import torch

    from .sampler import sampler_for_replica

    st = _state
    assert st is not None
    sampler = sampler_for_replica(st.plan, st.slot.pipeline, total_samples=len(dataset),
                                  consumed_samples=consumed_samples)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       pin_memory=torch.cuda.is_available(),
                                       persistent_workers=num_workers > 0)


def _wrap_loader(original):
    @functools.wraps(original)
    def build_pretraining_data_loader(dataset, consumed_samples, *a, **kw):
        if dataset is not None and mesh_run.uneven(_mesh):
            return mesh_run.replica_data_loader(dataset, consumed_samples, _mesh,
                                                num_workers=getattr(_mesh.args, "num_workers", 0))
        if dataset is None or not _uneven():
            return original(dataset, consumed_samples, *a, **kw)
        from megatron.core import parallel_state

        dp_rank = parallel_state.get_data_parallel_rank()
        if dp_rank != _state.slot.pipeline:
            raise AssertionError(f"data-parallel rank {dp_rank} != plan pipeline "
                                 f"{_state.slot.pipeline}")
        return build_replica_data_loader(dataset, consumed_samples,
                                         num_workers=getattr(_state.args, "num_workers", 0))
    return build_pretraining_data_loader


# -- installation ------------------------------------------------------------------------------

_TARGETS = (
    ("megatron.training.arguments", "parse_args", _wrap_parse_args),
    ("megatron.training.arguments", "validate_args", _wrap_validate_args),
    ("megatron.training.arguments", "core_transformer_config_from_args", _wrap_config),
    ("megatron.training.training", "get_model", _wrap_get_model),
    ("megatron.training.training", "get_forward_backward_func", _wrap_get_fb),
    ("megatron.training.training", "build_pretraining_data_loader", _wrap_loader),
)
_TARGETS += mesh_run.mesh_only_targets(mesh_state)  # each calls straight through otherwise


def installed() -> bool:
    try:
        module = sys.modules["megatron.training.arguments"]
    except KeyError:
        return False
    return is_wrapper(getattr(module, "validate_args", None))


def install() -> None:
    """Install the hooks (idempotent). Needs Megatron-LM's ``megatron.training``. With
    ``MEGATRON_HETERO_CPU=1`` it also prepares the CPU backend (:mod:`.cpu`)."""
    try:
        importlib.import_module("megatron.training")
    except ImportError as exc:
        if getattr(exc, "name", None) in ("megatron", "megatron.training"):
            raise HeteroError("megatron-hetero hooks need Megatron-LM's megatron.training "
                              "(megatron-core >= 0.17 ships it; or run a Megatron-LM checkout's "
                              "script, or put the checkout on PYTHONPATH)") from exc
        raise HeteroError(f"importing Megatron-LM's megatron.training failed: {exc}") from exc
    if os.environ.get(CPU_ENV, "") not in ("", "0"):
        from .cpu import prepare_cpu_run

        prepare_cpu_run()
    from .stack import prepare_stack

    prepare_stack()  # inside the hooks' validate_args: it sees the stage's offload settings
    for module_name, attr, make in _TARGETS:
        rebind(module_name, attr, make)
    if releases.has("model_builders"):
        from .builders import wrap_builders

        wrap_builders(_wrap_get_model)
    _install_excepthook()


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
