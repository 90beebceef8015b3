"""Per-stage memory policies as Megatron settings of one rank.

Megatron's recompute and offload options are global. Every rank has its own ``args`` and its
own ``TransformerConfig`` though, so the runtime sets them per rank from the rank's plan stage.
The ``TransformerConfig`` fields of a stage (recompute, activation offload, module-input offload;
per model chunk for an interleaved plan) come from :mod:`megatron_hetero.mcore.stage_policies`;
this module adds what is the runtime's own:

* the stage's Megatron ``args`` (:func:`stage_args`), optimizer offload among them:
  ``optimizer_cpu_offload`` + ``optimizer_offload_fraction`` (megatron-core's
  ``HybridDeviceOptimizer``; needs ``--use-precision-aware-optimizer``, and 16-bit parameters
  except on the CPU backend, see :mod:`megatron_hetero.mcore.cpu_offload`);
* activation offload (``cpu_offloading``) only where the installed megatron-core accepts it
  together with the plan's pipeline parallelism (0.16 and 0.17 refuse PP > 1) and Transformer
  Engine (which runs it) is installed;
* module-input offload (megatron-core's fine-grained activation offloading on the stage's
  ``args`` and on every model chunk's config; every other stage sets
  ``fine_grained_activation_offloading=False`` explicitly) runs on Transformer Engine's layers or
  on megatron-core's local layers (``--transformer-impl local``, and always on the CPU backend:
  :mod:`.stack`); with TE's layers and TE >= 2.10 it needs ``NVTE_CPU_OFFLOAD_V1=1`` in
  the environment before TE is imported
  (``megatron_hetero.launch`` sets it for such plans through :func:`set_launch_env`; Megatron
  asserts it).

  Megatron assumes every rank offloads or none does: the other ranks of a plan that offloads
  on some stages only join the offload summary's collectives
  (:func:`megatron_hetero.mcore.cpu_offload.join_offload_summary`).

What the installed megatron-core cannot honour is refused at start (:func:`check_supported`),
never dropped silently.
"""

from __future__ import annotations

import os
from functools import cache

from ..errors import HeteroError
from ..mcore.cpu_backend import cpu_backend_enabled
from ..mcore.cpu_offload import module_input_offload_supported, optimizer_offload_supported
from ..mcore.stage_policies import module_input_kwargs, recompute_kwargs
from ..hardware.optional import have_transformer_engine
from ..plan import MeshStage, Plan, Stage
from ..plan.checks import FP32_OPTIMIZER_OFFLOAD, optimizer_offload_runs, plan_stages

__all__ = ["stage_args", "apply_stage_args", "check_supported", "PolicyUnsupported",
           "activation_offload_supported", "set_launch_env"]

NVTE_ENV = "NVTE_CPU_OFFLOAD_V1"
"""Megatron's fine-grained offload needs it at 1 with Transformer Engine >= 2.10."""


class PolicyUnsupported(HeteroError):
    """The plan asks for a memory policy the installed megatron-core cannot apply."""


def stage_args(stage: Stage | MeshStage) -> dict:
    """Megatron ``args`` attributes this stage's plan entry sets on its ranks (before Megatron's
    own ``validate_args``, which then checks them as usual)."""
    out = dict(recompute_kwargs(stage))
    fraction = stage.offload.optimizer_fraction
    out["optimizer_cpu_offload"] = fraction > 0
    out["optimizer_offload_fraction"] = fraction if fraction > 0 else 1.0
    if stage.offload.activations:
        out["cpu_offloading"] = True
    # Megatron reads args.fine_grained_activation_offloading in validate_args (TE checks) and
    # in pretrain (CPU affinity of the offload copies); its config is built from args too.
    out.update(module_input_kwargs(stage))
    return out


def apply_stage_args(args, stage: Stage | MeshStage) -> None:
    """Set :func:`stage_args` on a rank's parsed Megatron ``args`` (the attributes its
    Megatron-LM has, and the recompute ones): a format-1 rank's and a mesh rank's alike."""
    for key, value in stage_args(stage).items():
        if hasattr(args, key) or key.startswith("recompute_"):
            setattr(args, key, value)


def set_launch_env(argv, environ=None) -> bool:
    """Before Transformer Engine is imported: ``NVTE_CPU_OFFLOAD_V1=1`` (unless already set)
    when the command line's ``--hetero-plan`` offloads module inputs on some stage (TE reads it
    at import; with TE >= 2.10 Megatron's fine-grained offload asserts it). True when the plan
    needs it."""
    from ..plan import load_any_plan

    environ = os.environ if environ is None else environ
    path = None
    for i, tok in enumerate(argv):
        if tok == "--hetero-plan" and i + 1 < len(argv):
            path = argv[i + 1]
        elif tok.startswith("--hetero-plan="):
            path = tok.split("=", 1)[1]
    plan = None if path is None else load_any_plan(path)
    if plan is None or not plan.offloads_module_inputs:
        return False
    environ.setdefault(NVTE_ENV, "1")
    return True


