"""The collector's logic, shared by the runtime (:mod:`megatron_hetero.runtime.telemetry`,
inside Megatron-LM's loop) and the rehearsal (:mod:`megatron_hetero.emulate.telemetry`, the CPU
trainer's loop). Pure Python: the clock, the process group and torch stay with the callers.

:class:`RankCapture` is one rank's side: every armed step it marks the start and end of the
step, of every forward and backward of a micro-batch through a model chunk (it wraps
megatron-core's ``schedules.forward_step`` / ``backward_step``: a backward is matched to its
chunk through the output tensor its forward returned, and each chunk runs its micro-batches in
order), of the gradient sync and of the optimizer step, and hands its figures (a plain dict, for
``gather_object``) to the writer. Steps that are not armed pass straight through: one
comparison per call. On an MoE model it arms the rank's expert-token counter for the step
(:class:`~megatron_hetero.mcore.expert_load.ExpertTokenCounter`, handed in by the caller) and
adds its counts, read after the step, to the figures.

:class:`RecordWriter` is rank 0's side: for each stage of each replica it keeps the slowest
tensor rank of the gathered figures, sums every rank's tokens per expert by MoE layer and
device type (:class:`~.records.ExpertLoad`), writes one :class:`~.records.StepRecord` beside
the plan's prediction, the run's profiles and, at the first report, the plan's copy. A write error (a full
disk) loses the telemetry, never the training.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..plan import Plan
from .prediction import Prediction, stage_path
from .profile_out import write_run_profiles
from .records import (ExpertLoad, OpSpan, RebalanceNote, StageFigures, StageRecord, StepRecord,
                      append_record, load_imbalance, set_aside_earlier_run)

__all__ = ["WallClock", "CudaClock", "StepCapture", "RankCapture", "RecordWriter"]


class WallClock:
    """Marks on the wall clock (CPU ranks)."""

    name = "wall"

    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    @staticmethod
    def resolve() -> None:
        pass

    @staticmethod
    def between(a: float, b: float) -> float:
        return b - a


class CudaClock:
    """Marks as CUDA events, read once the step is over (``torch``: the module, handed in)."""

    name = "cuda-events"

    def __init__(self, torch):
        self._torch = torch

    def mark(self):
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def resolve(self) -> None:
        self._torch.cuda.synchronize()

    @staticmethod
    def between(a, b) -> float:
        return a.elapsed_time(b) / 1e3


class StepCapture:
    """The marks of one armed step on this rank."""

    __slots__ = ("start", "end", "ops", "sync", "optimizer", "forwards", "backwards", "outputs")

    def __init__(self, start):
        self.start, self.end = start, None
        self.ops: list[tuple] = []  # (kind, micro-batch, chunk, mark, mark)
        self.sync: list[tuple] = []
        self.optimizer: list[tuple] = []
        self.forwards: dict[int, int] = {}  # chunk -> forwards run
        self.backwards: dict[int, int] = {}
        self.outputs: dict[int, int] = {}  # id(output tensor) -> chunk


def _first_tensor(value):
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return value


@dataclass(kw_only=True, slots=True)
class RankCapture:
    """One rank's marks of its armed steps (the hooks call its methods)."""

    clock: Any
    """:class:`WallClock` or :class:`CudaClock`."""
    chunks: dict[int, int] = field(default_factory=dict)
    """``id(model chunk)`` -> its index on this rank (as the schedule hands the chunks over)."""
    capture: StepCapture | None = None
    """The armed step's marks; None between armed steps."""
    experts: Any = None
    """An MoE model's expert-token counter on this rank (``armed``, ``take()``:
    :class:`~megatron_hetero.mcore.expert_load.ExpertTokenCounter`); None: nothing counted."""

    def arm(self) -> None:
        """The step starting now is measured."""
        self.capture = StepCapture(self.clock.mark())
        if self.experts is not None:
            self.experts.armed = True

    def disarm(self) -> StepCapture:
        """The armed step ended now: its marks."""
        capture, self.capture = self.capture, None
        capture.end = self.clock.mark()
        if self.experts is not None:
            self.experts.armed = False
        return capture

    def abandon(self) -> None:
        """The armed step failed: nothing of it is kept."""
        self.capture = None
        if self.experts is not None:
            self.experts.armed = False
            self.experts.take()

    def forward_step(self, original, *a, **kw):
        """Wraps ``schedules.forward_step(forward_step_func, data_iterator, model, ...)``."""
        cap = self.capture
        if cap is None:
            return original(*a, **kw)
        model = a[2] if len(a) > 2 else kw["model"]
        chunk = self.chunks.get(id(model), 0)
        mb = cap.forwards.get(chunk, 0)
        cap.forwards[chunk] = mb + 1
        t0 = self.clock.mark()
        out = original(*a, **kw)
        cap.ops.append(("F", mb, chunk, t0, self.clock.mark()))
        output = out[0] if isinstance(out, tuple) else out
        cap.outputs[id(_first_tensor(output))] = chunk
        return out

    def backward_step(self, original, *a, **kw):
        """Wraps ``schedules.backward_step(input_tensor, output_tensor, ...)`` (and megatron-core
        0.19's ``backward_step_multimodule``)."""
        cap = self.capture
        if cap is None:
            return original(*a, **kw)
        output = kw.get("output_tensor", a[1] if len(a) > 1 else None)
        chunk = cap.outputs.pop(id(_first_tensor(output)), 0)
        mb = cap.backwards.get(chunk, 0)
        cap.backwards[chunk] = mb + 1
        t0 = self.clock.mark()
        out = original(*a, **kw)
        cap.ops.append(("B", mb, chunk, t0, self.clock.mark()))
        return out

    def timed(self, what: str, call, *a, **kw):
        """``call(*a, **kw)``, timed as ``what`` (``sync`` or ``optimizer``) in an armed step."""
        cap = self.capture
        if cap is None:
            return call(*a, **kw)
        t0 = self.clock.mark()
        out = call(*a, **kw)
        getattr(cap, what).append((t0, self.clock.mark()))
        return out

    def figures(self, capture: StepCapture, *, slot: tuple[int, int, int], device_type: str,
                micro_batches: int, step_s: float | None = None) -> dict:
        """This rank's figures of an armed step (seconds, after the clock resolved), for
        :meth:`RecordWriter.write`: ``slot`` is (mesh, stage in the mesh, replica);
        ``step_s`` the step's time where the caller measured it (else from the marks)."""
        clock = self.clock
        clock.resolve()
        t0 = capture.start
        ops = [(kind, mb, chunk, clock.between(t0, a), clock.between(t0, b))
               for kind, mb, chunk, a, b in capture.ops]
        spent = {kind: sum(e - s for k, _, _, s, e in ops if k == kind) for kind in "FB"}
        tokens = self.experts.take() if self.experts is not None else {}
        return {"slot": slot, "tokens_per_expert": tokens, "device_type": device_type, "micro_batches": micro_batches,
                "step_s": clock.between(capture.start, capture.end) if step_s is None else step_s,
                "forward_s": spent["F"], "backward_s": spent["B"],
                "sync_s": sum(clock.between(a, b) for a, b in capture.sync),
                "optimizer_s": sum(clock.between(a, b) for a, b in capture.optimizer),
                "ops": ops}


