"""Placement: launcher ranks in any order land on slots of their own device type; a mismatch
is one clear message; a 1024-rank dry run builds Megatron's groups on the fake backend."""

from __future__ import annotations

import random

import pytest

from megatron_hetero.runtime.placement import (PlacementError, RankInfo, assign_ranks,
                                               detect_device_type, place_this_rank)

from .plans import A100, H100, V100, make_plan


def _infos(types, hosts=None):
    return [RankInfo(launcher_rank=r, device_type=t, host=(hosts[r] if hosts else "h"),
                     local_rank=r % 8) for r, t in enumerate(types)]


def _check(plan, infos, result):
    assert sorted(result) == list(range(plan.world_size))
    for info in infos:
        assert plan.device_type_of_rank(result[info.launcher_rank]) == info.device_type


def test_launcher_order_that_matches_is_kept():
    plan = make_plan(split=(2, 2), devices=[[A100, V100], [A100, V100]], replicas=[(1, 3), (1, 1)])
    types = [plan.device_type_of_rank(r) for r in range(plan.world_size)]
    assert assign_ranks(plan, _infos(types)) == list(range(plan.world_size))


@pytest.mark.parametrize("seed", range(20))
def test_shuffled_launcher_ranks_get_slots_of_their_type(seed):
    rng = random.Random(seed)
    tp = rng.choice([1, 2])
    plan = make_plan(split=(1, 2, 1), tp=tp, heads=4,
                     devices=[[A100, V100, H100], [V100, V100, A100]],
                     replicas=[(1, 2), (1, 1)])
    types = [plan.device_type_of_rank(r) for r in range(plan.world_size)]
    rng.shuffle(types)
    infos = _infos(types)
    result = assign_ranks(plan, infos)
    _check(plan, infos, result)
    assert assign_ranks(plan, list(reversed(infos))) == result  # order of reports is irrelevant


def test_tensor_parallel_groups_stay_on_one_host():
    plan = make_plan(split=(1, 1), tp=2, devices=[[A100, V100], [A100, V100]],
                     replicas=[(1, 1), (1, 1)])
    # hosts: two A100 nodes and two V100 nodes, launcher order interleaved across hosts
    types = [A100, V100, A100, V100, A100, V100, A100, V100]
    hosts = ["a1", "v1", "a2", "v2", "a1", "v1", "a2", "v2"]
    infos = _infos(types, hosts)
    result = assign_ranks(plan, infos)
    _check(plan, infos, result)
    host_of = {result[i.launcher_rank]: i.host for i in infos}
    for first in range(0, 8, 2):
        assert host_of[first] == host_of[first + 1]


def test_mismatch_lists_wanted_and_found_per_type():
    plan = make_plan(split=(1, 1), devices=[[A100, V100], [A100, V100]], replicas=[(1, 1), (1, 1)])
    with pytest.raises(PlacementError) as err:
        assign_ranks(plan, _infos([A100, A100, A100, V100]), source="p.yaml")
    text = str(err.value)
    assert "p.yaml" in text
    assert "plan wants 4 ranks: 2x A100-SXM-80GB, 2x V100-SXM2-32GB" in text
    assert "found      4 ranks: 3x A100-SXM-80GB, 1x V100-SXM2-32GB" in text
    assert "A100-SXM-80GB: plan wants 2, found 3 (launcher ranks 0, 1, 2)" in text
    with pytest.raises(PlacementError, match="found      3 ranks"):
        assign_ranks(plan, _infos([A100, V100, V100]))


def test_world_size_mismatch_is_refused_before_any_exchange():
    plan = make_plan(split=(1, 1), devices=[[A100, V100]])
    with pytest.raises(PlacementError, match="needs world size 2 .* started 3 ranks"):
        place_this_rank(plan, launcher_rank=0, world_size=3, device_type=A100)


def test_detection_override_and_aliases(monkeypatch):
    monkeypatch.delenv("MEGATRON_HETERO_DEVICE_TYPE", raising=False)
    assert detect_device_type(override="NVIDIA H100 80GB HBM3") == H100
    monkeypatch.setenv("MEGATRON_HETERO_DEVICE_TYPE", "v100-sxm2-32gb")
    assert detect_device_type() == V100
    assert detect_device_type(override="H100-SXM5-80GB") == H100  # the flag beats the environment
    monkeypatch.setenv("MEGATRON_HETERO_DEVICE_TYPE", "Mystery GPU 9000")
    with pytest.raises(PlacementError, match="'Mystery GPU 9000' .* not in the GPU catalog"):
        detect_device_type()
    assert detect_device_type(unknown_ok=True) == "unknown: Mystery GPU 9000"


