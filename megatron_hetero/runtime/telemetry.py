"""The job's telemetry (``--hetero-telemetry DIR``): what each rank spends in a training step,
gathered every ``--hetero-telemetry-interval`` steps and written beside what the plan predicted.

Every ``interval``-th step is *armed*: on each rank the hooks mark the start and end of the
step, of every forward and backward of a micro-batch through a model chunk (megatron-core's
schedules call ``forward_step`` / ``backward_step`` for each), of the gradient sync
(``finalize_model_grads``) and of the optimizer step. On a GPU a mark is a CUDA event, read
once the step is over (no synchronisation inside the step); on CPU ranks it is the wall clock.
Steps that are not armed pass straight through: one comparison per call.

After an armed step every rank hands its figures to rank 0 in one ``gather_object`` over a
gloo group (host memory: it works whatever vendors the pool mixes). Rank 0 keeps, for each
stage of each replica, its slowest tensor rank, and appends one
:class:`~megatron_hetero.telemetry.records.StepRecord` to ``DIR/telemetry.jsonl`` beside the
plan's prediction (:mod:`megatron_hetero.telemetry.prediction`); ``DIR/plan.yaml`` is a copy of
the plan. A backward is matched to its chunk and micro-batch through the output tensor its
forward returned; each chunk runs its micro-batches in order.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from ..errors import HeteroError
from ..hardware.inventory import load_inventory
from ..telemetry.prediction import Prediction, predict, stage_path
from ..telemetry.profile_out import run_profiles, software_now, write_run_profiles
from ..telemetry.records import OpSpan, StageFigures, StageRecord, StepRecord, append_record

__all__ = ["Telemetry", "DEFAULT_INTERVAL", "POINTS"]

DEFAULT_INTERVAL = 10
"""Steps between two reports when ``--hetero-telemetry-interval`` is not given."""

POINTS = {  # (module, function) -> the Telemetry method that wraps it
    ("megatron.training.training", "train_step"): "train_step",
    ("megatron.core.pipeline_parallel.schedules", "forward_step"): "forward_step",
    ("megatron.core.pipeline_parallel.schedules", "backward_step"): "backward_step",
    ("megatron.core.pipeline_parallel.schedules", "backward_step_multimodule"): "backward_step",
}
"""Megatron's functions the telemetry times (``backward_step_multimodule``: megatron-core 0.19's
multimodule schedule, where it exists)."""


class _WallClock:
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


class _CudaClock:
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


class _Capture:
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


class Telemetry:
    """The collector of one rank (made by :meth:`start`; the runtime hooks call its methods)."""

    def __init__(self, *, directory: Path, interval: int, plan, plan_path: str, slot,
                 device_type: str, inventory, clock, layer_spec: str):
        self.directory, self.interval = directory, interval
        self.plan, self.plan_path, self.slot = plan, plan_path, slot
        self.device_type, self.inventory, self.clock = device_type, inventory, clock
        self._capture: _Capture | None = None
        self._chunks: dict[int, int] = {}
        self._group = None
        self._prediction: Prediction | None = None
        self._wrapped_optimizer = False
        self._records: list[StepRecord] = []
        self._began = False
        self.live = None
        """Live rebalancing (:class:`.rebalance.LiveShares`) where the run asks for it."""
        self._layer_spec = layer_spec

    @classmethod
    def start(cls, args, state) -> "Telemetry | None":
        """The collector ``args`` ask for (``--hetero-telemetry``), or None."""
        directory = getattr(args, "hetero_telemetry", None)
        if not directory:
            return None
        interval = getattr(args, "hetero_telemetry_interval", None) or DEFAULT_INTERVAL
        if interval < 1:
            raise HeteroError(f"--hetero-telemetry-interval: found {interval}; expected a "
                              "number of steps >= 1")
        inventory_path = getattr(args, "hetero_inventory", None)
        inventory = load_inventory(inventory_path) if inventory_path else None  # fails early
        import torch
        clock = _CudaClock(torch) if torch.cuda.is_available() else _WallClock()
        stage = state.plan.stage_of_slot(state.slot)
        telemetry = cls(directory=Path(directory), interval=interval, plan=state.plan,
                        plan_path=state.plan_path, slot=state.slot, device_type=stage.device_type,
                        inventory=inventory, clock=clock, layer_spec=(
                            "transformer_engine" if getattr(args, "transformer_impl", None)
                            == "transformer_engine" else "local"))
        return telemetry

    # -- the hooks -------------------------------------------------------------------------
    def train_step(self, original, *a, **kw):
        """``megatron.training.training.train_step``: arms every ``interval``-th step."""
        iteration = kw.get("iteration")
        if iteration is None and len(a) > 7:
            iteration = a[7]
        step = (iteration or 0) + 1  # Megatron logs the step it runs as iteration + 1
        if self.live is not None:
            plan = self.live.before_step(step)
            if plan is not None:  # new shares from this step: predicted anew at the next report
                self.plan, self._prediction = plan, None
        if not self._wrapped_optimizer:
            self._wrap_optimizer(a[3] if len(a) > 3 else kw["optimizer"])
            model = a[2] if len(a) > 2 else kw["model"]
            self._chunks = {id(m): c for c, m in enumerate(model)}
        if step % self.interval:
            return original(*a, **kw)
        self._capture = _Capture(self.clock.mark())
        try:
            out = original(*a, **kw)
        finally:
            capture, self._capture = self._capture, None
        capture.end = self.clock.mark()
        self._report(step, capture)
        return out

    def forward_step(self, original, *a, **kw):
        cap = self._capture
        if cap is None:
            return original(*a, **kw)
        model = a[2] if len(a) > 2 else kw["model"]
        chunk = self._chunks.get(id(model), 0)
        mb = cap.forwards.get(chunk, 0)
        cap.forwards[chunk] = mb + 1
        t0 = self.clock.mark()
        out = original(*a, **kw)
        cap.ops.append(("F", mb, chunk, t0, self.clock.mark()))
        output = out[0] if isinstance(out, tuple) else out
        cap.outputs[id(_first_tensor(output))] = chunk
        return out

    def backward_step(self, original, *a, **kw):
        cap = self._capture
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

    def finalize_model_grads(self, call, *a, **kw):
        """Times the gradient sync (``call``: the backend's or Megatron's own)."""
        return self._timed("sync", call, *a, **kw)

    def _wrap_optimizer(self, optimizer) -> None:
        step = optimizer.step

        def timed_step(*a, **kw):
            return self._timed("optimizer", step, *a, **kw)
        optimizer.step = timed_step
        self._wrapped_optimizer = True

    def _timed(self, what: str, call, *a, **kw):
        cap = self._capture
        if cap is None:
            return call(*a, **kw)
        t0 = self.clock.mark()
        out = call(*a, **kw)
        getattr(cap, what).append((t0, self.clock.mark()))
        return out

    # -- the report --------------------------------------------------------------------------
    def _figures(self, capture: _Capture) -> dict:
        """This rank's figures of the armed step (seconds, after the clock resolved)."""
        clock = self.clock
        clock.resolve()
        t0 = capture.start
        ops = [(kind, mb, chunk, clock.between(t0, a), clock.between(t0, b))
               for kind, mb, chunk, a, b in capture.ops]
        spent = {kind: sum(e - s for k, _, _, s, e in ops if k == kind) for kind in "FB"}
        pipe = self.plan.meshes[self.slot.mesh].pipelines[self.slot.replica]
        return {"slot": (self.slot.mesh, self.slot.stage, self.slot.replica),
                "device_type": self.device_type, "micro_batches": pipe.num_microbatches,
                "step_s": clock.between(capture.start, capture.end),
                "forward_s": spent["F"], "backward_s": spent["B"],
                "sync_s": sum(clock.between(a, b) for a, b in capture.sync),
                "optimizer_s": sum(clock.between(a, b) for a, b in capture.optimizer),
                "ops": ops}

    def _report(self, step: int, capture: _Capture) -> None:
        import torch.distributed as dist

        mine = self._figures(capture)
        if self._group is None:  # every rank reaches its first report at the same step
            self._group = dist.new_group(backend="gloo")
        rank = dist.get_rank()
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self._group)
        note = self._write(step, gathered) if rank == 0 else None
        if self.live is not None:  # every rank takes rank 0's decision
            box = [note]
            dist.broadcast_object_list(box, src=0, group=self._group)
            self.live.schedule(box[0], rank=rank)

    def _write(self, step: int, gathered: list[dict]):
        """Rank 0: the step's record, written, and live rebalancing's decision on it."""
        if not self._began:
            try:
                self._begin()
            except OSError as exc:  # as below: the telemetry is lost, the training goes on
                print(f"megatron-hetero telemetry: {exc}", file=sys.stderr, flush=True)
                self._began = True
        if self._prediction is None:
            self._predict()
        slowest: dict[tuple, dict] = {}
        for fig in gathered:
            key = fig["slot"]
            have = slowest.get(key)
            if have is None or fig["forward_s"] + fig["backward_s"] > \
                    have["forward_s"] + have["backward_s"]:
                slowest[key] = fig
        plan, pred = self.plan, self._prediction
        stages = []
        for (k, j, r), fig in sorted(slowest.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
            g = sum(m.num_stages for m in plan.meshes[:k]) + j
            spent = fig["forward_s"] + fig["backward_s"] + fig["sync_s"] + fig["optimizer_s"]
            measured = StageFigures(forward_s=fig["forward_s"], backward_s=fig["backward_s"],
                                    sync_s=fig["sync_s"], optimizer_s=fig["optimizer_s"],
                                    wait_s=max(0.0, fig["step_s"] - spent))
            ops = [OpSpan(kind=kind, micro_batch=mb, chunk=c, start_s=max(0.0, s), end_s=max(0.0, e))
                   for kind, mb, c, s, e in fig["ops"]]
            stages.append(StageRecord(path=stage_path(plan, mesh=k, stage=j, replica=r),
                                      replica=r, stage=g, device_type=fig["device_type"],
                                      micro_batches=fig["micro_batches"], measured=measured,
                                      predicted=pred.stages.get((r, g)), ops=ops))
        record = StepRecord(step=step, step_time_s=max(f["step_s"] for f in gathered),
                            predicted_step_time_s=pred.step_time_s, prediction=pred.source,
                            clock=self.clock.name, stages=stages)
        if self.live is not None and record.predicted_step_time_s is not None:
            record.rebalance = self.live.decide(record)
        self._records.append(record)
        try:  # a full disk costs the telemetry, never the training
            append_record(self.directory, record)
            if pred.inventory is not None:
                write_run_profiles(self.directory, run_profiles(
                    plan, self._records, pred.inventory, software=self._software(),
                    layer_spec=self._layer_spec,
                    backend="cpu" if self.clock.name == "wall" else "cuda"))
        except OSError as exc:
            print(f"megatron-hetero telemetry: step {step} not written: {exc}", file=sys.stderr,
                  flush=True)
        line = f"megatron-hetero telemetry: step {step}: {record.step_time_s:.3f} s"
        worst = max(stages, key=lambda s: s.slowdown or 0.0)
        if worst.slowdown is not None:
            line += (f" (predicted {pred.step_time_s:.3f} s); slowest against its prediction: "
                     f"{worst.path} replica {worst.replica} ({worst.device_type}) "
                     f"{worst.slowdown:.2f}x")
        print(line, file=sys.stderr, flush=True)
        return record.rebalance

    @staticmethod
    def _software():
        import platform

        import torch
        from megatron.core import package_info
        return software_now(torch_version=str(torch.__version__),
                            megatron_core=str(package_info.__version__),
                            python=platform.python_version(), cuda=torch.version.cuda)

    def _begin(self) -> None:
        """Rank 0, at the first report: the folder and the plan's copy (the plan the run
        started with)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.plan_path, self.directory / "plan.yaml")
        self._began = True

    def _predict(self) -> None:
        """Rank 0: the prediction of the plan as it runs now."""
        inv = self.inventory
        try:
            self._prediction = predict(self.plan, inv, source=inv.source if inv else None,
                                       flash_attention=None if self._layer_spec ==
                                       "transformer_engine" else False)
        except HeteroError as exc:  # the run goes on; its records say why nothing is predicted
            print(f"megatron-hetero telemetry: no prediction: {exc}", file=sys.stderr, flush=True)
            self._prediction = Prediction(step_time_s=None, stages={}, source=f"none: {exc}")
