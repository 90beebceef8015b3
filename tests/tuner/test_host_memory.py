"""Host memory as a constraint (the inventory's ``host_memory_gb``): the bytes one rank offloads
worked by hand, their sum per node in the simulator, the tuner keeping to the limit, and the
line ``simulate`` prints for a node over it."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from megatron_hetero import models as M
from megatron_hetero.cli import main
from megatron_hetero.cost import CostModel
from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.plan import ModelSpec, plan_from_data, save_plan
from megatron_hetero.sim.step import simulate
from megatron_hetero.tuner import tune

REPO = Path(__file__).resolve().parents[2]
TINY = ModelSpec(name="tiny", num_layers=4, hidden_size=64, ffn_hidden_size=128,
                 num_attention_heads=4, num_query_groups=2, vocab_size=256, seq_length=16)
A100 = "A100-SXM-80GB"


def _inventory(host_memory_gb=None):
    group = {"gpu": A100, "nodes": 2, "gpus_per_node": 4}
    if host_memory_gb is not None:
        group["host_memory_gb"] = host_memory_gb
    return inventory_from_data({"groups": [group]})


def _plan(*, fraction=0.5, module_inputs=True, vp=1):
    """TP=2 with sequence parallelism, two pipelines of two stages of two layers; stage 0
    offloads, stage 1 does not. Stage 0 of both pipelines fills node 0, stage 1 node 1."""
    first = {"device_type": A100, "num_layers": 2,
             "offload": {"optimizer_fraction": fraction, "module_inputs": module_inputs}}
    last = {"device_type": A100, "num_layers": 2}
    if vp > 1:
        first["chunk_layers"] = last["chunk_layers"] = [1, 1]
    data = {"format_version": 1, "model": {f: getattr(TINY, f) for f in TINY.__slots__},
            "global_batch_size": 8, "tensor_model_parallel_size": 2, "sequence_parallel": True,
            "virtual_pipeline_size": vp,
            "pipelines": [{"micro_batch_size": 1, "num_microbatches": 4,
                           "stages": [first, last]}] * 2}
    return plan_from_data(data)


# one layer's module inputs, one micro-batch, TP=2 with sequence parallelism (s=16, b=1, h=64,
# h_kv=32): 6sbh / 2 + (4sbh + 4sb h_kv) / 2
MODULE_INPUTS = 6 * 16 * 64 / 2 + (4 * 16 * 64 + 4 * 16 * 32) / 2


def test_module_input_bytes_of_the_tiny_model():
    assert MODULE_INPUTS == 6144
    assert M.module_input_bytes(TINY, 1, 2, sequence_parallel=True) == MODULE_INPUTS


def test_stage_host_bytes_by_hand():
    cost = CostModel(TINY, _inventory())
    plan = _plan()
    # the optimizer: half of the shard (two layers plus the embedding, over TP=2 and DP=2) at
    # 12 bytes (fp32 master, m, v) and 4 more for the fp32 gradients the CPU step reads
    params = (2 * M.layer_params(TINY) + M.embedding_params(TINY, 2)) / 2
    optimizer = 0.5 * params / 2 * (12 + 4)
    # module inputs: stage 0 of 2 holds 2 micro-batches in flight, 2 layers each; one layer of
    # one micro-batch stays on the device
    offloaded = (2 * 2 - 1) * MODULE_INPUTS
    assert cost.stage_host_bytes(plan, 0, 0) == pytest.approx(optimizer + offloaded)
    assert cost.stage_host_bytes(plan, 1, 0) == pytest.approx(optimizer + offloaded)
    assert cost.stage_host_bytes(plan, 0, 1) == 0.0
    # each part alone
    assert cost.stage_host_bytes(_plan(module_inputs=False), 0, 0) == pytest.approx(optimizer)
    assert cost.stage_host_bytes(_plan(fraction=0.0), 0, 0) == pytest.approx(offloaded)
    # the device keeps what the host takes: activations with and without the offload
    kept = cost.stage_memory(_plan(fraction=0.0, module_inputs=False), 0, 0).activations
    assert kept - cost.stage_memory(plan, 0, 0).activations == pytest.approx(offloaded)


def test_stage_host_bytes_interleaved():
    cost = CostModel(TINY, _inventory())
    plan = _plan(fraction=0.0, vp=2)
    without = _plan(fraction=0.0, module_inputs=False, vp=2)
    got = cost.stage_host_bytes(plan, 0, 0)
    assert got == pytest.approx(cost.stage_memory(without, 0, 0).activations
                                - cost.stage_memory(plan, 0, 0).activations)
    # stage 0 of 2 with 2 chunks of one layer and 4 micro-batches: the interleaved warm-up runs
    # (p - s - 1) * 2 + (v - 1) * p = 4 forwards before its first backward, so 5 chunk-forwards
    # (one layer each) are in flight at the peak; one layer stays on the device
    assert got == pytest.approx((5 - 1) * MODULE_INPUTS)


def test_simulate_sums_host_memory_per_node():
    plan = _plan()
    probe = CostModel(TINY, _inventory(), host_reserve_gb=0.0)
    per_rank = probe.stage_host_bytes(plan, 0, 0)
    node0 = 2 * 2 * per_rank  # stage 0 of both pipelines, two tensor ranks each
    assert simulate(plan, probe, record_events=False).host_nodes == []  # no host_memory_gb

    roomy = CostModel(TINY, _inventory(host_memory_gb=1.0), host_reserve_gb=0.5)
    sim = simulate(plan, roomy, record_events=False)
    assert [(h.node, h.group, h.index) for h in sim.host_nodes] == [
        (f"{A100} node 0", 0, 0), (f"{A100} node 1", 0, 1)]
    assert sim.host_nodes[0].used_bytes == pytest.approx(0.5e9 + node0)
    assert sim.host_nodes[1].used_bytes == pytest.approx(0.5e9)  # stage 1 offloads nothing
    assert all(h.capacity_bytes == 1e9 and h.fits for h in sim.host_nodes)
    assert sim.fits_memory
    assert sim.to_dict()["host_nodes"][0]["used_bytes"] == pytest.approx(0.5e9 + node0)

    # the reserve leaves less than node 0's offload: node 0 is over, node 1 is not
    tight = CostModel(TINY, _inventory(host_memory_gb=1.0), host_reserve_gb=1.0 - node0 / 2e9)
    sim = simulate(plan, tight, record_events=False)
    assert [h.fits for h in sim.host_nodes] == [False, True]
    assert not sim.fits_memory
    assert all(s.memory.fits for s in sim.stages)  # the devices alone would fit


def test_no_host_memory_key_leaves_the_result_as_it_was():
    sim = simulate(_plan(), CostModel(TINY, _inventory()), record_events=False)
    assert sim.fits_memory and "host_nodes" not in sim.to_dict()


def test_bad_host_reserve_does_not_matter_without_the_key():
    # a reserve larger than any node: only checked where the inventory gives host memory
    cost = CostModel(TINY, _inventory(), host_reserve_gb=1e6)
    assert simulate(_plan(), cost, record_events=False).fits_memory
    cost = CostModel(TINY, _inventory(host_memory_gb=512), host_reserve_gb=1e6)
    assert not simulate(_plan(), cost, record_events=False).fits_memory


# -- the tuner -----------------------------------------------------------------------------------
def _scenario(host_memory_gb=None):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from bench_tuner import load_scenario
    finally:
        sys.path.remove(str(REPO / "scripts"))
    inv, model, gbs, _ = load_scenario(REPO / "examples/scenarios/a800-a40-llama2-70b.yaml")
    if host_memory_gb is not None:
        inv.groups = [dataclasses.replace(g, host_memory_gb=host_memory_gb) for g in inv.groups]
    return inv, model, gbs


def _host_check(plan, inv):
    return simulate(plan, CostModel(plan.model, inv, precision=plan.precision),
                    record_events=False)


@pytest.fixture(scope="module")
def free_plan():
    inv, model, gbs = _scenario()
    return tune(model, inv, gbs).plan


def test_tuner_keeps_to_a_small_host_memory(free_plan):
    assert any(s.offload.module_inputs for p in free_plan.pipelines for s in p.stages)
    inv, model, gbs = _scenario(host_memory_gb=120)
    # the plan found without the key overfills some node's 120 GB
    over = _host_check(free_plan, inv)
    assert not over.fits_memory and any(not h.fits for h in over.host_nodes)
    assert all(s.memory.fits for s in over.stages)
    got = tune(model, inv, gbs)
    check = _host_check(got.plan, inv)
    assert check.fits_memory and check.host_nodes and all(h.fits for h in check.host_nodes)
    assert got.sim.fits_memory


def test_ample_host_memory_changes_nothing(free_plan):
    inv, model, gbs = _scenario(host_memory_gb=4096)
    got = tune(model, inv, gbs)
    assert got.plan.to_data() == free_plan.to_data()
    assert all(h.fits for h in got.sim.host_nodes) and len(got.sim.host_nodes) == 8


# -- the command line ----------------------------------------------------------------------------
def _write(tmp_path, host_memory_gb):
    inv = tmp_path / "inventory.yaml"
    extra = f", host_memory_gb: {host_memory_gb}" if host_memory_gb is not None else ""
    inv.write_text(f"groups:\n  - {{gpu: {A100}, nodes: 2, gpus_per_node: 4{extra}}}\n")
    plan = tmp_path / "plan.yaml"
    save_plan(_plan(), plan)
    return str(plan), str(inv)


def test_simulate_names_the_node_over_its_host_memory(tmp_path, capsys):
    plan, inv = _write(tmp_path, 64)  # the default 64 GB reserve alone fills it
    out_json = tmp_path / "sim.json"
    assert main(["simulate", plan, "--inventory", inv, "--json", str(out_json)]) == 1
    err = capsys.readouterr().err  # a plan that does not fit is an error, and nothing is written
    assert f"needs 64.0 GB of host memory of 64 GB" in err and err.count("\n") == 1
    assert not out_json.exists()
    assert main(["simulate", plan, "--inventory", inv, "--json", str(out_json), "--warn-only"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "host memory over" in line]
    # node 0 offloads, node 1 holds only the reserve (64 GB of 64 fits)
    assert len(lines) == 1
    assert f"host memory over on {A100} node 0: 64.0 GB needed" in lines[0]
    assert "64 GB available" in lines[0]
    data = json.loads(out_json.read_text())
    assert not data["fits_memory"] and len(data["host_nodes"]) == 2


def test_simulate_output_without_host_memory_is_unchanged(tmp_path, capsys):
    plan, inv = _write(tmp_path, None)
    out_json = tmp_path / "sim.json"
    assert main(["simulate", plan, "--inventory", inv, "--json", str(out_json)]) == 0
    assert "host memory" not in capsys.readouterr().out
    assert "host_nodes" not in json.loads(out_json.read_text())


def test_a_host_smaller_than_the_reserve_is_named_in_the_error():
    from megatron_hetero.errors import InfeasibleError

    with pytest.raises(InfeasibleError) as err:
        tune(TINY, _inventory(host_memory_gb=32), 8)
    assert "groups[0] (A100-SXM-80GB) host_memory_gb 32 is less than the 64 GB host reserve" \
        in str(err.value)