def test_detection_resolves_an_alias_of_the_plans_own_gpu_entry(monkeypatch):
    # A custom card named in the plan's `gpus:`: torch reports its own name, one of the entry's
    # aliases; the plan's catalog (built-in + the plan's entries) maps it to the plan's type.
    import torch

    from megatron_hetero.plan import plan_from_data

    npu = {"vendor": "Acme", "bf16_tflops": 200.0, "bf16": True, "fp32_tflops": 50.0,
           "memory_gb": 64.0, "memory_bandwidth_gb_s": 1000.0, "intra_node_link": "PCIe5",
           "intra_node_bandwidth_gb_s": 64.0, "efficiency": 0.4, "aliases": ["ACME NPU-9 Pro"]}
    data = make_plan(split=(1, 1), devices=[[A100, A100]]).to_data()
    data["pipelines"][0]["stages"][1]["device_type"] = "Acme-NPU"
    data["gpus"] = {"Acme-NPU": npu}
    plan = plan_from_data(data, source="plan.yaml")
    monkeypatch.delenv("MEGATRON_HETERO_DEVICE_TYPE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "ACME NPU-9 Pro")
    assert detect_device_type(catalog=plan.catalog) == "Acme-NPU"
    # the built-in catalog does not know it: the rank reports it as unknown
    assert detect_device_type(unknown_ok=True) == "unknown: ACME NPU-9 Pro"
    with pytest.raises(PlacementError, match="under the plan's `gpus:`"):
        detect_device_type()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    assert detect_device_type(catalog=plan.catalog) == A100
    # launcher ranks 0 (the NPU) and 1 (the A100) swap into the plan's slots
    assert assign_ranks(plan, _infos(["Acme-NPU", A100])) == [1, 0]


def test_hooks_detect_a_plan_defined_type_through_the_plans_catalog(tmp_path, monkeypatch):
    # The runtime's own path: `--hetero-plan` loaded by the hooks, one rank on the CPU backend
    # emulating the plan's custom type (before, the built-in catalog made it "unknown").
    from types import SimpleNamespace

    import yaml

    from megatron_hetero.runtime import hooks

    data = make_plan(split=(2,), devices=[[A100]]).to_data()
    data["pipelines"][0]["stages"][0]["device_type"] = "Acme-NPU"
    data["gpus"] = {"Acme-NPU": {"vendor": "Acme", "bf16_tflops": 200.0, "bf16": True,
                                "fp32_tflops": 50.0, "memory_gb": 64.0,
                                "memory_bandwidth_gb_s": 1000.0, "intra_node_link": "PCIe5",
                                "intra_node_bandwidth_gb_s": 64.0, "efficiency": 0.4}}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    monkeypatch.delenv("MEGATRON_HETERO_DEVICE_TYPE", raising=False)
    monkeypatch.setenv("MEGATRON_HETERO_CPU", "1")
    args = SimpleNamespace(hetero_plan=str(path), rank=0, world_size=1, hetero_device_type=None,
                           tensor_model_parallel_size=1, pipeline_model_parallel_layout=None,
                           micro_batch_size=None, recompute_granularity=None,
                           recompute_method=None, recompute_num_layers=None)
    state = hooks.Runtime().start(args, argv=[]).state
    assert state.device_type == "Acme-NPU" and state.megatron_rank == 0


def _run_placement(rank, world, plan_data, types):
    """One launcher rank: report its type, get its Megatron rank, join gloo with it, and say
    which device types its Megatron pipeline group holds."""
    import os

    import torch
    import torch.distributed as dist

    from megatron_hetero.plan import plan_from_data

    plan = plan_from_data(plan_data)
    os.environ["MEGATRON_HETERO_DEVICE_TYPE"] = types[rank]
    placed = place_this_rank(plan, launcher_rank=rank, world_size=world,
                             device_type=detect_device_type())  # rank 0 hosts the store
    mrank = placed.rank
    dist.init_process_group("gloo", rank=mrank, world_size=world)  # env://, joins the same store
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=plan.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=plan.pipeline_model_parallel_size,
                                 create_gloo_process_groups=False)
    out = [None] * world
    dist.all_gather_object(out, (rank, mrank, types[rank], ps.get_pipeline_model_parallel_rank(),
                                 ps.get_data_parallel_rank()))
    ps.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_shuffled_launcher_ranks_on_gloo():
    from megatron_hetero.mcore.spawn import spawn

    plan = make_plan(split=(1, 1), devices=[[A100, V100], [H100, V100]], replicas=[(1, 3), (1, 1)])
    types = [V100, H100, V100, A100]  # launcher order differs from the plan's
    results = spawn(_run_placement, 4, args=(plan.to_data(), types), init_process_group=False,
                    timeout_s=120)
    table = results[0]
    assert all(r == table for r in results)
    assert sorted(m for _, m, _, _, _ in table) == [0, 1, 2, 3]
    for launcher, mrank, device, pp_rank, dp_rank in table:
        assert plan.stage(dp_rank, pp_rank).device_type == device
        slot = plan.slot_of_rank(mrank)
        assert (slot.pipeline, slot.stage) == (dp_rank, pp_rank)


