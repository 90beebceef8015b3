"""Per-stage warm-up (tier 1): the plan field and its rules, the order of one stage's forwards and
backwards, and the message program of the runtime's schedule checked for deadlock."""

from __future__ import annotations

import copy

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hetero.cli import main
from megatron_hetero.schedule.order import rank_order
from megatron_hetero.errors import SchemaError
from megatron_hetero.plan import load_plan, plan_from_data, save_plan
from megatron_hetero.schedule.rules import (has_extra_warmup, megatron_warmup, one_f_one_b,
                                            pipeline_warmups, stage_program, stage_schedule)

from .conftest import EXAMPLE_PLANS, REPO

BASE = yaml.safe_load((REPO / "tests/data/plan_a100_v100.yaml").read_text())


def _four_stages(counts, *, m=(8, 6)):
    """BASE as 4 stages of 8 layers; ``counts[d][s]`` the warm-up of stage s of pipeline d (None:
    left out)."""
    data = copy.deepcopy(BASE)
    data["global_batch_size"] = sum(m)
    for d, pipe in enumerate(data["pipelines"]):
        pipe["num_microbatches"] = m[d]
        pipe["stages"] = [dict(pipe["stages"][0], num_layers=8) for _ in range(4)]
        for s, w in enumerate(counts[d]):
            if w is not None:
                pipe["stages"][s]["warmup_microbatches"] = w
    return data


def test_order_of_a_stage():
    assert one_f_one_b(4, 1) == ("F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3")
    assert one_f_one_b(3, 3) == ("F0", "F1", "F2", "B0", "B1", "B2")
    assert one_f_one_b(2, 0) == ("F0", "B0", "F1", "B1")
    with pytest.raises(ValueError):
        one_f_one_b(2, 3)


@pytest.mark.parametrize("p, m", [(1, 3), (2, 1), (3, 2), (4, 8), (5, 4)])
def test_megatron_default_is_the_simulators_1f1b(p, m):
    """Without the field, the order is the simulator's twin of Megatron's 1F1B."""
    for s in range(p):
        mine = one_f_one_b(m, megatron_warmup(p, s, m))
        theirs = tuple(f"{'FB'[k]}{i}" for k, i, _ in rank_order(p, s, m))
        assert mine == theirs


def test_stage_schedule_takes_the_plans_counts(tmp_path):
    plan = plan_from_data(_four_stages([[6, 3, 2, 0], [None] * 4]))
    sched = stage_schedule(plan, 0, 0)
    assert (sched.warmup, sched.megatron_warmup, sched.extra) == (6, 3, 3)
    assert sched.ops[:8] == ("F0", "F1", "F2", "F3", "F4", "F5", "F6", "B0")
    assert stage_schedule(plan, 0, 3).ops == one_f_one_b(8, 0)
    assert pipeline_warmups(plan.pipelines[1]) == [3, 2, 1, 0]  # Megatron's
    assert has_extra_warmup(plan.pipelines[0]) and not has_extra_warmup(plan.pipelines[1])
    save_plan(plan, tmp_path / "p.yaml")
    assert load_plan(tmp_path / "p.yaml") == plan
    written = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert written["pipelines"][0]["stages"][0]["warmup_microbatches"] == 6
    assert "warmup_microbatches" not in written["pipelines"][1]["stages"][0]


def test_plans_without_the_field_load_and_write_as_before(tmp_path):
    for path in EXAMPLE_PLANS + [REPO / "tests/data/plan_a100_v100.yaml"]:
        plan = load_plan(path)
        assert all(s.warmup_microbatches is None for p in plan.pipelines for s in p.stages)
        assert "warmup_microbatches" not in yaml.safe_dump(plan.to_data())


@pytest.mark.parametrize("counts, path, phrase", [
    # more warm-up than the replica has micro-batches
    ([[9, 3, 2, 0], [None] * 4], r"pipelines\[0\]\.stages\[0\]\.warmup_microbatches",
     r"found 9; expected at most 8, the micro-batches of pipelines\[0\] \(num_microbatches\)"),
    ([[None] * 4, [4, 3, 2, 7]], r"pipelines\[1\]\.stages\[3\]\.warmup_microbatches",
     r"found 7; expected at most 6, the micro-batches of pipelines\[1\]"),
    # below Megatron's default
    ([[2, None, None, None], [None] * 4], r"pipelines\[0\]\.stages\[0\]\.warmup_microbatches",
     r"found 2; expected at least 3: stage 1 warms up 2, and each stage warms up at least one "
     r"more micro-batch than the next, or all 8"),
    ([[None, None, None, -1], [None] * 4], r"pipelines\[0\]\.stages\[3\]\.warmup_microbatches",
     "found -1; expected at least 0"),
    # an earlier stage left at Megatron's default below a later stage's extra warm-up
    ([[None, 4, None, None], [None] * 4], r"pipelines\[0\]\.stages\[0\]\.warmup_microbatches",
     r"found nothing \(Megatron's default 3\); expected at least 5: stage 1 warms up 4"),
    ([[5, 5, 1, 0], [None] * 4], r"pipelines\[0\]\.stages\[0\]\.warmup_microbatches",
     "found 5; expected at least 6"),
])
def test_bad_warmup_names_the_field(counts, path, phrase):
    with pytest.raises(SchemaError, match=path + ": " + phrase):
        plan_from_data(_four_stages(counts))


