"""The rehearsal's telemetry, slowdowns and live rebalancing (``rehearse --telemetry DIR
--slow PATH=FACTOR[@STEP] --rebalance``), one rank's side, as :class:`~.trainer.RankHooks`.

The marks and the records are the runtime's (:mod:`megatron_hetero.telemetry.collect`): each
rank wraps megatron-core's ``schedules.forward_step`` / ``backward_step`` (the trainer hands
them over: :attr:`~.trainer.RankHooks.around`), its gradient sync (``finish_grad_sync``) and
its optimizer step, and on an MoE model counts the tokens its routers send to each expert
(:class:`~megatron_hetero.mcore.expert_load.ExpertTokenCounter`); after each reported step every rank hands its figures to rank 0 in one
``gather_object`` over the rehearsal's gloo world, and rank 0 writes ``DIR/telemetry.jsonl``,
``DIR/plan.yaml`` (the shrunk plan that ran) and ``DIR/profile.<device type>.yaml``. A stage's
step time is the trainer's own (:attr:`~.trainer.RankResult.step_times`), so the records'
step times are the ones the rehearsal's report takes.

The predicted side is the rehearsal's own: the tuner's cost model for the emulated cluster
(:func:`.prediction.emulated_cost`, calibrated at start-up), in the seconds the CPU ranks run.
The profiles are that model's parts scaled by what ran, written under the plan's device types
(a profile of the shrunk model: ``tune --from-run DIR`` re-plans the shrunk model on them).

With ``--rebalance`` rank 0 decides at each report (:class:`~megatron_hetero.telemetry.
rebalance.Rebalancer`, as in the runtime), every rank takes the decision from a broadcast, and
the replicas run the new shares from the next step (:class:`ShareSchedule`: every replica
switches at the same global batch, so every sample is read exactly once). The first step is the
rehearsal's warm-up: it is neither reported nor rebalanced on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from ..mcore.expert_load import ExpertTokenCounter
from ..plan import Plan, save_any_plan
from ..sim.step import simulate
from ..telemetry.collect import RankCapture, RecordWriter, WallClock
from ..telemetry.prediction import Prediction, prediction_of
from ..telemetry.profile_out import run_profiles, software_now
from ..telemetry.rebalance import RebalancePolicy, Rebalancer, with_shares
from .prediction import emulated_cost, emulated_name
from .slow import SlowStage, slowdown_at

__all__ = ["LiveConfig", "ShareSchedule", "RankLive", "REPORTED_FROM"]

REPORTED_FROM = 2
"""The first step the telemetry reports (counted from 1; step 1 is the warm-up)."""


@dataclass(kw_only=True, slots=True)
class LiveConfig:
    """What the rehearsal's ranks measure, slow down and rebalance (picklable: it travels to
    every rank process)."""

    slow: list[SlowStage] = field(default_factory=list)
    """``--slow``: stages made slower from a step on."""
    directory: Path | None = None
    """``--telemetry DIR``; None: nothing written (rebalancing still reads the figures)."""
    interval: int = 1
    """Report every ``interval``-th step (``--telemetry-interval``)."""
    rebalance: RebalancePolicy | None = None
    """``--rebalance``'s policy; None: the shares stay."""
    calibration: object = None
    """The rehearsal's calibration (one, or one per device type): the prediction's."""
    factors: dict[str, float] = field(default_factory=dict)
    """Each device type's emulated slowdown over the CPU."""

    def __post_init__(self) -> None:
        if not 1 <= self.interval <= 1000:
            raise ValueError(f"--telemetry-interval: found {self.interval}; expected a number "
                             "of steps from 1 to 1000")

    @property
    def measures(self) -> bool:
        """Whether the ranks report (telemetry or rebalancing)."""
        return self.directory is not None or self.rebalance is not None


@dataclass(kw_only=True, slots=True)
class ShareSchedule:
    """The replicas' micro-batch shares step by step: the plan's until the first switch, then
    each switch's from its step on. Every replica of a rehearsal holds the same schedule, and a
    step's global batch is split by that step's plan (:func:`.trainer.sample_index`), so every
    sample of every global batch is read exactly once whatever the switches."""

    plan: Plan
    """The plan the rehearsal started with (one grid)."""
    switches: list[tuple[int, Plan]] = field(default_factory=list)
    """(first step, counted from 0 as the trainer counts, the plan with the new shares)."""
    started: int = -1
    """The last step :meth:`plan_at` gave (a switch must come later)."""

    def switch(self, *, from_step: int, shares: list[int]) -> Plan:
        """From step ``from_step`` on, replica ``d`` runs ``shares[d]`` micro-batches."""
        if from_step <= self.started or (self.switches and from_step < self.switches[-1][0]):
            raise ValueError(f"step {from_step} has begun or comes before an earlier switch; "
                             "switch from a later step")
        plan = with_shares(self.plan, shares, source="rebalancing")
        self.switches.append((from_step, plan))
        return plan

    def plan_at(self, step: int) -> Plan:
        """The plan of step ``step`` (counted from 0)."""
        self.started = max(self.started, step)
        plan = self.plan
        for first, p in self.switches:
            if step >= first:
                plan = p
        return plan


