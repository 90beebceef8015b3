"""``rehearse --slow PATH=FACTOR[@STEP] --telemetry DIR --rebalance``: a stage slowed from a step
on, the runtime's telemetry written from the CPU ranks, and the replicas' shares moved live;
the bad ``--slow`` values refused naming the flag (tier 1 unless marked)."""

from __future__ import annotations

import statistics

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hetero.cli import main
from megatron_hetero.cost.profile_file import load_profile
from megatron_hetero.emulate.rehearse import RehearsalConfig, rehearse
from megatron_hetero.emulate.slow import SlowStage, parse_slow, slowdown_at
from megatron_hetero.emulate.telemetry import REPORTED_FROM, ShareSchedule
from megatron_hetero.emulate.trainer import sample_index
from megatron_hetero.errors import HeteroError, SchemaError
from megatron_hetero.plan import Slot, load_any_plan, plan_from_data
from megatron_hetero.telemetry.rebalance import RebalancePolicy
from megatron_hetero.telemetry.records import read_records

from ..conftest import REPO, one_line_error
from .conftest import tiny_plan

MESH_PLAN = REPO / "examples/meshes/rehearse-plan.yaml"


def _plan_data(pipes, split=(2,)):
    model = {"name": "tiny", "num_layers": sum(split), "hidden_size": 256,
             "ffn_hidden_size": 688, "num_attention_heads": 8, "num_query_groups": 8,
             "vocab_size": 1000, "seq_length": 128}
    return {"format_version": 1, "model": model, "global_batch_size": sum(pipes),
            "precision": "fp16", "tensor_model_parallel_size": 1,
            "pipelines": [{"micro_batch_size": 1, "num_microbatches": m,
                           "stages": [{"device_type": "A100-SXM-80GB", "num_layers": n}
                                      for n in split]} for m in pipes]}


def test_slow_names_a_stage_as_the_telemetry_does():
    plan = plan_from_data(_plan_data([3, 3], split=(1, 1)))
    s = parse_slow("pipelines[1].stages[0]=2.5@4", plan, steps=6)
    assert (s.mesh, s.stage, s.replica, s.factor, s.from_step) == (0, 0, 1, 2.5, 4)
    assert parse_slow(" meshes[0].replicas[1].stages[1] = 3 ", plan, steps=6) == SlowStage(
        path="meshes[0].replicas[1].stages[1]", mesh=0, stage=1, replica=1, factor=3.0)
    slot = Slot(mesh=0, stage=0, replica=1, tensor_rank=0)
    both = [s, parse_slow("pipelines[1].stages[0]=2@5", plan, steps=6)]
    assert [slowdown_at(both, slot, n) for n in (3, 4, 5)] == [1.0, 2.5, 5.0]
    assert slowdown_at(both, Slot(mesh=0, stage=0, replica=0, tensor_rank=0), 6) == 1.0
    mesh = load_any_plan(MESH_PLAN)  # the T4 mesh has one replica: its telemetry path names it
    assert (parse_slow("meshes[1].stages[0]=2", mesh, steps=3).replica,
            parse_slow("meshes[0].replicas[1].stages[0]=2", mesh, steps=3).replica) == (0, 1)


@pytest.mark.parametrize("value,expected", [
    ("pipelines[1].stages[0]", "expected PATH=FACTOR[@STEP]"),
    ("pipelines[2].stages[0]=2", "found 'pipelines[2].stages[0]'; expected a stage of one "
                                 "replica of the plan: pipelines[0].stages[0]"),
    ("meshes[0].stages[0]=2", "found 'meshes[0].stages[0]'; expected a stage of one replica"),
    ("pipelines[1].stages[0]=fast", "found 'fast'; expected FACTOR a number"),
    ("pipelines[1].stages[0]=0.5", "found 0.5; expected FACTOR a number from 1 to 100"),
    ("pipelines[1].stages[0]=nan", "expected FACTOR a finite number"),
    ("pipelines[1].stages[0]=1e9", "expected FACTOR a number from 1 to 100"),
    ("pipelines[1].stages[0]=2@0", "found 0; expected STEP a step of the rehearsal, 1 to 4"),
    ("pipelines[1].stages[0]=2@9", "found 9; expected STEP a step of the rehearsal, 1 to 4"),
    ("pipelines[1].stages[0]=2@x", "found 'x'; expected STEP a whole number"),
])
def test_a_bad_slow_is_one_message_naming_the_flag(tmp_path, capsys, value, expected):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(_plan_data([3, 3])))
    assert main(["rehearse", str(path), "--steps", "4", "--slow", value]) == 1
    err = one_line_error(capsys, "rehearse")
    assert "--slow: " in err and expected in err


