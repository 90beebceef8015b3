"""The telemetry files a job with ``--hetero-telemetry DIR`` writes, and their strict reader.

``DIR/telemetry.jsonl`` holds one JSON object per reported step (:class:`StepRecord`); each
names every stage of every replica by its plan path (``pipelines[1].stages[0]``, or
``meshes[0].stages[1]`` with its ``replica`` for a chain of meshes) and gives what it measured
in that step beside what the plan predicted (:class:`StageFigures`). ``DIR/plan.yaml`` is the
plan the run ran. Every figure of a stage is that stage's over the whole step (all its
micro-batches and model chunks), on the slowest tensor-parallel rank of the stage.

Reading is strict, as plans are: an unknown key, a missing field or a value of the wrong type
is a :class:`~megatron_hetero.errors.SchemaError` naming the line and the field path.

An MoE model's record also counts the tokens megatron-core's router sent to each expert in the
step (:class:`ExpertLoad`, one per MoE layer and device type: the counts of every rank of that
type that runs the layer, summed), each row's load imbalance (the most loaded expert's tokens
over the mean) and the step's (:func:`load_imbalance` over the rows).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .._schema import from_data, to_data
from ..errors import SchemaError

__all__ = ["StageFigures", "StageRecord", "StepRecord", "OpSpan", "RebalanceNote", "ExpertLoad",
           "TELEMETRY_FILE", "load_imbalance", "read_records", "append_record",
           "set_aside_earlier_run"]

TELEMETRY_FILE = "telemetry.jsonl"
MOST_SECONDS = 1e5
"""The longest time a record may give (a day): anything longer is a broken clock."""


def _check_seconds(key: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0 <= value <= MOST_SECONDS):  # NaN fails too
        raise SchemaError("", key, value, f"a number of seconds from 0 to {MOST_SECONDS:g}")


@dataclass(kw_only=True, slots=True)
class StageFigures:
    """Seconds one stage of one replica spends in one step, by kind of work."""

    forward_s: float
    """Forward compute: every micro-batch through every model chunk of the stage."""
    backward_s: float
    """Backward compute (recomputed forwards included), every micro-batch and chunk."""
    sync_s: float
    """Gradient synchronisation over the stage's data-parallel group (what is not hidden
    behind the backward)."""
    optimizer_s: float
    """The optimizer step."""
    wait_s: float
    """The rest of the step: pipeline sends and waits for a neighbour (the bubble), data
    loading, and what the step spends outside the four above."""

    def __post_init__(self) -> None:
        for key in ("forward_s", "backward_s", "sync_s", "optimizer_s", "wait_s"):
            _check_seconds(key, getattr(self, key))

    @property
    def compute_s(self) -> float:
        """Forward plus backward compute."""
        return self.forward_s + self.backward_s


@dataclass(kw_only=True, slots=True)
class OpSpan:
    """One forward or backward of one micro-batch through one model chunk, as it ran."""

    kind: str
    """``F`` forward, ``B`` backward."""
    micro_batch: int
    chunk: int
    start_s: float
    """From the start of the step, on this stage's clock."""
    end_s: float

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B"):
            raise SchemaError("", "kind", self.kind, "F or B")
        if self.micro_batch < 0 or self.chunk < 0:
            raise SchemaError("", "micro_batch", self.micro_batch, "an index >= 0")
        _check_seconds("start_s", self.start_s)
        _check_seconds("end_s", self.end_s)
        if self.start_s > self.end_s:
            raise SchemaError("", "end_s", self.end_s, f"a time >= start_s ({self.start_s})")


@dataclass(kw_only=True, slots=True)
class StageRecord:
    """One stage of one replica in one reported step."""

    path: str
    """The stage's plan path, e.g. ``pipelines[1].stages[0]``."""
    replica: int
    """Its data-parallel replica (the pipeline of a one-grid plan)."""
    stage: int
    """Its stage along the whole pipeline (0 is the first)."""
    device_type: str
    micro_batches: int
    """Micro-batches the replica ran in the step."""
    measured: StageFigures
    predicted: StageFigures | None = None
    """The plan's prediction for this stage (None where the run had none)."""
    ops: list[OpSpan] | None = None
    """The stage's forwards and backwards in the step, in run order (the measured timeline)."""

    @property
    def slowdown(self) -> float | None:
        """Measured over predicted compute (forward plus backward); None without a
        prediction."""
        if self.predicted is None or self.predicted.compute_s <= 0:
            return None
        return self.measured.compute_s / self.predicted.compute_s


@dataclass(kw_only=True, slots=True)
class ExpertLoad:
    """The tokens routed to each expert of one MoE layer in one step, on one device type."""

    layer: int
    """megatron-core's layer number (from 1, over the whole model)."""
    device_type: str
    """The device type of the ranks counted (a layer that replicas of several types run has a
    row per type)."""
    tokens: list[int]
    """Per expert (global index): the routed token copies (``k`` per token at top-``k``),
    summed over the step's micro-batches and the ranks of this type that run the layer."""
    imbalance: float
    """The most loaded expert's tokens over the mean (1: balanced)."""

    def __post_init__(self) -> None:
        if self.layer < 0:
            raise SchemaError("", "layer", self.layer, "a layer number >= 0")
        if not self.tokens or any(n < 0 for n in self.tokens) or not sum(self.tokens):
            raise SchemaError("", "tokens", self.tokens,
                              "a count >= 0 per expert, some tokens in all")
        want = max(self.tokens) * len(self.tokens) / sum(self.tokens)
        if not abs(self.imbalance - want) <= 1e-9 * want:
            raise SchemaError("", "imbalance", self.imbalance,
                              f"the most loaded expert's tokens over the mean, {want}")

    @classmethod
    def of(cls, *, layer: int, device_type: str, tokens: list[int]) -> "ExpertLoad":
        """The row of these counts, its imbalance computed."""
        return cls(layer=layer, device_type=device_type, tokens=list(tokens),
                   imbalance=max(tokens) * len(tokens) / sum(tokens))


