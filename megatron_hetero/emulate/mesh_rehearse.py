"""Rehearse a mesh plan (format 2) on this machine, as :mod:`.rehearse` does a format-1 plan:
one CPU process per plan rank, each playing its mesh's GPU type.

1. *Shrink* the model in width (:func:`~megatron_hetero.models.shrink_model`, heads divisible
   by every mesh's TP); meshes, layer split, replicas and policies stay: each rank runs its
   stage's recompute, optimizer offload and module-input offload (the smallest module input
   offloaded scaled with the model, :func:`.shrink.offload_min_numel`, as for format 1).
2. *Refuse* a plan of more than ``max_ranks`` ranks.
3. *Calibrate* the CPU and gloo on two processes at each micro-batch size of the plan
   (:func:`.calibration.calibrate`, one per device type's idle gaps).
4. *Run* N steps of the mesh trainer (:mod:`.mesh_trainer`) under the speed emulation
   (:func:`.rank_hooks.rehearsal_hooks`) and, as for format 1, each rank's memory metered
   and capped at its device's memory scaled with the model (:func:`.memory.memory_caps`, the
   cost model's memory of the rank's mesh stage); the first step is a warm-up.
5. *Predict* the same emulated cluster with the cost model and the mesh simulator
   (:func:`megatron_hetero.sim.step.simulate`), the calibrated compute rescaled by the
   CPU time the ranks measured (:mod:`.drift`), and report both.

Not rehearsed on mesh plans (yet): link emulation.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass, field

from ..errors import HeteroError
from ..hardware.catalog import Catalog, load_catalog
from ..plan import Pipeline, Plan, Stage, mesh_plan_from_data, uniform_plan
from .calibration import Calibration, _mean, calibrate
from .drift import cpu_drifts, in_run_calibrations, measured_allreduce_gb_s
from .prediction import emulated_cluster, emulated_name
from .shrink import offload_min_numel, shrink_plan

__all__ = ["MeshStageReport", "MeshRehearsalResult", "predict_mesh",
           "rehearse_mesh", "format_mesh_report"]


@dataclass(kw_only=True, slots=True)
class MeshStageReport:
    """Measured and predicted figures of one (replica, stage) of a rehearsed mesh plan."""

    mesh: int
    replica: int
    stage: int
    """Stage in the whole pipeline."""
    device_type: str
    tensor_model_parallel_size: int
    num_layers: int
    num_microbatches: int
    factor: float
    """How many times longer than its CPU work the rank's compute took."""
    busy_s: float
    """Mean wall seconds of compute per reported step (stretched)."""
    cpu_s: float
    """Mean CPU seconds of compute per reported step."""
    predicted_busy_s: float
    peak_bytes: float | None = None
    """The rank's metered peak memory (None where memory was not metered)."""
    cap_bytes: float | None = None
    """Its cap: its device's memory scaled as the model was (:func:`.memory.memory_caps`)."""


@dataclass(kw_only=True, slots=True)
class MeshRehearsalResult:
    """What :func:`rehearse_mesh` returns."""

    plan: Plan
    """The shrunk plan the CPU ranks ran."""
    stages: list[MeshStageReport]
    step_times: list[float]
    """Per reported step, the slowest rank's wall seconds."""
    predicted_step_s: float
    """The simulator's step time, compute rescaled by the ranks' measured CPU drift."""
    a_priori_step_s: float
    """The same from the start-up calibration alone."""
    cpu_drift: float
    cpu_drifts: dict[str, float] = field(default_factory=dict)
    losses: list[float]
    calibration: Calibration
    time_scale: float
    verify_message: str | None = None

    @property
    def step_s(self) -> float:
        """Median of the reported steps' times."""
        return statistics.median(self.step_times)

    @property
    def ratio(self) -> float:
        """Measured (median) over predicted step time."""
        return self.step_s / self.predicted_step_s


def _calibration_plan(shrunk: Plan, b: int) -> Plan:
    """A one-process format-1 plan of the shrunk model at micro-batch size ``b``: what
    :func:`.calibration.calibrate` times."""
    device = shrunk.meshes[0].device_type
    return uniform_plan(model=shrunk.model, global_batch_size=b,
                tensor_model_parallel_size=1, precision="fp32", catalog=shrunk.catalog,
                pipelines=[Pipeline(micro_batch_size=b, num_microbatches=1,
                                    stages=[Stage(device_type=device,
                                                  num_layers=shrunk.model.num_layers)])])


def _calibrate(shrunk: Plan, factors: dict[str, float], *, seed: int,
               nice: int, meter: bool) -> dict[str, Calibration]:
    """One calibration per device type (its idle gaps), at every micro-batch size of the plan."""
    sizes = sorted({r.micro_batch_size for m in shrunk.meshes for r in m.replicas})
    by_idle: dict[float, Calibration] = {}
    for d in sorted(factors, key=lambda d: factors[d]):
        idle = round(max(0.0, factors[d] - 1.0), 3)
        if idle in by_idle:
            continue
        merged = None
        for b in sizes:
            c = calibrate(_calibration_plan(shrunk, b), seed=seed, nice=nice, idle_factor=idle,
                          meter=meter)
            if merged is None:
                merged = c
            else:
                merged.parts.update(c.parts)
                merged.step_overhead.update(c.step_overhead)
                merged.pipeline_overhead.update(c.pipeline_overhead)
                merged.layer_activation_bytes.update(c.layer_activation_bytes)
        by_idle[idle] = merged
    return {d: by_idle[round(max(0.0, f - 1.0), 3)] for d, f in factors.items()}


