"""A two-vendor mesh plan (issue 28) on CPU ranks: an A100 mesh (TP 1, DP 2) bridged to an
MI300X mesh (TP 2), the bridge the vendor boundary, trains equal to one process (fp32, rtol
1e-5, 3 steps, Adam with clipping, plain and distributed optimizer). On CPU ranks every group is
gloo and every tensor is on the host, so this checks that the CPU trainer (and ``rehearse``)
runs such a plan, not a staging through host memory: no runtime stages a bridge between vendors
on devices yet, and Megatron-LM's path refuses the plan (tests/test_plan_mesh_vendors.py)."""

from __future__ import annotations

import pytest

from ..conftest import evaluate_under, evaluated
from ..mcore.tiny_mesh_plans import tiny_mesh_plan

pytestmark = pytest.mark.slow  # spawns 4 ranks twice and one process once

CLIP = 0.05


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    plan = tiny_mesh_plan(tmp_path_factory.mktemp("vendors"), [(1, 2), (2, 1)],
                          device_types={0: "A100-SXM-80GB", 1: "MI300X-192GB"})
    return evaluate_under("from tests.emulate.mesh_cases import train_against_one_process",
                          {"vendors": f"train_against_one_process({plan!r}, {CLIP!r})"},
                          timeout=300)


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
