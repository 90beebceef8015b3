"""Human and JSON summaries of a tuned (or simulated) plan."""

from __future__ import annotations

from collections import OrderedDict

from ..cost.crossings import Crossing, host_staged_seconds
from ..plan.megatron_args import megatron_args
from ..plan import Plan
from ..sim.step import SimResult

__all__ = ["plan_table", "summary_lines", "host_memory_lines", "report_dict", "policy_text",
           "vendor_lines", "vendor_dict", "optimizer_seconds", "stage_dicts", "unused_gpus",
           "unused_line"]


def optimizer_seconds(plan: Plan, sim: SimResult, cost) -> dict[tuple[int, int], float]:
    """Each (pipeline, stage)'s optimizer step in seconds, as the simulator adds it after the
    gradient sync (part of ``sync_s``): memory-bound on the device, the offloaded fraction at
    the host's rate (:meth:`~megatron_hetero.cost.model.CostModel.optimizer_seconds`). Empty
    for a mesh plan."""
    if not plan.one_grid:
        return {}
    from ..cost.stage import StageShape

    seen: dict[tuple, float] = {}
    out = {}
    for st in sim.stages:
        stage = plan.stage(st.pipeline, st.stage)
        key = (st.stage, stage.device_type, stage.offload.optimizer_fraction)
        if key not in seen:
            seen[key] = cost.optimizer_seconds(StageShape.of(plan, st.pipeline, st.stage))
        out[(st.pipeline, st.stage)] = seen[key]
    return out


def stage_dicts(sim: SimResult, optimizer: dict[tuple[int, int], float]) -> list[dict]:
    """The per-stage JSON of ``simulate --json`` and ``tune --report``: each stage's figures,
    with ``optimizer_s`` (its optimizer step, inside ``sync_s``) where known."""
    out = []
    for st in sim.stages:
        d = st.to_dict()
        if (st.pipeline, st.stage) in optimizer:
            d["optimizer_s"] = optimizer[(st.pipeline, st.stage)]
        out.append(d)
    return out


def unused_gpus(plan: Plan, inventory) -> dict[str, int]:
    """GPUs of the inventory the plan leaves idle, per device type (none: empty)."""
    need = plan.device_counts()
    return {gpu: n - need.get(gpu, 0) for gpu, n in sorted(inventory.gpu_counts().items())
            if n > need.get(gpu, 0)}


def unused_line(plan: Plan, inventory) -> str | None:
    """One line naming the GPUs the plan leaves idle, or None when it uses them all."""
    idle = unused_gpus(plan, inventory)
    if not idle:
        return None
    have = inventory.gpu_counts()
    parts = ", ".join(f"{n} of {have[g]}x {g}" for g, n in idle.items())
    return (f"unused: {parts} (the plan needs {plan.world_size} of the inventory's "
            f"{inventory.num_gpus} GPUs; the launchers place its ranks on the hosts it needs, "
            "docs/launch.md)")


def _recompute_text(stage) -> str:
    r = stage.recompute
    if r.granularity == "full":
        return f"full {r.method} {r.num_layers}"
    return r.granularity


def policy_text(stage) -> str:
    """A stage's memory policy in words: ``recompute none``, then what it offloads."""
    text = f"recompute {_recompute_text(stage)}"
    off = stage.offload
    if off.optimizer_fraction:
        text += f", optimizer offload {off.optimizer_fraction:g}"
    if off.module_inputs:
        text += ", module inputs to host"
    if off.activations:
        text += ", activations to host"
    return text


def _groups(plan: Plan) -> "OrderedDict[tuple, list[int]]":
    """Pipelines with identical settings, so a 500-pipeline plan prints as a few columns."""
    groups: OrderedDict[tuple, list[int]] = OrderedDict()
    for d, pipe in enumerate(plan.pipelines):
        key = (pipe.micro_batch_size, pipe.num_microbatches,
               tuple((s.device_type, policy_text(s)) for s in pipe.stages))
        groups.setdefault(key, []).append(d)
    return groups


