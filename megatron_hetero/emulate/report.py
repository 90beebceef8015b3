"""The rehearsal's result and report: measured and predicted figures per stage, and the table."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..plan import ModelSpec, Plan
from .calibration import Calibration, _mean
from .verify import PrecisionVerdict

__all__ = ["StageReport", "RehearsalResult", "stage_reports", "module_inputs_note",
           "format_report"]


@dataclass(kw_only=True, slots=True)
class StageReport:
    """Measured and predicted figures of one (pipeline, stage), seconds per step."""

    pipeline: int
    """The replica (data-parallel rank) in its mesh."""
    stage: int
    """The stage in the whole pipeline."""
    mesh: int = 0
    """The mesh the stage belongs to."""
    tensor_model_parallel_size: int = 1
    """Its mesh's tensor-parallel size."""
    device_type: str
    num_layers: int
    num_microbatches: int
    factor: float
    step_s: float
    busy_s: float
    """Forward and backward compute, stretched: the emulated device's busy time."""
    cpu_s: float
    """CPU seconds of real work inside the busy time."""
    drift_s: float = 0.0
    """Largest lag, at a step's end, of this rank's compute behind its emulated duration (other
    processes held the cores): emulation error, included in busy_s."""
    peak_bytes: float | None
    cap_bytes: float | None
    sync_s: float = 0.0
    """Gradient sync and optimizer step, with the wait there for slower replicas (wall
    seconds; not stretched)."""
    predicted_busy_s: float | None = None
    predicted_idle_s: float | None = None
    """Predicted bubble, gradient sync, optimizer and waiting for others."""
    predicted_sync_s: float | None = None
    """The simulator's gradient sync, optimizer step and end-of-step wait for slower ranks."""

    @property
    def idle_s(self) -> float:
        return max(0.0, self.step_s - self.busy_s)

    @property
    def bubble_fraction(self) -> float:
        return self.idle_s / self.step_s if self.step_s else 0.0


@dataclass(kw_only=True, slots=True)
class RehearsalResult:
    plan: Plan
    """The shrunk plan that ran."""
    stages: list[StageReport]
    step_s: float
    """Measured step time: the mean over the reported steps of the slowest rank (a rank that fell
    behind its emulated time in one step makes it up in the next, so the mean is the figure)."""
    step_times: list[float]
    """Per reported step, the slowest rank's wall seconds."""
    predicted_step_s: float | None
    """The cost model's step time for the emulated cluster, its compute calibrated at start-up
    and rescaled by the CPU time the ranks measured (``cpu_drift``)."""
    a_priori_step_s: float | None
    """The same from the start-up calibration alone."""
    cpu_drift: float
    """CPU time the ranks' compute took over what the start-up calibration predicted."""
    cpu_drifts: dict[str, float] = field(default_factory=dict)
    """The same per device type (what the prediction is rescaled by)."""
    losses: list[float]
    calibration: Calibration
    time_scale: float = 1.0
    """The extra slowdown every emulated device ran at."""
    verify_message: str | None = None
    """With ``verify``: None when the run matched the single-process reference, else the first
    divergence."""
    verify_optimizer: str | None = None
    """The optimizer ``--verify`` trained both runs with (None: not verified)."""
    precision_verdict: PrecisionVerdict | None = None
    """With ``verify`` of a bf16 or fp16 plan: its :class:`.verify.PrecisionVerdict` (the fp32
    check is ``verify_message``)."""
    kept_module_inputs: list[tuple[int, int]] = field(default_factory=list)
    """(pipeline, stage) slots whose ``offload.module_inputs`` the CPU ranks did not run: the
    installed megatron-core has no fine-grained activation offloading
    (:func:`.shrink.without_module_inputs`)."""
    links: dict | None = None
    """With link emulation: ``(sender rank, receiver rank) -> Link`` the pipeline messages took
    (:func:`.links.rehearsal_links`); None without."""
    link_stretch: float | None = None
    """With link emulation: emulated seconds per real second the link times were scaled by."""
    rebalance: list = field(default_factory=list)
    """With ``--rebalance``: what live rebalancing said, in order
    (:class:`~megatron_hetero.telemetry.records.RebalanceNote`)."""
    slow: list = field(default_factory=list)
    """The ``--slow`` stages (:class:`.slow.SlowStage`)."""
    telemetry: object = None
    """The ``--telemetry`` folder (None: none written)."""

    @property
    def ratio(self) -> float | None:
        """Measured over predicted step time."""
        return self.step_s / self.predicted_step_s if self.predicted_step_s else None


