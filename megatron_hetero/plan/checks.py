"""What the runtime would stop at, checked from the plan before any rank starts (no torch):
the offload settings megatron-core refuses whatever is installed (each stage's memory on its
card under the cost model is :func:`megatron_hetero.sim.fits.check_fits`).

:func:`check_offload` holds megatron-core 0.17.1's own conditions on a stage's offload
(``TransformerConfig.__post_init__``, ``validate_args``, ``OptimizerConfig``):

* ``offload.activations`` (``cpu_offloading``) only at PP = 1 ("no support for Pipeline
  parallelism with CPU offloading"), and never with recompute on the same stage;
* ``offload.module_inputs`` (fine-grained activation offloading) never with
  ``offload.activations`` on the same stage;
* ``offload.optimizer_fraction > 0`` (the CPU-offload optimizer, which needs
  ``--use-precision-aware-optimizer``) only with the distributed optimizer, and only with 16-bit
  parameters (:func:`optimizer_offload_runs`).

:func:`host_bridges` says which bridges of a chain of meshes join two collective libraries
(they run staged through host memory).

What depends on the installed stack (Transformer Engine, its ``NVTE_CPU_OFFLOAD_V1``) is the
runtime's check at start (:func:`megatron_hetero.runtime.policies.check_supported`).
"""

from __future__ import annotations

from ..errors import Described, SchemaError
from ..hardware.catalog import load_catalog
from .types import Plan

__all__ = ["check_offload", "stage_layers", "optimizer_offload_runs",
           "plan_stages", "stage_path", "FP32_OPTIMIZER_OFFLOAD", "host_bridges"]

FP32_OPTIMIZER_OFFLOAD = (
    "megatron-core's CPU-offload optimizer does not run with fp32 parameters under the "
    "distributed optimizer (it refuses their shards, views of the parameters: \"can't optimize "
    "a non-leaf Tensor\"); train in bf16 or fp16")
"""Why :func:`optimizer_offload_runs` is false for fp32 (megatron-core 0.16.1 and 0.17.1)."""


def optimizer_offload_runs(precision: str) -> bool:
    """Whether megatron-core's CPU-offload optimizer runs on GPUs for parameters of
    ``precision``: not for fp32 (:data:`FP32_OPTIMIZER_OFFLOAD`). The tuner offers no optimizer
    offload then, ``validate`` refuses it, and the runtime stops at it (CPU ranks excepted: their
    stack has fixes, :mod:`megatron_hetero.mcore.cpu_offload`)."""
    return precision != "fp32"


def plan_stages(plan: Plan):
    """(field path of the stage, stage index along the pipeline, stage) for every stage of a
    format-1 plan (``pipelines[d].stages[s]``) or a mesh plan (``meshes[k].stages[j]``)."""
    if not plan.one_grid:
        s = 0
        for k, mesh in enumerate(plan.meshes):
            for j, stage in enumerate(mesh.stages):
                yield f"meshes[{k}].stages[{j}]", s + j, stage
            s += len(mesh.stages)
        return
    for d, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            yield f"pipelines[{d}].stages[{s}]", s, stage


def stage_path(plan: Plan, replica: int, stage: int) -> str:
    """The field path, in the file ``plan`` is written as, of replica ``replica``'s pipeline
    stage ``stage`` (of the whole model): ``pipelines[d].stages[s]`` for one grid,
    ``meshes[k].stages[j]`` for a chain of meshes."""
    if plan.one_grid:
        return f"pipelines[{replica}].stages[{stage}]"
    k, j = plan.stage_index[stage]
    return f"meshes[{k}].stages[{j}]"


def host_bridges(plan: Plan) -> list[bool]:
    """Per bridge of a chain of meshes (mesh ``k`` -> ``k + 1`` in chain order, then the
    wrap-around, last mesh -> mesh 0, which only an interleaved chain uses): whether its two
    meshes' collective libraries differ (NCCL beside RCCL), so that no device communicator joins
    them and the bridge sends through host memory on a gloo group
    (:mod:`megatron_hetero.mcore.bridge_groups`); empty for a format-1 plan."""
    if plan.one_grid:
        return []
    catalog = plan.catalog or load_catalog()
    libraries = [catalog.get(m.device_type).stack.library for m in plan.meshes]
    n = len(libraries)
    return [libraries[k] != libraries[(k + 1) % n] for k in range(n)]


def check_offload(plan: Plan, *, source: str) -> None:
    """Raise :class:`SchemaError` at the first stage whose offload megatron-core refuses (see
    the module docstring)."""
    pp = plan.pipeline_model_parallel_size
    for where, _, stage in plan_stages(plan):
        off = stage.offload
        if off.activations and pp > 1:
            raise SchemaError(source, f"{where}.offload.activations", True,
                              f"false at PP={pp}: megatron-core's activation offload "
                              "(cpu_offloading) runs only at PP = 1 (TransformerConfig: \"no "
                              "support for Pipeline parallelism with CPU offloading\"); "
                              "offload.module_inputs offloads activations with pipelines")
        if off.activations and stage.recompute.granularity != "none":
            raise SchemaError(source, f"{where}.offload.activations", True,
                              f"false with recompute ({stage.recompute.granularity}) on the same "
                              "stage: megatron-core's cpu_offloading refuses activation "
                              "recomputation")
        if off.activations and off.module_inputs:
            raise SchemaError(source, f"{where}.offload.module_inputs", True,
                              "false with offload.activations on the same stage: megatron-core's "
                              "fine-grained activation offloading cannot run with cpu_offloading")
        if off.optimizer_fraction > 0 and not optimizer_offload_runs(plan.precision):
            raise SchemaError(source, f"{where}.offload.optimizer_fraction",
                              off.optimizer_fraction,
                              f"0 with precision: {plan.precision}: {FP32_OPTIMIZER_OFFLOAD}")
        if off.optimizer_fraction > 0 and not plan.use_distributed_optimizer:
            raise SchemaError(source, f"{where}.offload.optimizer_fraction",
                              off.optimizer_fraction,
                              "0 with use_distributed_optimizer: false: megatron-core's CPU-offload "
                              "optimizer needs --use-precision-aware-optimizer, which it runs "
                              "only with the distributed optimizer")


def stage_layers(plan: Plan, s: int) -> str:
    """The model layers stage ``s`` holds, e.g. ``layers 10-19``, ``layers 0-5, 16-23``
    (interleaved), ``no layers``."""
    split = plan.layer_split
    v = getattr(plan, "virtual_pipeline_size", 1)
    if v > 1:
        chunks = [st.chunk_layers for m in plan.meshes for st in m.pipelines[0].stages]
        spans, start = [], 0
        for c in range(v):
            for i, row in enumerate(chunks):
                if i == s and row[c]:
                    spans.append((start, start + row[c] - 1))
                start += row[c]
    else:
        start = sum(split[:s])
        spans = [(start, start + split[s] - 1)] if split[s] else []
    if not spans:
        return "no layers"
    return "layers " + ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)

