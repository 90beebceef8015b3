"""The experts' load imbalance a run measures (issue 30): the rehearsal's telemetry counts the
tokens megatron-core's router sends to each expert per MoE layer, writes them and the
imbalance into ``telemetry.jsonl`` and the run's profile, and the cost model prices expert
compute at it.

The counts are checked against a count made independently in each rank by a forward hook of
the test's own on every router (all forwards of the measured steps; the plan recomputes
nothing, so each forward is one routing)."""

from __future__ import annotations

import functools

import pytest

from megatron_hetero import models as M
from megatron_hetero.cost import CostModel
from megatron_hetero.cost.profile_file import load_profile
from megatron_hetero.emulate import rehearse as rehearse_module
from megatron_hetero.emulate.calibration import Calibration
from megatron_hetero.emulate.rehearse import RehearsalConfig, rehearse
from megatron_hetero.emulate.telemetry import REPORTED_FROM
from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.plan import plan_from_data
from megatron_hetero.telemetry.records import ExpertLoad, read_records

from .conftest import tiny_plan

pytestmark = pytest.mark.slow

H100, A100 = "H100-SXM-80GB", "A100-SXM-80GB"
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
           moe_layer_freq=[0, 1, 1, 0, 1, 1])


def _plan(recompute=None):
    """PP2 x DP2 x EP2 of the tiny MoE model, 2:4 layers, stage 0 on H100, stage 1 on A100
    (``recompute``: each stage's)."""
    data = tiny_plan([2, 4], [(1, 2), (1, 2)], expert_model_parallel_size=2, recompute=recompute,
                     **MOE).to_data()
    for pipe in data["pipelines"]:
        pipe["stages"][0]["device_type"] = H100
    return plan_from_data(data)


def _chain(tmp_path):
    """An interleaved chain of two meshes (mesh 0 TP1 DP1 with chunks of 1 + 1 layers, mesh 1
    TP1 DP2 EP2 with chunks of 2 + 1), every other layer MoE: layer 1 on mesh 0's first chunk,
    3 on mesh 1's first (its second layer), 5 on mesh 1's second chunk. Each chunk is a model
    of its own there, numbering its layers from 1."""
    import yaml

    from megatron_hetero.plan import load_any_plan

    from ..mcore.tiny_mesh_plans import tiny_mesh_plan

    path = tiny_mesh_plan(tmp_path, [(1, 1), (1, 2)], chunks={0: [[1, 1]], 1: [[2, 1]]})
    data = yaml.safe_load(open(path))
    data["model"].update(hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                         num_query_groups=4, seq_length=8, **(MOE | {"moe_layer_freq": 2}))
    data["meshes"][1]["expert_model_parallel_size"] = 2
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return load_any_plan(path)


def counting_hooks(plan, rank, *, inner):
    """The rehearsal's hooks of ``rank`` (``inner``) plus the test's own count: a forward hook
    on every router adding ``routing_map.sum(0)`` per (step, layer) from the first reported
    step on; it comes back in the rank's report under ``routed``."""
    from megatron.core.transformer.moe.router import Router

    hooks = inner(plan, rank)
    built, started, reported = hooks.on_built, hooks.on_step_start, hooks.report
    routed: dict[tuple[int, int, int], list[int]] = {}  # (step, chunk, layer_number) -> counts
    step = [0]

    def counter(chunk):
        def counted(router, args, output):
            if step[0] + 1 >= REPORTED_FROM:
                counts = output[1].sum(dim=0).tolist()
                key = (step[0] + 1, chunk, router.layer_number)
                have = routed.setdefault(key, [0] * len(counts))
                routed[key] = [a + b for a, b in zip(have, counts)]
        return counted

    def on_built(chunks, optimizer):
        built(chunks, optimizer)
        for c, chunk in enumerate(chunks):
            for module in chunk.modules():
                if isinstance(module, Router):
                    module.register_forward_hook(counter(c))

    def on_step_start(n):
        step[0] = n
        started(n)

    def report():
        return {**reported(), "routed": routed, "rank": rank}

    hooks.on_built, hooks.on_step_start, hooks.report = on_built, on_step_start, report
    return hooks