def _span(ds: list[int]) -> str:
    if len(ds) == 1:
        return f"pipeline {ds[0]}"
    if ds == list(range(ds[0], ds[-1] + 1)):
        return f"pipelines {ds[0]}-{ds[-1]} (x{len(ds)})"
    return f"pipelines {','.join(map(str, ds[:4]))}{',...' if len(ds) > 4 else ''} (x{len(ds)})"


def plan_table(plan: Plan, sim: SimResult, title: str,
               optimizer: dict[tuple[int, int], float] | None = None):
    """A rich Table: stages as rows, (groups of identical) pipelines as columns; a stage that
    offloads optimizer state shows its optimizer step's seconds (``optimizer``, from
    :func:`optimizer_seconds`)."""
    from rich.table import Table

    table = Table(title=title, show_lines=True)
    table.add_column("stage", justify="right")
    groups = _groups(plan)
    for key, ds in groups.items():
        mbs, m, _ = key
        table.add_column(f"{_span(ds)}\nmicro-batches {m} x {mbs}")
    for s in range(plan.pipeline_model_parallel_size):
        chunks = plan.pipelines[0].stages[s].chunk_layers
        row = [f"{s}\n{plan.layer_split[s]} layers"
               + (f"\n({'+'.join(map(str, chunks))})" if plan.virtual_pipeline_size > 1 else "")]
        for ds in groups.values():
            st = plan.stage(ds[0], s)
            res = sim.stage(ds[0], s)
            mem = res.memory
            policy = policy_text(st).replace(", ", "\n")
            opt = (optimizer or {}).get((ds[0], s))
            row.append(f"{st.device_type}\n{mem.total / 1e9:.1f} / {mem.capacity / 1e9:.1f} GB\n"
                       f"{policy}\nbusy {res.busy_s:.2f} s"
                       + (f"\noptimizer {opt:.2f} s" if opt is not None
                          and st.offload.optimizer_fraction else ""))
        table.add_row(*row)
    return table


def summary_lines(plan: Plan, sim: SimResult, label: str) -> str:
    counts = ", ".join(f"{n}x {g}" for g, n in sorted(plan.device_counts().items()))
    return (f"{label}: step {sim.step_time_s:.3f} s, {sim.tokens_per_s:,.0f} tokens/s, "
            f"MFU {sim.mfu:.3f}; TP={plan.tensor_model_parallel_size} "
            f"PP={plan.pipeline_model_parallel_size} DP={plan.data_parallel_size}"
            + plan.meshes[0].expert_text
            + (f" VP={plan.virtual_pipeline_size}" if plan.virtual_pipeline_size > 1 else "")
            + f" on {counts}; layers {plan.layer_split}"
            + (f" in {plan.virtual_pipeline_size} chunks per stage {plan.virtual_stage_layers}"
               " (model order)" if plan.virtual_pipeline_size > 1 else "")
            + (f", micro-batches in groups of {plan.microbatch_group_size} per chunk"
               if plan.microbatch_group_size is not None else ""))


def host_memory_lines(sim: SimResult) -> list[str]:
    """One line per node whose host memory the plan overfills (none when it fits, or when no
    inventory group gives ``host_memory_gb``)."""
    return [f"host memory over on {h.node}: {h.used_bytes / 1e9:.1f} GB needed (offloaded "
            f"optimizer state and module inputs plus the host reserve), "
            f"{h.capacity_bytes / 1e9:.0f} GB available"
            for h in sim.host_nodes if not h.fits]


