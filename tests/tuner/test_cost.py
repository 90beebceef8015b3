"""The cost model and the 1F1B simulator against cases worked out by hand."""

from __future__ import annotations

import math

import pytest

from megatron_hetero import models as M
from megatron_hetero.cost import CostModel
from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.cost.stage import StageShape
from megatron_hetero.plan import ModelSpec, Offload, Recompute, plan_from_data
from megatron_hetero.sim.step import simulate
from megatron_hetero.sim.pipeline import one_f_one_b

from ..conftest import typed_plan
from ..shapes import stage

TINY = ModelSpec(name="tiny", num_layers=4, hidden_size=64, ffn_hidden_size=128,
                 num_attention_heads=4, num_query_groups=2, vocab_size=256, seq_length=16)


def test_layer_flops_by_hand():
    # h=64, kv width 32, s=16, b=1, SwiGLU
    qkv = 2 * 16 * 64 * (64 + 2 * 32)
    attention = 2 * 16 * 16 * 64 * 2
    proj = 2 * 16 * 64 * 64
    mlp = 2 * 16 * 64 * 128 * 3
    assert M.layer_forward_flops(TINY, 1) == qkv + attention + proj + mlp
    assert M.layer_forward_flops(TINY, 3) == 3 * (qkv + attention + proj + mlp)
    assert M.output_forward_flops(TINY, 1) == 2 * 16 * 64 * 256


def test_llama2_7b_parameter_count():
    m = M.model_preset("llama2-7b")
    total = 32 * M.layer_params(m) + M.embedding_params(m) + M.output_params(m)
    assert total == 6_738_415_616  # the published Llama-2-7B parameter count


@pytest.mark.parametrize("t", [1, 2, 4])
def test_activation_bytes_match_korthikanti_for_gpt(t):
    # plain MHA, 4h MLP without SwiGLU: Korthikanti's sbh(10 + 24/t + 5as/(ht))
    m = ModelSpec(name="gpt", num_layers=2, hidden_size=256, ffn_hidden_size=1024,
                  num_attention_heads=8, num_query_groups=8, vocab_size=512, seq_length=128,
                  swiglu=False)
    s, b, h, a = 128, 2, 256, 8
    none = M.layer_activation_bytes(m, b, t, "none")
    assert none == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert M.layer_activation_bytes(m, b, t, "selective") == pytest.approx(s * b * h * (10 + 24 / t))
    assert M.layer_activation_bytes(m, b, t, "full") == 2 * s * b * h
    assert M.layer_activation_bytes(m, b, t, "none", flash_attention=True) == pytest.approx(
        s * b * h * (10 + 24 / t))


def _inventory(gpus=None, **extra):
    data = {"groups": [{"gpu": "A100-SXM-80GB", "nodes": 2, "gpus_per_node": 4},
                       {"gpu": "V100-SXM2-32GB", "nodes": 1, "gpus_per_node": 4}]}
    if gpus:
        data["gpus"] = gpus
    data.update(extra)
    return inventory_from_data(data)


def test_compute_time_is_flops_over_rate():
    inv = _inventory()
    cost = CostModel(TINY, inv)
    f, b = cost.layer_times("A100-SXM-80GB", 1, 1)
    rate = 312e12 * 0.5
    assert f == pytest.approx(M.layer_forward_flops(TINY, 1) / rate)
    assert b == pytest.approx(2 * f)
    st = cost.times(stage("A100-SXM-80GB", 2, place="last",
                          recompute=Recompute(granularity="full", method="uniform", num_layers=1)))
    out = M.output_forward_flops(TINY, 1) / rate
    assert st.forward_s == pytest.approx(2 * f + out)
    assert st.backward_s == pytest.approx(2 * 2 * f + 2 * out + 2 * f)  # + recompute forward


def test_memory_by_hand():
    inv = _inventory()
    cost = CostModel(TINY, inv, workspace_gb=0)
    mem = cost.memory(stage("A100-SXM-80GB", 2, place="first", data_parallel_size=4))
    params = 2 * M.layer_params(TINY) + 256 * 64
    assert mem.params == 2 * params and mem.grads == 4 * params
    assert mem.optimizer == pytest.approx(12 * params / 4)
    acts = 2 * M.layer_activation_bytes(TINY, 1, 1, "none", flash_attention=True) + 16 * 64
    assert mem.activations == pytest.approx(3 * acts)