@pytest.mark.parametrize("args,expected", [
    (["--rebalance"], "--hetero-rebalance needs at least two replicas"),
    (["--rebalance-patience", "3"], "--rebalance-patience: given without --rebalance"),
    (["--rebalance", "--rebalance-threshold", "1"], "--rebalance-threshold: found 1.0"),
    (["--telemetry", "x", "--telemetry-interval", "0"], "--telemetry-interval: found 0"),
])
def test_bad_live_flags_are_one_message(tmp_path, capsys, args, expected):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(_plan_data([3], split=(1, 1))
                                   if args == ["--rebalance"] else _plan_data([3, 3])))
    assert main(["rehearse", str(path), "--steps", "3", *args]) == 1
    assert expected in one_line_error(capsys, "rehearse")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_sample_is_read_once_across_changes_of_shares(data):
    """Any sequence of share switches on the rehearsal's schedule: each step's global batch is
    read whole, each sample once, by the replicas' micro-batches (the trainer's data order)."""
    d = data.draw(st.integers(2, 4), label="replicas")
    mbs = data.draw(st.integers(1, 3), label="micro_batch_size")
    total = data.draw(st.integers(d, 4 * d), label="micro-batches")
    shares = _split(data, total, d)
    plan = tiny_plan([2], [(mbs, m) for m in shares])
    schedule = ShareSchedule(plan=plan)
    steps = data.draw(st.integers(2, 6), label="steps")
    switch_at = {s: _split(data, total, d) for s in data.draw(
        st.sets(st.integers(1, steps - 1), max_size=3), label="switch steps")}
    for step in range(steps):
        if step in switch_at:
            schedule.switch(from_step=step, shares=switch_at[step])
        now = schedule.plan_at(step)
        read = [sample_index(now, Slot(mesh=0, stage=0, replica=r, tensor_rank=0), step, k, row)
                for r, p in enumerate(now.pipelines) for k in range(p.num_microbatches)
                for row in range(mbs)]
        g = plan.global_batch_size
        assert sorted(read) == list(range(step * g, (step + 1) * g))
        expected = switch_at.get(max((s for s in switch_at if s <= step), default=-1), shares)
        assert [p.num_microbatches for p in now.pipelines] == expected
    with pytest.raises(ValueError, match="has begun"):
        schedule.switch(from_step=steps - 1, shares=shares)


def _split(data, total: int, d: int) -> list[int]:
    cuts = sorted(data.draw(st.lists(st.integers(1, total - 1), min_size=d - 1, max_size=d - 1,
                                     unique=True))) if total > d else list(range(1, d))
    edges = [0, *cuts, total]
    return [b - a for a, b in zip(edges, edges[1:])]


@pytest.mark.slow
def test_a_rehearsal_that_rebalances_mid_way_trains_as_one_process_and_reports_itself(tmp_path):
    """PP=2 x DP=2 (4 CPU ranks), stage 0 of replica 1 six times slower from step 2, a drift on
    two reports in a row (steps 2 and 3) moves the shares from 3:3 at step 4 (the step after
    the decision; one report is not enough: the first steps after the warm-up are noisy on a
    busy machine), the losses and final
    parameters equal one process's (fp32, rtol 1e-5), every sample is read once (the trainer
    asserts the global loss over every token), and the telemetry written from the ranks is the
    rehearsal's own measurement: its step times are the report's, its stages' compute encloses
    the emulated busy time, and its micro-batch counts follow the switch."""
    plan = plan_from_data(_plan_data([3, 3], split=(1, 1)))
    out = tmp_path / "telemetry"
    slow = parse_slow("pipelines[1].stages[0]=6@2", plan, steps=5)
    config = RehearsalConfig(steps=5, hidden_size=16, slow=[slow], telemetry=out,
                             rebalance=RebalancePolicy(patience=2))
    result = rehearse(plan, config, verify=True)
    assert result.verify_message is None
    moves = [n for n in result.rebalance if n.shares is not None]
    assert moves and moves[0].from_step == 4, [n.message for n in result.rebalance]
    assert moves[0].shares[0] > moves[0].shares[1]

    records = read_records(out)
    assert [r.step for r in records] == list(range(REPORTED_FROM, 6))
    assert [r.step_time_s for r in records] == result.step_times
    shares = [3, 3]
    for rec in records:
        for m in moves:
            if rec.step >= m.from_step:
                shares = m.shares
        assert [s.micro_batches for s in rec.stages if s.stage == 0] == shares, rec.step
        assert rec.predicted_step_time_s > 0 and "emulated cluster" in rec.prediction
        assert [len(s.ops) for s in rec.stages] == [2 * s.micro_batches for s in rec.stages]
    assert [m.shares for m in moves] == [r.rebalance.shares for r in records
                                         if r.rebalance and r.rebalance.shares]
    for st_ in result.stages:  # mean over the reported steps, as the report takes them
        rows = [s for r in records for s in r.stages
                if (s.replica, s.stage) == (st_.pipeline, st_.stage)]
        # the telemetry's spans enclose the emulation's timers (no bound on the time between
        # them: a loaded machine may stretch it), inside the step
        compute = statistics.fmean(s.measured.compute_s for s in rows)
        sync = statistics.fmean(s.measured.sync_s + s.measured.optimizer_s for s in rows)
        assert st_.busy_s <= compute and st_.sync_s <= sync, (st_, compute, sync)
        assert compute + sync <= result.step_s * (1 + 1e-9), (st_, compute, sync)
    assert load_any_plan(out / "plan.yaml") == result.plan
    profile = load_profile(out / "profile.A100-SXM-80GB.yaml")
    assert profile.data.model == result.plan.model
    assert profile.data.timing.method == "run-telemetry"


def test_a_chain_of_meshes_refuses_rebalancing_at_start():
    with pytest.raises(HeteroError, match="chain of meshes"):
        rehearse(load_any_plan(MESH_PLAN), RehearsalConfig(rebalance=RebalancePolicy()))


def test_slow_stage_checks_its_own_fields():
    with pytest.raises(SchemaError, match="--slow: found 0; expected STEP"):
        SlowStage(path="p", mesh=0, stage=0, replica=0, factor=2.0, from_step=0)
