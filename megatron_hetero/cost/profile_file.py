"""Reading, looking up and writing the device profile file (``profile.yaml``), and the cost
model's view of it.

``megatron-hetero profile`` writes one file per device type; ``megatron-hetero tune --profile
FILE`` reads them back. The file's format (its dataclasses and version numbers) is
:mod:`megatron_hetero.cost.profile_schema`, documented in ``docs/profile-format.md``. Loading is
strict (unknown keys, missing fields and wrong types are :class:`SchemaError` naming the field
path).

:class:`MeasuredProfile` implements :class:`~megatron_hetero.cost.profile_protocol.DeviceProfile`:
it answers with measured seconds for a model shape it profiled, linearly interpolated between two
measured micro-batch sizes at the same TP size, and ``None`` otherwise. :class:`ProfileUsage`
records which answers were measured and which fell back, for the tuner's report.

No torch here: the tuner imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from .._schema import from_data, read_yaml, write_yaml
from ..errors import SchemaError
from ..plan import ModelSpec
from .profile_protocol import DeviceProfile, Part
from .profile_schema import (
    LAYER_SHAPE_FIELDS, READABLE_VERSIONS, VOCAB_SHAPE_FIELDS, MemoryFigures, ProfileData,
    ProfileEntry,
)

__all__ = ["MeasuredProfile", "ProfileUsage", "inventory_entry", "load_profile", "load_profiles",
           "save_profile", "shape_matches", "run_profile_name"]


def run_profile_name(device_type: str) -> str:
    """The name of a device type's profile in a run's telemetry folder
    (:mod:`megatron_hetero.telemetry.profile_out`; ``tune --from-run`` reads them)."""
    return f"profile.{device_type}.yaml"


def shape_matches(profiled: ModelSpec, asked: ModelSpec, part: Part) -> bool:
    """True when ``asked`` has the shape ``profiled`` measured for ``part``."""
    keys = LAYER_SHAPE_FIELDS if part == "layer" else VOCAB_SHAPE_FIELDS
    return all(getattr(profiled, k) == getattr(asked, k) for k in keys)


def _by_micro_batch(rows, micro_batch_size: int, figures):
    """``(figures(row), False)`` of the row measured at ``micro_batch_size`` (rows sorted by
    it), ``(interpolated figures, True)`` linearly between the two nearest measured sizes, or
    None outside them."""
    for e in rows:
        if e.micro_batch_size == micro_batch_size:
            return figures(e), False
    below = [e for e in rows if e.micro_batch_size < micro_batch_size]
    above = [e for e in rows if e.micro_batch_size > micro_batch_size]
    if not below or not above:
        return None
    lo, hi = below[-1], above[0]
    w = (micro_batch_size - lo.micro_batch_size) / (hi.micro_batch_size - lo.micro_batch_size)
    return tuple(a + w * (b - a) for a, b in zip(figures(lo), figures(hi))), True


class MeasuredProfile:
    """A loaded profile, answering the cost model (:class:`DeviceProfile`)."""

    __slots__ = ("data", "source", "device_type", "_by_tp")

    def __init__(self, data: ProfileData, *, source: str = "<profile>"):
        self.data = data
        self.source = source
        self.device_type: str = data.device.type
        self._by_tp: dict[int, list[ProfileEntry]] = {}
        for e in data.entries:
            self._by_tp.setdefault(e.tensor_parallel_size, []).append(e)
        for entries in self._by_tp.values():
            entries.sort(key=lambda e: e.micro_batch_size)

    @property
    def efficiency(self) -> float | None:
        return self.data.efficiency

    @property
    def moe_load_imbalance(self) -> float | None:
        """The measured load imbalance of an MoE model's experts (None: not measured)."""
        return self.data.moe_load_imbalance

    @property
    def optimizer_factor(self) -> float | None:
        """The measured optimizer step over the cost model's price (None: not measured)."""
        return self.data.optimizer_factor

    def times(self, part: Part, *, model: ModelSpec, micro_batch_size: int,
              tensor_parallel_size: int) -> tuple[float, float] | None:
        found = self.lookup(part, model=model, micro_batch_size=micro_batch_size,
                            tensor_parallel_size=tensor_parallel_size)
        return None if found is None else found[0]

    def lookup(self, part: Part, *, model: ModelSpec, micro_batch_size: int,
               tensor_parallel_size: int) -> tuple[tuple[float, float], bool] | None:
        """``((forward_s, backward_s), interpolated)`` or None. Between two measured
        micro-batch sizes the times are interpolated linearly; outside them, None."""
        if not shape_matches(self.data.model, model, part):
            return None
        entries = self._by_tp.get(tensor_parallel_size)
        if not entries:
            return None
        return _by_micro_batch(entries, micro_batch_size,
                               lambda e: (getattr(e, part).forward_s, getattr(e, part).backward_s))

    def pipeline_overhead(self, *, model: ModelSpec, micro_batch_size: int,
                          tensor_parallel_size: int) -> tuple[float, float] | None:
        """Measured (forward, backward) seconds a pipeline stage pays per micro-batch beyond its
        parts (``pipeline`` entries; negative scatter counted as 0), for the profiled shape at
        TP=1: exact, or interpolated linearly between two measured micro-batch sizes; None
        otherwise (format 1, no pipeline measured, another shape or micro-batch size). At
        TP > 1 the TP=1 figure is used: the schedule's work per micro-batch does not shrink
        with the tensor-parallel size."""
        pipe = self.data.pipeline
        if pipe is None or not shape_matches(self.data.model, model, "output"):
            return None
        rows = sorted((e for e in pipe.entries if e.tensor_parallel_size == 1),
                      key=lambda e: e.micro_batch_size)
        got = _by_micro_batch(rows, micro_batch_size,
                              lambda e: (e.forward_overhead_s, e.backward_overhead_s))
        return None if got is None else (max(0.0, got[0][0]), max(0.0, got[0][1]))

    @property
    def unfused_attention(self) -> bool:
        """Whether the profiled layers stored attention's ``s x s`` matrices: megatron-core's
        local layers run core attention unfused; Transformer Engine's run a fused kernel."""
        return self.data.timing.layer_spec == "local"

    def activation_bytes(self, *, model: ModelSpec, micro_batch_size: int,
                         tensor_parallel_size: int) -> float | None:
        """Measured activation bytes one layer keeps per micro-batch without recompute
        (``memory.activation_bytes_per_layer``): exact, or interpolated linearly between two
        measured micro-batch sizes of this shape and TP size; None otherwise."""
        if not shape_matches(self.data.model, model, "layer"):
            return None
        rows = [e for e in self._by_tp.get(tensor_parallel_size, []) if e.memory is not None]
        got = _by_micro_batch(rows, micro_batch_size,
                              lambda e: (float(e.memory.activation_bytes_per_layer),))
        return None if got is None else got[0][0]

    def memory(self, *, model: ModelSpec, micro_batch_size: int,
               tensor_parallel_size: int) -> MemoryFigures | None:
        """Measured memory figures of one layer at exactly this shape, or None."""
        if not shape_matches(self.data.model, model, "layer"):
            return None
        for e in self._by_tp.get(tensor_parallel_size, []):
            if e.micro_batch_size == micro_batch_size:
                return e.memory
        return None

    def __repr__(self) -> str:
        return f"MeasuredProfile({self.device_type!r}, {self.source!r})"