def predict_mesh(shrunk: Plan, calibration, factors: dict[str, float], *,
                 distributed_optimizer: bool = False):
    """The cost model and mesh simulator on the emulated cluster
    (:func:`.prediction.emulated_cluster`: each device type the calibrated CPU over its factor,
    gloo between them) for ``shrunk`` as the CPU ranks run it (fp32). Returns a ``SimResult``."""
    from ..cost.model import CostModel
    from ..sim.step import simulate

    inventory, profiles, options = emulated_cluster(dict(shrunk.device_counts()), calibration,
                                                    factors)
    data = shrunk.to_data()
    data["precision"] = "fp32"
    for mesh in data["meshes"]:
        mesh["device_type"] = emulated_name(mesh["device_type"])
    emu = mesh_plan_from_data(data, source="<emulated plan>", catalog=inventory.catalog)
    cost = CostModel(emu.model, inventory, profiles=profiles, precision="fp32",
                     use_distributed_optimizer=distributed_optimizer, **options)
    return simulate(emu, cost, record_events=False)


def _device_slowdowns(plan: Plan, catalog: Catalog) -> dict[str, float]:
    flops = {d: catalog.get(d).achievable_flops for d in plan.device_counts()}
    fastest = max(flops.values())
    return {d: fastest / f for d, f in sorted(flops.items())}


def _auto_time_scale(plan: Plan, slowdowns: dict[str, float],
                     utilization: float = 0.7) -> float:
    """As :func:`.host.auto_time_scale`, over the meshes' ranks."""
    import os

    demand = sum(m.world_size / slowdowns[m.device_type] for m in plan.meshes)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1.0, round(demand / (utilization * (cores or 1)), 2))


def rehearse_mesh(plan: Plan, config, *, catalog: Catalog | None = None,
                  verify: bool = False, source: str = "PLAN", progress=None,
                  calibration: dict[str, Calibration] | None = None) -> MeshRehearsalResult:
    """Shrink, calibrate, run and predict the mesh plan ``plan`` (see the module docstring);
    ``config`` is the rehearsal's :class:`.rehearse.RehearsalConfig` (its link emulation is
    not used on mesh plans)."""
    from .calibration import activation_scale
    from .memory import memory_caps
    from .mesh_trainer import mesh_reference_plan, train_mesh_plan
    from .rank_hooks import rehearsal_hooks
    from .rehearse import train_and_verify
    from .trainer import TrainConfig

    _check_megatron_core(source)
    catalog = catalog or plan.catalog or load_catalog()
    say = progress or (lambda msg: None)
    shrunk = shrink_plan(plan, config.hidden_size, catalog or plan.catalog, precision="fp32")
    if shrunk.world_size > config.max_ranks:
        raise HeteroError(f"{source}: the plan has {shrunk.world_size} ranks; this rehearsal "
                          f"starts at most {config.max_ranks} CPU processes on one machine")
    slowdowns = _device_slowdowns(plan, catalog)
    metered = config.meter_memory or config.memory_cap
    time_scale = config.time_scale or _auto_time_scale(plan, slowdowns)
    factors = {d: s * time_scale for d, s in slowdowns.items()}
    if calibration is None:
        say("calibrating the CPU and gloo")
        calibration = _calibrate(shrunk, factors, seed=config.seed, nice=config.nice,
                                 meter=metered)
    say(f"running {config.steps} steps on {shrunk.world_size} CPU ranks")
    tconf = TrainConfig(steps=config.steps, seed=config.seed, gather_params=verify,
                        eval_forward_only=verify, timeout_s=config.timeout_s,
                        offload_min_numel=offload_min_numel(plan, shrunk))
    dist_opt = tconf.distributed_optimizer(shrunk)
    fastest = calibration[min(factors, key=lambda d: (factors[d], d))]
    caps = memory_caps(plan, shrunk, catalog, cpu_shards_optimizer=dist_opt,
                       activation_scale=activation_scale(shrunk, fastest)) if metered else None
    hooks = functools.partial(rehearsal_hooks, factors=factors, time_scale=time_scale,
                              caps=caps, enforce_caps=config.memory_cap, nice=config.nice)
    result, verify_message = train_and_verify(train_mesh_plan, mesh_reference_plan, shrunk,
                                              tconf, hooks=hooks, verify=verify, say=say)

    steps = range(1, config.steps)  # step 0 is the warm-up
    step_times = [max(r.step_times[k] for r in result.ranks) for k in steps]
    a_priori = predict_mesh(shrunk, calibration, factors, distributed_optimizer=dist_opt)
    leads = [r for r in result.ranks if r.tensor_rank == 0]
    device_of = functools.partial(_device_of, shrunk)
    drifts, drift = cpu_drifts(shrunk, leads, a_priori, steps, device_of=device_of)
    world_bw = measured_allreduce_gb_s(result.ranks,
                                       default=min(c.allreduce_gb_s for c in calibration.values()))
    in_run = in_run_calibrations(calibration, drifts, drift, world_bw)
    sim = predict_mesh(shrunk, in_run, factors, distributed_optimizer=dist_opt)
    stages = []
    for r in sorted(leads, key=lambda r: (r.stage, r.pipeline)):
        slot = shrunk.slot_of_rank(r.rank)
        mesh = shrunk.meshes[slot.mesh]
        stages.append(MeshStageReport(
            mesh=slot.mesh, replica=r.pipeline, stage=r.stage, device_type=mesh.device_type,
            tensor_model_parallel_size=mesh.tensor_model_parallel_size,
            num_layers=mesh.stages[slot.stage].num_layers,
            num_microbatches=mesh.replicas[slot.replica].num_microbatches,
            factor=r.extra["factor"], busy_s=_mean([r.extra["busy"][k] for k in steps]),
            cpu_s=_mean([r.extra["cpu"][k] for k in steps]),
            predicted_busy_s=sim.stage(r.pipeline, r.stage).busy_s,
            peak_bytes=r.extra.get("peak_bytes"), cap_bytes=caps[r.rank][0] if caps else None))
    return MeshRehearsalResult(plan=shrunk, stages=stages, step_times=step_times,
                               predicted_step_s=sim.step_time_s,
                               a_priori_step_s=a_priori.step_time_s, cpu_drift=drift,
                               cpu_drifts=drifts, losses=result.losses,
                               calibration=next(iter(calibration.values())),
                               time_scale=time_scale, verify_message=verify_message)