def test_two_stage_1f1b_by_hand():
    # f = 1, b = 2 on both stages, 2 micro-batches, no send time: (p - 1 + m)(f + b) = 9
    finish, busy, _, _ = one_f_one_b([1, 1], [2, 2], [0], [0], 2)
    assert finish == [9, 7] and busy == [6, 6]
    # with 0.5 s sends, each holding its sender until it has crossed (worked on paper): stage 0
    # F0 0-1, F1 1.5-2.5; stage 1 F0 1.5-2.5, B0 2.5-4.5 (held to 5), F1 5-6, B1 6-8 (held to
    # 8.5); stage 0 B0 5-7, B1 8.5-10.5
    finish, _, _, _ = one_f_one_b([1, 1], [2, 2], [0.5], [0.5], 2)
    assert finish == [10.5, 8.5]
    # one stage is a plain loop
    finish, _, _, _ = one_f_one_b([1], [2], [], [], 5)
    assert finish == [15]


def test_simulate_two_stage_plan_matches_hand_formula():
    # custom device with a round rate; fp32 all the way, huge links (10 PB/s, the most a file may
    # give) so sends are tiny
    gpus = {"ROUND": {"vendor": "test", "bf16_tflops": 1.0, "bf16": True, "fp32_tflops": 1.0,
                      "memory_gb": 1000, "memory_bandwidth_gb_s": 1e6, "intra_node_link": "x",
                      "intra_node_bandwidth_gb_s": 1e7, "efficiency": 1.0}}
    inv = inventory_from_data({"groups": [{"gpu": "ROUND", "nodes": 1, "gpus_per_node": 2}],
                               "gpus": gpus})
    m = TINY
    data = {"format_version": 1, "model": {f: getattr(m, f) for f in m.__slots__},
            "global_batch_size": 3, "tensor_model_parallel_size": 1, "precision": "bf16",
            "use_distributed_optimizer": False,
            "pipelines": [{"micro_batch_size": 1, "num_microbatches": 3, "stages": [
                {"device_type": "ROUND", "num_layers": 2}, {"device_type": "ROUND", "num_layers": 2}]}]}
    plan = plan_from_data(data, catalog=inv.catalog)
    cost = CostModel(m, inv, p2p_latency_s=0.0)
    res = simulate(plan, cost)
    layer = M.layer_forward_flops(m, 1) / 1e12
    out = M.output_forward_flops(m, 1) / 1e12
    f0, f1 = 2 * layer, 2 * layer + out
    # stage 1 is the bottleneck: F0 on s0, then stage 1 runs 3 x (f1 + b1), then B2 on s0
    expected = f0 + 3 * (f1 + 2 * f1) + 2 * f0
    opt = cost.optimizer_seconds(StageShape.of(plan, 0, 0))
    assert res.step_time_s == pytest.approx(expected + opt, rel=1e-6)
    assert res.stage(0, 1).busy_s == pytest.approx(3 * 3 * f1)
    assert res.fits_memory


