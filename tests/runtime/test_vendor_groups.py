"""Process groups of a plan across vendors: every group Megatron-core 0.17.1 builds
(``initialize_model_parallel``) and the pipeline-edge groups get the backend their ranks share;
``torch.distributed.new_group`` is intercepted on every rank (a fake world, no devices) to see
the backend asked for each group."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

import pytest

from megatron_hetero.errors import HeteroError
from megatron_hetero.plan import save_plan
from megatron_hetero.runtime import vendors

from ..conftest import mcore_environ
from .plans import A100, H100, make_plan

MI300X = "MI300X-192GB"

_CHECKER = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from megatron.core import parallel_state
    from megatron_hetero.plan import load_plan
    from megatron_hetero.runtime import hooks, vendors
    from megatron_hetero.runtime.core_run import CoreBackend, CoreRankState

    original = dist.new_group

    def new_group(*a, **kw):  # record, then build it on the fake world
        asked[-1].append([sorted(kw.get("ranks") or range(plan.world_size)), kw.get("backend")])
        kw["backend"], kw["pg_options"] = None, None
        return original(*a, **kw)

    dist.new_group = new_group
    runtime = hooks.install()
    every = []
    for path in sys.argv[1:]:  # one plan after the other
        plan = load_plan(path)
        asked, out = [], []
        for rank in range(plan.world_size):
            asked.append([])
            dist.init_process_group("fake", store=FakeStore(), rank=rank,
                                    world_size=plan.world_size)
            groups = vendors.groups_for(plan, cpu_backend=False)  # what validate_args prepares
            runtime.backend = CoreBackend(vendor_groups=groups, state=CoreRankState(
                plan=plan, plan_path=path, launcher_rank=rank, megatron_rank=rank,
                device_type=plan.device_type_of_rank(rank), slot=plan.slot_of_rank(rank)))
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=plan.tensor_model_parallel_size,
                pipeline_model_parallel_size=plan.pipeline_model_parallel_size,
                distributed_timeout_minutes=1)
            router = groups.routes if groups else None
            out.append({"staged_peers": sorted(p for p, e in router.edges.items() if e.staged)
                        if router else None,
                        "device_peers": sorted(p for p, e in router.edges.items()
                                               if not e.staged) if router else None,
                        "choices": len(groups.choices) if groups else 0})
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        every.append({"asked": asked, "ranks": out})
    print("RESULT" + json.dumps(every))
""")

# The plans of the tests below; the one of a single vendor first (its groups are Megatron's own:
# the hooks call straight through).
PLANS = {
    "one-vendor": make_plan(split=(1, 1), devices=[[A100, H100]], replicas=[(1, 2)]),
    "tp2": make_plan(split=(1, 2), tp=2, devices=[[A100, MI300X]] * 2, replicas=[(1, 2), (2, 1)]),
    "three-stages": make_plan(split=(1, 1, 2), devices=[[A100, H100, MI300X]], replicas=[(1, 3)]),
}


@pytest.fixture(scope="module")
def groups(tmp_path_factory) -> dict:
    """``{plan: {"asked": [groups asked per rank], "ranks": [routes per rank]}}`` of every plan of
    ``PLANS``, one subprocess under the venv's megatron-core (0.19.2) for all of them."""
    root = tmp_path_factory.mktemp("vendor_groups")
    paths = []
    for name, plan in PLANS.items():
        paths.append(str(root / f"{name}.yaml"))
        save_plan(plan, paths[-1])
    proc = subprocess.run([sys.executable, "-c", _CHECKER, *paths], text=True,
                          capture_output=True, env=mcore_environ(), timeout=300 * len(paths))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(zip(PLANS, json.loads(proc.stdout.split("RESULT", 1)[1])))


def test_every_device_backend_group_is_one_vendors(groups):
    """TP=2, two pipelines of an A100 and an MI300X stage (uneven layers and replicas): 8 ranks.
    Every group asked on a device backend holds one vendor's ranks, every group across vendors
    is gloo, and every rank builds the same groups in the same order."""
    plan, got = PLANS["tp2"], groups["tp2"]
    vendor = vendors.rank_vendors(plan)
    assert vendor == ["NVIDIA"] * 4 + ["AMD"] * 4  # Megatron order tp-dp-pp
    first = got["asked"][0]
    assert all(seq == first for seq in got["asked"])  # the same groups, same order, every rank
    device = [(r, b) for r, b in first if b != "gloo"]
    across = [(r, b) for r, b in first if len({vendor[x] for x in r}) > 1]
    assert device and across
    for ranks, backend in device:
        assert len({vendor[r] for r in ranks}) == 1, ranks
        assert backend == "nccl"  # NVIDIA's NCCL and AMD's RCCL share the torch name
    for ranks, backend in across:
        assert backend == "gloo", ranks
    # the pipeline groups and edge groups cross (stage 0 rank r with stage 1 rank r + 4);
    # tensor- and data-parallel groups stay on the device backend
    assert [[0, 4], "gloo"] in first and [[1, 5], "gloo"] in first
    assert [[0, 1], "nccl"] in first and [[4, 6], "nccl"] in first  # TP group, DP group
    # each rank routes its one pipeline edge through host memory
    assert [r["staged_peers"] for r in got["ranks"]] == [[4], [5], [6], [7], [0], [1], [2], [3]]
    assert all(r["device_peers"] == [] for r in got["ranks"])


def test_an_edge_inside_one_vendor_stays_on_the_device_backend(groups):
    """A100 -> H100 -> MI300X: the NVIDIA edge's group is NCCL, the NVIDIA -> AMD edge's gloo."""
    got = groups["three-stages"]
    assert [r["staged_peers"] for r in got["ranks"]] == [[], [2], [1]]
    assert [r["device_peers"] for r in got["ranks"]] == [[1], [0], []]
    first = got["asked"][0]
    assert [[0, 1], "nccl"] in first and [[1, 2], "gloo"] in first
    assert [[0, 1, 2], "gloo"] in first  # the pipeline group spans both vendors


def test_a_one_vendor_plan_keeps_megatrons_backends(groups):
    got = groups["one-vendor"]
    backends = {b for seq in got["asked"] for _, b in seq}
    assert backends <= {None, "gloo"}  # what Megatron asked, untouched
    assert all(r["staged_peers"] is None and r["choices"] == 0 for r in got["ranks"])


def test_group_backend_and_world_group():
    plan = make_plan(split=(1, 1), devices=[[A100, MI300X]], replicas=[(1, 2)])
    assert vendors.group_backend(plan, None, asked=None) == "gloo"  # the world
    assert vendors.group_backend(plan, [1], asked=None) == "nccl"
    assert vendors.group_backend(plan, [0], asked="gloo") == "gloo"  # Megatron's gloo groups
    nvidia = make_plan(split=(1, 1), devices=[[A100, H100]], replicas=[(1, 2)])
    assert vendors.group_backend(nvidia, None, asked=None) is None
    args = argparse.Namespace(rank=1, distributed_backend="nccl", variable_seq_lengths=False,
                              use_ring_exchange_p2p=False)
    vendors.prepare(nvidia, args, source="p.yaml", cpu_backend=True)
    assert args.distributed_backend == "nccl"
    args.variable_seq_lengths = True
    with pytest.raises(HeteroError, match="--variable-seq-lengths"):
        vendors.prepare(plan, args, source="p.yaml", cpu_backend=True)
    args.variable_seq_lengths = False
    assert vendors.pipeline_edges(plan) == [(0, 1)]
