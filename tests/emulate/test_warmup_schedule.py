"""The per-stage warm-up schedule (megatron_hetero.mcore.warmup_schedule) on CPU ranks, and the
rehearsal's link emulation (megatron_hetero.emulate.links).

- Each rank runs exactly the order of forwards and backwards that
  :func:`megatron_hetero.schedule.rules.stage_schedule` gives its stage, and training equals one
  process (losses rtol 1e-5, parameters rtol 1e-5 + atol 1e-5 as in test_equivalence) over 3
  steps: PP=3 with warm-ups 5, 3, 0 (Megatron: 2, 1, 0) under 0.05 s of link latency; PP=2 x
  DP=2 where only replica 0 asks for more (replica 1 runs Megatron's own schedule), with the
  overlapped gradient reduction and the distributed optimizer; TP=2 x PP=2 with micro-batches of
  2, the first stage warming up all 3.
- A message under link emulation takes its latency on both ends; 0.2 s of latency makes a step
  at least 0.2 s longer.
"""

from __future__ import annotations

import functools
import time

import pytest

from megatron_hetero.emulate.links import Link, emulate_links, plan_links
from megatron_hetero.emulate.trainer import (RankHooks, TrainConfig, compare_results,
                                             reference_plan, train_plan)
from megatron_hetero.hardware import inventory_from_data
from megatron_hetero.mcore.warmup_schedule import schedule_for
from megatron_hetero.plan import plan_from_data
from megatron_hetero.schedule.rules import stage_schedule

from .conftest import tiny_plan

RTOL, ATOL = 1e-5, 1e-5


def _with_warmups(plan, counts):
    """``plan`` with ``counts[d][s]`` warm-up micro-batches (None: Megatron's)."""
    data = plan.to_data()
    for d, row in enumerate(counts):
        for s, w in enumerate(row):
            if w is not None:
                data["pipelines"][d]["stages"][s]["warmup_microbatches"] = w
    return plan_from_data(data)


PLANS = {
    "pp3_warmup_5_3_0": _with_warmups(tiny_plan([2, 2, 2], [(1, 6)]), [[5, 3, 0]]),
    "pp2_dp2_one_replica_warms_up": _with_warmups(
        tiny_plan([1, 5], [(1, 4), (1, 2)], overlap_grad_reduce=True,
                  use_distributed_optimizer=True), [[4, 1], [None, None]]),
    "tp2_pp2_warmup_3_0": _with_warmups(tiny_plan([2, 4], [(2, 3)], tp=2), [[3, None]]),
}
LATENCY = {"pp3_warmup_5_3_0": 0.05, "pp2_dp2_one_replica_warms_up": 0.0,
           "tp2_pp2_warmup_3_0": 0.02}


def _uniform_links(plan, latency_s: float) -> dict:
    """Every pipeline pair of ``plan`` on a fast link with ``latency_s`` per message."""
    tp = plan.tensor_model_parallel_size
    inventory = inventory_from_data({"groups": [{"gpu": "A100-SXM-80GB", "nodes": plan.world_size,
                                                 "gpus_per_node": tp}]})
    return plan_links(plan, inventory, latency_s=latency_s)


def recording_hooks(plan, rank, *, latency_s: float = 0.0):
    """Hooks that record the kinds of the rank's compute steps, one list per step (the k-th
    forward of a step is micro-batch k's, and so is the k-th backward); with ``latency_s`` the
    rank's pipeline messages wait that long."""
    if latency_s:
        emulate_links(_uniform_links(plan, latency_s), rank)
    steps: list[list[str]] = [[]]
    counts = {"forward": 0, "backward": 0}

    class _Record:
        def __init__(self, kind):
            self.kind = kind

        def __enter__(self):
            steps[-1].append(f"{self.kind[0].upper()}{counts[self.kind]}")
            counts[self.kind] += 1

        def __exit__(self, *exc):
            return False

    def on_step_end(step, wall_s):
        steps.append([])
        counts.update(forward=0, backward=0)

    return RankHooks(compute=_Record, on_step_end=on_step_end, report=lambda: steps[:-1])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PLANS))