def test_simulate_keeps_pipelines_that_differ_apart():
    """The simulator computes the costs of alike pipelines once; pipelines that differ in one
    stage's recompute, optimizer offload or micro-batch count still get their own times and
    memory, the same as each gets in a plan of its own."""
    inv = _inventory()
    cost = CostModel(TINY, inv)

    def pipe(m, gran="none", frac=0.0):
        return {"micro_batch_size": 1, "num_microbatches": m, "stages": [
            {"device_type": "A100-SXM-80GB", "num_layers": 2},
            {"device_type": "A100-SXM-80GB", "num_layers": 2, "recompute": {"granularity": gran},
             "offload": {"optimizer_fraction": frac}}]}

    def plan_of(pipes):
        data = {"format_version": 1, "model": {f: getattr(TINY, f) for f in TINY.__slots__},
                "global_batch_size": sum(p["num_microbatches"] for p in pipes),
                "tensor_model_parallel_size": 1, "pipelines": pipes}
        return plan_from_data(data, catalog=inv.catalog)

    variants = [pipe(4), pipe(4, "selective"), pipe(4, frac=0.5), pipe(6)]
    res = simulate(plan_of(variants), cost)
    for d, variant in enumerate(variants):
        alone = simulate(plan_of([variant]), cost)
        for s in range(2):
            got, ref = res.stage(d, s), alone.stage(0, s)
            assert (got.forward_s, got.backward_s, got.busy_s) == pytest.approx(
                (ref.forward_s, ref.backward_s, ref.busy_s))
            # memory differs from a one-pipeline plan only in the optimizer shard (DP 4 vs 1)
            assert (got.memory.params, got.memory.activations) == pytest.approx(
                (ref.memory.params, ref.memory.activations))
    assert res.stage(1, 1).backward_s > res.stage(0, 1).backward_s  # selective recompute
    assert res.stage(2, 1).memory.optimizer < res.stage(0, 1).memory.optimizer
    assert res.stage(3, 1).busy_s == pytest.approx(1.5 * res.stage(0, 1).busy_s)


def test_placement_follows_megatron_rank_order():
    inv = _inventory()  # 2 A100 nodes of 4, 1 V100 node of 4
    stages = [["A100-SXM-80GB", "A100-SXM-80GB", "V100-SXM2-32GB"]] * 2
    from megatron_hetero.cost import place
    pl = place(typed_plan(stages, 2), inv)
    # stage 0 of both pipelines fills the first A100 node, stage 1 the second
    assert pl.node(0, 0, 0) == pl.node(0, 0, 1) != pl.node(0, 1, 0) == pl.node(0, 1, 1)
    assert pl.node(0, 2, 0) == pl.node(0, 2, 1) and pl.node(0, 2, 0).group == 1
    assert pl.link_bandwidth(pl.node(0, 0, 0), pl.node(0, 1, 0)) == inv.inter_node_bandwidth(0)
    assert pl.link_bandwidth(pl.node(0, 1, 0), pl.node(0, 2, 0)) == inv.inter_group_bandwidth_gb_s
    assert pl.slowest_bandwidth([pl.node(0, 0, 0), pl.node(0, 0, 1)]) == inv.intra_node_bandwidth(0)
    from megatron_hetero.errors import InfeasibleError
    with pytest.raises(InfeasibleError, match="V100"):
        place(typed_plan([["V100-SXM2-32GB"]] * 3, 2), inv)
    # a TP group never straddles nodes: 3 groups of 2 do not fit two nodes of 3
    odd = inventory_from_data({"groups": [{"gpu": "A100-SXM-80GB", "nodes": 2, "gpus_per_node": 3}]})
    assert len({place(typed_plan([["A100-SXM-80GB"]] * 2, 2), odd).node(0, 0, d) for d in range(2)}) == 2
    with pytest.raises(InfeasibleError):
        place(typed_plan([["A100-SXM-80GB"]] * 3, 2), odd)


def test_profile_times_replace_estimates():
    class Prof:
        device_type = "A100-SXM-80GB"
        efficiency = 0.25

        def times(self, part, *, model, micro_batch_size, tensor_parallel_size):
            return (0.5, 1.5) if part == "layer" and micro_batch_size == 1 else None

    inv = _inventory()
    cost = CostModel(TINY, inv, profiles={"A100-SXM-80GB": Prof()})
    assert cost.layer_times("A100-SXM-80GB", 1, 1) == (0.5, 1.5)
    f2, _ = cost.layer_times("A100-SXM-80GB", 2, 1)
    assert f2 == pytest.approx(M.layer_forward_flops(TINY, 2) / (312e12 * 0.25))


def test_flash_attention_follows_bf16_support():
    # V100 (no bf16) runs unfused attention and stores Korthikanti's 5as^2b term; A100 does not
    inv = _inventory()
    cost = CostModel(TINY, inv)
    s, b, a = 16, 1, 4
    v100 = cost.layer_activation_bytes("V100-SXM2-32GB", b, 1, "none")
    a100 = cost.layer_activation_bytes("A100-SXM-80GB", b, 1, "none")
    assert v100 - a100 == pytest.approx(5 * a * s * s * b)
    assert CostModel(TINY, inv, flash_attention=True).layer_activation_bytes(
        "V100-SXM2-32GB", b, 1, "none") == a100


