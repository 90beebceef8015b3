"""Interleaved (virtual) pipeline stages: Megatron's order, the simulator and the in-flight
activations, against cases worked by hand."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings, strategies as st

from megatron_hetero import models as M
from megatron_hetero.cost import CostModel, StageShape
from megatron_hetero.schedule.order import (peak_activations, peak_in_flight, rank_order,
                                             schedule_table, warmup_count)
from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.plan import ModelSpec, plan_from_data
from megatron_hetero.sim.step import simulate
from megatron_hetero.sim.pipeline import interleaved_1f1b, one_f_one_b

TINY = ModelSpec(name="tiny", num_layers=8, hidden_size=64, ffn_hidden_size=128,
                 num_attention_heads=4, num_query_groups=2, vocab_size=256, seq_length=16)
ROUND = {"ROUND": {"vendor": "test", "bf16_tflops": 1.0, "bf16": True, "fp32_tflops": 1.0,
                   "memory_gb": 1000, "memory_bandwidth_gb_s": 1e6, "intra_node_link": "x",
                   "intra_node_bandwidth_gb_s": 1e7, "efficiency": 1.0}}


def test_schedule_table_and_order_by_hand():
    # Megatron's comment: PP2, group 3, m 5, v 2 -> micro-batches 0 1 2 0 1 2 3 4 3 4
    assert schedule_table(5, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1),
                                       (3, 0), (4, 0), (3, 1), (4, 1)]
    # p 2, v 2, m 4, rank 0: warm-up (2 - 0 - 1) * 2 + (2 - 1) * 2 = 4 forwards, then 1F1B
    assert warmup_count(2, 0, 4, 2) == 4 and warmup_count(2, 1, 4, 2) == 2
    F, B = 0, 1
    assert rank_order(2, 0, 4, 2) == [
        (F, 0, 0), (F, 1, 0), (F, 0, 1), (F, 1, 1),
        (F, 2, 0), (B, 0, 1), (F, 3, 0), (B, 1, 1), (F, 2, 1), (B, 0, 0), (F, 3, 1), (B, 1, 0),
        (B, 2, 1), (B, 3, 1), (B, 2, 0), (B, 3, 0)]
    # v = 1 is plain 1F1B: p - r - 1 warm-up forwards
    assert rank_order(3, 0, 4) == [(F, 0, 0), (F, 1, 0), (F, 2, 0), (B, 0, 0), (F, 3, 0),
                                   (B, 1, 0), (B, 2, 0), (B, 3, 0)]


def test_peak_in_flight_by_hand():
    # rank 0 above, chunk 0 holding a0 = 3 bytes, chunk 1 a1 = 1: after F(2,0) 3 a0 + 2 a1 = 11,
    # after F(3,0) 4 a0 + a1 = 13, the peak
    assert peak_in_flight(rank_order(2, 0, 4, 2), [3.0, 1.0]) == 13.0
    assert peak_in_flight(rank_order(2, 0, 4, 2), [1.0, 1.0]) == 5.0  # warm-up + 1 chunks
    # rank 1: F(0,0) F(1,0) F(0,1) -> 2 a0 + a1 = 7; B(0,1) F(1,1) B(1,1) leave 2 a0, then
    # F(2,0) -> 3 a0 = 9, the peak
    assert peak_in_flight(rank_order(2, 1, 4, 2), [3.0, 1.0]) == 9.0
    assert peak_in_flight(rank_order(2, 1, 4, 2), [1.0, 5.0]) == 7.0  # 2 a0 + a1
    # v = 1: stage s of p holds min(p - s, m) micro-batches
    assert [peak_in_flight(rank_order(4, s, 8), [1.0]) for s in range(4)] == [4, 3, 2, 1]
    assert peak_in_flight(rank_order(4, 0, 2), [1.0]) == 2


def test_two_stage_interleaved_by_hand():
    # p 2, v 2, m 2, every chunk f = 1, b = 2, no sends. Stage 0 runs 4 warm-up forwards: F00
    # 0-1, F10 1-2, F01 2-3 (after F00 on stage 1, 1-2), F11 3-4. Stage 1: F00 1-2, F10 2-3,
    # F01 3-4, B01 4-6, F11 6-7, B11 7-9, B00 9-11 (after B01 on stage 0, 6-8), B10 11-13.
    # Stage 0: B01 6-8, B11 9-11, B00 11-13, B10 13-15: the step is 15, the closed form
    # (m v + p - 1)(f + b) for uniform chunks
    finish, busy, _, events = interleaved_1f1b([[1, 1], [1, 1]], [[2, 2], [2, 2]], [0, 0], [0, 0], 2,
                                               record=True)
    assert max(finish) == 15 and busy == [12, 12]
    s1 = [(k, i, c, a) for s, k, i, a, _, c in sorted(events, key=lambda e: e[3]) if s == 1]
    assert s1 == [("F", 0, 0, 1), ("F", 1, 0, 2), ("F", 0, 1, 3), ("B", 0, 1, 4),
                  ("F", 1, 1, 6), ("B", 1, 1, 7), ("B", 0, 0, 9), ("B", 1, 0, 11)]
    s0 = [(k, i, c, a) for s, k, i, a, _, c in sorted(events, key=lambda e: e[3]) if s == 0]
    assert s0[4:] == [("B", 0, 1, 6), ("B", 1, 1, 9), ("B", 0, 0, 11), ("B", 1, 0, 13)]


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 5), st.integers(2, 4), st.integers(1, 4), st.floats(0.1, 5),
       st.floats(0.1, 5))
def test_interleaved_uniform_chunks_closed_form(p, v, groups, f, b):
    # uniform chunks, no sends: the bubble shrinks v times, (m v + p - 1)(f + b) per chunk
    m = groups * p
    finish, busy, _, _ = interleaved_1f1b([[f] * v] * p, [[b] * v] * p, [0.0] * p, [0.0] * p, m)
    assert max(finish) == pytest.approx((m * v + p - 1) * (f + b))
    assert busy == pytest.approx([m * v * (f + b)] * p)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.tuples(st.floats(0.1, 5), st.floats(0.1, 5)), min_size=2, max_size=2),
                min_size=2, max_size=4),
       st.integers(1, 3), st.floats(0, 1))
def test_interleaved_dependencies_hold(stages, groups, send):
    p, v = len(stages), 2
    m = groups * p
    f = [[a for a, _ in chunks] for chunks in stages]
    b = [[c for _, c in chunks] for chunks in stages]
    finish, busy, _, events = interleaved_1f1b(f, b, [send] * p, [send] * p, m, record=True)
    end = {(s, k, i, c): e for s, k, i, _, e, c in events}
    start = {(s, k, i, c): a for s, k, i, a, _, c in events}
    assert len(events) == 2 * p * v * m
    for (s, k, i, c), a in start.items():
        if k == "F" and s > 0:
            assert a >= end[(s - 1, "F", i, c)] + send - 1e-9
        if k == "F" and s == 0 and c > 0:
            assert a >= end[(p - 1, "F", i, c - 1)] + send - 1e-9
        if k == "B" and s < p - 1:
            assert a >= end[(s + 1, "B", i, c)] + send - 1e-9
        if k == "B" and s == p - 1:
            assert a >= end[(s, "F", i, c)] - 1e-9
            if c < v - 1:
                assert a >= end[(0, "B", i, c + 1)] + send - 1e-9
    # one op at a time per stage; no stage beats its own work
    for s in range(p):
        mine = sorted((e for e in events if e[0] == s), key=lambda e: e[3])
        assert all(x[4] <= y[3] + 1e-12 for x, y in zip(mine, mine[1:]))
        assert finish[s] >= m * (sum(f[s]) + sum(b[s])) - 1e-9


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.data())
def test_interleaved_schedule_is_the_earliest_one_in_megatrons_order(p, v, groups, data):
    """Each op starts as soon as both its stage is free (the op before it in the rank's
    Megatron order has ended and, non-interleaved, its send has crossed the link: Megatron's
    1F1B waits for its sends) and its input has arrived over its link: the unique schedule of
    that order. Checked op by op against the recurrence for random durations and link times,
    and (interleaved) a random micro-batch group Megatron takes."""
    m = groups * p if v > 1 else groups
    g = None
    if v > 1:
        g = data.draw(st.sampled_from([h for h in range(p, m + 1) if m % h == 0 or m % h >= p]))
    dur = st.floats(0.01, 3)
    f = [[data.draw(dur) for _ in range(v)] for _ in range(p)]
    b = [[data.draw(dur) for _ in range(v)] for _ in range(p)]
    send_f = [data.draw(st.floats(0, 1)) for _ in range(p)]
    send_b = [data.draw(st.floats(0, 1)) for _ in range(p)]
    finish, busy, last_b, events = interleaved_1f1b(f, b, send_f, send_b, m, record=True, group=g)
    end = {(s, k, i, c): e for s, k, i, _, e, c in events}
    for s in range(p):
        mine = sorted((e for e in events if e[0] == s), key=lambda e: (e[3], e[4]))
        assert [(0 if k == "F" else 1, i, c) for _, k, i, _, _, c in mine] == rank_order(
            p, s, m, v, g)
        free = 0.0
        for _, k, i, a, e, c in mine:
            if k == "F":
                dep = (end[(s - 1, "F", i, c)] + send_f[s - 1] if s > 0 else
                       end[(p - 1, "F", i, c - 1)] + send_f[p - 1] if c > 0 else 0.0)
            else:
                dep = (end[(s + 1, "B", i, c)] + send_b[s] if s < p - 1 else
                       end[(0, "B", i, c + 1)] + send_b[p - 1] if c < v - 1 else
                       end[(s, "F", i, c)])
            assert a == pytest.approx(max(free, dep), abs=1e-9)
            assert e == pytest.approx(a + (f if k == "F" else b)[s][c], abs=1e-9)
            free = e
            if v == 1:  # held until the send has crossed
                free += (send_f[s] if s < p - 1 else 0.0) if k == "F" else \
                    (send_b[s - 1] if s > 0 else 0.0)
        assert finish[s] == pytest.approx(free, abs=1e-9)
        assert busy[s] == pytest.approx(m * (sum(f[s]) + sum(b[s])))
        for c in range(v):
            assert last_b[s][c] == pytest.approx(max(a for x, k, i, a, _, cc in events
                                                     if x == s and k == "B" and cc == c), abs=1e-9)
    # without recording, the same times
    again = interleaved_1f1b(f, b, send_f, send_b, m, group=g)
    assert again[0] == finish and again[2] == last_b


def _plan(chunks, *, m=4, v=2, recompute=None):
    inv = inventory_from_data({"groups": [{"gpu": "ROUND", "nodes": 1, "gpus_per_node": 2}],
                               "gpus": copy.deepcopy(ROUND)})
    stages = [{"device_type": "ROUND", "num_layers": sum(c), "chunk_layers": list(c)}
              | ({"recompute": recompute} if recompute else {}) for c in chunks]
    data = {"format_version": 1, "model": {f: getattr(TINY, f) for f in TINY.__slots__},
            "global_batch_size": m, "tensor_model_parallel_size": 1, "precision": "bf16",
            "use_distributed_optimizer": False, "virtual_pipeline_size": v,
            "pipelines": [{"micro_batch_size": 1, "num_microbatches": m, "stages": stages}]}
    if v == 1:
        del data["virtual_pipeline_size"]
        for s in stages:
            del s["chunk_layers"]
    return plan_from_data(data, catalog=inv.catalog), inv


def test_simulate_interleaved_plan_by_hand():
    plan, inv = _plan([[2, 2], [2, 2]], m=4)
    cost = CostModel(TINY, inv, p2p_latency_s=0.0)
    res = simulate(plan, cost)
    layer = M.layer_forward_flops(TINY, 1) / 1e12
    out = M.output_forward_flops(TINY, 1) / 1e12
    f = [[2 * layer, 2 * layer], [2 * layer, 2 * layer + out]]
    b = [[2 * x for x in row] for row in f]
    sends = [cost.p2p_seconds(1, 1e9)] * 2  # every link is in the node
    finish, busy, _, _ = interleaved_1f1b(f, b, sends, sends, 4)
    opt = max(cost.optimizer_seconds(StageShape.of(plan, 0, s)) for s in range(2))
    assert res.step_time_s == pytest.approx(max(finish) + opt, rel=1e-3)
    assert res.stage(0, 1).busy_s == pytest.approx(4 * 3 * (4 * layer + out))
    assert res.stage(0, 1).forward_s == pytest.approx(4 * layer + out)
    kinds = {(e.kind, e.chunk) for e in res.events}
    assert {("F", 0), ("F", 1), ("B", 0), ("B", 1), ("O", 0)} <= kinds
    # interleaving the same layers beats plain 1F1B here (4 micro-batches, 2 stages)
    flat, _ = _plan([[4], [4]], m=4, v=1)
    assert res.step_time_s < simulate(flat, cost).step_time_s


def test_interleaved_memory_counts_chunks_in_flight():
    # stage 0 chunk 0 holds 1 layer and the embedding, chunk 1 holds 3 layers; m 4: the peak is
    # 4 chunk-0 + 1 chunk-1 activations (rank 0 above: after F(3,0)) or 3 + 2
    plan, inv = _plan([[1, 3], [2, 2]], m=4)
    cost = CostModel(TINY, inv)
    layer = cost.layer_activation_bytes("ROUND", 1, 1, "none")
    emb = cost.hidden_bytes(1, 1) / 2
    a0, a1 = layer + emb, 3 * layer
    mem = cost.stage_memory(plan, 0, 0)
    assert mem.activations == pytest.approx(max(4 * a0 + a1, 3 * a0 + 2 * a1))
    # the last stage: warm-up 2 chunk-0 forwards, then one chunk at a time, the last chunk with
    # the final norm input and fp32 logits
    last = 2 * layer + cost.hidden_bytes(1, 1) + M.logits_bytes(TINY, 1, 1)
    mem1 = cost.stage_memory(plan, 0, 1)
    assert mem1.activations == pytest.approx(2 * (2 * layer) + last)
    # parameters are the stage's, as without interleaving
    flat, _ = _plan([[4], [4]], m=4, v=1)
    assert mem.params == pytest.approx(cost.stage_memory(flat, 0, 0).params)
    # full recompute keeps a checkpoint per chunk and layer group plus one chunk's transient
    full, _ = _plan([[1, 3], [2, 2]], m=4, recompute={"granularity": "full", "method": "uniform",
                                                       "num_layers": 1})
    ckpt = cost.hidden_bytes(1, 1)
    c0, c1 = ckpt + emb, 3 * ckpt
    assert cost.stage_memory(full, 0, 0).activations == pytest.approx(
        max(4 * c0 + c1, 3 * c0 + 2 * c1) + layer)


def test_interleaved_block_recompute_covers_the_first_layers_in_chunk_order():
    # block 3 on chunks of 2 + 2 layers: all of chunk 0 and the first layer of chunk 1
    plan, inv = _plan([[2, 2], [2, 2]], recompute={"granularity": "full", "method": "block",
                                                   "num_layers": 3})
    cost = CostModel(TINY, inv)
    layer_f, _ = cost.layer_times("ROUND", 1, 1)
    plain, _ = _plan([[2, 2], [2, 2]])
    extra = simulate(plan, cost).stage(0, 0).backward_s - simulate(plain, cost).stage(0, 0).backward_s
    assert extra == pytest.approx(3 * layer_f)
    # memory: chunk 0 keeps 2 checkpoints, chunk 1 one checkpoint and one whole layer; rank 0
    # peaks at 4 chunk-0 + 1 chunk-1 or 3 + 2 (m = 4), plus one layer's recompute transient
    layer = cost.layer_activation_bytes("ROUND", 1, 1, "none")
    ckpt, emb = cost.hidden_bytes(1, 1), cost.hidden_bytes(1, 1) / 2
    a0, a1 = 2 * ckpt + emb, ckpt + layer
    assert cost.stage_memory(plan, 0, 0).activations == pytest.approx(
        max(4 * a0 + a1, 3 * a0 + 2 * a1) + layer)


def _plain_1f1b_order(p: int, s: int, m: int) -> list[tuple[int, int]]:
    """Megatron's non-interleaved 1F1B, written out: min(p - s - 1, m) warm-up forwards, then a
    forward and a backward in turn, then the remaining backwards."""
    warm = min(p - s - 1, m)
    order = [(0, i) for i in range(warm)]
    for i in range(m - warm):
        order += [(0, warm + i), (1, i)]
    return order + [(1, i) for i in range(m - warm, m)]


def test_one_f_one_b_runs_plain_1f1b_order():
    # one_f_one_b is the interleaved simulation with one chunk: it must run plain 1F1B's order
    for p, m in ((1, 3), (2, 5), (4, 4), (4, 2)):
        f, b = [1.0 + s for s in range(p)], [2.0] * p
        plain = one_f_one_b(f, b, [0.1] * (p - 1), [0.1] * (p - 1), m, record=True)[3]
        for s in range(p):
            got = [(0 if k == "F" else 1, i) for st_, k, i, _, _ in plain if st_ == s]
            assert got == _plain_1f1b_order(p, s, m)
            assert [(k, i) for k, i, _ in rank_order(p, s, m)] == got


def test_timeline_png_colours_chunks(tmp_path):
    pytest.importorskip("matplotlib")
    plan, inv = _plan([[2, 2], [2, 2]])
    res = simulate(plan, CostModel(TINY, inv))
    out = tmp_path / "t.png"
    res.timeline_png(out)
    assert out.stat().st_size > 1000


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 12),
       st.lists(st.floats(0.0, 10.0), min_size=4, max_size=4))
def test_peak_activations_shortcut_matches_the_whole_order(p, v, groups, w):
    weights = w[:v]
    for m in (groups * p, groups * p + 1):  # whole groups (shortcut) and not
        for r in range(p):
            want = peak_in_flight(rank_order(p, r, m, v), weights)
            assert peak_activations(p, r, m, v, weights) == pytest.approx(want)


def test_overlap_grad_reduce_sends_each_chunk_after_its_last_backward():
    # two replicas on a slow node link (1 GB/s) so that the gradient sync matters
    gpus = copy.deepcopy(ROUND)
    gpus["ROUND"]["intra_node_bandwidth_gb_s"] = 1.0
    inv = inventory_from_data({"groups": [{"gpu": "ROUND", "nodes": 1, "gpus_per_node": 4}],
                               "gpus": gpus})
    stages = [{"device_type": "ROUND", "num_layers": 4, "chunk_layers": [2, 2]} for _ in range(2)]
    data = {"format_version": 1, "model": {f: getattr(TINY, f) for f in TINY.__slots__},
            "global_batch_size": 8, "tensor_model_parallel_size": 1, "precision": "bf16",
            "use_distributed_optimizer": False, "virtual_pipeline_size": 2,
            "pipelines": [{"micro_batch_size": 1, "num_microbatches": 4, "stages": stages}] * 2}
    plain = plan_from_data(data, catalog=inv.catalog)
    overlapped = plan_from_data(dict(data, overlap_grad_reduce=True), catalog=inv.catalog)
    cost = CostModel(TINY, inv, p2p_latency_s=0.0)
    a, b = simulate(plain, cost), simulate(overlapped, cost)
    layer = M.layer_forward_flops(TINY, 1) / 1e12
    out = M.output_forward_flops(TINY, 1) / 1e12
    f = [[2 * layer, 2 * layer], [2 * layer, 2 * layer + out]]
    bwd = [[2 * x for x in row] for row in f]
    send = cost.p2p_seconds(1, 1.0)
    finish, _, last_b, _ = interleaved_1f1b(f, bwd, [send] * 2, [send] * 2, 4)
    for s in range(2):
        shape = StageShape.of(plain, 0, s)
        opt = cost.optimizer_seconds(shape)
        comm = [cost.dp_sync_seconds(cost.chunk_params(shape, c), 2, 1.0) for c in range(2)]
        # without overlap: the whole stage's sync after its last backward, then the optimizer
        opt_end = lambda res: max(e.end for e in res.events if e.stage == s and e.kind == "O")  # noqa: E731
        assert opt_end(a) == pytest.approx(finish[s] + sum(comm) + opt)
        # with it: chunk 1 (its last backward comes first) then chunk 0, one after the other
        assert last_b[s][1] < last_b[s][0]
        t = last_b[s][1] + comm[1]
        t = max(t, last_b[s][0]) + comm[0]
        assert opt_end(b) == pytest.approx(max(finish[s], t) + opt)
    assert b.step_time_s < a.step_time_s


# -- the micro-batch group (Megatron's --microbatch-group-size-per-virtual-pipeline-stage) ------
def test_micro_batch_group_order_and_memory_by_hand():
    # p 2, v 2, m 4, group 4: the table runs chunk 0 of micro-batches 0-3, then chunk 1. Rank 0
    # warms up with (2 - 0 - 1) * 2 + (2 - 1) * 4 = 6 forwards (4 with the default group 2)
    F, B = 0, 1
    assert warmup_count(2, 0, 4, 2, 4) == 6 and warmup_count(2, 1, 4, 2, 4) == 4
    assert rank_order(2, 0, 4, 2, 4) == [
        (F, 0, 0), (F, 1, 0), (F, 2, 0), (F, 3, 0), (F, 0, 1), (F, 1, 1),
        (F, 2, 1), (B, 0, 1), (F, 3, 1), (B, 1, 1),
        (B, 2, 1), (B, 3, 1), (B, 0, 0), (B, 1, 0), (B, 2, 0), (B, 3, 0)]
    # held after the warm-up: 4 chunk-0 + 2 chunk-1 forwards; F(2,1) adds one: with a0 = 3,
    # a1 = 1 that is 15 (13 with the default group, test_peak_in_flight_by_hand)
    assert peak_in_flight(rank_order(2, 0, 4, 2, 4), [3.0, 1.0]) == 15.0
    assert peak_activations(2, 0, 4, 2, [3.0, 1.0], 4) == 15.0
    assert peak_activations(2, 0, 4, 2, [3.0, 1.0]) == 13.0
    # f 1, b 2, no sends: the last stage's backwards of chunk 0 wait for stage 0's of chunk 1;
    # worked through op by op the step ends at 27 = (m v + p - 1)(f + b), as with group 2
    finish, busy, _, events = interleaved_1f1b([[1, 1], [1, 1]], [[2, 2], [2, 2]], [0, 0], [0, 0],
                                               4, record=True, group=4)
    assert max(finish) == 27 and busy == [24, 24]
    s1 = [(k, i, c, a) for s, k, i, a, _, c in sorted(events, key=lambda e: e[3]) if s == 1]
    assert s1 == [("F", 0, 0, 1), ("F", 1, 0, 2), ("F", 2, 0, 3), ("F", 3, 0, 4),
                  ("F", 0, 1, 5), ("B", 0, 1, 6), ("F", 1, 1, 8), ("B", 1, 1, 9),
                  ("F", 2, 1, 11), ("B", 2, 1, 12), ("F", 3, 1, 14), ("B", 3, 1, 15),
                  ("B", 0, 0, 17), ("B", 1, 0, 19), ("B", 2, 0, 21), ("B", 3, 0, 23)]


class _PPGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


class _Communicator:  # what get_pp_rank_microbatches reads of Megatron's P2PCommunicator
    def __init__(self, p, r, v):
        self.pp_group, self.virtual_pipeline_model_parallel_size = _PPGroup(p, r), v


@pytest.mark.filterwarnings("ignore")
def test_order_matches_megatrons_own_table_and_warm_up():
    """Our table and warm-up counts against megatron-core's own functions for every group
    Megatron takes (p <= g <= m, remainder 0 or at least p)."""
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    checked = 0
    for p in (2, 3, 4):
        for v in (2, 3):
            for m in range(p, 4 * p + 3):
                for g in range(p, m + 1):
                    if m % g and m % g < p:
                        continue
                    assert schedule_table(m, v, g) == schedules.get_schedule_table(m, v, g)
                    for r in range(p):
                        got = schedules.get_pp_rank_microbatches(
                            m, v, g, p2p_communicator=_Communicator(p, r, v))
                        assert got[2] == warmup_count(p, r, m, v, g), (p, v, m, g, r)
                        checked += 1
    assert checked > 500


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 5), st.integers(2, 4), st.integers(1, 8), st.integers(0, 6),
       st.lists(st.floats(0.0, 10.0), min_size=4, max_size=4))
def test_peak_activations_shortcut_with_a_group(p, v, groups, extra, w):
    weights = w[:v]
    for m in (groups * p, groups * p + 1):
        for g in sorted({p, min(m, p + extra)}):
            for r in range(p):
                want = peak_in_flight(rank_order(p, r, m, v, g), weights)
                assert peak_activations(p, r, m, v, weights, g) == pytest.approx(want)
