"""The GPU catalog: datasheet figures per GPU model, looked up by name or by reported alias."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping

import yaml

from .._schema import from_data
from ..errors import Described, SchemaError
from ..limits import quantity

__all__ = ["GPUSpec", "GPUOverride", "Catalog", "load_catalog", "DeviceStack", "VENDOR_STACKS",
           "DRIVER_SHARE"]

DRIVER_SHARE = 0.01
"""Share of a card's memory (as sold, read in GiB) the driver keeps where a catalog entry gives
no ``visible_memory_gib``: the H200 of docs/gpu.md, sold as 141 GB, reports 139.8 GiB (0.85%).
Cards with ECC on GDDR memory (T4, L4, A10) keep more: give their ``visible_memory_gib``."""


@dataclass(kw_only=True, slots=True, frozen=True)
class DeviceStack:
    """How torch drives a vendor's accelerators."""

    torch_device: str
    """The torch device type (``torch.device(torch_device, i)``)."""
    dist_backend: str
    """The ``torch.distributed`` backend of its device tensors."""
    library: str
    """The collective library behind that backend (two vendors whose backends share a torch
    name, as NCCL and RCCL do, still cannot join one group)."""


VENDOR_STACKS: dict[str, DeviceStack] = {
    "NVIDIA": DeviceStack(torch_device="cuda", dist_backend="nccl", library="NCCL"),
    "AMD": DeviceStack(torch_device="cuda", dist_backend="nccl", library="RCCL (ROCm)"),
    "Huawei": DeviceStack(torch_device="npu", dist_backend="hccl", library="HCCL (torch_npu)"),
}
"""The device stack of each vendor the catalog knows: ROCm builds of torch expose AMD GPUs as
``cuda`` devices and RCCL under the ``nccl`` backend name; Ascend NPUs need ``torch_npu``."""


@dataclass(kw_only=True, slots=True, frozen=True)
class GPUSpec:
    """Datasheet figures of one GPU model (see catalog.yaml for units)."""

    name: str = field(default="", metadata={"internal": True})
    vendor: str
    bf16_tflops: float = field(metadata=quantity("tflops"))
    """Dense bf16 (or fp16 where ``bf16`` is false) tensor-core TFLOPS."""
    bf16: bool
    fp32_tflops: float = field(metadata=quantity("tflops"))
    memory_gb: float = field(metadata=quantity("memory_gb"))
    """Device memory as sold, in GB (the datasheet's figure)."""
    memory_bandwidth_gb_s: float = field(metadata=quantity("bandwidth_gb_s"))
    intra_node_link: str
    intra_node_bandwidth_gb_s: float = field(metadata=quantity("bandwidth_gb_s"))
    """One-direction bandwidth to peers in the same node."""
    efficiency: float
    """Default achievable fraction of ``bf16_tflops`` on transformer layers."""
    aliases: list[str] = field(default_factory=list)
    notes: str | None = None
    torch_device: str | None = None
    """The torch device type; absent: the vendor's (:data:`VENDOR_STACKS`), else ``cuda``."""
    dist_backend: str | None = None
    """The ``torch.distributed`` backend of its device tensors; absent: the vendor's, else
    ``nccl``."""
    visible_memory_gib: float | None = field(default=None, metadata=quantity("memory_gb"))
    """Device memory as torch reports it (``total_memory`` / 2^30, what the driver leaves);
    absent: :data:`DRIVER_SHARE` less than ``memory_gb`` read as GiB
    (:attr:`visible_memory_bytes`)."""

    def __post_init__(self) -> None:
        for key in ("bf16_tflops", "fp32_tflops", "memory_gb", "memory_bandwidth_gb_s",
                    "intra_node_bandwidth_gb_s"):
            if getattr(self, key) <= 0:
                raise SchemaError("", key, getattr(self, key), "a positive number")
        if not 0 < self.efficiency <= 1:
            raise SchemaError("", "efficiency", self.efficiency, "a fraction in (0, 1]")
        if self.visible_memory_gib is not None and not 0 < self.visible_memory_gib <= self.memory_gb:
            raise SchemaError("", "visible_memory_gib", self.visible_memory_gib,
                              f"what the device reports, in GiB: positive and at most memory_gb "
                              f"({self.memory_gb:g}) read as GiB")
        self._check_stack()

    def _check_stack(self) -> None:
        """The vendor, the torch device and the backend name one stack: an entry that gives a
        vendor the table knows and another device or backend (an NVIDIA card on ``npu``), or a
        device the table knows with another backend (``npu`` on ``nccl``), contradicts itself."""
        for key in ("vendor", "torch_device", "dist_backend"):
            value = getattr(self, key)
            if value is not None and not value.strip():
                raise SchemaError("", key, value, "a name (or leave the key out)")
        known = VENDOR_STACKS.get(self.vendor)
        for key in ("torch_device", "dist_backend"):
            value = getattr(self, key)
            if known is not None and value is not None and value != getattr(known, key):
                raise SchemaError("", key, value, f"{getattr(known, key)!r}, the {key} of "
                                  f"{self.vendor}'s accelerators (or leave the key out); a "
                                  "vendor of another stack needs its own vendor name")
        backends = {st.torch_device: st.dist_backend for st in VENDOR_STACKS.values()}
        if (self.torch_device in backends and self.dist_backend is not None
                and self.dist_backend != backends[self.torch_device]):
            raise SchemaError("", "dist_backend", self.dist_backend,
                              f"{backends[self.torch_device]!r}, the backend of torch device "
                              f"{self.torch_device!r} tensors")

    @property
    def stack(self) -> DeviceStack:
        """How torch drives this device: the entry's own fields over its vendor's defaults
        (a vendor the table lacks defaults to ``cuda``/``nccl`` under its own library)."""
        known = VENDOR_STACKS.get(self.vendor)
        return DeviceStack(
            torch_device=self.torch_device or (known.torch_device if known else "cuda"),
            dist_backend=self.dist_backend or (known.dist_backend if known else "nccl"),
            library=known.library if known else f"{self.vendor}'s")

    @property
    def memory_bytes(self) -> float:
        """The memory as sold, in bytes (``memory_gb`` x 10^9)."""
        return self.memory_gb * 1e9

    @property
    def visible_memory_bytes(self) -> float:
        """The memory the device reports: ``visible_memory_gib`` where the entry gives it, else
        ``memory_gb`` read as GiB (HBM and GDDR come in binary sizes: a card sold as 80 GB
        holds 80 GiB) less :data:`DRIVER_SHARE`. The cost model plans against this, less the
        memory headroom (:class:`~megatron_hetero.cost.model.CostModel`)."""
        if self.visible_memory_gib is not None:
            return self.visible_memory_gib * 2**30
        return self.memory_gb * 2**30 * (1.0 - DRIVER_SHARE)

    @property
    def achievable_flops(self) -> float:
        """FLOP/s a transformer layer reaches on this card by default."""
        return self.bf16_tflops * 1e12 * self.efficiency