def _tp2_plan(sp: bool):
    m = TINY
    data = {"format_version": 1, "model": {f: getattr(m, f) for f in m.__slots__},
            "global_batch_size": 4, "tensor_model_parallel_size": 2, "sequence_parallel": sp,
            "pipelines": [{"micro_batch_size": 1, "num_microbatches": 4, "stages": [
                {"device_type": "A100-SXM-80GB", "num_layers": 2},
                {"device_type": "A100-SXM-80GB", "num_layers": 2}]}]}
    return plan_from_data(data)


@pytest.mark.parametrize("bw_gb_s", [1e6, 0.05])
def test_backward_hides_tp_allreduces_behind_weight_gradients(bw_gb_s):
    # TP2 on one A100 node whose link is fast (every backward all-reduce hidden) or slow
    inv = _inventory(groups=[{"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 4,
                              "intra_node_bandwidth_gb_s": bw_gb_s}])
    cost = CostModel(TINY, inv)
    s, h, b, t, rate = 16, 64, 2, 2, 312e12 * 0.5
    compute = M.layer_forward_flops(TINY, b) / t / rate
    ar = 2 * (t - 1) / t * (2 * b * s * h) / (bw_gb_s * 1e9)  # one all-reduce of [s, b, h]
    qkv = 2 * b * s * h * (64 + 2 * 32) / t / rate  # its weight-gradient GEMM
    fc1 = 2 * b * s * h * 2 * 128 / t / rate  # SwiGLU: gate and up
    fwd, bwd = cost.layer_times("A100-SXM-80GB", b, t)
    assert fwd == pytest.approx(compute + 2 * ar)  # the forward waits for both
    # each column-parallel linear's input-gradient all-reduce runs beside its weight gradient
    assert bwd == pytest.approx(2 * compute + max(0, ar - qkv) + max(0, ar - fc1))
    # sequence parallelism: half of each behind a GEMM, the row-parallel all-gathers exposed
    _, bwd_sp = cost.layer_times("A100-SXM-80GB", b, t, sp=True)
    assert bwd_sp == pytest.approx(2 * compute + 2 * max(0, ar / 2 - qkv)
                                   + 2 * max(0, ar / 2 - fc1) + ar)
    if bw_gb_s > 1:
        assert bwd == pytest.approx(2 * compute)
    else:
        assert bwd > 2 * compute + ar  # the slow link: more than one all-reduce shows
    assert cost.layer_times("A100-SXM-80GB", b, 1) == pytest.approx(
        (M.layer_forward_flops(TINY, b) / rate, 2 * M.layer_forward_flops(TINY, b) / rate))


