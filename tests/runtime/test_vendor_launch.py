"""A plan across vendors trains through megatron.training's pretrain on CPU ranks, each playing
its plan GPU (A100: NVIDIA, MI300X: AMD): the pipeline edge between the vendors goes through
host buffers on its gloo group (counted), every other group on the vendor's, and training equals
one replica of one vendor in fp32: 4 steps, every logged loss and the final checkpoint's
parameters and Adam state."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hetero.plan import plan_from_data, save_plan

from .launching import launch, logged_losses
from .plans import A100, make_plan
from .test_launch import (INTERLEAVED_6, INTERLEAVED_CHUNKS, REORDERED_SUM_ATOL, SAVE_AT_END,
                          STEPS, TWO_STAGES_4, assert_same_final_checkpoint)

MI300X = "MI300X-192GB"


@pytest.fixture(autouse=True)
def _needs_mcore(mcore_env):
    return mcore_env


def test_two_vendor_uneven_plan_equals_one_vendor_replica(tmp_path, reference_run):
    """Stages of 1 and 2 layers on A100 then MI300X, two replicas of 2 x 1 and 1 x 2
    micro-batches (4 processes), train as the same stages on A100 then V100 with one replica
    running 4 micro-batches of 1 (2 processes, Megatron's own p2p)."""
    cross = tmp_path / "cross.yaml"
    save_plan(make_plan(split=(1, 2), devices=[[A100, MI300X]] * 2, replicas=[(1, 2), (2, 1)]),
              cross)
    iters = STEPS
    four = launch(4, str(cross), tmp_path, iters=iters, timeout=400,
                  extra=[a.format(work=tmp_path) for a in SAVE_AT_END])
    two, two_dir = reference_run(2, TWO_STAGES_4, iters=iters, extra=SAVE_AT_END)
    for code, out, _ in four + two:
        assert code == 0, out[-3000:]
    assert ("megatron-hetero: GPUs of 2 vendors: world group gloo, 2 pipeline edges across "
            "vendors staged through host memory") in four[0][1]
    # every activation forward and every gradient back crossed through host buffers:
    # ranks 0, 1 (A100) run 2 and 1 micro-batches per step, ranks 2, 3 (MI300X) the same
    per_step = [2, 1, 2, 1]
    assert [log["staged"] for _, _, log in four] == [[n * iters] * 2 for n in per_step]
    assert all("staged" not in log for _, _, log in two)
    got, want = logged_losses(four[3][1]), logged_losses(two[1][1])
    assert len(want) == iters and got == pytest.approx(want, rel=1e-5)
    assert_same_final_checkpoint(tmp_path, two_dir, tmp_path)


def test_interleaved_two_vendor_plan_equals_one_vendor_replica(tmp_path, reference_run):
    """Interleaved (PP=2, chunks of 1+1 and 2+1 layers): A100 and MI300X are each other's
    previous and next stage, every chunk boundary crosses vendors both ways; replicas of 4 and
    2 micro-batches train as one A100 + V100 replica running all 6."""
    cross = tmp_path / "cross.yaml"
    plan = make_plan(chunks=INTERLEAVED_CHUNKS, devices=[[A100, MI300X]] * 2,
                     replicas=[(1, 4), (1, 2)])
    save_plan(dataclasses.replace(plan, overlap_grad_reduce=True), cross)
    four = launch(4, str(cross), tmp_path, iters=STEPS, timeout=400,
                  extra=[a.format(work=tmp_path) for a in SAVE_AT_END])
    two, two_dir = reference_run(2, INTERLEAVED_6, iters=STEPS, extra=SAVE_AT_END)
    for code, out, _ in four + two:
        assert code == 0, out[-3000:]
    sends = [log["staged"][0] for _, _, log in four]
    recvs = [log["staged"][1] for _, _, log in four]
    # ranks 0 and 2 are replica 0's stages, 1 and 3 replica 1's: what one sends the other gets
    assert min(sends) > 0 and sends[0] == recvs[2] and sends[2] == recvs[0]
    assert sends[1] == recvs[3] and sends[3] == recvs[1] and sends[0] == 2 * sends[1]
    got, want = logged_losses(four[3][1]), logged_losses(two[1][1])
    assert len(want) == STEPS and got == pytest.approx(want, rel=1e-5)
    assert_same_final_checkpoint(tmp_path, two_dir, tmp_path, param_atol=REORDERED_SUM_ATOL)


def test_per_stage_warmup_across_vendors_trains_as_megatrons(tmp_path, reference_run):
    """The per-stage warm-up schedule (stage 0 warms up 3 micro-batches; its single isend and
    irecv reach the routed primitives) on A100 -> MI300X trains as Megatron's 1F1B on A100 ->
    V100."""
    plan = make_plan(split=(1, 2), devices=[[A100, MI300X]], replicas=[(1, 4)])
    data = plan.to_data()
    data["pipelines"][0]["stages"][0]["warmup_microbatches"] = 3
    warm = tmp_path / "warm.yaml"
    save_plan(plan_from_data(data), warm)
    ours = launch(2, str(warm), tmp_path, iters=STEPS,
                  extra=[a.format(work=tmp_path) for a in SAVE_AT_END])
    theirs, their_dir = reference_run(2, TWO_STAGES_4, iters=STEPS, extra=SAVE_AT_END)
    for code, out, _ in ours + theirs:
        assert code == 0, out[-3000:]
    assert "warm-up 3 micro-batches (Megatron's 1)" in ours[0][1]
    assert [log["staged"] for _, _, log in ours] == [[4 * STEPS] * 2] * 2  # 4 a step each way
    got, want = logged_losses(ours[1][1]), logged_losses(theirs[1][1])
    assert len(want) == STEPS and got == pytest.approx(want, rel=1e-5)
    assert_same_final_checkpoint(tmp_path, their_dir, tmp_path)