@dataclass(kw_only=True, slots=True)
class GPUOverride:
    """Partial GPU entry in an inventory: overrides fields of a catalog entry, or (with every
    required field given) adds a new one."""

    vendor: str | None = None
    bf16_tflops: float | None = field(default=None, metadata=quantity("tflops"))
    bf16: bool | None = None
    fp32_tflops: float | None = field(default=None, metadata=quantity("tflops"))
    memory_gb: float | None = field(default=None, metadata=quantity("memory_gb"))
    memory_bandwidth_gb_s: float | None = field(default=None, metadata=quantity("bandwidth_gb_s"))
    intra_node_link: str | None = None
    intra_node_bandwidth_gb_s: float | None = field(default=None, metadata=quantity("bandwidth_gb_s"))
    efficiency: float | None = None
    aliases: list[str] | None = None
    notes: str | None = None
    torch_device: str | None = None
    dist_backend: str | None = None
    visible_memory_gib: float | None = field(default=None, metadata=quantity("memory_gb"))


def _norm(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _words(name: str) -> frozenset[str]:
    """The words of a name, lower case (``NVIDIA A100-PCIE-40GB``: nvidia, a100, pcie, 40gb)."""
    return frozenset(re.findall(r"[a-z0-9]+", name.lower()))


class Catalog:
    """GPU models by canonical name, with alias lookup that ignores case and punctuation."""

    def __init__(self, specs: Mapping[str, GPUSpec]):
        self._specs = dict(specs)
        self._by_key: dict[str, str] = {}
        for name, spec in self._specs.items():
            for key in [name, *spec.aliases]:
                self._by_key.setdefault(_norm(key), name)

    def names(self) -> list[str]:
        return list(self._specs)

    def __contains__(self, name: str) -> bool:
        return self.resolve(name) is not None

    def resolve(self, name: str) -> str | None:
        """Canonical catalog name for a name or alias, or None."""
        return self._by_key.get(_norm(name))

    def fitting(self, name: str) -> list[str]:
        """The entries a name that is no entry's name or alias could mean: those whose name or
        an alias has every word of it (``A100-40GB``: A100-SXM-40GB and A100-PCIe-40GB)."""
        words = _words(name)
        if not words:
            return []
        return [n for n, spec in self._specs.items()
                if any(words <= _words(key) for key in [n, *spec.aliases])]

    def refuse_ambiguous(self, name: str, *, source: str, path: str) -> None:
        """Raise :class:`SchemaError` when ``name`` is no entry's name or alias but fits two or
        more entries: the planner must not guess between an SXM and a PCIe card."""
        if self.resolve(name) is not None:
            return
        fits = self.fitting(name)
        if len(fits) > 1:
            raise SchemaError(source, path, name,
                              "the name of one card; it fits " + ", ".join(fits[:-1])
                              + f" and {fits[-1]} (they differ in link and clocks: name the "
                              "one you have)")

    def get(self, name: str, *, source: str = "catalog", path: str = "") -> GPUSpec:
        canonical = self.resolve(name)
        if canonical is None:
            self.refuse_ambiguous(name, source=source, path=path)
            fits = self.fitting(name)
            hint = f"; did you mean {fits[0]}?" if fits else ""
            raise SchemaError(source, path, name, "a GPU in the catalog: " + ", ".join(self._specs)
                              + " (or add its entry under the inventory's `gpus:` key, or the "
                              f"plan's){hint}")
        return self._specs[canonical]

    def with_overrides(self, overrides: Mapping[str, GPUOverride], *, source: str,
                       path: str = "gpus") -> "Catalog":
        """This catalog with an inventory's ``gpus:`` applied: a name the catalog knows (or one
        of its aliases) overrides the given fields of that entry; another name adds an entry,
        which must then give every field."""
        catalog = Catalog(self._specs)
        for name, ov in overrides.items():
            given = {k: v for k, v in dataclasses.asdict(ov).items() if v is not None}
            canonical = catalog.resolve(name)
            where = f"{path}.{name}"
            catalog.refuse_ambiguous(name, source=source, path=where)
            if canonical is not None:
                base = {f.name: getattr(catalog._specs[canonical], f.name)
                        for f in dataclasses.fields(GPUSpec)}
                base.update(given)
                base.pop("name")
                spec = from_data(GPUSpec, base, source=source, path=where)
            else:
                spec = from_data(GPUSpec, given, source=source, path=where)
            catalog._put(canonical or name, spec, source=source, where=where)
        return catalog

    def with_entries(self, entries: Mapping[str, GPUSpec], *, source: str,
                     path: str = "gpus") -> "Catalog":
        """This catalog with full entries (a plan's ``gpus:``) added or replacing the entry of
        the same canonical name. A key must be a canonical name: an alias of another entry is
        refused, as is an alias that another entry already answers to."""
        catalog = Catalog(self._specs)
        for name, spec in entries.items():
            where = f"{path}.{name}"
            canonical = catalog.resolve(name)
            if canonical is not None and canonical != name:
                raise SchemaError(source, where, Described(f"an entry named {name!r}, an alias of "
                                                           f"{canonical}"),
                                  f"the canonical name {canonical!r} (to replace that entry) or "
                                  "a name the catalog does not know (to add one)")
            catalog._put(name, spec, source=source, where=where)
        return catalog

    def _put(self, name: str, spec: GPUSpec, *, source: str, where: str) -> None:
        """Add or replace entry ``name`` of this new catalog (one being built: a catalog is
        copied once for a whole ``gpus:``, not once per entry, which was quadratic)."""
        if not _norm(name):
            raise SchemaError(source, where, name, "a GPU name with at least one letter or digit")
        for i, alias in enumerate(spec.aliases):
            if not _norm(alias):
                raise SchemaError(source, f"{where}.aliases[{i}]", alias,
                                  "a name with at least one letter or digit")
        for i, alias in enumerate(spec.aliases):
            owner = self.resolve(alias)
            if owner is not None and owner != name:
                raise SchemaError(source, f"{where}.aliases[{i}]", alias,
                                  f"a name no other catalog entry answers to ({owner} does)")
        old = self._specs.get(name)
        self._specs[name] = dataclasses.replace(spec, name=name)
        if old is not None and old.aliases:  # the replaced entry's aliases go with it
            self._by_key = {}
            for n, sp in self._specs.items():
                for key in [n, *sp.aliases]:
                    self._by_key.setdefault(_norm(key), n)
            return
        for key in [name, *spec.aliases]:
            self._by_key.setdefault(_norm(key), name)


def _builtin() -> dict[str, Any]:
    text = resources.files(__package__).joinpath("catalog.yaml").read_text()
    return yaml.safe_load(text)


def load_catalog() -> Catalog:
    """The built-in catalog (a new one each time: callers may add entries to theirs)."""
    return Catalog(_builtin_specs())


@lru_cache(maxsize=1)
def _builtin_specs() -> dict[str, GPUSpec]:
    """The built-in entries, read once per process (``tune`` reads them again to find what a
    plan must carry, :func:`~megatron_hetero.placement.inventory.embedded_gpus`); the entries are
    frozen and :class:`Catalog` copies the mapping."""
    specs = {}
    for name, data in _builtin().items():
        spec = from_data(GPUSpec, data, source="megatron_hetero/hardware/catalog.yaml", path=name)
        specs[name] = dataclasses.replace(spec, name=name)
    return specs