def test_sequence_parallel_follows_the_plan():
    # one cost model; each plan is costed by its own sequence_parallel flag
    cost = CostModel(TINY, _inventory(), p2p_latency_s=0.0)
    plain, sp = _tp2_plan(False), _tp2_plan(True)
    sbh, t = 16 * 1 * 64, 2
    # stage 0 holds min(p - s, m) = 2 micro-batches of 2 layers plus the embedding's dropout
    # mask (1 byte per element: sbh bytes); sequence parallelism shards the 10sbh replicated
    # bytes per layer and the mask over t
    saved = 2 * (2 * 10 * sbh + sbh) * (1 - 1 / t)
    got = cost.stage_memory(plain, 0, 0).activations - cost.stage_memory(sp, 0, 0).activations
    assert got == pytest.approx(saved)
    # the same FLOPs and forward traffic (all-gather + reduce-scatter = all-reduce); the
    # backward waits for the row-parallel linears' all-gathers, which plain TP does not have
    # (test_backward_hides_tp_allreduces_behind_weight_gradients)
    with_sp, without = cost.stage_times(sp, 0, 1), cost.stage_times(plain, 0, 1)
    assert with_sp.forward_s == without.forward_s
    assert with_sp.backward_s > without.backward_s
    # pipeline sends carry [s/t, b, h]
    bw = 100.0
    assert cost.p2p_seconds(1, bw, tp=2, sp=True) == pytest.approx(
        cost.p2p_seconds(1, bw, tp=2, sp=False) / 2)
    # and the simulator reads the flag
    assert simulate(sp, cost).step_time_s != simulate(plain, cost).step_time_s
    # at TP = 1 the plan cannot ask for it
    from megatron_hetero.errors import SchemaError
    data = _tp2_plan(True).to_data()
    data["tensor_model_parallel_size"] = 1
    with pytest.raises(SchemaError, match="sequence_parallel"):
        plan_from_data(data)
    # Korthikanti: selective with sequence parallelism is sbh * 34 / t for GPT shapes
    gpt = ModelSpec(name="gpt", num_layers=2, hidden_size=256, ffn_hidden_size=1024,
                    num_attention_heads=8, num_query_groups=8, vocab_size=512, seq_length=128,
                    swiglu=False)
    assert M.layer_activation_bytes(gpt, 1, 4, "selective", sequence_parallel=True) == \
        pytest.approx(128 * 256 * 34 / 4)


def test_simulate_cli_on_the_hand_written_example(capsys):
    from megatron_hetero.cli import main
    rc = main(["simulate", "examples/llama2/7b/plan.yaml", "--inventory",
               "examples/llama2/7b/inventory.yaml"])
    out = capsys.readouterr().out
    assert rc == 0 and "predicted: step" in out and "pipeline 1 stage 1 (V100-SXM2-32GB)" in out


def test_optimizer_offload_trades_memory_for_host_time():
    inv = _inventory()
    cost = CostModel(TINY, inv, host_optimizer_gb_s=1.0)
    on = stage("A100-SXM-80GB", 2, in_flight=1, data_parallel_size=2)
    full = cost.memory(on)
    half = cost.memory(on.but(offload=Offload(optimizer_fraction=0.5)))
    assert half.optimizer == pytest.approx(full.optimizer / 2)
    assert half.params == full.params and half.activations == full.activations
    on_device = cost.optimizer_seconds(on)
    on_host = cost.optimizer_seconds(on.but(offload=Offload(optimizer_fraction=1.0)))
    # same bytes touched: the time ratio is device memory bandwidth over the host rate
    assert on_host / on_device == pytest.approx(2039.0 / 1.0)


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.floats(0.1, 5), st.floats(0.1, 5))
def test_1f1b_uniform_stages_closed_form(p, m, f, b):
    finish, busy, _, _ = one_f_one_b([f] * p, [b] * p, [0.0] * (p - 1), [0.0] * (p - 1), m)
    assert max(finish) == pytest.approx((m + p - 1) * (f + b))
    assert busy == pytest.approx([m * (f + b)] * p)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 5), st.floats(0.1, 5)), min_size=1, max_size=5),
       st.integers(1, 10), st.floats(0, 1))
def test_1f1b_bounds_for_uneven_stages(stages, m, send):
    p = len(stages)
    f = [a for a, _ in stages]
    b = [c for _, c in stages]
    finish, busy, _, events = one_f_one_b(f, b, [send] * (p - 1), [send] * (p - 1), m, record=True)
    step = max(finish)
    # no stage can beat its own work, nor one micro-batch's round trip through every stage
    assert step >= max(m * (x + y) for x, y in stages) - 1e-9
    assert step >= sum(f) + sum(b) + 2 * send * (p - 1) - 1e-9
    # and 1F1B never does worse than running micro-batches one after another
    assert step <= m * (sum(f) + sum(b) + 2 * send * (p - 1)) + 1e-9
    # each stage runs one op at a time, F before B of the same micro-batch
    for s in range(p):
        mine = sorted((e for e in events if e[0] == s), key=lambda e: e[3])
        assert all(x[4] <= y[3] + 1e-12 for x, y in zip(mine, mine[1:]))
        start = {(k, i): a for _, k, i, a, _ in mine}
        assert all(start[("F", i)] < start[("B", i)] for i in range(m))
