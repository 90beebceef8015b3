"""The job's telemetry (``--hetero-telemetry DIR``): what each rank spends in a training step,
gathered every ``--hetero-telemetry-interval`` steps and written beside what the plan predicted.

Every ``interval``-th step is *armed*: on each rank the hooks mark the start and end of the
step, of every forward and backward of a micro-batch through a model chunk (megatron-core's
schedules call ``forward_step`` / ``backward_step`` for each), of the gradient sync
(``finalize_model_grads``) and of the optimizer step. On a GPU a mark is a CUDA event, read
once the step is over (no synchronisation inside the step); on CPU ranks it is the wall clock.
On an MoE model a forward hook on each of the rank's routers counts the tokens routed to each
expert in the armed step (:class:`~megatron_hetero.mcore.expert_load.ExpertTokenCounter`:
device tensors, read after the step).
Steps that are not armed pass straight through: one comparison per call.

After an armed step every rank hands its figures to rank 0 in one ``gather_object`` over a
gloo group (host memory: it works whatever vendors the pool mixes). Rank 0 keeps, for each
stage of each replica, its slowest tensor rank, and appends one
:class:`~megatron_hetero.telemetry.records.StepRecord` to ``DIR/telemetry.jsonl`` beside the
plan's prediction (:mod:`megatron_hetero.telemetry.prediction`); ``DIR/plan.yaml`` is a copy of
the plan. The marks and the records are :mod:`megatron_hetero.telemetry.collect`'s, which the
rehearsal's collector shares; this module is what is Megatron-LM's: the hook points, arming by
Megatron's iteration, the group and the prediction on the run's inventory.
"""

from __future__ import annotations

import shutil
import sys
from functools import partial
from pathlib import Path

from ..errors import HeteroError
from ..hardware.inventory import load_inventory
from ..mcore.expert_load import ExpertTokenCounter
from ..telemetry.collect import CudaClock, RankCapture, RecordWriter, WallClock
from ..telemetry.prediction import Prediction, predict
from ..telemetry.profile_out import run_profiles, software_now

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


class Telemetry:
    """The collector of one rank (made by :meth:`start`; the runtime hooks call its methods)."""

    def __init__(self, *, directory: Path, interval: int, plan, plan_path: str, slot,
                 device_type: str, inventory, clock, layer_spec: str):
        self.directory, self.interval = directory, interval
        self.plan, self.plan_path, self.slot = plan, plan_path, slot
        self.device_type, self.inventory = device_type, inventory
        self.rank = RankCapture(clock=clock)
        self._group = None
        self._writer: RecordWriter | None = None
        self._wrapped_optimizer = False
        self.live = None
        """Live rebalancing (:class:`.rebalance.LiveShares`) where the run asks for it."""
        self._layer_spec = layer_spec

    @property
    def clock(self):
        return self.rank.clock

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
        clock = CudaClock(torch) if torch.cuda.is_available() else WallClock()
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
                self.plan = plan
                if self._writer is not None:
                    self._writer.runs(plan)
        if not self._wrapped_optimizer:
            self._wrap_optimizer(a[3] if len(a) > 3 else kw["optimizer"])
            model = a[2] if len(a) > 2 else kw["model"]
            self.rank.chunks = {id(m): c for c, m in enumerate(model)}
            if self.plan.model.is_moe:
                self.rank.experts = ExpertTokenCounter(
                    model, self.plan.chunk_first_layers(self.slot))
        if step % self.interval:
            return original(*a, **kw)
        self.rank.arm()
        try:
            out = original(*a, **kw)
        except BaseException:
            self.rank.abandon()
            raise
        self._report(step, self.rank.disarm())
        return out

    def forward_step(self, original, *a, **kw):
        return self.rank.forward_step(original, *a, **kw)

    def backward_step(self, original, *a, **kw):
        return self.rank.backward_step(original, *a, **kw)

    def finalize_model_grads(self, call, *a, **kw):
        """Times the gradient sync (``call``: the backend's or Megatron's own)."""
        return self.rank.timed("sync", call, *a, **kw)

    def _wrap_optimizer(self, optimizer) -> None:
        optimizer.step = partial(self.rank.timed, "optimizer", optimizer.step)
        self._wrapped_optimizer = True

    # -- the report --------------------------------------------------------------------------
    def _report(self, step: int, capture) -> None:
        import torch.distributed as dist

        pipe = self.plan.meshes[self.slot.mesh].pipelines[self.slot.replica]
        mine = self.rank.figures(capture, slot=(self.slot.mesh, self.slot.stage, self.slot.replica),
                                 device_type=self.device_type,
                                 micro_batches=pipe.num_microbatches)
        if self._group is None:  # every rank reaches its first report at the same step
            self._group = dist.new_group(backend="gloo")
        rank = dist.get_rank()
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self._group)
        note = None
        if rank == 0:
            decide = self.live.decide if self.live is not None else None
            note = self._writer_now().write(step, gathered, decide).rebalance
        if self.live is not None:  # every rank takes rank 0's decision
            box = [note]
            dist.broadcast_object_list(box, src=0, group=self._group)
            self.live.schedule(box[0], rank=rank)

    def _writer_now(self) -> RecordWriter:
        """Rank 0's writer (made at the first report)."""
        if self._writer is None:
            self._writer = RecordWriter(
                directory=self.directory, plan=self.plan, clock_name=self.clock.name,
                predict=self._predict,
                copy_plan=partial(shutil.copyfile, self.plan_path),  # the plan it started with
                profiles=self._profiles)
        return self._writer

    def _profiles(self, plan, records, prediction: Prediction):
        if prediction.inventory is None:
            return {}
        return run_profiles(plan, records, prediction.inventory, software=self._software(),
                            layer_spec=self._layer_spec,
                            backend="cpu" if self.clock.name == "wall" else "cuda")

    @staticmethod
    def _software():
        import platform

        import torch
        from megatron.core import package_info
        return software_now(torch_version=str(torch.__version__),
                            megatron_core=str(package_info.__version__),
                            python=platform.python_version(), cuda=torch.version.cuda)

    def _predict(self, plan) -> Prediction:
        """Rank 0: the prediction of the plan as it runs now."""
        inv = self.inventory
        try:
            return predict(plan, inv, source=inv.source if inv else None,
                           flash_attention=None if self._layer_spec ==
                           "transformer_engine" else False)
        except HeteroError as exc:  # the run goes on; its records say why nothing is predicted
            _say_no_prediction(exc)
            return Prediction(step_time_s=None, stages={}, source=f"none: {exc}")


def _say_no_prediction(exc) -> None:
    print(f"megatron-hetero telemetry: no prediction: {exc}", file=sys.stderr, flush=True)
