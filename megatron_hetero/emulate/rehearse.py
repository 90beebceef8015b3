"""Rehearse a plan on this machine: one CPU process per plan rank, each playing its GPU type.
One rehearsal for every plan shape: one grid or a chain of meshes (the trainer's backend,
:mod:`.rank_backends`, is the only part that differs; a chain needs megatron-core 0.17+).

``megatron-hetero rehearse PLAN`` (see :func:`megatron_hetero.cli.rehearse.rehearse_main`):

1. *Shrink* the model in width (:func:`~megatron_hetero.models.shrink_model`): hidden size,
   heads, FFN, vocabulary and sequence scale down together (FFN, vocabulary and sequence keep
   their ratio to the hidden size, so layers, output layer and attention keep their relative
   costs; heads divisible by every mesh's TP); the layer count, the layer split, the meshes,
   the micro-batch sizes and counts and each stage's policies stay as in the plan.
2. *Refuse* a plan this machine cannot host (:func:`.host.check_host_capacity`): more than
   :data:`.host.MAX_RANKS` ranks, or more estimated memory than is available.
3. *Calibrate*, on two CPU processes, what the emulated cluster is made of: the CPU time of one
   forward and backward of the shrunk layer, embedding and output layer, the bytes a layer
   saves for the backward pass, the optimizer step's rate, and gloo's point-to-point latency and
   bandwidth and all-reduce bandwidth, at each micro-batch size of the plan, once per device
   type's idle gaps; the emulated device ``d`` then computes at
   ``cpu speed / factor(d)`` (:mod:`.speed`). ``--calibration FILE`` reads it from a file an
   earlier rehearsal of the same shrunk model wrote (:mod:`.calibration_file`).
4. *Run* N steps on the CPU ranks under the speed and memory emulation (:mod:`.speed`,
   :mod:`.memory`); the first step is a warm-up and is not reported.
5. *Predict* the same emulated setup with the tuner's cost model and simulator
   (:func:`megatron_hetero.sim.step.simulate`), over an
   inventory whose custom GPU entries are these emulated devices, and print both side by side.
   The CPU's speed drifts between the calibration and the run on a shared machine, so the
   calibrated compute is rescaled by one factor, the CPU time the ranks' compute measured over
   what the calibration expected for it (both predictions are reported).

Not rehearsed on a chain of meshes: link emulation (refused: megatron-core's bridges send with
``dist.send``/``recv``/``broadcast`` directly, not through the two p2p primitives
:mod:`.links` wraps).

``--verify`` also trains the same model, data and seed in one process and compares losses and
final parameters (fp32, rtol 1e-5, atol 1e-5: 1% of an Adam step); it names the first diverging
step and tensor. A bf16 or fp16 plan then trains in its own precision, and its deviation from
the fp32 one-process run must be no larger than plain Megatron's uniform plan's in the same
precision (:mod:`.verify`).

The parts live in sibling modules: :mod:`.shrink` (the shrunk plan; the model is shrunk by
:func:`megatron_hetero.models.shrink_model`), :mod:`.host` (what this machine can host, the
automatic time scale), :mod:`.calibration` (the CPU and gloo measured), :mod:`.drift` (the
calibration rescaled by the CPU time the run measured), :mod:`.prediction` (the emulated cluster
and the tuner's prediction of it), :mod:`.rank_hooks` (each rank's speed and memory emulation)
and :mod:`.report` (the result and its table). This module holds the configuration, the
orchestration and the command line.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import HeteroError
from ..hardware.catalog import Catalog, load_catalog
from ..plan import Plan
from ..telemetry.rebalance import RebalancePolicy, check_rebalanceable
from .calibration import Calibration, _mean, activation_scale, calibrate
from .calibration_file import calibration_key, load_calibrations, save_calibrations
from .drift import cpu_drifts, in_run_calibrations, measured_allreduce_gb_s
from .host import MAX_RANKS, auto_time_scale, check_host_capacity
from .links import rehearsal_links
from .prediction import predict, trainer_shards_optimizer
from .rank_backends import backend_for
from .rank_hooks import rehearsal_hooks, user_error
from .report import RehearsalResult, format_report, stage_reports
from .slow import SlowStage
from .telemetry import LiveConfig
from .shrink import offload_min_numel, shrink_plan, without_module_inputs
from .trainer import TrainConfig, train_plan
from .verify import fp16_initial_loss_scale, train_and_verify

__all__ = ["RehearsalConfig", "rehearse", "train_and_verify", "format_report",
           "VERIFY_OPTIMIZER"]

VERIFY_OPTIMIZER = "sgd"
"""The optimizer of a ``--verify`` rehearsal (Megatron's SGD, momentum 0.9): linear in the
gradient, so the comparison with one process is decisive (the step's timing then holds SGD's
optimizer step, not Adam's). A plan that offloads optimizer state verifies with Adam (the
hybrid optimizer megatron-core offloads with takes Adam only)."""


@dataclass(kw_only=True, slots=True)
class RehearsalConfig:
    """How to rehearse a plan."""

    steps: int = 3
    """Training steps; the first is a warm-up and is not reported."""
    hidden_size: int = 64
    """Hidden size of the shrunk model (heads, FFN, vocabulary and sequence follow)."""
    time_scale: float | None = None
    """Extra slowdown of every emulated device (see :mod:`.speed`); None picks the smallest
    that keeps the ranks' compute within 70% of this machine's cores (:func:`auto_time_scale`)."""
    memory_cap: bool = True
    """Cap each rank's memory to its device's memory scaled with the model (see :mod:`.memory`)."""
    meter_memory: bool = True
    """Count each rank's saved activations (the report's memory peak; needed by the cap). The
    accounting is Python work inside every stretched step (about 4 us per saved tensor);
    calibration runs turn it off, with the cap, so that the ranks run only the model."""
    seed: int = 1234
    nice: int = 0
    """``os.nice`` increment of the rank processes (negative, as root, shields the emulated
    timing from other work on a busy machine)."""
    max_ranks: int = MAX_RANKS
    timeout_s: float = 600.0
    """Hard limit on the whole multi-process run."""
    emulate_links: bool = False
    """Make every pipeline message take the time of the link the inventory gives its two ranks
    (:mod:`.links`), scaled like the compute: a shrunk message takes the rehearsal's stretch
    (emulated over real seconds of a layer) times what the real one takes on the real link.
    Needs the inventory."""
    link_latency_s: float = 20e-6
    """Latency of one real pipeline message on every link, with ``emulate_links`` (seconds on
    the real cluster, scaled like the bandwidth; the cost model's default)."""
    slow: list[SlowStage] = field(default_factory=list)
    """``--slow``: stages of one replica made slower from a step on (:mod:`.slow`)."""
    telemetry: Path | None = None
    """``--telemetry DIR``: the runtime's telemetry files, written from the ranks
    (:mod:`.telemetry`)."""
    telemetry_interval: int = 1
    """Report every N-th step after the warm-up (``--telemetry-interval``)."""
    rebalance: RebalancePolicy | None = None
    """``--rebalance``: move the replicas' micro-batch shares live, as the runtime does."""

    def __post_init__(self) -> None:
        # the rehearse command's option of each field is named: the CLI passes them through
        if self.steps < 2:
            raise ValueError(f"steps (--steps): found {self.steps}; expected at least 2 (the "
                             "first is a warm-up)")
        if self.hidden_size < 8:
            raise ValueError(f"hidden_size (--hidden-size): found {self.hidden_size}; expected "
                             "at least 8")
        if self.time_scale is not None and not 1 <= self.time_scale < math.inf:
            raise ValueError(f"time_scale (--time-scale): found {self.time_scale}; expected a "
                             "finite number >= 1")
        if not 1 <= self.telemetry_interval <= 1000:
            raise ValueError(f"telemetry_interval (--telemetry-interval): found "
                             f"{self.telemetry_interval}; expected a number of steps from 1 "
                             "to 1000")
        if not 0 <= self.link_latency_s < math.inf:
            raise ValueError(f"link_latency_s (--link-latency): found {self.link_latency_s}; "
                             "expected a finite number of seconds >= 0")


def _train(plan, config, hooks):
    """:func:`.trainer.train_plan` of ``plan`` on CPU ranks, ``hooks`` each rank's hooks, a
    rank's plan mistake (out of memory under the caps) raised as its one-line error."""
    from ..mcore.spawn import SpawnError

    try:
        return train_plan(plan, config, hooks_factory=hooks)
    except SpawnError as exc:
        user = user_error(exc)
        if user is not None:
            raise user from None
        raise


def rehearse(plan: Plan, config: RehearsalConfig | None = None, *, catalog: Catalog | None = None,
             verify: bool = False, source: str = "PLAN", progress=None,
             calibration: Calibration | dict[str, Calibration] | None = None,
             inventory=None, calibration_file: str | None = None) -> RehearsalResult:
    """Shrink, check, calibrate, run and predict ``plan`` (see the module docstring);
    ``inventory`` gives the links of ``config.emulate_links``; ``calibration``: one
    :class:`Calibration` or one per device type, measured before (none is then measured);
    else ``calibration_file`` (``--calibration``): read where it exists, else measured and
    written there (:mod:`.calibration_file`)."""
    from ..mcore.cpu_offload import module_input_offload_supported
    from .memory import memory_caps
    from .speed import device_slowdowns

    config = config or RehearsalConfig()
    backend_for(plan).check_installed(source)
    if config.emulate_links and not plan.one_grid:
        raise HeteroError(f"{source}: link emulation (--emulate-links) is not built for a "
                          "chain of meshes (format 2) yet")
    if config.emulate_links and inventory is None:
        raise HeteroError(f"{source}: link emulation (--emulate-links) needs the inventory "
                          "(--inventory): the links between the plan's GPUs come from it")
    if config.rebalance is not None:
        check_rebalanceable(plan, source=source)
    catalog = catalog or plan.catalog or load_catalog()
    say = progress or (lambda msg: None)
    shrunk, kept_inputs = shrink_plan(plan, config.hidden_size, catalog), []
    if shrunk.offloads_module_inputs and not module_input_offload_supported():
        shrunk, kept_inputs = without_module_inputs(shrunk, catalog)
    check_host_capacity(shrunk, max_ranks=config.max_ranks, source=source, catalog=catalog)
    slowdowns = device_slowdowns(plan, catalog)
    time_scale = config.time_scale or auto_time_scale(plan, slowdowns)
    factors = {d: s * time_scale for d, s in slowdowns.items()}
    if calibration is None:
        calibration = _calibration(shrunk, factors, config, calibration_file, source, say)
    calibrations = calibration
    if not isinstance(calibration, Calibration):  # the fastest device's
        calibration = calibrations[min(factors, key=lambda d: (factors[d], d))]
    caps = memory_caps(plan, shrunk, catalog,
                       activation_scale=activation_scale(shrunk, calibration),
                       cpu_shards_optimizer=trainer_shards_optimizer(shrunk))
    say(f"running {config.steps} steps on {shrunk.world_size} CPU ranks")
    # --verify trains with SGD: linear in the gradient, so a plan and one process agree to
    # rounding, where Adam turns fp32 reduction-order noise (a TP group's) into parameter
    # differences a bug could hide behind (issue 32 A.8)
    # (a plan that offloads optimizer state runs megatron-core's hybrid optimizer: Adam only)
    optimizer = VERIFY_OPTIMIZER if verify and not shrunk.offloads_optimizer else "adam"
    # --verify trains in the plan's precision (megatron-core's mixed precision), the rest fp32;
    # a plan that offloads optimizer state verifies in fp32 (the CPU stack's fixes of
    # megatron-core's hybrid optimizer, mcore/cpu_offload.py, run fp32 parameters only)
    precision = shrunk.precision if verify and not shrunk.offloads_optimizer else "fp32"
    tconf = TrainConfig(steps=config.steps, seed=config.seed, gather_params=verify,
                        optimizer=optimizer, precision=precision,
                        initial_loss_scale=fp16_initial_loss_scale(shrunk),
                        loss_scale_hysteresis=1,
                        eval_forward_only=verify, timeout_s=config.timeout_s,
                        offload_min_numel=offload_min_numel(plan, shrunk))
    metered = config.meter_memory or config.memory_cap
    links, link_stretch = _links(plan, shrunk, config, inventory, calibration, factors)
    live = None
    if config.slow or config.telemetry is not None or config.rebalance is not None:
        live = LiveConfig(slow=list(config.slow), directory=config.telemetry,
                          interval=config.telemetry_interval, rebalance=config.rebalance,
                          calibration=calibrations, factors=factors)
    hooks = functools.partial(rehearsal_hooks, factors=factors, time_scale=time_scale,
                              caps=caps if metered else None, enforce_caps=config.memory_cap,
                              nice=config.nice, links=links, live=live)
    result, verify_message, verdict = train_and_verify(shrunk, tconf, hooks=hooks,
                                                       verify=verify, say=say, train=_train)

    steps = range(1, config.steps)  # step 0 is the warm-up
    step_times = [max(r.step_times[k] for r in result.ranks) for k in steps]
    a_priori = predict(shrunk, calibrations, factors, links=links)
    # The CPU's speed drifts between the start-up calibration and the run (other processes,
    # caches, frequency): rescale the calibrated compute by the CPU time the ranks measured.
    # Per device type: each type's ranks sleep their own gaps between steps, and the CPU speed
    # after a gap differs with its length, so one drift for all types over-corrects one and
    # under-corrects the other (seen: A100 ranks at 1.6x their calibration, V100 ranks at 1.0x).
    leads = [r for r in result.ranks if r.tensor_rank == 0]
    drifts, drift = cpu_drifts(shrunk, leads, a_priori, steps)
    # ... and take the gloo all-reduce bandwidth the ranks measured among themselves
    world_bw = measured_allreduce_gb_s(result.ranks, default=calibration.allreduce_gb_s)
    in_run = in_run_calibrations(calibrations, drifts, drift, world_bw)
    sim = predict(shrunk, in_run, factors, links=links)
    stages = stage_reports(shrunk, leads, steps, caps, sim)
    return RehearsalResult(plan=shrunk, stages=stages, step_s=_mean(step_times),
                           step_times=step_times, predicted_step_s=sim.step_time_s,
                           a_priori_step_s=a_priori.step_time_s, cpu_drift=drift,
                           cpu_drifts=drifts,
                           losses=result.losses, calibration=calibration, time_scale=time_scale,
                           verify_message=verify_message, precision_verdict=verdict,
                           kept_module_inputs=kept_inputs,
                           verify_optimizer=optimizer if verify else None,
                           links=links, link_stretch=link_stretch,
                           rebalance=(result.ranks[0].extra or {}).get("rebalance", []),
                           slow=list(config.slow), telemetry=config.telemetry)


def _calibration(shrunk: Plan, factors: dict[str, float], config: RehearsalConfig,
                 path: str | None, source: str, say) -> dict[str, Calibration]:
    """The calibration per device type: read from ``path`` where it exists (measured for this
    shrunk model, micro-batch sizes, metering and idle gaps, else refused), else measured
    (:func:`_calibrate_devices`) and, with ``path``, written there."""
    key = calibration_key(shrunk, {d: max(0.0, f - 1.0) for d, f in factors.items()},
                          config.meter_memory or config.memory_cap)
    if path is not None and os.path.exists(path):
        say(f"reading the calibration from {path}")
        return load_calibrations(path, key, source=source)
    say("calibrating the CPU and gloo")
    measured = _calibrate_devices(shrunk, factors, config)
    if path is not None:
        save_calibrations(path, measured, key)
    return measured


def _calibrate_devices(shrunk: Plan, factors: dict[str, float],
                       config: RehearsalConfig) -> dict[str, Calibration]:
    """One calibration per device type: each device's rank sleeps factor - 1 times every step
    after it, and a CPU step that follows such an idle gap costs more than one run back to back,
    so the penalty is measured per device (none at factor 1; docs/calibration.md)."""
    by_idle: dict[float, Calibration] = {}
    for d in sorted(factors, key=lambda d: factors[d]):
        idle = round(max(0.0, factors[d] - 1.0), 3)
        if idle not in by_idle:
            by_idle[idle] = calibrate(shrunk, seed=config.seed, nice=config.nice,
                                      idle_factor=idle,
                                      meter=config.meter_memory or config.memory_cap)
    return {d: by_idle[round(max(0.0, f - 1.0), 3)] for d, f in factors.items()}


def _links(plan: Plan, shrunk: Plan, config: RehearsalConfig, inventory, calibration,
           factors: dict[str, float]):
    """(:func:`.links.rehearsal_links` table, its time stretch), or (None, None) without
    ``config.emulate_links``."""
    if not config.emulate_links:
        return None, None
    fastest = min(factors, key=lambda d: (factors[d], d))
    return rehearsal_links(plan, shrunk, inventory, calibration=calibration,
                           factor=factors[fastest], latency_s=config.link_latency_s)
