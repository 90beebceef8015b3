"""``rehearse --slow PATH=FACTOR[@STEP]``: one stage of one replica turns FACTOR times slower
from step STEP on (a card that heats up, a noisy neighbour), so that the telemetry and live
rebalancing can be rehearsed against it.

PATH names the stage as the telemetry does (:func:`~megatron_hetero.telemetry.prediction.
stage_names`): ``pipelines[r].stages[s]`` on a plan of one grid, ``meshes[k].stages[j]`` on a
mesh of one replica, ``meshes[k].replicas[r].stages[j]`` on any plan. Every tensor-parallel rank
of the stage slows alike. STEP counts steps as the telemetry does (1 is the first, the
rehearsal's warm-up); without it the stage is slow from the start. Several ``--slow`` of one
stage multiply from their own steps on.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import SchemaError
from ..plan import Plan, Slot
from ..telemetry.prediction import stage_names

__all__ = ["SlowStage", "parse_slow", "slowdown_at", "MOST_FACTOR"]

MOST_FACTOR = 100.0
"""The largest slowdown ``--slow`` takes."""

_FORM = "PATH=FACTOR[@STEP], e.g. 'pipelines[1].stages[0]=2.5@4'"
_TEXT = re.compile(r"^\s*(?P<path>[^=]+?)\s*=\s*(?P<factor>[^@]+?)\s*(?:@\s*(?P<step>.+?))?\s*$")


@dataclass(kw_only=True, slots=True, frozen=True)
class SlowStage:
    """One stage of one replica that runs ``factor`` times slower from ``from_step`` on."""

    path: str
    """The stage's path as given."""
    mesh: int
    stage: int
    """The stage in its mesh."""
    replica: int
    factor: float
    """How many times longer its forwards and backwards take (1 to :data:`MOST_FACTOR`)."""
    from_step: int = 1
    """The first slow step, counted from 1 as the telemetry counts them."""

    def __post_init__(self) -> None:
        if not (isinstance(self.factor, (int, float)) and 1.0 <= self.factor <= MOST_FACTOR):
            raise SchemaError("--slow", "", self.factor,
                              f"FACTOR a number from 1 to {MOST_FACTOR:g} ({_FORM})")
        if not (isinstance(self.from_step, int) and self.from_step >= 1):
            raise SchemaError("--slow", "", self.from_step, f"STEP a step >= 1 ({_FORM})")

    def slows(self, slot: Slot) -> bool:
        """Whether ``slot`` (any of the stage's tensor ranks) is this stage of this replica."""
        return (slot.mesh, slot.stage, slot.replica) == (self.mesh, self.stage, self.replica)


def parse_slow(text: str, plan: Plan, *, steps: int) -> SlowStage:
    """One ``--slow`` value on ``plan`` (of ``steps`` rehearsed steps), or a
    :class:`~megatron_hetero.errors.SchemaError` naming the flag and what it expected."""
    match = _TEXT.match(text or "")
    if match is None:
        raise SchemaError("--slow", "", text, _FORM)
    names = stage_names(plan)
    path = match["path"]
    if path not in names:
        first: dict[tuple, str] = {}  # one name per stage: the telemetry's where it has one
        for name, slot in names.items():
            first.setdefault(slot, name)
        some = list(first.values())
        raise SchemaError("--slow", "", path, "a stage of one replica of the plan: "
                          + ", ".join(some[:8]) + (", ..." if len(some) > 8 else ""))
    try:
        factor = float(match["factor"])
    except ValueError:
        raise SchemaError("--slow", "", match["factor"], f"FACTOR a number ({_FORM})") from None
    if not math.isfinite(factor):
        raise SchemaError("--slow", "", match["factor"], f"FACTOR a finite number ({_FORM})")
    step = 1
    if match["step"] is not None:
        try:
            step = int(match["step"])
        except ValueError:
            raise SchemaError("--slow", "", match["step"], f"STEP a whole number ({_FORM})") \
                from None
        if not 1 <= step <= steps:
            raise SchemaError("--slow", "", step, f"STEP a step of the rehearsal, 1 to {steps} "
                              "(--steps)")
    mesh, stage, replica = names[path]
    return SlowStage(path=path, mesh=mesh, stage=stage, replica=replica, factor=factor,
                     from_step=step)


def slowdown_at(slow: list[SlowStage], slot: Slot, step: int) -> float:
    """The extra slowdown of ``slot`` in step ``step`` (counted from 1): the product of its
    stage's ``--slow`` factors whose step has come."""
    out = 1.0
    for s in slow:
        if s.slows(slot) and step >= s.from_step:
            out *= s.factor
    return out