def stage_reports(shrunk: Plan, leads, steps, caps: dict[int, tuple[float, float, float]],
                  sim) -> list[StageReport]:
    """One :class:`StageReport` per tensor-parallel lead rank in ``leads`` (the trainer's rank
    results), measured over the reported ``steps`` and predicted by ``sim`` (a ``SimResult``),
    in (mesh, pipeline, stage) order."""
    stages = []
    for r in leads:
        extra = r.extra
        slot = shrunk.slot_of_rank(r.rank)
        mesh = shrunk.meshes[slot.mesh]
        st = shrunk.stage_of_slot(slot)
        pred = sim.stage(r.pipeline, r.stage)
        stages.append(StageReport(
            pipeline=r.pipeline, stage=r.stage, mesh=slot.mesh,
            tensor_model_parallel_size=mesh.tensor_model_parallel_size,
            device_type=st.device_type, num_layers=st.num_layers,
            num_microbatches=mesh.pipelines[slot.replica].num_microbatches,
            factor=extra["factor"], step_s=_mean([r.step_times[k] for k in steps]),
            busy_s=_mean([extra["busy"][k] for k in steps]),
            cpu_s=_mean([extra["cpu"][k] for k in steps]),
            drift_s=max(extra["drift"][k] for k in steps),
            sync_s=_mean([extra["sync"][k] for k in steps]),
            peak_bytes=extra["peak_bytes"], cap_bytes=caps[r.rank][0],
            predicted_busy_s=pred.busy_s, predicted_idle_s=sim.step_time_s - pred.busy_s,
            predicted_sync_s=pred.sync_s + pred.idle_s))
    stages.sort(key=lambda s: (s.mesh, s.pipeline, s.stage))
    return stages


def module_inputs_note(slots: list[tuple[int, int]]) -> str:
    """The report's line on module-input offload the CPU ranks did not run (the installed
    megatron-core has no fine-grained activation offloading)."""
    where = ", ".join(f"pipeline {d} stage {s}" for d, s in slots)
    return (f"note: offload.module_inputs is not rehearsed on {where}: the installed "
            f"megatron-core has no fine-grained activation offloading (megatron-core 0.16.1 and "
            f"0.17.1 have it); those ranks keep the tensors, their memory caps count them as "
            f"offloaded, and neither the measured nor the predicted times include the host "
            f"copies")