@dataclass(kw_only=True, slots=True)
class _Tally:
    measured: int = 0
    interpolated: int = 0
    estimated: int = 0
    keys_measured: set = field(default_factory=set)
    keys_estimated: set = field(default_factory=set)


class ProfileUsage:
    """Wraps profiles to record which figures the cost model got measured and which it had to
    estimate. Pass :meth:`wrap`'s result to the cost model, then read :meth:`report`.

    Device types without a profile are not asked through here; :meth:`report` lists them as
    estimated when given the device types the plan used.
    """

    def __init__(self, profiles: Mapping[str, MeasuredProfile]):
        self.profiles = dict(profiles)
        self._tally: dict[str, _Tally] = {name: _Tally() for name in self.profiles}

    def wrap(self) -> dict[str, DeviceProfile]:
        return {name: _Recording(p, self._tally[name]) for name, p in self.profiles.items()}

    def report(self, device_types: Iterable[str] = ()) -> dict:
        """Plain data for the JSON report: per device type, where its figures came from."""
        out: dict[str, dict] = {}
        used = set(device_types)
        for name in sorted(used | set(self.profiles)):
            p = self.profiles.get(name)
            if p is None:
                out[name] = {"source": "catalog", "profile": None,
                             "note": "no profile: catalog bf16_tflops x catalog efficiency"}
                continue
            t = self._tally[name]
            if used and name not in used:
                source = "unused (the plan has no such device)"
            elif t.measured + t.interpolated and not t.estimated:
                source = "measured"
            elif t.measured + t.interpolated:
                source = "partly measured"
            else:
                source = "estimated with measured efficiency" if p.efficiency else "estimated"
            out[name] = {
                "source": source,
                "profile": p.source,
                "efficiency": p.efficiency,
                "lookups_measured": t.measured,
                "lookups_interpolated": t.interpolated,
                "lookups_estimated": t.estimated,
                "measured": sorted(f"{k[0]} mbs={k[1]} tp={k[2]}" for k in t.keys_measured),
                "estimated": sorted(f"{k[0]} mbs={k[1]} tp={k[2]}" for k in t.keys_estimated),
            }
        return out

    def summary_lines(self, device_types: Iterable[str] = ()) -> list[str]:
        """One line per device type for the human summary."""
        lines = []
        for name, r in self.report(device_types).items():
            if r["profile"] is None:
                lines.append(f"{name}: estimated (catalog datasheet x default efficiency; "
                             "no --profile given)")
                continue
            eff = f", measured efficiency {r['efficiency']:.3f}" if r["efficiency"] else ""
            lines.append(f"{name}: {r['source']} from {r['profile']} ({r['lookups_measured']} "
                         f"measured, {r['lookups_interpolated']} interpolated, "
                         f"{r['lookups_estimated']} estimated lookups{eff})")
        return lines