def test_warmup_is_capped_by_the_micro_batches_and_may_reach_them():
    plan = plan_from_data(_four_stages([[6, 6, 6, 5], [6, 5, 4, 3]], m=(6, 6)))
    assert pipeline_warmups(plan.pipelines[0]) == [6, 6, 6, 5]
    assert stage_schedule(plan, 0, 0).ops == one_f_one_b(6, 6)  # every forward, then backwards


def test_interleaved_and_single_stage_plans_refuse_it():
    data = copy.deepcopy(BASE)
    data["virtual_pipeline_size"] = 2
    for pipe in data["pipelines"]:
        for stage, chunks in zip(pipe["stages"], ([6, 8], [10, 8])):
            stage["chunk_layers"] = chunks
        pipe["stages"][0]["warmup_microbatches"] = 3
    with pytest.raises(SchemaError, match=r"pipelines\[0\]\.stages\[0\]\.warmup_microbatches: "
                       r"found 3; expected absent: a plan of one pipeline grid with model chunks "
                       r"\(2 a stage\) runs Megatron's own interleaved schedule"):
        plan_from_data(data)
    data = copy.deepcopy(BASE)
    for pipe in data["pipelines"]:
        pipe["stages"] = [dict(pipe["stages"][0], num_layers=32)]
    data["precision"] = "bf16"
    data["pipelines"][1]["stages"][0]["warmup_microbatches"] = 2
    with pytest.raises(SchemaError, match=r"pipelines\[1\]\.stages\[0\]\.warmup_microbatches: "
                                          r"found 2; expected absent or 0"):
        plan_from_data(data)


def test_validate_prints_the_field_path(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(_four_stages([[9, 3, 2, 0], [None] * 4])))
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}: pipelines[0].stages[0].warmup_microbatches: found 9; expected at most 8" in err


# -- the message program: no deadlock under a transport that pairs each link's messages in order --
def run_programs(warmups, m):
    """Run every stage's :func:`stage_program` against a strict transport: each link is one
    queue per end, the k-th message one end posts pairs with the k-th the other end posts (they
    must be the same message), and completes once both ends posted it and the link's earlier
    messages completed. Posting never blocks; waits block until the message completed. Returns
    the ops each stage ran, or raises AssertionError naming where it stuck."""
    p = len(warmups)
    progs = [stage_program(warmups, s, m) for s in range(p)]
    pc = [0] * p
    queues = {(s, end): [] for s in range(p - 1) for end in ("up", "down")}  # link s = (s, s+1)
    done = {s: 0 for s in range(p - 1)}  # messages completed per link
    ran = [[] for _ in range(p)]
    where = {}  # (stage, message) -> (link, position)

    def post(s, link, end, msg):
        queues[(link, end)].append(msg)
        where[(s, msg)] = (link, len(queues[(link, end)]) - 1)

    def settle():
        for link in done:
            up, down = queues[(link, "up")], queues[(link, "down")]
            while done[link] < min(len(up), len(down)):
                k = done[link]
                assert up[k] == down[k], f"link {link} pairs {up[k]} with {down[k]}"
                done[link] += 1

    def completed(s, msg):
        link, k = where[(s, msg)]
        return done[link] > k

    progress = True
    while progress:
        progress = False
        settle()
        for s in range(p):
            while pc[s] < len(progs[s]):
                kind, i = progs[s][pc[s]]
                if kind == "post_recv_prev" or kind == "send_prev":
                    post(s, s - 1, "down", ("A" if kind == "post_recv_prev" else "G", i))
                elif kind == "send_next" or kind == "post_recv_next":
                    post(s, s, "up", ("A" if kind == "send_next" else "G", i))
                elif kind in ("wait_prev", "wait_next"):
                    if not completed(s, ("A" if kind == "wait_prev" else "G", i)):
                        break
                else:
                    ran[s].append(f"{'F' if kind == 'forward' else 'B'}{i}")
                pc[s] += 1
                progress = True
                settle()
    stuck = {s: progs[s][pc[s]] for s in range(p) if pc[s] < len(progs[s])}
    assert not stuck, f"deadlock: stages stuck at {stuck}"
    assert all(done[link] == 2 * m for link in done)  # every message went through
    return ran


@st.composite
def valid_warmups(draw):
    p, m = draw(st.integers(1, 6)), draw(st.integers(1, 10))
    counts = [draw(st.integers(0, min(m, 2)))]
    for _ in range(p - 1):
        counts.insert(0, draw(st.integers(min(counts[0] + 1, m), m)))
    return counts, m


@settings(max_examples=300, deadline=None)
@given(case=valid_warmups())
def test_program_runs_the_order_without_deadlock(case):
    warmups, m = case
    ran = run_programs(warmups, m)
    for s, w in enumerate(warmups):
        assert tuple(ran[s]) == one_f_one_b(m, w)


def test_megatron_default_and_harp_counts_run():
    run_programs([megatron_warmup(5, s, 8) for s in range(5)], 8)
    run_programs([7, 4, 3, 1, 0], 8)  # delta 3 across one boundary, 2 and 1 elsewhere


def test_the_checker_finds_a_deadlock():
    """Warm-ups that rise along the pipeline (which the plan refuses) post a link's messages in
    different orders at its two ends, and would deadlock."""
    with pytest.raises(AssertionError, match=r"link 0 pairs \('G', 0\) with \('A', 1\)"):
        run_programs([0, 1], 3)
