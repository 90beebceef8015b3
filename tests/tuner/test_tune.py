"""Properties of the plans `tune` emits, the infeasible error, and the CLI."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from megatron_hetero.cli import main
from megatron_hetero.cost import CostModel
from megatron_hetero.errors import InfeasibleError
from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.models import PRESETS, model_preset
from megatron_hetero.plan import ModelSpec, plan_from_data
from megatron_hetero.placement.inventory import check_against_inventory
from megatron_hetero.sim.step import simulate
from megatron_hetero.tuner import tune
from megatron_hetero.tuner.validation import validate_plan

GPUS = ["H100-SXM-80GB", "A100-SXM-40GB", "V100-SXM2-32GB", "RTX4090-24GB", "A40-48GB", "T4-16GB"]

SMALL = ModelSpec(name="small", num_layers=8, hidden_size=1024, ffn_hidden_size=2816,
                  num_attention_heads=8, num_query_groups=4, vocab_size=32000, seq_length=2048)


@st.composite
def inventories(draw):
    n = draw(st.integers(1, 3))
    types = draw(st.lists(st.sampled_from(GPUS), min_size=n, max_size=n, unique=True))
    groups = [{"gpu": t, "nodes": draw(st.integers(1, 2)),
               "gpus_per_node": draw(st.sampled_from([1, 2, 4, 8]))} for t in types]
    for g in groups:  # host RAM per node: unchecked, or tight enough to bind on offload
        host = draw(st.sampled_from([None, 72, 96, 512]))
        if host is not None:
            g["host_memory_gb"] = host
    return inventory_from_data({"groups": groups})


def _check_emitted(result, inventory, model, gbs):
    plan = result.plan
    # the plan round-trips through the strict loader and fits the inventory
    again = plan_from_data(plan.to_data(), catalog=inventory.catalog)
    check_against_inventory(again, inventory)
    assert again.global_batch_size == gbs and again.model == model
    cost = CostModel(model, inventory, precision=plan.precision)
    for d in range(plan.data_parallel_size):
        for s in range(plan.pipeline_model_parallel_size):
            mem = cost.stage_memory(plan, d, s)
            assert mem.total <= mem.capacity, (d, s, mem)
    sim = simulate(plan, cost, record_events=False)
    assert sim.step_time_s == pytest.approx(result.sim.step_time_s)
    # validate --inventory's every check (what the command runs) accepts it
    validate_plan(again, inventory, source="tuned")
    # no stage finishes its micro-batches' forwards and backwards faster than the cost model
    # prices them one after another: a step that drops work (a micro-batch, a backward, a
    # recompute) is shorter than this
    for d, pipe in enumerate(plan.pipelines):
        for s in range(plan.pipeline_model_parallel_size):
            work = pipe.num_microbatches * cost.stage_times(plan, d, s).total_s
            assert sim.step_time_s >= work * (1 - 1e-9), (d, s, sim.step_time_s, work)
            assert sim.stage(d, s).busy_s >= work * (1 - 1e-9), (d, s)
    # host RAM too, where the inventory gives it
    assert sim.fits_memory
    assert all(h.used_bytes <= h.capacity_bytes for h in sim.host_nodes)
    if result.baseline_sim is not None:
        assert result.sim.step_time_s <= result.baseline_sim.step_time_s * (1 + 1e-9)
    assert result.upper_bound_step_time_s <= result.sim.step_time_s
    # tensor parallelism always runs with sequence parallelism, in the plan and in its arguments
    tp = plan.tensor_model_parallel_size
    assert plan.sequence_parallel == (tp > 1)
    from megatron_hetero.plan.megatron_args import megatron_args
    assert ("--sequence-parallel" in megatron_args(plan)) == (tp > 1)
    if result.baseline_plan is not None:
        base = result.baseline_plan
        assert base.sequence_parallel == (base.tensor_model_parallel_size > 1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inventories(), st.sampled_from(["small", "llama2-7b", "llama2-13b"]), st.integers(1, 96))
def test_emitted_plans_validate_and_fit(inventory, name, gbs):
    model = SMALL if name == "small" else model_preset(name, seq_length=2048)
    try:
        result = tune(model, inventory, gbs)
    except InfeasibleError as exc:
        text = str(exc)
        assert "GB needed per GPU" in text and "available" in text
        if any(g.host_memory_gb is not None and g.host_memory_gb < 64 for g in inventory.groups):
            assert "host reserve" in text
        for gpu in inventory.gpu_counts():
            assert gpu in text
        return
    _check_emitted(result, inventory, model, gbs)


def test_infeasible_names_memory_per_type():
    inv = inventory_from_data({"groups": [{"gpu": "RTX3090-24GB", "nodes": 1, "gpus_per_node": 2}]})
    with pytest.raises(InfeasibleError, match=r"RTX3090-24GB: \d+\.\d GB needed per GPU, 23.0 GB available"):
        tune(model_preset("llama2-70b"), inv, 8)


def test_uneven_data_parallel_follows_speed():
    # two identical nodes but one type twice as fast: shares follow speed, layers stay shared
    inv = inventory_from_data({
        "groups": [{"gpu": "FAST", "nodes": 1, "gpus_per_node": 1},
                   {"gpu": "SLOW", "nodes": 1, "gpus_per_node": 1}],
        "gpus": {name: {"vendor": "test", "bf16_tflops": tf, "bf16": True, "fp32_tflops": 1.0,
                        "memory_gb": 80, "memory_bandwidth_gb_s": 2000, "intra_node_link": "x",
                        "intra_node_bandwidth_gb_s": 300, "efficiency": 0.5}
                 for name, tf in (("FAST", 200.0), ("SLOW", 100.0))}})
    result = tune(SMALL, inv, 96, )
    plan = result.plan
    shares = {p.stages[0].device_type: p.samples for p in plan.pipelines}
    assert plan.pipeline_model_parallel_size == 1 and shares == {"FAST": 64, "SLOW": 32}
    assert result.baseline_sim.step_time_s > result.sim.step_time_s


def test_deterministic():
    inv = inventory_from_data({"groups": [{"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 8},
                                          {"gpu": "V100-SXM2-32GB", "nodes": 1, "gpus_per_node": 8}]})
    a = tune(PRESETS["llama2-7b"], inv, 256).plan.to_data()
    b = tune(PRESETS["llama2-7b"], inv, 256).plan.to_data()
    assert a == b


def test_cli_tune_then_simulate(tmp_path, capsys):
    plan, report, png = tmp_path / "plan.yaml", tmp_path / "r.json", tmp_path / "t.png"
    rc = main(["tune", "examples/llama2/7b/inventory.yaml", "--model", "llama2-7b",
               "--global-batch-size", "128", "--seq-length", "2048", "-o", str(plan),
               "--report", str(report), "--timeline", str(png), "-q"])
    assert rc == 0
    data = json.loads(report.read_text())
    for key in ("predicted_step_time_s", "baseline_step_time_s", "upper_bound_step_time_s",
                "search_time_s"):
        assert data[key] > 0
    assert isinstance(data["megatron_args"], list) and "--hetero-plan" in data["megatron_args"]
    assert data["upper_bound_step_time_s"] <= data["predicted_step_time_s"] <= data["baseline_step_time_s"]
    assert png.stat().st_size > 0
    capsys.readouterr()
    assert main(["simulate", str(plan), "--inventory", "examples/llama2/7b/inventory.yaml"]) == 0
    out = capsys.readouterr().out
    assert f"{data['predicted_step_time_s']:.3f} s" in out


def test_cli_infeasible_is_one_line(capsys, tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("groups:\n  - {gpu: RTX3090-24GB, nodes: 1, gpus_per_node: 4}\n")
    rc = main(["tune", str(inv), "--model", "llama2-70b", "--global-batch-size", "4", "-q",
               "-o", str(tmp_path / "plan.yaml")])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_tuner_side_imports_without_torch():
    import subprocess
    import sys
    code = ("import sys; import megatron_hetero.tuner, megatron_hetero.sim.step, megatron_hetero.cost;"
            "from megatron_hetero.cli import build_parser; build_parser();"
            "assert 'torch' not in sys.modules and 'megatron.core' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_global_batch_no_micro_batch_divides():
    from megatron_hetero.tuner import TuneOptions
    inv = inventory_from_data({"groups": [{"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 8}]})
    with pytest.raises(InfeasibleError, match="global batch size 6"):
        tune(SMALL, inv, 6, options=TuneOptions(micro_batch_sizes=(4,)))


def test_small_global_batch_uses_fewer_pipelines():
    inv = inventory_from_data({"groups": [{"gpu": "A100-SXM-80GB", "nodes": 2, "gpus_per_node": 8}]})
    result = tune(SMALL, inv, 2)
    assert result.plan.data_parallel_size <= 2
    _check_emitted(result, inv, SMALL, 2)


def test_no_optimizer_offload_option():
    from megatron_hetero.tuner import TuneOptions
    inv = inventory_from_data({"groups": [{"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 8},
                                          {"gpu": "V100-SXM2-32GB", "nodes": 1, "gpus_per_node": 8}]})
    model = model_preset("llama2-7b")
    result = tune(model, inv, 512, options=TuneOptions(optimizer_offload=False))
    assert all(s.offload.optimizer_fraction == 0 for p in result.plan.pipelines for s in p.stages)
    _check_emitted(result, inv, model, 512)


def test_five_types():
    groups = [{"gpu": g, "nodes": 1, "gpus_per_node": 4}
              for g in ("H100-SXM-80GB", "A100-SXM-40GB", "V100-SXM2-32GB", "A40-48GB", "T4-16GB")]
    inv = inventory_from_data({"groups": groups})
    model = model_preset("llama2-7b", seq_length=2048)
    result = tune(model, inv, 64)
    _check_emitted(result, inv, model, 64)
    assert "H100-SXM-80GB" in result.plan.device_counts()


def test_selective_recompute_where_attention_is_unfused():
    # V100 runs unfused attention: selective recompute drops its stored s x s matrices, and
    # the tuner takes it where it is the cheapest way to fit
    import dataclasses
    from megatron_hetero.plan import Recompute
    inv = inventory_from_data({"groups": [{"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 8},
                                          {"gpu": "V100-SXM2-32GB", "nodes": 1, "gpus_per_node": 8}]})
    model = model_preset("llama2-7b")
    result = tune(model, inv, 512)
    _check_emitted(result, inv, model, 512)
    plan = result.plan
    cost = CostModel(model, inv, precision=plan.precision)
    chosen = [(d, s) for d, p in enumerate(plan.pipelines) for s, st in enumerate(p.stages)
              if st.recompute.granularity == "selective"]
    assert chosen and all(plan.stage(d, s).device_type == "V100-SXM2-32GB" for d, s in chosen)
    d, s = chosen[0]
    stage = plan.stage(d, s)
    # without it the stage (same optimizer offload) does not fit
    bare = dataclasses.replace(stage, recompute=Recompute())
    plan.pipelines[d].stages[s] = bare
    assert not cost.stage_memory(plan, d, s).fits
    plan.pipelines[d].stages[s] = stage
    # the baseline keeps one recompute setting on every stage
    base = result.baseline_plan
    assert len({(st.recompute.granularity, st.recompute.method, st.recompute.num_layers)
                for p in base.pipelines for st in p.stages}) == 1


def test_type_orders_widen_the_search(monkeypatch):
    # mixed pipelines are tried in every type order; restricted to memory-rich first the
    # search can only do worse, and on A800 + A40 (70B) it does (the A40s first win)
    from megatron_hetero.tuner import space
    inv = inventory_from_data({"groups": [{"gpu": "A800-80GB", "nodes": 4, "gpus_per_node": 8},
                                          {"gpu": "A40-48GB", "nodes": 4, "gpus_per_node": 8}]})
    model = model_preset("llama2-70b")
    every = tune(model, inv, 512)
    monkeypatch.setattr(space, "orders", lambda n: [tuple(range(n))])
    rich_first = tune(model, inv, 512)
    assert every.sim.step_time_s < rich_first.sim.step_time_s
    assert every.plan.stage(0, 0).device_type == "A40-48GB"
    _check_emitted(every, inv, model, 512)


SMALL16 = ModelSpec(name="small16", num_layers=16, hidden_size=2048, ffn_hidden_size=5504,
                    num_attention_heads=16, num_query_groups=16, vocab_size=32000, seq_length=2048)
"""A 16-layer model small enough that 8 micro-batches leave a large pipeline bubble."""


def test_interleaving_where_the_bubble_dominates():
    # 8 micro-batches on a 2-stage A100 + V100 pipeline: the fill and drain cost a fifth of the
    # step without interleaving, so the search splits each stage into model chunks
    model = SMALL16
    inv = inventory_from_data({"groups": [
        {"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 2},
        {"gpu": "V100-SXM2-32GB", "nodes": 1, "gpus_per_node": 2}]})
    from megatron_hetero.tuner import TuneOptions
    flat = tune(model, inv, 8, options=TuneOptions(max_virtual_pipeline_size=1))
    result = tune(model, inv, 8)
    plan = result.plan
    v, p = plan.virtual_pipeline_size, plan.pipeline_model_parallel_size
    assert v > 1 and flat.plan.virtual_pipeline_size == 1
    assert result.sim.step_time_s < flat.sim.step_time_s
    for stage in plan.pipelines[0].stages:
        assert len(stage.chunk_layers) == v and sum(stage.chunk_layers) == stage.num_layers
    # the structured search spreads each stage's layers evenly over its chunks; the local
    # search may then move layers between chunks (and the micro-batch group), only if faster
    assert result.sim.step_time_s <= result.searched_step_time_s
    assert all(pipe.num_microbatches % p == 0 for pipe in plan.pipelines)
    _check_emitted(result, inv, model, 8)


def test_the_baseline_interleaves_too():
    # plain Megatron has virtual pipeline stages (uniform split): the baseline searches them,
    # so the reported speedup is not measured against a handicapped baseline
    model = SMALL16
    inv = inventory_from_data({"groups": [
        {"gpu": "RTX4090-24GB", "nodes": 1, "gpus_per_node": 4},
        {"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 1}]})
    from megatron_hetero.tuner import TuneOptions
    result = tune(model, inv, 8)
    flat = tune(model, inv, 8, options=TuneOptions(max_virtual_pipeline_size=1))
    base = result.baseline_plan
    p, v = base.pipeline_model_parallel_size, base.virtual_pipeline_size
    assert v > 1 and len(set(base.virtual_stage_layers)) == 1
    assert base.uniform_data_parallel and base.pipelines[0].num_microbatches % p == 0
    assert len({s.recompute.granularity for pipe in base.pipelines for s in pipe.stages}) == 1
    assert result.sim.step_time_s <= result.baseline_sim.step_time_s
    # capping the tuned search's chunks does not cap the baseline's, and the tuner still never
    # emits a plan slower than the baseline it reports
    assert flat.plan.virtual_pipeline_size == 1 or flat.fell_back_to_baseline
    assert flat.baseline_plan.virtual_pipeline_size > 1
    assert flat.baseline_sim.step_time_s == result.baseline_sim.step_time_s
    assert flat.sim.step_time_s <= flat.baseline_sim.step_time_s


def test_progress_covers_the_walk_and_the_local_search(monkeypatch):
    """A long search shows two bars: the walk over structures, finished when it stops early,
    and the local search, one step per start it climbs from. The plan is the one found
    without the bars."""
    import rich.progress
    events = []

    class Recorder:
        def __init__(self, **kwargs):
            self.tasks = {}

        def start(self):
            events.append("start")

        def stop(self):
            events.append("stop")

        def add_task(self, name, total=None):
            self.tasks[len(self.tasks)] = name
            events.append(("add", name, total))
            return len(self.tasks) - 1

        def advance(self, task):
            pass

        def update(self, task, **kwargs):
            events.append((self.tasks[task], kwargs))

    monkeypatch.setattr(rich.progress, "Progress", Recorder)
    inv = inventory_from_data({"groups": [{"gpu": "A800-80GB", "nodes": 4, "gpus_per_node": 8},
                                          {"gpu": "A40-48GB", "nodes": 4, "gpus_per_node": 8}]})
    model = model_preset("llama2-70b")
    from megatron_hetero.tuner import TuneOptions
    shown = tune(model, inv, 512, options=TuneOptions(progress=True))
    quiet = tune(model, inv, 512)
    assert shown.plan.to_data() == quiet.plan.to_data()
    assert events[0] == "start" and events[-1] == "stop"
    walk = [e for e in events if isinstance(e, tuple) and e[0] == "searching plans"]
    total = next(e[2] for e in events if isinstance(e, tuple) and e[:2] == ("add", "searching plans"))
    assert walk == [("searching plans", {"completed": total})]
    local = [e[1] for e in events if isinstance(e, tuple) and e[0] == "local search on the simulator"]
    assert local == [{"completed": 1, "total": 2}, {"completed": 2, "total": 2}]  # 2 types: 2 orders


def test_fp32_plans_never_offload_optimizer_state():
    """megatron-core's CPU-offload optimizer does not run with fp32 parameters: 4 A100-40GB
    hold llama2-13b in bf16 only by offloading optimizer state, so in fp32 nothing fits, and
    the message says why (before, the search emitted an fp32 plan with the offload)."""
    from megatron_hetero.tuner import TuneOptions
    inv = inventory_from_data({"groups": [{"gpu": "A100-SXM-40GB", "nodes": 1, "gpus_per_node": 4}]})
    model = model_preset("llama2-13b")
    assert tune(model, inv, 64, options=TuneOptions(precision="bf16")).plan.offloads_optimizer
    with pytest.raises(InfeasibleError, match="no stage may offload optimizer state in fp32"):
        tune(model, inv, 64, options=TuneOptions(precision="fp32"))
    small = inventory_from_data({"groups": [{"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 8}]})
    plan = tune(model, small, 64, options=TuneOptions(precision="fp32")).plan
    assert plan.precision == "fp32" and not plan.offloads_optimizer