def test_ranks_run_the_planned_order_and_train_as_one_process(name):
    plan = PLANS[name]
    config = TrainConfig(steps=3, use_distributed_optimizer=None)
    result = train_plan(plan, config, hooks_factory=functools.partial(
        recording_hooks, latency_s=LATENCY[name]))
    for r in result.ranks:
        want = list(stage_schedule(plan, r.pipeline, r.stage).ops)
        assert r.extra == [want] * config.steps, (r.pipeline, r.stage)
    reference = train_plan(reference_plan(plan), TrainConfig(steps=3))
    assert compare_results(result, reference, rtol=RTOL, atol=ATOL) is None


def test_only_replicas_that_ask_run_the_warmup_schedule():
    plan = PLANS["pp2_dp2_one_replica_warms_up"]

    def megatron(**kw):
        return "megatron"

    ours = schedule_for(plan, 0, megatron)
    assert ours is not megatron and ours.warmups == (4, 1)
    assert ours(forward_only=True) == "megatron"  # evaluation runs Megatron's
    assert schedule_for(plan, 1, megatron) is megatron
    plain = tiny_plan([1, 5], [(1, 4)])
    assert schedule_for(plain, 0, megatron) is megatron
    interleaved = tiny_plan(None, [(1, 4)], chunks=[[1, 1], [3, 1]])
    assert schedule_for(interleaved, 0, megatron) is megatron