def _say(text: str) -> None:
    print(f"megatron-hetero telemetry: {text}", file=sys.stderr, flush=True)


@dataclass(kw_only=True, slots=True)
class RecordWriter:
    """Rank 0's side: the records of the gathered figures, written to ``directory``."""

    directory: Path | None
    """Where the files go; None: the records are kept (:attr:`records`), nothing is written
    (a rehearsal that rebalances without ``--telemetry``)."""
    plan: Plan
    """The plan as it runs now (live rebalancing replaces it: :meth:`runs`)."""
    clock_name: str
    """The ranks' clock (``wall`` or ``cuda-events``)."""
    predict: Callable[[Plan], Prediction]
    """The prediction of a plan (made again after its shares move)."""
    copy_plan: Callable[[Path], None]
    """Writes the plan the run started with to the given path (at the first report)."""
    profiles: Callable[[Plan, list[StepRecord], Prediction], dict] | None = None
    """The run's profiles from its records so far (``profile_out.run_profiles``), or None."""
    records: list[StepRecord] = field(default_factory=list)
    """Every record written so far."""
    prediction: Prediction | None = None
    """The current plan's prediction (made at the first report after the plan changed)."""
    began: bool = False
    """Whether the folder and the plan's copy were made (or failed)."""

    def _begin(self, step: int) -> None:
        """The folder and the plan's copy; another run's records found there are set aside
        (:func:`~.records.set_aside_earlier_run`), never mixed with this run's."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fresh = self.directory / "plan.yaml.partial"
        self.copy_plan(fresh)
        earlier = set_aside_earlier_run(self.directory, first_step=step,
                                        plan_text=fresh.read_bytes())
        if earlier is not None:
            _say(f"{self.directory} held another run's records; they are now in {earlier}")
        fresh.replace(self.directory / "plan.yaml")

    def runs(self, plan: Plan) -> None:
        """The run's plan from now on (its shares moved): predicted anew at the next report."""
        self.plan, self.prediction = plan, None

    def write(self, step: int, gathered: list[dict],
              decide: Callable[[StepRecord], RebalanceNote | None] | None = None) -> StepRecord:
        """The record of reported step ``step`` from every rank's figures (``gathered``),
        with ``decide``'s rebalancing note, appended to the telemetry and printed."""
        if not self.began and self.directory is not None:
            self.began = True
            try:
                self._begin(step)
            except OSError as exc:  # as below: the telemetry is lost, the training goes on
                _say(str(exc))
        if self.prediction is None:
            self.prediction = self.predict(self.plan)
        record = self._record(step, gathered)
        if decide is not None and record.predicted_step_time_s is not None:
            record.rebalance = decide(record)
        self.records.append(record)
        if self.directory is None:
            return record
        try:  # a full disk costs the telemetry, never the training
            append_record(self.directory, record)
            if self.profiles is not None:
                write_run_profiles(self.directory, self.profiles(self.plan, self.records,
                                                                 self.prediction))
        except OSError as exc:
            _say(f"step {step} not written: {exc}")
        pred = self.prediction
        line = f"step {step}: {record.step_time_s:.3f} s"
        worst = max(record.stages, key=lambda s: s.slowdown or 0.0)
        if worst.slowdown is not None:
            line += (f" (predicted {pred.step_time_s:.3f} s); slowest against its prediction: "
                     f"{worst.path} replica {worst.replica} ({worst.device_type}) "
                     f"{worst.slowdown:.2f}x")
        _say(line)
        return record

    def _record(self, step: int, gathered: list[dict]) -> StepRecord:
        slowest: dict[tuple, dict] = {}
        for fig in gathered:
            have = slowest.get(fig["slot"])
            if have is None or fig["forward_s"] + fig["backward_s"] > \
                    have["forward_s"] + have["backward_s"]:
                slowest[fig["slot"]] = fig
        plan, pred = self.plan, self.prediction
        stages = []
        for (k, j, r), fig in sorted(slowest.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
            g = sum(m.num_stages for m in plan.meshes[:k]) + j
            spent = fig["forward_s"] + fig["backward_s"] + fig["sync_s"] + fig["optimizer_s"]
            measured = StageFigures(forward_s=fig["forward_s"], backward_s=fig["backward_s"],
                                    sync_s=fig["sync_s"], optimizer_s=fig["optimizer_s"],
                                    wait_s=max(0.0, fig["step_s"] - spent))
            ops = [OpSpan(kind=kind, micro_batch=mb, chunk=c, start_s=max(0.0, s),
                          end_s=max(0.0, e)) for kind, mb, c, s, e in fig["ops"]]
            stages.append(StageRecord(path=stage_path(plan, mesh=k, stage=j, replica=r),
                                      replica=r, stage=g, device_type=fig["device_type"],
                                      micro_batches=fig["micro_batches"], measured=measured,
                                      predicted=pred.stages.get((r, g)), ops=ops))
        experts = _expert_loads(gathered)
        return StepRecord(step=step, step_time_s=max(f["step_s"] for f in gathered),
                          predicted_step_time_s=pred.step_time_s, prediction=pred.source,
                          clock=self.clock_name, stages=stages, experts=experts or None,
                          moe_load_imbalance=load_imbalance(experts))


def _expert_loads(gathered: list[dict]) -> list[ExpertLoad]:
    """Every rank's tokens per expert summed by (MoE layer, device type), in that order (rows
    of no tokens left out)."""
    sums: dict[tuple[int, str], list[int]] = {}
    for fig in gathered:
        for layer, counts in fig.get("tokens_per_expert", {}).items():
            have = sums.setdefault((layer, fig["device_type"]), [0] * len(counts))
            for e, n in enumerate(counts):
                have[e] += n
    return [ExpertLoad.of(layer=layer, device_type=device, tokens=tokens)
            for (layer, device), tokens in sorted(sums.items()) if sum(tokens)]
