"""The CPU's drift between the start-up calibration and the run, and the calibration rescaled.

The CPU's speed drifts between the start-up calibration and the run (other processes, caches,
frequency): the rehearsal rescales the calibrated compute by the CPU time the ranks measured,
per device type (each type's ranks sleep their own gaps between steps, and the CPU speed after
a gap differs with its length), and takes the gloo all-reduce bandwidth the ranks measured
among themselves.
"""

from __future__ import annotations

import dataclasses

from ..plan import Plan
from .calibration import Calibration, _mean

__all__ = ["cpu_drifts", "measured_allreduce_gb_s", "rescaled", "in_run_calibrations"]


def cpu_drifts(shrunk: Plan, leads, a_priori, steps) -> tuple[dict[str, float], float]:
    """(device type -> drift, the drift over all of them): the CPU time the ranks' compute
    measured over what the start-up calibration expected for it (``a_priori``, a ``SimResult``),
    from the tensor-parallel lead ranks ``leads`` over the reported ``steps`` (each rank's device
    type is its stage's in ``shrunk``)."""
    measured_cpu: dict[str, float] = {}
    calibrated_cpu: dict[str, float] = {}
    for r in leads:
        dev = shrunk.device_type_of_rank(r.rank)
        measured_cpu[dev] = measured_cpu.get(dev, 0.0) + _mean([r.extra["cpu"][k] for k in steps])
        calibrated_cpu[dev] = (calibrated_cpu.get(dev, 0.0)
                               + a_priori.stage(r.pipeline, r.stage).busy_s / r.extra["factor"])
    drifts = {d: (measured_cpu[d] / calibrated_cpu[d] if calibrated_cpu[d] > 0 else 1.0)
              for d in measured_cpu}
    total_cal = sum(calibrated_cpu.values())
    drift = sum(measured_cpu.values()) / total_cal if total_cal > 0 else 1.0
    return drifts, drift


def measured_allreduce_gb_s(ranks, default: float) -> float:
    """The slowest gloo all-reduce bandwidth the ranks measured among themselves, else
    ``default``."""
    return min((r.extra["allreduce_gb_s"] for r in ranks if r.extra.get("allreduce_gb_s")),
               default=default)


def rescaled(c: Calibration, drift: float, world_bw: float) -> Calibration:
    """``c`` with its compute times stretched (its FLOP rate slowed) by ``drift``, and the
    all-reduce bandwidth ``world_bw`` where it is finite."""
    return dataclasses.replace(
        c, layer_flops_per_s=c.layer_flops_per_s / drift,
        parts={k: (f * drift, b * drift) for k, (f, b) in c.parts.items()},
        pipeline_overhead={k: (f * drift, b * drift)
                           for k, (f, b) in c.pipeline_overhead.items()},
        step_overhead={k: (f * drift, b * drift) for k, (f, b) in c.step_overhead.items()},
        allreduce_gb_s=world_bw if world_bw < float("inf") else c.allreduce_gb_s)


def in_run_calibrations(calibrations, drifts: dict[str, float], drift: float,
                        world_bw: float) -> dict[str, Calibration]:
    """Device type -> its calibration rescaled by its drift (``drift`` for a type without one);
    ``calibrations``: one :class:`Calibration` for the device types of ``drifts``, or one per
    device type."""
    per_device = (calibrations if not isinstance(calibrations, Calibration)
                  else {d: calibrations for d in drifts})
    return {d: rescaled(c, drifts.get(d, drift), world_bw) for d, c in per_device.items()}
