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


def _plan():
    """PP2 x DP2 x EP2 of the tiny MoE model, 2:4 layers, stage 0 on H100, stage 1 on A100."""
    data = tiny_plan([2, 4], [(1, 2), (1, 2)], expert_model_parallel_size=2, **MOE).to_data()
    for pipe in data["pipelines"]:
        pipe["stages"][0]["device_type"] = H100
    return plan_from_data(data)


def counting_hooks(plan, rank, *, inner):
    """The rehearsal's hooks of ``rank`` (``inner``) plus the test's own count: a forward hook
    on every router adding ``routing_map.sum(0)`` per (step, layer) from the first reported
    step on; it comes back in the rank's report under ``routed``."""
    from megatron.core.transformer.moe.router import Router

    hooks = inner(plan, rank)
    built, started, reported = hooks.on_built, hooks.on_step_start, hooks.report
    routed: dict[tuple[int, int], list[int]] = {}
    step = [0]

    def counted(router, args, output):
        if step[0] + 1 >= REPORTED_FROM:
            counts = output[1].sum(dim=0).tolist()
            have = routed.setdefault((step[0] + 1, router.layer_number), [0] * len(counts))
            routed[(step[0] + 1, router.layer_number)] = [a + b for a, b in zip(have, counts)]

    def on_built(chunks, optimizer):
        built(chunks, optimizer)
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, Router):
                    module.register_forward_hook(counted)

    def on_step_start(n):
        step[0] = n
        started(n)

    def report():
        return {**reported(), "routed": routed, "rank": rank}

    hooks.on_built, hooks.on_step_start, hooks.report = on_built, on_step_start, report
    return hooks


def test_rehearsal_measures_the_experts_load_imbalance(tmp_path, monkeypatch):
    plan = _plan()
    trained = []
    original = rehearse_module._train

    def train(shrunk, config, hooks):
        result = original(shrunk, config, functools.partial(counting_hooks, inner=hooks))
        trained.append(result)
        return result

    monkeypatch.setattr(rehearse_module, "_train", train)
    out = tmp_path / "run"
    calibration = Calibration(parts={(p, 1): (1e-3, 2e-3) for p in ("layer", "embedding",
                                                                      "output")},
                              layer_flops_per_s=1e9)
    result = rehearse(plan, RehearsalConfig(steps=3, hidden_size=16, telemetry=out,
                                            memory_cap=False, meter_memory=False),
                      calibration=calibration)
    (train_result,) = trained
    shrunk = result.plan

    # the independent count: per (step, layer, device type), every rank of that type summed
    want: dict[tuple[int, int, str], list[int]] = {}
    for r in train_result.ranks:
        device = shrunk.stage_of_slot(shrunk.slot_of_rank(r.extra["rank"])).device_type
        for (step, layer), counts in r.extra["routed"].items():
            have = want.setdefault((step, layer, device), [0] * len(counts))
            want[(step, layer, device)] = [a + b for a, b in zip(have, counts)]

    records = read_records(out)
    assert [r.step for r in records] == [2, 3]
    tokens_per_step = 2 * 4 * shrunk.model.seq_length  # top-2 of every token of 4 samples
    for rec in records:
        got = {(rec.step, row.layer, row.device_type): row.tokens for row in rec.experts}
        mine = {k: v for k, v in want.items() if k[0] == rec.step}
        assert got == mine
        # MoE layers 2 (stage 0: layers 1-2, H100) and 3, 5, 6 (stage 1: layers 3-6, A100),
        # megatron-core's numbers over the whole model
        assert [(row.layer, row.device_type) for row in rec.experts] == [
            (2, H100), (3, A100), (5, A100), (6, A100)]
        for row in rec.experts:
            assert sum(row.tokens) == tokens_per_step
            assert row.imbalance == pytest.approx(max(row.tokens) / (tokens_per_step / 4))
            assert row.imbalance >= 1
        assert rec.moe_load_imbalance == pytest.approx(
            sum(max(v) for v in mine.values()) / sum(sum(v) / 4 for v in mine.values()))
        assert rec.moe_load_imbalance >= 1

    # the run's profiles carry each device type's imbalance over the reported steps
    for device in (H100, A100):
        rows = [v for (s, layer, d), v in want.items() if d == device]
        measured = sum(max(v) for v in rows) / sum(sum(v) / 4 for v in rows)
        profile = load_profile(out / f"profile.{device}.yaml")
        assert profile.moe_load_imbalance == pytest.approx(measured)
        assert measured >= 1

    # the cost model prices that device type's routed experts at it: at a shape the run did
    # not measure (TP 2), as a cost model told the factor; more than balanced experts
    profile = load_profile(out / f"profile.{H100}.yaml")
    factor = profile.moe_load_imbalance
    inventory = inventory_from_data({"groups": [{"gpu": H100, "nodes": 1, "gpus_per_node": 8},
                                                {"gpu": A100, "nodes": 1, "gpus_per_node": 8}]})
    model = profile.data.model
    from_run = CostModel(model, inventory, profiles={H100: profile})
    told = CostModel(model, inventory, moe_load_imbalance=factor)
    balanced = CostModel(model, inventory)
    assert from_run.load_imbalance(H100) == factor
    assert from_run.layer_times(H100, 1, 2) == told.layer_times(H100, 1, 2)
    extra = (factor - 1) * M.expert_forward_flops(model, 1) / 2 / told.flops_rate(H100)
    assert told.layer_times(H100, 1, 2)[0] == pytest.approx(
        balanced.layer_times(H100, 1, 2)[0] + extra)