def vendor_lines(crossings: list[Crossing], sim: SimResult) -> list[str]:
    """One line per pipeline edge and data-parallel group that crosses vendors (staged through
    the hosts), then their share of the step; none for a one-vendor plan."""
    if not crossings:
        return []
    lines = [f"across vendors: {c.kind} {c.where} ({' -> '.join(c.vendors)}): host path "
             f"{c.bandwidth_gb_s:.2f} GB/s, {c.seconds_per_step:.3f} s per step" for c in crossings]
    busy = host_staged_seconds(crossings)
    runs = ("the runtime cannot run a data-parallel group across vendors (docs/vendors.md)"
            if any(c.kind == "data-parallel group" for c in crossings) else
            "the runtime stages these edges through host memory over gloo (docs/vendors.md)")
    lines.append(f"across vendors: the busiest host-staged links {busy:.3f} s per step, "
                 f"{busy / sim.step_time_s:.1%} of the step; {runs}")
    return lines


def vendor_dict(crossings: list[Crossing], sim: SimResult) -> dict:
    """The report's ``vendor_crossings``: each crossing and the busiest host-staged links'
    seconds and share of the step."""
    busy = host_staged_seconds(crossings)
    return {"crossings": [c.to_dict() for c in crossings], "host_staged_seconds": busy,
            "host_staged_share": busy / sim.step_time_s}


def report_dict(result, plan_path: str | None, *,
                optimizer: dict[tuple[int, int], float] | None = None) -> dict:
    """The JSON report of ``tune`` (a :class:`~megatron_hetero.tuner.search.TuneResult`);
    ``optimizer``: each stage's optimizer seconds (:func:`optimizer_seconds`)."""
    plan, sim = result.plan, result.sim
    base = result.baseline_sim
    out = {
        "predicted_step_time_s": sim.step_time_s,
        "baseline_step_time_s": base.step_time_s if base else None,
        "upper_bound_step_time_s": result.upper_bound_step_time_s,
        "search_time_s": result.search_time_s,
        "search_cpu_s": result.search_cpu_s,
        "megatron_args": megatron_args(plan, plan_path),
        "tokens_per_s": sim.tokens_per_s,
        "mfu": sim.mfu,
        "efficiency": result.upper_bound_step_time_s / sim.step_time_s,
        "speedup_over_baseline": (base.step_time_s / sim.step_time_s) if base else None,
        "fell_back_to_baseline": result.fell_back_to_baseline,
        "structures_evaluated": result.structures_evaluated,
        "searched_step_time_s": result.searched_step_time_s,
        "refine_simulations": result.refine_simulations,
        "warmup_gain_over_1f1b": result.warmup_gain,
        "plan": {"tensor_model_parallel_size": plan.tensor_model_parallel_size,
                 "pipeline_model_parallel_size": plan.pipeline_model_parallel_size,
                 "data_parallel_size": plan.data_parallel_size, "layer_split": plan.layer_split,
                 "virtual_pipeline_size": plan.virtual_pipeline_size,
                 "virtual_stage_layers": plan.virtual_stage_layers,
                 "microbatch_group_size": plan.microbatch_group,
                 "overlap_grad_reduce": plan.overlap_grad_reduce,
                 "num_microbatches": [p.num_microbatches for p in plan.pipelines],
                 "device_counts": dict(sorted(plan.device_counts().items()))},
        "stages": stage_dicts(sim, optimizer or {}),
    }
    if sim.host_nodes:
        out["host_nodes"] = [h.to_dict() for h in sim.host_nodes]
    if result.baseline_plan is not None:
        b = result.baseline_plan
        out["baseline"] = {
            "tokens_per_s": base.tokens_per_s, "mfu": base.mfu,
            "tensor_model_parallel_size": b.tensor_model_parallel_size,
            "pipeline_model_parallel_size": b.pipeline_model_parallel_size,
            "data_parallel_size": b.data_parallel_size,
            "virtual_pipeline_size": b.virtual_pipeline_size,
            "micro_batch_size": b.pipelines[0].micro_batch_size,
            "num_microbatches": b.pipelines[0].num_microbatches,
            "recompute": _recompute_text(b.pipelines[0].stages[0]),
            "device_counts": dict(sorted(b.device_counts().items())),
            "megatron_args": megatron_args(b),
        }
    return out