class _Recording:
    __slots__ = ("_p", "_t", "device_type")

    def __init__(self, profile: MeasuredProfile, tally: _Tally):
        self._p, self._t = profile, tally
        self.device_type = profile.device_type

    @property
    def efficiency(self) -> float | None:
        return self._p.efficiency

    @property
    def moe_load_imbalance(self) -> float | None:
        return self._p.moe_load_imbalance

    @property
    def optimizer_factor(self) -> float | None:
        return self._p.optimizer_factor

    def times(self, part: Part, *, model: ModelSpec, micro_batch_size: int,
              tensor_parallel_size: int) -> tuple[float, float] | None:
        found = self._p.lookup(part, model=model, micro_batch_size=micro_batch_size,
                               tensor_parallel_size=tensor_parallel_size)
        key = (part, micro_batch_size, tensor_parallel_size)
        if found is None:
            self._t.estimated += 1
            self._t.keys_estimated.add(key)
            return None
        if found[1]:
            self._t.interpolated += 1
        else:
            self._t.measured += 1
        self._t.keys_measured.add(key)
        return found[0]

    def __getattr__(self, name):
        return getattr(self._p, name)


def load_profile(path: str | Path, *, catalog=None) -> MeasuredProfile:
    """Load ``profile.yaml`` strictly. With ``catalog``, ``device.type`` must be a name it knows
    (aliases are resolved to the canonical name)."""
    source = str(path)
    raw = read_yaml(path)
    if isinstance(raw, dict) and raw.get("format_version") not in (None, *READABLE_VERSIONS):
        raise SchemaError(source, "format_version", raw.get("format_version"),
                          f"one of {', '.join(map(str, READABLE_VERSIONS))} (this "
                          "megatron-hetero reads profile formats "
                          f"{', '.join(map(str, READABLE_VERSIONS))}; re-run "
                          "`megatron-hetero profile`)")
    data = from_data(ProfileData, raw, source=source)
    if catalog is not None:
        canonical = catalog.resolve(data.device.type)
        if canonical is None:
            catalog.get(data.device.type, source=source, path="device.type")  # raises
        data.device.type = canonical
    return MeasuredProfile(data, source=source)


def load_profiles(paths: Iterable[str | Path], *, catalog=None) -> dict[str, MeasuredProfile]:
    """Profiles by device type; two files for one type is an error."""
    out: dict[str, MeasuredProfile] = {}
    for path in paths:
        p = load_profile(path, catalog=catalog)
        if p.device_type in out:
            raise SchemaError(str(path), "device.type", p.device_type,
                              f"one profile per device type ({out[p.device_type].source} "
                              "profiles it already)")
        out[p.device_type] = p
    return out


def inventory_entry(data: ProfileData) -> dict:
    """A ``gpus:`` entry for an inventory, made of what a CPU profile measured, so that the
    tuner can plan with ``device.type`` (``CPU``) as a device: peak = the measured matmul rate,
    efficiency = the measured layer efficiency, memory = host memory, links = the measured p2p
    bandwidth (1 GB/s when not measured)."""
    dev = data.device
    if dev.peak_matmul_tflops is None:
        raise SchemaError("<profile>", "device.peak_matmul_tflops", None,
                          "a measured matmul rate (only CPU profiles record one)")
    p2p = max((s.gb_s for s in data.communication.p2p), default=1.0) if data.communication else 1.0
    return {"vendor": "CPU", "bf16_tflops": dev.peak_matmul_tflops, "bf16": True,
            "fp32_tflops": dev.peak_matmul_tflops,
            "memory_gb": round((dev.memory_bytes or 8e9) / 1e9, 3),
            "memory_bandwidth_gb_s": 10.0, "intra_node_link": "host memory (gloo)",
            "intra_node_bandwidth_gb_s": p2p, "efficiency": data.efficiency or 0.5,
            "notes": f"measured by megatron-hetero profile on {dev.name} at {data.created}"}


def save_profile(data: ProfileData, path: str | Path) -> None:
    write_yaml(data.to_data(), path)