def test_plan_links_follow_the_inventory():
    plan = tiny_plan([2, 2, 2], [(1, 2), (1, 2)])
    inventory = inventory_from_data({
        "groups": [{"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 4},
                   {"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 2,
                    "intra_node_bandwidth_gb_s": 300}],
        "inter_group_bandwidth_gb_s": 0.125})
    links = plan_links(plan, inventory, latency_s=1e-5, time_stretch=2.0, bytes_ratio=0.5)
    # ranks t + DP*s: stages 0 and 1 of both pipelines fill group 0's node, stage 2 group 1's
    assert set(links) == {(0, 2), (2, 0), (2, 4), (4, 2), (1, 3), (3, 1), (3, 5), (5, 3)}
    nvlink = inventory.spec("A100-SXM-80GB").intra_node_bandwidth_gb_s
    assert links[(0, 2)] == Link(bandwidth_bytes_s=nvlink * 1e9 * 0.5 / 2, latency_s=2e-5)
    assert links[(2, 4)] == Link(bandwidth_bytes_s=0.125e9 * 0.5 / 2, latency_s=2e-5)
    assert links[(2, 4)].seconds(1e6) == pytest.approx(1e6 / 31.25e6 + 2e-5)


def _timed_messages(rank, world_size, latency_s):
    """Rank 0 sends rank 1 one activation through megatron-core's P2PCommunicator; both time
    their call."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from megatron_hetero.mcore.cpu_backend import enable_cpu_backend

    enable_cpu_backend()
    if latency_s:
        emulate_links({(0, 1): Link(bandwidth_bytes_s=1e12, latency_s=latency_s),
                       (1, 0): Link(bandwidth_bytes_s=1e12, latency_s=latency_s)}, rank)
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        comm = P2PCommunicator(ps.get_pipeline_model_parallel_group(),
                               ModelParallelConfig(pipeline_dtype=torch.float32,
                                                   pipeline_model_parallel_size=2))
        torch.distributed.barrier()
        t0 = time.monotonic()
        if rank == 0:
            comm.send_forward(torch.arange(8.0).view(2, 1, 4), is_last_stage=False)
            got = None
        else:
            got = comm.recv_forward((2, 1, 4), is_first_stage=False).detach().clone()
        return time.monotonic() - t0, got
    finally:
        ps.destroy_model_parallel()


@pytest.mark.slow
def test_link_emulation_delays_each_message_on_both_ends():
    from megatron_hetero.mcore.spawn import spawn

    slow = spawn(_timed_messages, 2, args=(0.2,))
    fast = spawn(_timed_messages, 2, args=(0.0,))
    # each end waits at least the latency the link owes (a sleep: no load shortens it); how
    # fast the same message is without it is a timing, not checked
    assert all(seconds >= 0.2 for seconds, _ in slow)
    assert fast[1][1].flatten().tolist() == [float(i) for i in range(8)]
    assert slow[1][1].flatten().tolist() == [float(i) for i in range(8)]


def _latency_hooks(plan, rank, *, latency_s):
    if latency_s:
        emulate_links(_uniform_links(plan, latency_s), rank)
    return RankHooks()


@pytest.mark.slow
def test_link_latency_makes_a_step_longer():
    plan = tiny_plan([1, 5], [(1, 2)])
    config = TrainConfig(steps=3, gather_params=False, eval_forward_only=False)
    steps = {}
    for latency in (0.0, 0.2):
        result = train_plan(plan, config, hooks_factory=functools.partial(_latency_hooks,
                                                                          latency_s=latency))
        steps[latency] = min(max(r.step_times[k] for r in result.ranks) for k in range(1, 3))
    # the first activation and the last gradient both cross the link on the critical path
    assert steps[0.2] >= steps[0.0] + 0.2


def _rehearsal_files(tmp_path, inter_group_gb_s: float):
    """A 2-stage plan (A100 then V100, 4 micro-batches, the A100 stage warming up 3) and an
    inventory that joins the two types by ``inter_group_gb_s``."""
    import yaml

    plan = _with_warmups(tiny_plan([2, 2], [(1, 4)], hidden_size=256, num_attention_heads=8,
                                   ffn_hidden_size=688, vocab_size=1000, seq_length=256),
                         [[3, None]])
    data = plan.to_data()
    data["pipelines"][0]["stages"][1]["device_type"] = "V100-SXM2-32GB"
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump({
        "groups": [{"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 1},
                   {"gpu": "V100-SXM2-32GB", "nodes": 1, "gpus_per_node": 1}],
        "inter_group_bandwidth_gb_s": inter_group_gb_s}))
    return str(tmp_path / "plan.yaml"), str(tmp_path / "inventory.yaml")


def test_rehearse_emulate_links_needs_the_inventory(tmp_path, capsys):
    from megatron_hetero.cli import main

    plan, _ = _rehearsal_files(tmp_path, 1.0)
    assert main(["rehearse", plan, "--emulate-links"]) == 1
    assert "--emulate-links) needs the inventory (--inventory)" in capsys.readouterr().err


@pytest.mark.slow
def test_rehearse_with_emulated_links_runs_the_warmup_plan_exactly(tmp_path, capsys):
    """The rehearsal of a plan with extra warm-up over a 1 GB/s link between its two GPU types,
    links emulated: it reports the links and --verify matches one process."""
    from megatron_hetero.cli import main

    plan, inventory = _rehearsal_files(tmp_path, 1.0)
    assert main(["rehearse", plan, "--inventory", inventory, "--emulate-links", "--steps", "2",
                 "--hidden-size", "32", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "links: emulated from the inventory, scaled" in out
    assert "verify: losses and final parameters match" in out


def test_prediction_takes_the_emulated_links():
    """predict(links=...): a pipeline message costs its emulated link's time for the shrunk
    fp32 message, or gloo's where that is longer, and a link as slow as a stage's step slows
    Megatron's 1F1B more than the warm-up that hides it."""
    from megatron_hetero.emulate.calibration import Calibration
    from megatron_hetero.emulate.prediction import predict

    plan = tiny_plan([2, 2], [(1, 8)])
    calibration = Calibration(layer_flops_per_s=1e9, allreduce_gb_s=1.0, p2p_latency_s=1e-4,
                              parts={(part, 1): (1e-2, 2e-2)
                                     for part in ("layer", "embedding", "output")})
    factors = {"A100-SXM-80GB": 1.0}
    message = 4.0 * 1 * plan.model.seq_length * plan.model.hidden_size
    slow = Link(bandwidth_bytes_s=message / 0.1, latency_s=0.02)  # 0.12 s a message
    links = {(0, 1): slow, (1, 0): slow}
    fast = {(0, 1): Link(bandwidth_bytes_s=1e15, latency_s=0.0),
            (1, 0): Link(bandwidth_bytes_s=1e15, latency_s=0.0)}
    gloo = predict(plan, calibration, factors).step_time_s
    assert predict(plan, calibration, factors, links=fast).step_time_s == pytest.approx(gloo)
    megatron = predict(plan, calibration, factors, links=links).step_time_s
    assert megatron > gloo + 2 * 0.12  # at least the fill and the drain cross it
    warm = predict(_with_warmups(plan, [[4, None]]), calibration, factors, links=links)
    assert warm.step_time_s < megatron