def load_imbalance(rows: list[ExpertLoad]) -> float | None:
    """The load imbalance of several layers (and steps) together: the sum of each row's most
    loaded expert's tokens over the sum of its mean (the experts' compute at the most loaded
    expert's pace, over the same at balance); None without rows."""
    if not rows:
        return None
    return (sum(max(r.tokens) for r in rows)
            / sum(sum(r.tokens) / len(r.tokens) for r in rows))


@dataclass(kw_only=True, slots=True)
class RebalanceNote:
    """What live rebalancing decided at a reported step (``--hetero-rebalance``)."""

    message: str
    shares: list[int] | None = None
    """The replicas' new micro-batch counts; None where nothing moved."""
    from_step: int | None = None
    """The first step that runs them."""


@dataclass(kw_only=True, slots=True)
class StepRecord:
    """One line of ``telemetry.jsonl``: one reported training step."""

    step: int
    """Megatron's iteration of the step (counted from 1, as Megatron logs it)."""
    step_time_s: float
    """The whole training step, measured on the writing rank (every rank ends the step
    together: the optimizer waits for the last gradient)."""
    predicted_step_time_s: float | None = None
    prediction: str = ""
    """What the predicted side used (the inventory file, or the catalog's figures)."""
    clock: str = "wall"
    """``cuda-events`` (GPU time between CUDA events) or ``wall`` (CPU ranks)."""
    stages: list[StageRecord]
    rebalance: RebalanceNote | None = None
    """Live rebalancing's decision at this step, where it decided or said something."""
    experts: list[ExpertLoad] | None = None
    """An MoE model's tokens per expert, per MoE layer and device type, in layer order."""
    moe_load_imbalance: float | None = None
    """The step's load imbalance over every row of :attr:`experts` (:func:`load_imbalance`)."""

    def __post_init__(self) -> None:
        _check_seconds("step_time_s", self.step_time_s)
        want = load_imbalance(self.experts or [])
        if want != self.moe_load_imbalance and not (
                want is not None and self.moe_load_imbalance is not None
                and abs(self.moe_load_imbalance - want) <= 1e-9 * want):
            raise SchemaError("", "moe_load_imbalance", self.moe_load_imbalance,
                              f"the imbalance of the experts' rows ({want})")
        if self.predicted_step_time_s is not None:
            _check_seconds("predicted_step_time_s", self.predicted_step_time_s)
        if self.step < 0:
            raise SchemaError("", "step", self.step, "an iteration >= 0")
        if not self.stages:
            raise SchemaError("", "stages", self.stages, "at least one stage")

    def to_json(self) -> str:
        return json.dumps(to_data(self), separators=(",", ":"))


def append_record(directory: str | Path, record: StepRecord) -> None:
    """Append ``record`` as one line to ``DIR/telemetry.jsonl`` (flushed: a reader or a crash
    sees whole lines)."""
    path = Path(directory) / TELEMETRY_FILE
    with open(path, "a", encoding="utf-8") as f:
        f.write(record.to_json() + "\n")
        f.flush()


def read_records(directory: str | Path) -> list[StepRecord]:
    """Every step of ``DIR/telemetry.jsonl``, in file order. A missing file, a line that is not
    JSON or a record that does not match the format is a :class:`SchemaError` naming the line."""
    path = Path(directory) / TELEMETRY_FILE
    if not path.is_file():
        raise SchemaError(str(path), "", None, "a telemetry file written by a run with "
                          "--hetero-telemetry (or rehearse --telemetry)")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            source = f"{path}:{n}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                if n > 1 and not line.endswith("\n"):  # a run cut off mid-line: keep the rest
                    break
                raise SchemaError(source, "", line[:40], f"one JSON object per line ({exc.msg})")
            out.append(from_data(StepRecord, data, source=source))
    if not out:
        raise SchemaError(str(path), "", None, "at least one reported step")
    return out


def _last_step(path: Path) -> int | None:
    """The step of the file's last whole record, or None where it has none that reads."""
    last = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                step = json.loads(line).get("step") if line.endswith("\n") else None
            except (json.JSONDecodeError, AttributeError):
                step = None
            last = step if isinstance(step, int) else last
    return last


def set_aside_earlier_run(directory: Path, *, first_step: int, plan_text: bytes) -> Path | None:
    """Before a run's first record goes to ``directory``: where the folder holds another run's
    records, move them (``telemetry.jsonl``, ``plan.yaml``, ``profile.*.yaml``) into
    ``directory/earlier-N`` (the first free N) and return that folder; None where there are
    none, or where they are this run's own before a resume: the same plan (``plan_text``, the
    plan file this run writes), every recorded step before ``first_step``."""
    records = directory / TELEMETRY_FILE
    if not records.is_file() or records.stat().st_size == 0:
        return None
    plan = directory / "plan.yaml"
    last = _last_step(records)
    if last is not None and last < first_step and plan.is_file() and \
            plan.read_bytes() == plan_text:
        return None
    n = 1
    while (directory / f"earlier-{n}").exists():
        n += 1
    target = directory / f"earlier-{n}"
    target.mkdir()
    for path in [records, plan, *sorted(directory.glob("profile.*.yaml"))]:
        if path.is_file():
            path.replace(target / path.name)
    return target
