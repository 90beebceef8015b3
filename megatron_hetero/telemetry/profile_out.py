"""Per-layer costs from a run's telemetry, in the profile format ``tune --profile`` reads
(``DIR/profile.<device type>.yaml``, one per device type; ``timing.method: run-telemetry``).

A run measures whole stages, not parts. Per device type, the run's measured forward compute
over the plan's predicted forward compute, summed over every stage of that type and every
reported step, is one factor (the backward's another); each part the cost model prices for the
run's own shapes (a transformer layer, the embedding, the output layer, per micro-batch size
and TP size the plan gives that type) is written at that factor times its price. The profile
thus reproduces the run's measured stage compute exactly in total, in the cost model's
proportions between the parts. It carries no memory figures (memory is priced as without a
profile). Of an MoE model it carries the load imbalance the run measured on that device type
(``moe_load_imbalance``: :func:`~.records.load_imbalance` over the records' rows of that
type), which the cost model then prices the routed experts and the all-to-alls at. It carries
the optimizer step's measured over predicted seconds, summed alike (``optimizer_factor``), by
which the cost model then scales its price of that type's optimizer step.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from .._schema import write_yaml
from .._version import __version__
from ..cost.model import CostModel
from ..cost.profile_file import run_profile_name
from ..cost.profile_schema import (FORMAT_VERSION, DeviceInfo, PartTimes, ProfileData,
                                   ProfileEntry, Software, Timing)
from ..hardware.inventory import Inventory
from ..plan import Plan
from .prediction import plan_cost_model
from .records import StepRecord, load_imbalance

__all__ = ["run_factors", "optimizer_factors", "run_profiles", "write_run_profiles", "profile_name"]

profile_name = run_profile_name

LEAST_S = 1e-9
"""A part the cost model prices at nothing (the embedding's lookup) is written at 1 ns: the
profile format holds positive times only."""


def run_factors(records: list[StepRecord]) -> dict[str, tuple[float, float]]:
    """Per device type: (measured over predicted forward, the same for backward), summed over
    its stages and the reported steps; device types without a prediction are left out."""
    sums: dict[str, list[float]] = {}
    for rec in records:
        for s in rec.stages:
            if s.predicted is None:
                continue
            acc = sums.setdefault(s.device_type, [0.0, 0.0, 0.0, 0.0])
            acc[0] += s.measured.forward_s
            acc[1] += s.predicted.forward_s
            acc[2] += s.measured.backward_s
            acc[3] += s.predicted.backward_s
    return {d: (mf / pf, mb / pb) for d, (mf, pf, mb, pb) in sums.items() if pf > 0 and pb > 0}


def optimizer_factors(records: list[StepRecord]) -> dict[str, float]:
    """Per device type: the optimizer step's measured over predicted seconds, summed over its
    stages and the reported steps (types whose predicted optimizer step is 0 left out)."""
    sums: dict[str, list[float]] = {}
    for rec in records:
        for s in rec.stages:
            if s.predicted is not None:
                acc = sums.setdefault(s.device_type, [0.0, 0.0])
                acc[0] += s.measured.optimizer_s
                acc[1] += s.predicted.optimizer_s
    return {d: min(max(m / p, 0.01), 1000.0) for d, (m, p) in sums.items() if p > 0 and m > 0}


def run_profiles(plan: Plan, records: list[StepRecord], inventory: Inventory | None, *,
                 software: Software, layer_spec: str, backend: str, cost: CostModel | None = None,
                 priced_as: Callable[[str], str] = str) -> dict[str, ProfileData]:
    """The profile of each device type of the run (see the module docstring). ``cost``: the
    cost model the records' predictions came from, where that is not the plan's on
    ``inventory`` (the rehearsal's emulated cluster, whose device ``priced_as(d)`` plays the
    plan's ``d``)."""
    # per-part prices: gradient overlap changes none
    cost = cost or plan_cost_model(plan, inventory)
    shapes: dict[str, set[tuple[int, int]]] = {}
    for mesh in plan.meshes:
        for pipe in mesh.pipelines:
            for st in pipe.stages:
                shapes.setdefault(st.device_type, set()).add(
                    (pipe.micro_batch_size, mesh.tensor_model_parallel_size))
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    optimizer = optimizer_factors(records)
    out = {}
    for device, (kf, kb) in sorted(run_factors(records).items()):
        entries = []
        for b, tp in sorted(shapes.get(device, ())):
            parts = {}
            for part, times in (("layer", cost.layer_times), ("embedding", cost.embedding_times),
                                ("output", cost.output_times)):
                f, bw = times(priced_as(device), b, tp)
                parts[part] = PartTimes(forward_s=max(kf * f, LEAST_S), backward_s=max(kb * bw, LEAST_S))
            entries.append(ProfileEntry(micro_batch_size=b, tensor_parallel_size=tp, **parts))
        out[device] = ProfileData(
            format_version=FORMAT_VERSION,
            device=DeviceInfo(name=f"{device} as the run measured it", type=device,
                              backend=backend),
            software=software,
            timing=Timing(method="run-telemetry", warmup=0, repeats=len(records),
                          layer_spec=layer_spec, precision=plan.precision),
            model=plan.model, entries=entries, created=created,
            optimizer_factor=optimizer.get(device),
            moe_load_imbalance=load_imbalance([row for rec in records for row in rec.experts or ()
                                               if row.device_type == device]))
    return out


def write_run_profiles(directory: str | Path, profiles: dict[str, ProfileData]) -> list[Path]:
    """Write each profile as ``DIR/profile.<device type>.yaml`` (replaced whole: a reader never
    sees half a file); the paths written."""
    written = []
    for device, data in profiles.items():
        path = Path(directory) / profile_name(device)
        tmp = path.with_name(path.name + ".partial")
        write_yaml(data.to_data(), tmp)
        tmp.replace(path)
        written.append(path)
    return written


def software_now(*, torch_version: str, megatron_core: str, python: str,
                 cuda: str | None) -> Software:
    return Software(megatron_hetero=__version__, python=python, torch=torch_version,
                    megatron_core=megatron_core, cuda=cuda)
