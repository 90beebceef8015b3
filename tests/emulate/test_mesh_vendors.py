"""A two-vendor mesh plan (issue 28) on CPU ranks: an A100 mesh (TP 1, DP 2) bridged to an
MI300X mesh (TP 2), the bridge the vendor boundary, trains equal to one process (fp32, rtol
1e-5, 3 steps, Adam with clipping, plain and distributed optimizer); with two model chunks a
stage (interleaved 1F1B, the wrap-around bridge between vendors too) as well. The bridges
between vendors take the path devices take: a gloo group of their own, every message through
host buffers (megatron_hetero/mcore/bridge_groups.py; on CPU ranks the copies are host to host,
and tests/mcore/test_bridge_groups.py checks the group and counts the staged messages)."""

from __future__ import annotations

import pytest

from ..conftest import evaluate_under, evaluated
from ..mcore.tiny_mesh_plans import tiny_mesh_plan

pytestmark = pytest.mark.slow  # spawns 3-4 ranks four times and one process three times

CLIP = 0.05
VENDORS = {0: "A100-SXM-80GB", 1: "MI300X-192GB"}  # NCCL beside RCCL


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    plan = tiny_mesh_plan(tmp_path_factory.mktemp("vendors"), [(1, 2), (2, 1)],
                          device_types=VENDORS)
    chunks = tiny_mesh_plan(tmp_path_factory.mktemp("vendor-chunks"), [(1, 1), (2, 1)],
                            device_types=VENDORS, chunks={0: [[1, 1]], 1: [[1, 1]]})
    return evaluate_under("from tests.emulate.mesh_cases import train_against_one_process, "
                          "train_interleaved_against_one_process",
                          {"vendors": f"train_against_one_process({plan!r}, {CLIP!r})",
                           "chunks": f"train_interleaved_against_one_process({chunks!r}, "
                                     f"0.05, {CLIP!r})"},
                          timeout=600)


def test_two_vendor_mesh_plan_trains_equal_to_one_process(trained):
    got = evaluated(trained, "vendors")
    ref = got["reference"]
    assert ref["losses"][2] < ref["losses"][0]
    for optimizer in ("plain", "distributed"):
        run = got[optimizer]
        assert run["diverges"] is None, (optimizer, run["diverges"])
        assert len(run["grad_norms"]) == 4
        for norms in run["grad_norms"]:
            assert norms == pytest.approx(ref["grad_norms"], rel=1e-5), (optimizer, norms)


def test_two_vendor_mesh_plan_with_chunks_trains_equal_to_one_process(trained):
    """TP1 A100 -> TP2 MI300X, two chunks of one layer a stage: both bridges (the wrap-around
    too) between vendors; SGD and Adam with clipping, 3 steps, as tests/emulate/
    test_mesh_interleaved.py."""
    got = evaluated(trained, "chunks")
    for run in ("sgd", "adam"):
        r = got[run]
        assert r["diverges"] is None, (run, r["diverges"])
        assert r["reference"]["losses"][2] < r["reference"]["losses"][0]
        assert len(r["grad_norms"]) == 3
        for norms in r["grad_norms"]:
            assert norms == pytest.approx(r["reference"]["grad_norms"], rel=1e-5), (run, norms)