CASES = {  # name: (plan, the (layer, device type) rows every record has)
    "pp2-dp2-ep2": (lambda tmp_path: _plan(), [(2, H100), (3, A100), (5, A100), (6, A100)]),
    # stage 1 recomputes every layer: its routers run twice per micro-batch, counted once
    "recompute": (lambda tmp_path: _plan([None, {"granularity": "full", "method": "uniform",
                                                 "num_layers": 1}]),
                  [(2, H100), (3, A100), (5, A100), (6, A100)]),
    "interleaved-chain": (_chain, [(1, "RTX3090-24GB"), (3, "RTX3090-24GB"),
                                   (5, "RTX3090-24GB")]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rehearsal_measures_the_experts_load_imbalance(tmp_path, monkeypatch, case):
    """The records' rows name the MoE layers by their number in the whole model (1 = the
    first), on the device type that runs them, and hold exactly the tokens the test's own
    router hooks counted there (summed over the replicas; on the chain, whose chunks number
    their layers from 1, matched as a whole); the imbalances follow from them, at least 1;
    the profile's factor is each device type's over the reported steps, and the cost model
    prices experts at it."""
    make, rows = CASES[case]
    plan = make(tmp_path)
    trained = []
    original = rehearse_module._train

    def train(shrunk, config, hooks):
        result = original(shrunk, config, functools.partial(counting_hooks, inner=hooks))
        trained.append(result)
        return result

    monkeypatch.setattr(rehearse_module, "_train", train)
    out = tmp_path / "run"
    calibration = Calibration(parts={(p, b): (1e-3, 2e-3) for p in ("layer", "embedding",
                                                                      "output") for b in (1, 2)},
                              layer_flops_per_s=1e9)
    result = rehearse(plan, RehearsalConfig(steps=3, hidden_size=16, telemetry=out,
                                            memory_cap=False, meter_memory=False),
                      calibration=calibration)
    (train_result,) = trained
    shrunk = result.plan

    # the independent count: per (step, stage, chunk, router's layer_number) and device type,
    # every replica's ranks summed
    want: dict[tuple, list[int]] = {}
    for r in train_result.ranks:
        slot = shrunk.slot_of_rank(r.extra["rank"])
        device = shrunk.stage_of_slot(slot).device_type
        for (step, chunk, number), counts in r.extra["routed"].items():
            key = (step, shrunk.global_stage(slot), chunk, number, device)
            have = want.setdefault(key, [0] * len(counts))
            want[key] = [a + b for a, b in zip(have, counts)]
    if case != "interleaved-chain":  # one chunk a stage: megatron-core numbers them in the model
        assert sorted((k[3], k[4]) for k in want if k[0] == REPORTED_FROM) == rows
    if case == "recompute":  # the test's hooks saw stage 1's routing twice, alike
        for key in [k for k in want if k[1] == 1]:
            assert all(n % 2 == 0 for n in want[key])
            want[key] = [n // 2 for n in want[key]]

    records = read_records(out)
    assert [r.step for r in records] == [2, 3]
    tokens_per_step = 2 * 4 * shrunk.model.seq_length  # top-2 of every token of 4 samples
    for rec in records:
        assert [(row.layer, row.device_type) for row in rec.experts] == rows
        mine = [(k[4], v) for k, v in want.items() if k[0] == rec.step]
        assert sorted((row.device_type, row.tokens) for row in rec.experts) == sorted(mine)
        for row in rec.experts:
            assert sum(row.tokens) == tokens_per_step
            assert row.imbalance == pytest.approx(max(row.tokens) / (tokens_per_step / 4))
            assert row.imbalance >= 1
        assert rec.moe_load_imbalance == pytest.approx(
            sum(max(v) for _, v in mine) / sum(sum(v) / 4 for _, v in mine))
        assert rec.moe_load_imbalance >= 1

    # the run's profiles carry each device type's imbalance over the reported steps
    for device in sorted({d for _, d in rows}):
        counted = [v for k, v in want.items() if k[4] == device]
        measured = sum(max(v) for v in counted) / sum(sum(v) / 4 for v in counted)
        profile = load_profile(out / f"profile.{device}.yaml")
        assert profile.moe_load_imbalance == pytest.approx(measured)
        assert measured >= 1

    # the cost model prices that device type's routed experts at it: at a shape the run did
    # not measure (TP 2), as a cost model told the factor; more than balanced experts
    device = rows[0][1]
    profile = load_profile(out / f"profile.{device}.yaml")
    factor = profile.moe_load_imbalance
    inventory = inventory_from_data({"groups": [{"gpu": device, "nodes": 1,
                                                 "gpus_per_node": 8}]})
    model = profile.data.model
    from_run = CostModel(model, inventory, profiles={device: profile})
    told = CostModel(model, inventory, moe_load_imbalance=factor)
    balanced = CostModel(model, inventory)
    assert from_run.load_imbalance(device) == factor
    assert from_run.layer_times(device, 1, 2) == told.layer_times(device, 1, 2)
    extra = (factor - 1) * M.expert_forward_flops(model, 1) / 2 / told.flops_rate(device)
    assert told.layer_times(device, 1, 2)[0] == pytest.approx(
        balanced.layer_times(device, 1, 2)[0] + extra)
