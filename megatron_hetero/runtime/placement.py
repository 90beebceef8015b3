"""Placement: put every plan slot on a GPU of the type the plan names.

The launcher (srun, torchrun) numbers processes in its own order. Each process reports its
device type; every rank then computes the same assignment of launcher ranks to Megatron ranks
(:func:`assign_ranks`) and plays the Megatron rank it was given. Megatron builds its process
groups from that renumbered rank, so its tensor-, data- and pipeline-parallel groups follow the
plan without any change to Megatron.

The assignment is pure and deterministic (the same inputs give the same answer on every rank).
A plan that does not match the devices found raises :class:`PlacementError` with the same
message on every rank, before any model is built.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass

from ..errors import HeteroError
from ..hardware.catalog import Catalog, load_catalog
from ..mcore.cpu_backend import CPU_ENV, cpu_mode
from ..plan import Plan
from ..placement.inventory import check_plan_vendors
from .arguments import DEVICE_TYPE_ENV

__all__ = ["RankInfo", "Placed", "PlacementError", "assign_ranks", "detect_device_type",
           "exchange_rank_infos", "place_this_rank", "check_device_stacks", "CPU_ENV",
           "device_type_of_rank"]

_KEY_PREFIX = "megatron_hetero/placement"

_STACK_MODULES = {"npu": "torch_npu"}
"""Torch device types that need a module beside torch (imported for its side effects)."""


class PlacementError(HeteroError):
    """The devices found do not match the plan (raised identically on every rank)."""


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What one launcher rank reports about itself."""

    launcher_rank: int
    device_type: str
    """Canonical catalog name of its device."""
    host: str = ""
    local_rank: int = 0

    def to_json(self) -> str:
        return json.dumps([self.launcher_rank, self.device_type, self.host, self.local_rank])

    @classmethod
    def from_json(cls, text: str) -> "RankInfo":
        rank, device, host, local = json.loads(text)
        return cls(launcher_rank=rank, device_type=device, host=host, local_rank=local)


@dataclass(frozen=True, kw_only=True, slots=True)
class Placed:
    """This process's place under the plan (:func:`place_this_rank`)."""

    rank: int
    """Its Megatron rank."""
    server: object = None
    """The rendezvous store this process hosts (launcher rank 0 without torchrun's agent), or
    None: whoever places the rank keeps it for the job's life, since Megatron's own rendezvous
    joins it as a client."""


def detect_device_type(*, override: str | None = None, catalog: Catalog | None = None,
                       emulated: str | None = None, where: str = "",
                       unknown_ok: bool = False) -> str:
    """This rank's device type as a canonical catalog name.

    Order: ``override`` (``--hetero-device-type``), then ``$MEGATRON_HETERO_DEVICE_TYPE``, then
    ``emulated`` (the CPU backend's type), then ``torch.cuda.get_device_name()``. With
    ``unknown_ok``, a name the catalog does not know comes back as ``"unknown: NAME"`` (so that
    the other ranks, not only this one, report the mismatch instead of waiting for it).
    ``catalog`` is the loaded plan's (``plan.catalog``: the built-in catalog plus the plan's
    ``gpus`` entries, whose ``aliases`` match the names custom devices report); default the
    built-in one.
    """
    catalog = catalog or load_catalog()
    name, how = None, ""
    if override:
        name, how = override, "--hetero-device-type"
    elif os.environ.get(DEVICE_TYPE_ENV):
        name, how = os.environ[DEVICE_TYPE_ENV], f"${DEVICE_TYPE_ENV}"
    elif emulated:
        name, how = emulated, "the CPU backend's emulated device"
    else:
        import torch

        if not torch.cuda.is_available():
            raise PlacementError(
                f"{where}no CUDA device to detect: set --hetero-device-type or ${DEVICE_TYPE_ENV} "
                f"to a catalog GPU type, or {CPU_ENV}=1 for the CPU backend")
        name, how = torch.cuda.get_device_name(), "torch.cuda.get_device_name()"
    canonical = catalog.resolve(name)
    if canonical is None and unknown_ok:
        return f"unknown: {name}"
    if canonical is None:
        raise PlacementError(
            f"{where}device {name!r} (from {how}) is not in the GPU catalog; known types: "
            + ", ".join(catalog.names())
            + f". Set --hetero-device-type or ${DEVICE_TYPE_ENV} to one of them, or add the "
            "name to the `aliases` of its entry under the plan's `gpus:`.")
    return canonical