class RankLive:
    """One rank's telemetry, slowdown and share switches (made in the rank process by
    :func:`.rank_hooks.rehearsal_hooks`)."""

    def __init__(self, *, plan: Plan, rank: int, config: LiveConfig, speed):
        self.plan, self.rank, self.config, self.speed = plan, rank, config, speed
        self.slot = plan.slot_of_rank(rank)
        self.device_type = plan.stage_of_slot(self.slot).device_type
        self.base_slowdown = speed.slowdown
        self.capture = RankCapture(clock=WallClock())
        self.shares = ShareSchedule(plan=plan)
        self.rebalancer = Rebalancer(policy=config.rebalance) if config.rebalance else None
        self.writer: RecordWriter | None = None
        self.notes: list = []
        """Rank 0: every rebalancing note, in order."""

    # -- hooks ---------------------------------------------------------------------------------
    def on_built(self, model_chunks, optimizer) -> None:
        self.capture.chunks = {id(m): c for c, m in enumerate(model_chunks)}
        if self.plan.model.is_moe:
            self.capture.experts = ExpertTokenCounter(model_chunks,
                                                      self.plan.chunk_first_layers(self.slot))
        for chunk in model_chunks:
            chunk.finish_grad_sync = partial(self.capture.timed, "sync", chunk.finish_grad_sync)
        optimizer.step = partial(self.capture.timed, "optimizer", optimizer.step)

    def on_step_start(self, step: int) -> None:
        n = step + 1  # the telemetry's count
        self.speed.slowdown = self.base_slowdown * slowdown_at(self.config.slow, self.slot, n)
        if self.config.measures and self._reported(n):
            self.capture.arm()

    def around(self, kind: str, original, *a, **kw):
        if kind == "forward":
            return self.capture.forward_step(original, *a, **kw)
        return self.capture.backward_step(original, *a, **kw)

    def plan_at(self, step: int) -> Plan:
        return self.shares.plan_at(step)

    def on_step_end(self, step: int, wall_s: float) -> None:
        if self.capture.capture is None:
            return
        import torch.distributed as dist

        n = step + 1
        pipe = self.shares.plan_at(step).meshes[self.slot.mesh].pipelines[self.slot.replica]
        mine = self.capture.figures(self.capture.disarm(),
                                    slot=(self.slot.mesh, self.slot.stage, self.slot.replica),
                                    device_type=self.device_type,
                                    micro_batches=pipe.num_microbatches, step_s=wall_s)
        gathered = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        note = self._write(n, gathered, self.shares.plan_at(step)) if self.rank == 0 else None
        if self.rebalancer is None:
            return
        box = [note]
        dist.broadcast_object_list(box, src=0)
        note = box[0]
        if note is not None and note.shares is not None:
            plan = self.shares.switch(from_step=note.from_step - 1, shares=note.shares)
            if self.writer is not None:
                self.writer.runs(plan)

    def _reported(self, n: int) -> bool:
        return n >= REPORTED_FROM and (n - REPORTED_FROM) % self.config.interval == 0

    # -- rank 0 ----------------------------------------------------------------------------------
    def _write(self, step: int, gathered: list[dict], plan: Plan):
        """Rank 0: the record of ``step`` (written where ``--telemetry`` asks) and the
        rebalancing decision on it."""
        if self.writer is None:
            self.writer = RecordWriter(
                directory=self.config.directory,
                plan=plan, clock_name=self.capture.clock.name, predict=self._predict,
                copy_plan=partial(_save_plan, self.plan), profiles=self._profiles)
        decide = partial(self.rebalancer.note, plan) if self.rebalancer else None
        record = self.writer.write(step, gathered, decide)
        note = record.rebalance
        if note is not None:
            self.notes.append(note)
            print(f"megatron-hetero rebalance: {note.message}"
                  + (f"; from step {note.from_step}" if note.from_step else ""), flush=True)
        return note

    def _predict(self, plan: Plan) -> Prediction:
        emu, cost = emulated_cost(plan, self.config.calibration, self.config.factors)
        return prediction_of(emu, cost, simulate(emu, cost, record_events=False),
                             source="the tuner's cost model of the emulated cluster (start-up "
                                    "calibration)", inventory=cost.inventory)

    def _profiles(self, plan: Plan, records, prediction: Prediction):
        import platform

        import torch
        from megatron.core import package_info

        _, cost = emulated_cost(plan, self.config.calibration, self.config.factors)
        return run_profiles(plan, records, None, cost=cost, priced_as=emulated_name,
                            software=software_now(torch_version=str(torch.__version__),
                                                  megatron_core=str(package_info.__version__),
                                                  python=platform.python_version(), cuda=None),
                            layer_spec="local", backend="cpu")


def _save_plan(plan: Plan, path: Path) -> None:
    save_any_plan(plan, path)
