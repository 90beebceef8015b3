"""The rehearsal's calibration from a file: its own, or a profile's.

``rehearse --calibration FILE``: the first rehearsal measures the calibration and writes it,
the next ones of the same shrunk model read it instead of measuring again (about 10-20 s of two
CPU processes each, more on a loaded machine). :func:`calibration_from_profile` makes one from
a profile of this machine (``megatron-hetero profile``, docs/profiling.md), so that a
rehearsal's a-priori prediction is the profile's.

A file holds one :class:`~.calibration.Calibration` per device type, each measured after that
device's idle gap (:func:`.rehearse._calibrate_devices`), and what they were measured for: the
shrunk model, its micro-batch sizes, whether the saved activations were metered, and each
device's idle factor. A rehearsal whose shrunk plan differs in any of these refuses the file,
naming what differs (measure again into another file). The CPU's speed drifts between runs on
a shared machine; the rehearsal's prediction rescales by the CPU time each run measures
(:mod:`.drift`) either way, while its a-priori prediction then comes from the file's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .._schema import read_yaml, write_yaml
from ..errors import HeteroError
from ..plan import Plan
from .calibration import Calibration

__all__ = ["CALIBRATION_KIND", "calibration_key", "save_calibrations", "load_calibrations",
           "calibration_from_profile"]

CALIBRATION_KIND = "megatron-hetero rehearsal calibration"
"""The ``kind`` of the file (version 1)."""

_PAIRS = ("pipeline_overhead", "step_overhead")
_SCALARS = ("layer_flops_per_s", "p2p_latency_s", "bandwidth_gb_s", "allreduce_gb_s",
            "optimizer_gb_s")


def calibration_key(shrunk: Plan, idle_factors: dict[str, float], metered: bool) -> dict:
    """What a calibration was measured for (compared on reading)."""
    return {"model": dataclasses.asdict(shrunk.model),
            "micro_batch_sizes": sorted({p.micro_batch_size for m in shrunk.meshes
                                         for p in m.pipelines}),
            "metered": bool(metered),
            "idle_factors": {d: round(float(f), 3) for d, f in sorted(idle_factors.items())}}


def _to_data(c: Calibration) -> dict:
    return {"parts": [[part, b, list(t)] for (part, b), t in sorted(c.parts.items())],
            "layer_activation_bytes": {int(b): float(v)
                                       for b, v in sorted(c.layer_activation_bytes.items())},
            **{k: {int(b): list(v) for b, v in sorted(getattr(c, k).items())} for k in _PAIRS},
            **{k: float(getattr(c, k)) for k in _SCALARS}}


def _from_data(data, where: str) -> Calibration:
    try:
        return Calibration(
            parts={(str(part), int(b)): (float(t[0]), float(t[1])) for part, b, t in data["parts"]},
            layer_activation_bytes={int(b): float(v)
                                    for b, v in data["layer_activation_bytes"].items()},
            **{k: {int(b): (float(v[0]), float(v[1])) for b, v in data[k].items()} for k in _PAIRS},
            **{k: float(data[k]) for k in _SCALARS})
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise HeteroError(f"{where}: not a calibration this version writes ({exc!r}); delete "
                          "the file to measure again") from None


def save_calibrations(path: str | Path, calibrations: dict[str, Calibration], key: dict) -> None:
    """Write ``calibrations`` (device type -> Calibration) measured for ``key``
    (:func:`calibration_key`) to ``path``."""
    write_yaml({"kind": CALIBRATION_KIND, "version": 1, "measured_for": key,
                "devices": {d: _to_data(c) for d, c in sorted(calibrations.items())}}, path)


def load_calibrations(path: str | Path, key: dict, *, source: str) -> dict[str, Calibration]:
    """The calibrations at ``path`` (device type -> Calibration), refused (``HeteroError``
    naming ``source``'s option and what differs) unless they were measured for ``key``."""
    where = f"{source} (--calibration {path})"
    data = read_yaml(path)
    if not isinstance(data, dict) or data.get("kind") != CALIBRATION_KIND or \
            data.get("version") != 1:
        raise HeteroError(f"{where}: not a rehearsal calibration (kind {CALIBRATION_KIND!r}, "
                          "version 1)")
    found = data.get("measured_for") or {}
    differs = [k for k in key if found.get(k) != key[k]]
    if differs:
        raise HeteroError(f"{where}: measured for another rehearsal: its "
                          f"{', '.join(differs)} differ from this one's ({key[differs[0]]!r} "
                          f"here, {found.get(differs[0])!r} in the file); use another file or "
                          "delete it to measure again")
    devices = data.get("devices")
    if not isinstance(devices, dict) or set(devices) != set(key["idle_factors"]):
        raise HeteroError(f"{where}: its devices {sorted(devices or {})} are not this "
                          f"rehearsal's {sorted(key['idle_factors'])}")
    return {d: _from_data(v, f"{where}: devices.{d}") for d, v in devices.items()}


def calibration_from_profile(profile, shrunk: Plan, base: Calibration | None = None
                             ) -> Calibration:
    """The rehearsal's :class:`Calibration` of ``shrunk`` from ``profile`` (a loaded
    ``MeasuredProfile`` of this machine's CPU, ``megatron-hetero profile --device cpu`` of the
    shrunk model, taken before the run): the forward and backward seconds of a layer, the
    embedding and the output layer at each of the plan's micro-batch sizes (TP=1), the
    layer's FLOP/s, its pipeline overhead and idle penalty where measured, the saved
    activation bytes, gloo's p2p latency and bandwidth and all-reduce bandwidth; what a profile
    does not measure (the optimizer step's rate) from ``base`` (default: the
    :class:`Calibration` defaults). Refused (``HeteroError``) where the profile lacks a part at
    one of the plan's micro-batch sizes or profiled another shape."""
    from ..models import layer_forward_flops

    out = dataclasses.replace(base or Calibration(), parts={}, pipeline_overhead={},
                              step_overhead={}, layer_activation_bytes={})
    m = shrunk.model
    for b in sorted({p.micro_batch_size for mesh in shrunk.meshes for p in mesh.pipelines}):
        for part in ("layer", "embedding", "output"):
            got = profile.times(part, model=m, micro_batch_size=b, tensor_parallel_size=1)
            if got is None:
                raise HeteroError(f"{profile.source}: no {part} at micro-batch size {b} for the "
                                  f"shrunk model (hidden size {m.hidden_size}); profile it")
            out.parts[(part, b)] = got
        over = profile.pipeline_overhead(model=m, micro_batch_size=b, tensor_parallel_size=1)
        if over is not None:
            out.pipeline_overhead[b] = over
        for e in profile.data.entries:
            if (e.micro_batch_size, e.tensor_parallel_size) == (b, 1) and e.idle_penalty:
                out.step_overhead[b] = (e.idle_penalty.forward_s, e.idle_penalty.backward_s)
        saved = profile.activation_bytes(model=m, micro_batch_size=b, tensor_parallel_size=1)
        if saved is not None:
            out.layer_activation_bytes[b] = saved
        lf, lb = out.parts[("layer", b)]
        out.layer_flops_per_s = 3 * layer_forward_flops(m, b) / (lf + lb)
    comm = profile.data.communication
    if comm is not None:
        if comm.p2p_latency_s is not None:
            out.p2p_latency_s = comm.p2p_latency_s
        if comm.p2p:
            out.bandwidth_gb_s = max(s.gb_s for s in comm.p2p)
        if comm.all_reduce:
            out.allreduce_gb_s = max(s.gb_s for s in comm.all_reduce)
    return out
