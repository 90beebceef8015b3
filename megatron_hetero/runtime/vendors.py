"""Process groups of a plan whose GPUs are of several vendors (docs/vendors.md).

NCCL, RCCL and HCCL cannot join one communicator. On a plan across vendors (which
:func:`~megatron_hetero.placement.inventory.check_plan_vendors` accepts: vendor boundaries on pipeline
edges only), every group gets the backend its members can share:

* :func:`group_backend`, a pure function of the plan and a group's Megatron ranks (placement
  makes Megatron rank ``r`` a GPU of the plan's type for ``r``, so every rank knows every
  rank's vendor): the vendor's device backend (``nccl``, ``hccl``) for a group inside one
  vendor, ``gloo`` for a group across vendors (the world group, a pipeline group, the
  model-parallel and embedding groups), and ``gloo`` where Megatron asks for it;
* :class:`VendorGroups`, what the runtime's hooks of ``megatron.core.parallel_state.create_group``
  (through which Megatron builds every group) and ``initialize_model_parallel`` do on such a
  plan: pass that backend (every rank calls it for every group in the same order, so every
  rank decides alike), and build, after Megatron's groups, one group per pipeline edge
  (:func:`pipeline_edges`) and route the pipeline's messages over them (:mod:`.host_p2p`: an
  edge across vendors is staged through host buffers on its gloo group);
* the hooks make the world group gloo (``--distributed-backend gloo``).

A mesh plan across vendors (each mesh one device type) takes the same world and ``create_group``
hooks (the multimodule backend, :mod:`.mesh_run`); each mesh's grid is made on its vendor's
backend (:func:`mesh_backends`), and its bridges between vendors stage through host memory on
gloo groups of their own (:mod:`megatron_hetero.mcore.bridge_groups`) instead of the edge
routing.

On the CPU backend (``MEGATRON_HETERO_CPU=1``) every group is gloo whatever the decision; the
decisions are still recorded (:func:`choices`) and the edges still routed, so a CPU run takes
the same host-staged path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..plan import Plan
from ..plan.checks import host_bridges

__all__ = ["GLOO", "GroupChoice", "rank_vendors", "spans_vendors", "group_backend",
           "pipeline_edges", "VendorGroups", "groups_for", "prepare", "mesh_backends"]

GLOO = "gloo"


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupChoice:
    """One group Megatron (or these hooks) built on a plan across vendors."""

    ranks: tuple[int, ...]
    """Its Megatron ranks (every rank for the world group)."""
    asked: str | None
    """The backend Megatron asked for (None: the default group's)."""
    backend: str
    """The backend chosen for a device run (:func:`group_backend`)."""
    vendors: tuple[str, ...]
    """The vendors of its ranks, sorted."""


def rank_vendors(plan: Plan) -> list[str]:
    """The vendor of every Megatron rank's GPU (``result[rank]``)."""
    return [plan.catalog.get(plan.device_type_of_rank(r)).vendor for r in range(plan.world_size)]


def spans_vendors(plan: Plan) -> bool:
    """Whether the plan's GPUs are of more than one vendor."""
    return len({plan.catalog.get(t).vendor for t in plan.device_counts()}) > 1


def group_backend(plan: Plan, ranks, *, asked: str | None) -> str | None:
    """The backend of the group of Megatron ranks ``ranks`` (None: every rank) that Megatron
    asked to build on ``asked``: unchanged on a plan of one vendor; else ``gloo`` where Megatron
    asked for it or the ranks are of several vendors, and their vendor's device backend
    otherwise."""
    if not spans_vendors(plan):
        return asked
    if asked == GLOO:
        return GLOO
    vendors = rank_vendors(plan)
    members = range(plan.world_size) if ranks is None else ranks
    found = {vendors[r] for r in members}
    if len(found) > 1:
        return GLOO
    rank = next(iter(members))
    return plan.catalog.get(plan.device_type_of_rank(rank)).stack.dist_backend


def pipeline_edges(plan: Plan) -> list[tuple[int, int]]:
    """Every pair of Megatron ranks that exchange pipeline messages, as (rank of stage s, rank
    of stage s + 1), pipeline by pipeline, tensor rank by tensor rank; with interleaving also
    (last stage, first stage), the chunk boundary. A pair appears once."""
    from ..plan import Slot

    p = plan.pipeline_model_parallel_size
    pairs = [(s, s + 1) for s in range(p - 1)]
    if plan.virtual_pipeline_size > 1 and p > 1:
        pairs.append((p - 1, 0))
    out, seen = [], set()
    for d in range(plan.data_parallel_size):
        for a, b in pairs:
            for t in range(plan.tensor_model_parallel_size):
                ra = plan.rank_of_slot(Slot(mesh=0, stage=a, replica=d, tensor_rank=t))
                rb = plan.rank_of_slot(Slot(mesh=0, stage=b, replica=d, tensor_rank=t))
                if frozenset((ra, rb)) not in seen:
                    seen.add(frozenset((ra, rb)))
                    out.append((ra, rb))
    return out


# -- the hooks ---------------------------------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class VendorGroups:
    """The groups of this rank on a plan across vendors: what the runtime's hooks of
    ``create_group`` and ``initialize_model_parallel`` do (:func:`prepare` makes one)."""

    plan: Plan
    """The plan (across vendors)."""
    cpu_backend: bool
    """Every group is gloo whatever the decision (``MEGATRON_HETERO_CPU=1``)."""
    choices: list[GroupChoice] = field(default_factory=list)
    """The groups built so far in this process, in order."""
    routes: object = None
    """This rank's pipeline-edge router (:class:`.host_p2p.Router`; its counters say how many
    messages took the host-staged path), or None before the groups are built."""

    def create_group(self, original, ranks=None, timeout=None, backend=None, pg_options=None,
                     **kw):
        """``parallel_state.create_group`` with the backend :func:`group_backend` chooses."""
        chosen = group_backend(self.plan, ranks, asked=backend)
        members = tuple(range(self.plan.world_size) if ranks is None else ranks)
        vendors = rank_vendors(self.plan)
        self.choices.append(GroupChoice(ranks=members, asked=backend, backend=chosen,
                                        vendors=tuple(sorted({vendors[r] for r in members}))))
        if self.cpu_backend or chosen == GLOO:
            chosen, pg_options = GLOO, None  # the device backend's options do not apply
        return original(ranks, timeout=timeout, backend=chosen, pg_options=pg_options, **kw)

    def build_edges(self, *, timeout_minutes: float) -> None:
        """After Megatron's groups: one group per pipeline edge, built by every rank in the same
        order, and this rank's pipeline messages routed over its edges."""
        from datetime import timedelta

        import torch.distributed as dist
        from megatron.core import parallel_state

        from .host_p2p import Edge, install_router

        me, vendors = dist.get_rank(), rank_vendors(self.plan)
        edges = {}
        for a, b in pipeline_edges(self.plan):
            group = parallel_state.create_group(sorted((a, b)), timeout=timedelta(
                minutes=timeout_minutes), group_desc="HETERO_PIPELINE_EDGE")
            if me in (a, b):
                edges[b if me == a else a] = Edge(group=group, staged=vendors[a] != vendors[b])
        self.routes = install_router(edges)


def groups_for(plan: Plan, *, cpu_backend: bool) -> VendorGroups | None:
    """The :class:`VendorGroups` of ``plan``; None for a plan of one vendor (nothing changes)."""
    return VendorGroups(plan=plan, cpu_backend=cpu_backend) if spans_vendors(plan) else None


def prepare(plan: Plan, args, *, source: str, cpu_backend: bool) -> VendorGroups | None:
    """Before Megatron initialises torch.distributed: on a plan across vendors, refuse what the
    routed pipeline cannot carry, make the world group gloo (``args.distributed_backend``: the
    world spans vendors; Megatron's barriers and scalar collectives on it take host or CUDA
    tensors) and return the groups' hooks (None for a plan of one vendor)."""
    from ..errors import HeteroError

    if spans_vendors(plan):
        used = [flag for flag, on in (
            ("--variable-seq-lengths", getattr(args, "variable_seq_lengths", False)),
            ("--use-ring-exchange-p2p", getattr(args, "use_ring_exchange_p2p", False))) if on]
        if used and plan.one_grid:
            raise HeteroError(f"{source}: a plan across vendors routes pipeline messages edge "
                              f"by edge (host-staged across vendors); {' and '.join(used)} "
                              "exchange on the whole pipeline group instead and are not "
                              "supported with it (docs/vendors.md)")
        args.distributed_backend = GLOO
        vendors = rank_vendors(plan)
        if plan.one_grid:
            staged = sum(1 for a, b in pipeline_edges(plan) if vendors[a] != vendors[b])
            what = "pipeline edges"
        else:  # a chain of meshes: its bridges (the wrap-around where it has model chunks)
            crossing = host_bridges(plan)
            staged = sum(crossing if plan.interleaved_chain else crossing[:-1])
            what = "bridges between meshes"
        if int(getattr(args, "rank", 0)) == 0:
            print(f"megatron-hetero: GPUs of {len(set(vendors))} vendors: world group "
                  f"gloo, {staged} {what} across vendors staged through host memory",
                  flush=True)
    return groups_for(plan, cpu_backend=cpu_backend)


def mesh_backends(plan: Plan) -> list[str | None]:
    """The backend of each mesh's grid groups on devices (:func:`group_backend` of its ranks:
    its vendor's device backend on a plan across vendors, whose world is gloo; None, the
    world's, otherwise)."""
    return [group_backend(plan, range(plan.rank_offset(k), plan.rank_offset(k) + m.world_size),
                          asked=None) for k, m in enumerate(plan.meshes)]
