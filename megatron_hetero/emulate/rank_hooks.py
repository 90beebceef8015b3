"""The rehearsal's ranks: speed and memory emulation of each CPU rank (the trainer's
``hooks_factory``), the gloo bandwidth they measure among themselves, and the user error a rank
raised."""

from __future__ import annotations

import contextlib

from ..errors import HeteroError
from ..plan import Plan
from .calibration import _all_reduce_seconds, _renice
from .telemetry import LiveConfig, RankLive

__all__ = ["rehearsal_hooks", "user_error"]


class _RankEmulation:
    """Speed and memory emulation of one rank, as :class:`~.trainer.RankHooks`."""

    def __init__(self, speed, meter):
        self.speed, self.meter = speed, meter
        self.busy: list[float] = []
        self.cpu: list[float] = []
        self.drift: list[float] = []
        self.sync: list[float] = []
        self._last = (0.0, 0.0, 0.0)

    @contextlib.contextmanager
    def compute(self, kind: str):
        # backward too: a recomputing stage saves its recomputed activations there
        ctx = self.meter.saved_activations() if self.meter is not None else contextlib.nullcontext()
        with self.speed.step(), ctx:
            yield

    def on_step_end(self, step: int, wall_s: float) -> None:
        sp = self.speed
        self.busy.append(sp.busy_s - self._last[0])
        self.cpu.append(sp.cpu_s - self._last[1])
        self.drift.append(sp.drift_s)
        if step == 0:
            sp.drift_s = 0.0  # one-time costs of the warm-up are not carried into the next steps
        self.sync.append(self._sync_total - self._last[2])
        self._last = (sp.busy_s, sp.cpu_s, self._sync_total)
        if self.meter is not None and self._built is not None:
            self.meter.count_static(*self._built)  # the optimizer state exists after a step

    _built = None
    allreduce_gb_s = None

    def on_built(self, model_chunks, optimizer) -> None:
        self._built = (model_chunks, optimizer)
        if self.meter is not None:
            self.meter.count_static(model_chunks, optimizer)
        # time the gradient sync and the optimizer step (neither is stretched)
        for chunk in model_chunks:
            chunk.finish_grad_sync = self._timed(chunk.finish_grad_sync)
        optimizer.step = self._timed(optimizer.step)

    _sync_total = 0.0

    def _timed(self, fn):
        import time

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync_total += time.perf_counter() - t0
        return timed

    def report(self) -> dict:
        meter = self.meter
        return {"busy": self.busy, "cpu": self.cpu, "drift": self.drift, "sync": self.sync,
                "factor": self.speed.factor,
                "slept_s": self.speed.slept_s,
                "peak_bytes": meter.peak_bytes if meter else None,
                "cap_bytes": meter.cap if meter else None,
                "static_bytes": meter.static_bytes if meter else None,
                "allreduce_gb_s": self.allreduce_gb_s}


def _world_allreduce_gb_s(plan: Plan) -> float:
    """Bus bandwidth (``2 (n-1)/n x bytes / s``) of an all-reduce of one stage's gradients over
    every rank of the rehearsal: what gradient sync sees with this many processes on this
    machine. Runs on every rank before training (a collective of the whole world)."""
    import torch
    import torch.distributed as dist

    from .. import models as M

    n = dist.get_world_size()
    if n < 2:
        return float("inf")
    params = max(M.layer_params(plan.model) * max(plan.layer_split)
                 + M.embedding_params(plan.model), 1 << 16)
    buf = torch.zeros(int(params))
    return 2 * (n - 1) / n * buf.numel() * 4 / _all_reduce_seconds(buf, 4) / 1e9


def rehearsal_hooks(plan: Plan, rank: int, *, factors: dict[str, float],
                    time_scale: float, caps: dict[int, tuple[float, float, float]] | None,
                    enforce_caps: bool = True, nice: int = 0, links=None,
                    live: LiveConfig | None = None):
    """``hooks_factory`` of the rehearsal (runs inside each rank process): the rank's
    :class:`~.trainer.RankHooks` emulating its device's speed (``factors[device] / time_scale``
    slower than the CPU, on top of the time scale), with ``caps`` its memory (``caps[rank]``
    = (cap, device bytes, scale); enforced when ``enforce_caps``), with ``links`` (every
    rank's :func:`.links.plan_links` table) the time of its pipeline messages and with
    ``live`` its slowdowns, telemetry and live rebalancing (:mod:`.telemetry`)."""
    from .links import emulate_links
    from .memory import MemoryMeter, meter_module_input_offload
    from .speed import SpeedEmulation
    from .trainer import RankHooks

    _renice(nice)
    if links:
        emulate_links(links, rank)
    allreduce_gb_s = _world_allreduce_gb_s(plan)
    device, pipeline, stage = _place(plan, rank)
    speed = SpeedEmulation(slowdown=factors[device] / time_scale, time_scale=time_scale,
                           device_type=device, absorb_contention=True)
    meter = None
    if caps is not None:
        cap, device_bytes, scale = caps[rank]
        meter = MemoryMeter(rank=rank, pipeline=pipeline, stage=stage,
                            device_type=device, cap=cap if enforce_caps else None,
                            device_bytes=device_bytes, scale=scale)
        if _stage_of(plan, rank).offload.module_inputs:
            meter_module_input_offload(meter)  # the inputs its offload manager keeps
    emu = _RankEmulation(speed, meter)
    emu.allreduce_gb_s = allreduce_gb_s
    if live is None:
        return RankHooks(compute=emu.compute, on_step_end=emu.on_step_end, report=emu.report,
                         on_built=emu.on_built)
    rank_live = RankLive(plan=plan, rank=rank, config=live, speed=speed)

    def on_built(model_chunks, optimizer):
        emu.on_built(model_chunks, optimizer)
        rank_live.on_built(model_chunks, optimizer)

    def on_step_end(step: int, wall_s: float):
        emu.on_step_end(step, wall_s)
        rank_live.on_step_end(step, wall_s)

    def report():
        return {**emu.report(), "rebalance": rank_live.notes,
                "shares": [(first, [p.num_microbatches for p in plan.pipelines])
                           for first, plan in rank_live.shares.switches]}

    return RankHooks(compute=emu.compute, on_step_end=on_step_end, report=report,
                     on_built=on_built, on_step_start=rank_live.on_step_start,
                     around=rank_live.around,
                     plan_at=rank_live.plan_at if live.rebalance is not None else None)


def _place(plan: Plan, rank: int) -> tuple[str, int, int]:
    """(device type, pipeline, stage) of ``rank``; of a mesh plan's rank: its replica in its mesh
    and its stage in the whole pipeline."""
    slot = plan.slot_of_rank(rank)
    return plan.stage_of_slot(slot).device_type, slot.replica, plan.global_stage(slot)


def _stage_of(plan: Plan, rank: int):
    """The plan stage ``rank`` runs (its policies)."""
    return plan.stage_of_slot(plan.slot_of_rank(rank))


def user_error(exc) -> HeteroError | None:
    """The user error a rank raised (e.g. MemoryCapError), from the remote traceback of a
    :class:`~megatron_hetero.mcore.spawn.SpawnError`; None for anything else (a bug)."""
    tb = getattr(exc, "remote_traceback", "") or ""
    for line in reversed(tb.strip().splitlines()):
        head, sep, message = line.partition(": ")
        if sep and head.startswith("megatron_hetero.") and head.rsplit(".", 1)[-1] in (
                "MemoryCapError", "HeteroError", "SchemaError", "InfeasibleError"):
            return HeteroError(message)
    return None
