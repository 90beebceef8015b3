"""Speed emulation: a CPU rank plays a GPU type at that type's speed relative to the others.

Rule. Every rank runs its real forward and backward micro-batch steps on the CPU, measures the
CPU time the step used (``time.thread_time`` when torch runs one intra-op thread, else
``time.process_time``; never wall time, which the other processes on the same cores inflate) and
then *sleeps* ``(factor - 1) x cpu_time``, so the step takes ``factor`` times its real work.
Sleeping waits; it does not burn a core that the other ranks need.

``factor = slowdown x time_scale``:

- ``slowdown`` is the device's speed relative to the fastest device type of the plan, from the
  catalog's achievable FLOP/s (``bf16_tflops x efficiency``): 1 for the fastest type, 2.5 for a
  type 2.5 times slower.
- ``time_scale`` (default 1) slows every device, the fastest included, by the same factor. With
  more ranks than cores a value above 1 keeps the cores idle part of the time, so that the
  emulated ranks do not steal CPU from each other and step times stay close to the emulated ones.

With ``absorb_contention`` (what the rehearsal uses) the rank keeps an emulated clock: the
sleep is ``factor x cpu_time`` minus the wall time the step already took, minus the *drift*
(how far this rank's compute so far has run behind its emulated duration: time lost to other
processes beyond a sleep budget, or sleeps that overshot). A step that lost time to other
processes on the same cores sleeps that much less, and a loss too large for one step's budget is
made up in the next ones, so the rank's total compute time stays ``factor x`` its CPU time
instead of ``wall + (factor - 1) x cpu_time``. Without contention both rules sleep the same
``(factor - 1) x cpu_time``.

The emulated device then achieves ``cpu_flops / factor`` FLOP/s, which is what the rehearsal's
prediction feeds the cost model (see :func:`emulated_flops`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Literal

from ..hardware.catalog import Catalog, load_catalog
from ..plan import Plan

__all__ = ["SpeedEmulation", "device_slowdowns", "emulated_flops", "cpu_clock"]


def device_slowdowns(plan: Plan, catalog: Catalog | None = None) -> dict[str, float]:
    """Slowdown of every device type in ``plan`` relative to its fastest type (>= 1; the
    fastest type gets exactly 1), from the catalog's achievable FLOP/s."""
    catalog = catalog or plan.catalog or load_catalog()
    flops = {d: catalog.get(d).achievable_flops for d in plan.device_counts()}
    fastest = max(flops.values())
    return {d: fastest / f for d, f in sorted(flops.items())}


def emulated_flops(cpu_flops: float, slowdown: float, time_scale: float = 1.0) -> float:
    """FLOP/s an emulated device reaches when the CPU reaches ``cpu_flops`` on the real work."""
    return cpu_flops / (slowdown * time_scale)


def cpu_clock() -> tuple[Literal["thread", "process"], "callable"]:
    """The CPU-time clock that covers this rank's compute: the calling thread's when torch
    computes on it alone (one intra-op thread; CPU autograd runs the backward on the caller),
    else the whole process's."""
    try:
        import torch
        single = torch.get_num_threads() == 1
    except ImportError:  # pragma: no cover - the emulation runs with torch
        single = True
    return ("thread", time.thread_time) if single else ("process", time.process_time)


@dataclass(kw_only=True, slots=True)
class SpeedEmulation:
    """Stretches each wrapped compute step of one rank to its emulated device's speed."""

    slowdown: float
    """Speed of the fastest device type of the plan over this rank's device type (>= 1)."""
    time_scale: float = 1.0
    """Extra slowdown applied to every device alike (>= 1)."""
    device_type: str = ""
    """Device this rank plays (for reports)."""
    enabled: bool = True
    """When False, steps are timed but not stretched."""
    absorb_contention: bool = False
    """Sleep ``factor x cpu - wall`` instead of ``(factor - 1) x cpu`` (see the module doc)."""
    cpu_s: float = 0.0
    """CPU seconds of real work measured inside the wrapped steps."""
    requested_s: float = 0.0
    """Seconds of sleep the rule asked for (``slept_s`` adds the sleeps' overshoot)."""
    slept_s: float = 0.0
    """Seconds actually slept to stretch them (measured, so sleep overshoot is included)."""
    busy_s: float = 0.0
    """Wall seconds spent inside the wrapped steps, sleeps included: this rank's busy time."""
    drift_s: float = 0.0
    """With ``absorb_contention``: wall seconds the wrapped steps have taken so far beyond
    ``factor x`` their CPU time, not yet made up (emulation error; 0 when all is well)."""
    steps: int = 0
    """Wrapped steps so far."""
    clock_name: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if not self.slowdown >= 1.0:
            raise ValueError(f"slowdown must be >= 1 (relative to the fastest device), "
                             f"got {self.slowdown}")
        if not self.time_scale >= 1.0:
            raise ValueError(f"time_scale must be >= 1, got {self.time_scale}")

    @property
    def factor(self) -> float:
        """How many times longer than its real CPU work a step takes."""
        return self.slowdown * self.time_scale

    @contextmanager
    def step(self) -> Iterator[None]:
        """Wrap one forward or backward micro-batch step."""
        self.clock_name, clock = cpu_clock()
        wall0, cpu0 = time.perf_counter(), clock()
        try:
            yield
        finally:
            cpu = clock() - cpu0
            if not self.enabled:
                extra = 0.0
            elif self.absorb_contention:
                extra = self.factor * cpu - (time.perf_counter() - wall0) - self.drift_s
            else:
                extra = (self.factor - 1.0) * cpu
            if extra > 0:
                self.requested_s += extra
                t = time.perf_counter()
                time.sleep(extra)
                self.slept_s += time.perf_counter() - t
            wall = time.perf_counter() - wall0
            if self.absorb_contention and self.enabled:
                self.drift_s += wall - self.factor * cpu
            self.cpu_s += cpu
            self.busy_s += wall
            self.steps += 1

    def reset(self) -> None:
        """Forget the accounting (e.g. after the warm-up step)."""
        self.cpu_s = self.slept_s = self.busy_s = self.drift_s = self.requested_s = 0.0
        self.steps = 0

    def totals(self) -> dict[str, float]:
        return {"cpu_s": self.cpu_s, "slept_s": self.slept_s, "busy_s": self.busy_s,
                "drift_s": self.drift_s,
                "steps": float(self.steps), "factor": self.factor}