def _counts_text(counts: Counter) -> str:
    return ", ".join(f"{n}x {gpu}" for gpu, n in sorted(counts.items())) or "nothing"


def device_type_of_rank(plan: Plan, rank: int) -> str:
    """The device type the plan puts on Megatron rank ``rank``."""
    return plan.device_type_of_rank(rank)


def _tensor_groups(plan: Plan) -> list[tuple[int, int]]:
    """(first rank, size) of every tensor-parallel group, in rank order (each mesh its own
    size)."""
    return plan.tensor_groups()


def assign_ranks(plan: Plan, infos: list[RankInfo], *,
                 source: str = "plan") -> list[int]:
    """Megatron rank of every launcher rank (``result[launcher_rank]``).

    Slots are handed out per device type in Megatron rank order, one tensor-parallel group at a
    time, to that type's launcher ranks sorted by (host, local rank, launcher rank), so that a
    tensor-parallel group stays on consecutive GPUs of one host where the hosts allow it. When the
    launcher's own order already matches the plan, it is kept (Megatron rank = launcher rank).
    """
    world = plan.world_size
    found = Counter(i.device_type for i in infos)
    wanted = plan.device_counts()
    if len(infos) != world or found != wanted:
        lines = [f"{source}: the devices found do not match the plan"]
        lines.append(f"  plan wants {world} ranks: {_counts_text(wanted)}")
        lines.append(f"  found      {len(infos)} ranks: {_counts_text(found)}")
        for gpu in sorted(set(found) | set(wanted)):
            if found[gpu] != wanted[gpu]:
                ranks = sorted(i.launcher_rank for i in infos if i.device_type == gpu)
                shown = ", ".join(map(str, ranks[:16])) + (" ..." if len(ranks) > 16 else "")
                lines.append(f"  {gpu}: plan wants {wanted[gpu]}, found {found[gpu]}"
                             + (f" (launcher ranks {shown})" if ranks else ""))
        lines.append(f"  (override a rank's detected type with --hetero-device-type or "
                     f"${DEVICE_TYPE_ENV})")
        raise PlacementError("\n".join(lines))
    by_rank = sorted(infos, key=lambda i: i.launcher_rank)
    if [i.launcher_rank for i in by_rank] != list(range(world)):
        raise PlacementError(f"{source}: launcher ranks are not 0..{world - 1}: "
                             f"{[i.launcher_rank for i in by_rank][:16]}")
    if all(device_type_of_rank(plan, i.launcher_rank) == i.device_type for i in by_rank):
        return list(range(world))

    pool: dict[str, list[RankInfo]] = defaultdict(list)
    for info in sorted(infos, key=lambda i: (i.host, i.local_rank, i.launcher_rank)):
        pool[info.device_type].append(info)
    taken = Counter()
    result = [-1] * world
    for first, tp in _tensor_groups(plan):  # a tensor-parallel group: consecutive Megatron ranks
        gpu = device_type_of_rank(plan, first)
        start = taken[gpu]
        for t, info in enumerate(pool[gpu][start:start + tp]):
            result[info.launcher_rank] = first + t
        taken[gpu] += tp
    assert sorted(result) == list(range(world)), result
    return result