@pytest.mark.slow
def test_mismatch_on_gloo_every_rank_says_the_same():
    from megatron_hetero.mcore.spawn import spawn

    plan = make_plan(split=(1, 1), devices=[[A100, V100], [A100, V100]], replicas=[(1, 1), (1, 1)])

    messages = spawn(_mismatch_rank, 4, args=(plan.to_data(), [A100, A100, V100, A100]),
                     init_process_group=False, timeout_s=120)
    assert len(set(messages)) == 1 and "plan wants 2, found 3" in messages[0]


def _mismatch_rank(rank, world, plan_data, types):
    from megatron_hetero.plan import plan_from_data
    try:
        place_this_rank(plan_from_data(plan_data), launcher_rank=rank, world_size=world,
                        device_type=types[rank])
    except PlacementError as exc:
        return str(exc)
    return None


def test_1024_ranks_dry_run_on_the_fake_backend():
    """Assignment for 1024 shuffled ranks, every Megatron group checked through megatron-core's
    own RankGenerator, and megatron-core's group construction run on the fake backend."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    tp, pp, dp = 4, 4, 64
    devices = [[H100, H100, A100, A100] if d < 32 else [A100, V100, V100, V100]
               for d in range(dp)]
    plan = make_plan(split=(2, 3, 3, 2), tp=tp, devices=devices,
                     replicas=[(1, 2) if d < 32 else (1, 1) for d in range(dp)])
    assert plan.world_size == 1024
    # 128 nodes of 8 GPUs of one type each; the launcher numbers the GPUs in random order
    gpus = [(f"node{r // 8}", plan.device_type_of_rank(r)) for r in range(1024)]
    random.Random(7).shuffle(gpus)
    hosts, types = [h for h, _ in gpus], [t for _, t in gpus]
    infos = _infos(types, hosts)
    result = assign_ranks(plan, infos)
    _check(plan, infos, result)
    launcher_of = {m: l for l, m in enumerate(result)}

    gen = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for group in gen.get_ranks("pp"):  # one pipeline: its stages in order
        d = plan.slot_of_rank(group[0]).pipeline
        assert [types[launcher_of[m]] for m in group] == [s.device_type
                                                          for s in plan.pipelines[d].stages]
    for group in gen.get_ranks("tp"):  # one stage of one pipeline, on one host
        assert len({types[launcher_of[m]] for m in group}) == 1
        assert len({hosts[launcher_of[m]] for m in group}) == 1

    launcher = 777
    dist.init_process_group("fake", rank=result[launcher], world_size=1024, store=FakeStore())
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                     pipeline_model_parallel_size=pp,
                                     create_gloo_process_groups=False)
        slot = plan.slot_of_rank(result[launcher])
        assert ps.get_pipeline_model_parallel_rank() == slot.stage
        assert ps.get_data_parallel_rank() == slot.pipeline
        assert ps.get_tensor_model_parallel_rank() == slot.tensor_rank
        assert plan.stage(slot.pipeline, slot.stage).device_type == types[launcher]
        pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
        assert [types[launcher_of[m]] for m in pp_ranks] == [
            s.device_type for s in plan.pipelines[slot.pipeline].stages]
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