def _check_megatron_core(source: str) -> None:
    """Refuse where the installed megatron-core lacks the multimodule schedule (0.16)."""
    try:
        from megatron.core.process_groups_config import (  # noqa: F401
            MultiModuleProcessGroupCollection,
        )
    except ImportError:
        from importlib.metadata import version
        raise HeteroError(f"{source}: rehearsing a mesh plan needs megatron-core 0.17 (its "
                          "multimodule 1F1B schedule); megatron-core "
                          f"{version('megatron-core')} is installed") from None


def _device_of(shrunk: Plan, rank_result) -> str:
    return shrunk.meshes[shrunk.slot_of_rank(rank_result.rank).mesh].device_type


def format_mesh_report(result: MeshRehearsalResult, *, source: str = "PLAN",
                       real=None) -> str:
    """The mesh rehearsal's table: measured and predicted compute per (stage, replica), and the
    step time measured (median) against predicted."""
    m, plan = result.plan.model, result.plan
    lines = [
        f"rehearsal of {source} (mesh plan): {real.name if real else m.name}, {m.num_layers} "
        f"layers {plan.layer_split}, shrunk to hidden {m.hidden_size} (heads "
        f"{m.num_attention_heads}, ffn {m.ffn_hidden_size}, vocab {m.vocab_size}, seq "
        f"{m.seq_length}); {plan.world_size} CPU ranks; {len(result.step_times)} measured steps "
        f"after 1 warm-up; every device slowed {result.time_scale:g}x more (time scale)",
        plan.describe(),
        "",
        f"{'mesh':>4} {'stage':>5} {'repl':>4}  {'device':<18} {'TP':>2} {'layers':>6} "
        f"{'micro':>5} {'slow':>6} | {'busy s':>7} {'cpu s':>7} | {'pred busy':>9} | "
        f"{'peak MB':>8} {'cap MB':>8}",
    ]
    for st in result.stages:
        lines.append(f"{st.mesh:>4} {st.stage:>5} {st.replica:>4}  {st.device_type:<18} "
                     f"{st.tensor_model_parallel_size:>2} {st.num_layers:>6} "
                     f"{st.num_microbatches:>5} {st.factor:>5.2f}x | {st.busy_s:>7.3f} "
                     f"{st.cpu_s:>7.3f} | {st.predicted_busy_s:>9.3f} | "
                     f"{_mb(st.peak_bytes):>8} {_mb(st.cap_bytes):>8}")
    lines += [
        "",
        f"step time: measured {result.step_s:.3f} s (median of {len(result.step_times)}: "
        + ", ".join(f"{t:.3f}" for t in result.step_times) + f"), predicted "
        f"{result.predicted_step_s:.3f} s by the mesh simulator for this emulated cluster; "
        f"measured/predicted {result.ratio:.2f}",
        f"  (the ranks' compute took {result.cpu_drift:.2f}x the CPU time the start-up "
        f"calibration measured; from that calibration alone the prediction is "
        f"{result.a_priori_step_s:.3f} s)",
        "not rehearsed on mesh plans: link emulation",
        "losses: " + ", ".join(f"{x:.4f}" for x in result.losses),
    ]
    return "\n".join(lines)


def _mb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"