def exchange_rank_infos(mine: RankInfo, world_size: int, store) -> list[RankInfo]:
    """Every launcher rank's :class:`RankInfo`, through a c10d store (no process group needed)."""
    generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"{_KEY_PREFIX}/{generation}"
    store.set(f"{prefix}/{mine.launcher_rank}", mine.to_json())
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    store.wait(keys)
    infos = [RankInfo.from_json(store.get(k).decode()) for k in keys]
    store.set(f"{prefix}/read/{mine.launcher_rank}", "1")
    if isinstance(store, _HostedStore):
        # The process that hosts the store must not leave (a placement error stops every rank)
        # before the others have read it: their reads would fail with "connection reset".
        store.wait([f"{prefix}/read/{r}" for r in range(world_size)])
    return infos


class _HostedStore:
    """The c10d store this process hosts (its server lives as long as this object)."""

    __slots__ = ("store",)

    def __init__(self, store):
        self.store = store

    def set(self, key, value):
        return self.store.set(key, value)

    def get(self, key):
        return self.store.get(key)

    def wait(self, keys):
        return self.store.wait(keys)


def _launcher_store(launcher_rank: int, world_size: int, timeout_minutes: float):
    """A c10d TCPStore on MASTER_ADDR:MASTER_PORT, hosted by launcher rank 0 unless torchrun's
    agent already hosts one (then a :class:`_HostedStore`). Megatron's own rendezvous then
    joins the same server as a client."""
    from datetime import timedelta

    import torch.distributed as dist

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    hosting = launcher_rank == 0 and not agent
    store = dist.TCPStore(host, port, world_size, is_master=hosting,
                          timeout=timedelta(minutes=timeout_minutes), multi_tenant=True)
    # The Megatron rank 0 may now be another process: every rank joins the server as a client.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return _HostedStore(store) if hosting else store


def place_this_rank(plan: Plan, *, launcher_rank: int, world_size: int,
                    device_type: str,
                    source: str = "plan", store=None, timeout_minutes: float = 10.0) -> Placed:
    """This process's Megatron rank under ``plan`` (and the rendezvous store it hosts, which
    the caller keeps); exchanges device types with every rank."""
    import socket

    if world_size != plan.world_size:
        # Every rank sees the same WORLD_SIZE, so every rank raises the same message.
        wanted = plan.device_counts()
        shape = plan.sizes_text()
        raise PlacementError(
            f"{source}: the plan needs world size {plan.world_size} ({_counts_text(wanted)}; "
            f"{shape}); the launcher started {world_size} ranks")
    mine = RankInfo(launcher_rank=launcher_rank, device_type=device_type,
                    host=socket.gethostname(), local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    if world_size == 1:
        infos = [mine]
    else:
        store = store or _launcher_store(launcher_rank, world_size, timeout_minutes)
        infos = exchange_rank_infos(mine, world_size, store)
    return Placed(rank=assign_ranks(plan, infos, source=source)[launcher_rank],
                  server=store if isinstance(store, _HostedStore) else None)


def check_device_stacks(plan: Plan, *, source: str) -> None:
    """Refuse, before any model is built and with the same message on every rank, a plan this
    runtime cannot carry on devices: GPUs of several vendors other than across pipeline edges
    (a data-parallel group across vendors, or Ascend NPUs beside another vendor:
    :func:`~megatron_hetero.placement.inventory.check_plan_vendors`; on the CPU backend too, as
    ``validate`` refuses it), or a device type whose torch stack this process lacks (Ascend
    NPUs without ``torch_npu``; not asked on the CPU backend, ``MEGATRON_HETERO_CPU=1``, whose
    ranks only play the device)."""
    check_plan_vendors(plan, plan.catalog, source=source)
    if cpu_mode():
        return
    for device_type in sorted(plan.device_counts()):
        stack = plan.catalog.get(device_type).stack
        module = _STACK_MODULES.get(stack.torch_device)
        if module is not None and importlib.util.find_spec(module) is None:
            raise PlacementError(
                f"{source}: the plan runs on {device_type} ({stack.torch_device} devices, "
                f"{stack.dist_backend} backend), which needs the {module} package; this "
                f"environment lacks it (install the vendor's {module} build of this torch "
                "version on every node of that type: docs/vendors.md)")