def format_report(result: RehearsalResult, *, source: str = "PLAN",
                  real: ModelSpec | None = None) -> str:
    """The rehearsal's table: measured and predicted time per pipeline and stage (of a chain of
    meshes, each row also names its mesh and the mesh's TP)."""
    m = result.plan.model
    c = result.calibration
    n_steps = len(result.step_times)
    plan = result.plan
    chain = not plan.one_grid  # rows name their mesh and its TP
    split = (f"{plan.layer_split}, interleaved: {plan.virtual_pipeline_size} model chunks per "
             f"stage of {[s.chunk_layers for k in plan.meshes for s in k.pipelines[0].stages]} "
             "layers"
             + (f", micro-batches in groups of {plan.microbatch_group_size}"
                if plan.microbatch_group_size is not None else "")
             if plan.virtual_pipeline_size > 1 else f"{plan.layer_split}")
    lines = [
        f"rehearsal of {source}: {real.name if real else m.name}, {m.num_layers} layers "
        f"{split}, shrunk to hidden {m.hidden_size} "
        f"(heads {m.num_attention_heads}, "
        f"ffn {m.ffn_hidden_size}, vocab {m.vocab_size}, seq {m.seq_length}); "
        f"{result.plan.world_size} CPU ranks; {n_steps} measured steps after 1 warm-up; every "
        f"device slowed {result.time_scale:g}x more (time scale)",
        f"calibrated: shrunk layer fwd+bwd "
        f"{1e3 * sum(next(v for k, v in c.parts.items() if k[0] == 'layer')):.2f} ms of CPU "
        f"({c.layer_flops_per_s / 1e9:.2f} GFLOP/s); gloo p2p {c.p2p_latency_s * 1e6:.0f} us, "
        f"{c.bandwidth_gb_s:.2f} GB/s, all-reduce {c.allreduce_gb_s:.2f} GB/s; optimizer "
        f"{c.optimizer_gb_s:.2f} GB/s",
        "",
        (f"{'mesh':>4} " if chain else "")
        + f"{'pipe':>4} {'stage':>5}  {'device':<18} " + (f"{'TP':>2} " if chain else "")
        + f"{'layers':>6} {'micro':>5} {'slow':>6}"
        f" | {'step s':>7} {'busy s':>7} {'idle s':>7} {'bubble':>6} {'sync s':>6}"
        f" | {'pred busy':>9} {'pred idle':>9} {'bubble':>6} {'sync s':>6}"
        f" | {'memory peak/cap':>17}",
    ]
    for st in result.stages:
        pred_bubble = (st.predicted_idle_s / result.predicted_step_s
                       if result.predicted_step_s else float("nan"))
        mem = ("-" if st.peak_bytes is None else
               f"{st.peak_bytes / 2**20:.2f}/{st.cap_bytes / 2**20:.2f} MiB"
               + ("!" if st.peak_bytes > st.cap_bytes else ""))
        lines.append(
            (f"{st.mesh:>4} " if chain else "")
            + f"{st.pipeline:>4} {st.stage:>5}  {st.device_type:<18} "
            + (f"{st.tensor_model_parallel_size:>2} " if chain else "")
            + f"{st.num_layers:>6} {st.num_microbatches:>5} {st.factor:>5.2f}x"
            f" | {st.step_s:>7.3f} {st.busy_s:>7.3f} {st.idle_s:>7.3f} {st.bubble_fraction:>6.1%}"
            f" {st.sync_s:>6.3f}"
            f" | {st.predicted_busy_s:>9.3f} {st.predicted_idle_s:>9.3f} {pred_bubble:>6.1%}"
            f" {st.predicted_sync_s:>6.3f}"
            f" | {mem:>17}")
    lines.append("")
    if result.links:
        slowest = min(result.links.values(), key=lambda x: x.bandwidth_bytes_s)
        lines.append(f"links: emulated from the inventory, scaled {result.link_stretch:.3g}x like "
                     f"the compute; slowest {slowest.bandwidth_bytes_s / 1e6:.3g} MB/s of shrunk "
                     f"messages + {slowest.latency_s * 1e6:.3g} us")
        lines.extend(_host_staged_lines(result))
    if result.kept_module_inputs:
        lines.append(module_inputs_note(result.kept_module_inputs))
    worst = max((st.drift_s for st in result.stages), default=0.0)
    if worst > 0.02 * result.step_s:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        lines.append(f"note: other processes held the cores: a rank's compute ran up to "
                     f"{worst:.3f} s behind its emulated time at a step's end (load average "
                     f"{load:.1f} on {os.cpu_count()} cores); measured times are too long by "
                     f"up to that much")
    if result.predicted_step_s:
        lines.append(f"step time: measured {result.step_s:.3f} s (mean of {n_steps}), predicted "
                     f"{result.predicted_step_s:.3f} s by the tuner's cost model for this emulated "
                     f"cluster; measured/predicted {result.ratio:.2f}")
        per = (" (" + ", ".join(f"{d} {x:.2f}x" for d, x in sorted(result.cpu_drifts.items()))
               + ")" if len(result.cpu_drifts) > 1 else "")
        lines.append(f"  (the ranks' compute took {result.cpu_drift:.2f}x the CPU time the "
                     f"start-up calibration measured{per}; from that calibration alone the "
                     f"prediction is {result.a_priori_step_s:.3f} s)")
    for sl in result.slow:
        lines.append(f"slowed: {sl.path} {sl.factor:g}x from step {sl.from_step} (steps counted "
                     "from 1; the report's slow column shows the last step's)")
    if result.step_times and (result.slow or result.rebalance):
        lines.append("step times: " + ", ".join(f"{x:.3f}" for x in result.step_times)
                     + " s (steps 2.." + str(len(result.step_times) + 1) + ")")
    for note in result.rebalance:
        lines.append(f"rebalance: {note.message}"
                     + (f"; from step {note.from_step}" if note.from_step else ""))
    if result.telemetry is not None:
        lines.append(f"telemetry: {result.telemetry}/telemetry.jsonl, plan.yaml (the shrunk plan "
                     "that ran) and its profiles; megatron-hetero report "
                     f"{result.telemetry}")
    lines.append("losses: " + ", ".join(f"{x:.4f}" for x in result.losses))
    return "\n".join(lines)


def _host_staged_lines(result: RehearsalResult) -> list[str]:
    """One line per pair of ranks whose link is the host path (GPUs of two vendors)."""
    plan, stretch = result.plan, result.link_stretch or 1.0
    pairs = {(min(a, b), max(a, b)): link for (a, b), link in result.links.items()
             if link.host_path is not None}
    lines = []
    for (a, b), link in sorted(pairs.items()):
        hp = link.host_path
        lines.append(
            f"  host-staged: ranks {a} <-> {b} ({plan.device_type_of_rank(a)} <-> "
            f"{plan.device_type_of_rank(b)}): device-to-host {hp.host_link_gb_s:.3g} GB/s, "
            f"network {hp.network_gb_s:.3g} GB/s ({'RDMA' if hp.rdma else 'TCP'}), host-to-device "
            f"{hp.host_link_gb_s:.3g} GB/s one after another: {hp.bandwidth_gb_s:.3g} GB/s + "
            f"{link.latency_s / stretch * 1e6:.3g} us a message, as the cost model prices a "
            f"pipeline send")
    return lines