@cache
def activation_offload_supported(pipeline_parallel_size: int) -> bool:
    """Whether the installed ``TransformerConfig`` accepts ``cpu_offloading`` at this PP size."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        TransformerConfig(num_layers=4, hidden_size=8, num_attention_heads=1,
                          pipeline_model_parallel_size=pipeline_parallel_size,
                          pipeline_dtype=torch.float32,
                          cpu_offloading=True, cpu_offloading_num_layers=1)
    except (ValueError, AssertionError):
        return False
    return True


def _te_needs_v1_env() -> bool:
    """Transformer Engine >= 2.10 (Megatron then asserts ``NVTE_CPU_OFFLOAD_V1=1``)."""
    from megatron.core.utils import is_te_min_version

    return is_te_min_version("2.10.0")


def check_supported(plan: Plan, *, source: str = "plan",
                    use_precision_aware_optimizer=None, transformer_impl=None) -> None:
    """Refuse, with one message naming every offending stage, the policies this megatron-core
    cannot apply (of a format-1 or a mesh plan: every rank of a mesh plan runs its own
    stage's, as a format-1 plan's). ``use_precision_aware_optimizer`` and ``transformer_impl``
    (the parsed arguments) are checked when given."""
    problems = []
    pp = plan.pipeline_model_parallel_size
    interleaved = getattr(plan, "virtual_pipeline_size", 1) > 1
    for path, _, stage in plan_stages(plan):
        r = stage.recompute
        chunks = getattr(stage, "chunk_layers", None)
        if (r.granularity == "full" and r.method == "uniform" and chunks and interleaved
                and any(n % r.num_layers for n in chunks)):
            problems.append(f"{path}.recompute.num_layers: uniform "
                            f"recompute groups of {r.num_layers} layers must divide each "
                            f"model chunk's layers {chunks} (Megatron recomputes "
                            f"per chunk); use a divisor or method block")
        where = f"{path}.offload"
        if stage.offload.activations:
            if stage.recompute.granularity != "none":
                problems.append(f"{where}.activations: megatron-core's cpu_offloading does "
                                f"not work together with recompute "
                                f"({stage.recompute.granularity}) on the same stage")
            elif not activation_offload_supported(pp):
                problems.append(f"{where}.activations: the installed megatron-core refuses "
                                f"activation offload (cpu_offloading) with pipeline "
                                f"parallelism (PP={pp})")
            elif not have_transformer_engine():
                problems.append(f"{where}.activations: megatron-core's activation offload "
                                f"(cpu_offloading) runs through Transformer Engine, which is "
                                f"not installed")
        if stage.offload.module_inputs:
            problems += _module_input_problems(stage, f"{where}.module_inputs",
                                               transformer_impl)
        if stage.offload.optimizer_fraction > 0:
            if not optimizer_offload_supported():
                problems.append(f"{where}.optimizer_fraction: the installed megatron-core "
                                f"has no CPU-offload optimizer")
            elif use_precision_aware_optimizer is False:
                problems.append(f"{where}.optimizer_fraction: optimizer offload needs "
                                f"--use-precision-aware-optimizer on the command line")
            elif not optimizer_offload_runs(plan.precision):  # on CPU ranks as on a GPU
                problems.append(f"{where}.optimizer_fraction: {FP32_OPTIMIZER_OFFLOAD}")
    if problems:
        raise PolicyUnsupported(f"{source}: the plan asks for memory policies this Megatron "
                                f"cannot apply:\n  " + "\n  ".join(problems))


def _module_input_problems(stage: Stage | MeshStage, where: str, transformer_impl) -> list[str]:
    if stage.offload.activations:
        return [f"{where}: megatron-core's fine-grained activation offloading cannot run with "
                f"cpu_offloading (offload.activations) on the same stage; choose one"]
    if not module_input_offload_supported():
        return [f"{where}: the installed megatron-core has no fine-grained activation "
                f"offloading (TransformerConfig.fine_grained_activation_offloading)"]
    if cpu_backend_enabled() or transformer_impl == "local":
        return []  # megatron-core's local layers run it (runtime/stack.py)
    if not have_transformer_engine():
        return [f"{where}: megatron-core's fine-grained activation offloading runs on Transformer "
                f"Engine's layers, which is not installed, or on megatron-core's local layers: "
                f"pass --transformer-impl local (the command line has "
                f"{transformer_impl or 'the default, transformer_engine'})"]
    if _te_needs_v1_env() and os.environ.get(NVTE_ENV, "0") != "1":
        return [f"{where}: with Transformer Engine >= 2.10 megatron-core's fine-grained "
                f"activation offloading needs {NVTE_ENV}=1 in the environment before Transformer "
                f"Engine is imported (python -m megatron_hetero.launch sets it for such plans)"]
    return []
