"""Plan schema: strict loading, every invariant, round trips (tier 1)."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hetero.errors import SchemaError
from megatron_hetero.hardware import inventory_from_data, load_catalog
from megatron_hetero.plan import (Offload, Plan, Recompute, Slot, load_plan, plan_from_data,
                                  save_plan)
from megatron_hetero.placement.inventory import check_against_inventory

from .conftest import EXAMPLE_PLANS, REPO

BASE = yaml.safe_load((REPO / "tests/data/plan_a100_v100.yaml").read_text())


def _mutate(path: str, value):
    """A deep copy of BASE with the dotted/indexed ``path`` set to ``value`` (or deleted)."""
    data = copy.deepcopy(BASE)
    keys = []
    for part in path.replace("]", "").split("."):
        name, *idx = part.split("[")
        keys.append(name)
        keys.extend(int(i) for i in idx)
    target = data
    for k in keys[:-1]:
        target = target[k]
    if value is _DELETE:
        del target[keys[-1]]
    else:
        target[keys[-1]] = value
    return data


_DELETE = object()


def test_example_plans_load_and_round_trip(tmp_path):
    assert EXAMPLE_PLANS, "no example plans found"
    for path in EXAMPLE_PLANS:
        plan = load_plan(path)
        out = tmp_path / "plan.yaml"
        save_plan(plan, out)
        assert load_plan(out) == plan


# (mutation path, new value, field path the error must name, a phrase of the expectation)
BAD = [
    ("format_version", 3, "format_version", "one of 1"),
    ("model.num_layers", "32", "model.num_layers", "an integer"),
    ("model.hidden_size", True, "model.hidden_size", "an integer"),
    ("model.seq_length", _DELETE, "model.seq_length", "missing"),
    ("model.num_query_groups", 5, "model.num_query_groups", "divisor of num_attention_heads"),
    ("model.hidden_size", 4100, "model.hidden_size", "multiple of num_attention_heads"),
    ("model.colour", "red", "model.colour", "unknown key"),
    ("global_batch_size", 127, "global_batch_size", "sum over pipelines"),
    ("global_batch_size", 0, "global_batch_size", "positive"),
    ("tensor_model_parallel_size", 3, "tensor_model_parallel_size", "divisor"),
    ("pipelines", [], "pipelines", "at least one pipeline"),
    ("pipelines[1].stages[1].num_layers", 17, "pipelines[1].stages[1].num_layers", "as in pipelines[0]"),
    ("pipelines[0].stages[0].num_layers", 13, "pipelines[1].stages[0].num_layers", "as in pipelines[0]"),
    ("pipelines[1].num_microbatches", 0, "pipelines[1].num_microbatches", "positive"),
    ("pipelines[0].micro_batch_size", 1.5, "pipelines[0].micro_batch_size", "an integer"),
    ("pipelines[0].stages[0].device_type", "Z80", "pipelines[0].stages[0].device_type", "catalog"),
    ("pipelines[0].stages[0].device_type", "NVIDIA A100-SXM4-80GB",
     "pipelines[0].stages[0].device_type", "canonical"),
    ("pipelines[0].stages[0].recompute", {"granularity": "full"},
     "pipelines[0].stages[0].recompute.method", "uniform"),
    ("pipelines[0].stages[0].recompute", {"granularity": "partial"},
     "pipelines[0].stages[0].recompute.granularity", "'selective'"),
    ("pipelines[0].stages[0].recompute",
     {"granularity": "full", "method": "block", "num_layers": 15},
     "pipelines[0].stages[0].recompute.num_layers", "at most the stage's num_layers"),
    ("pipelines[0].stages[0].recompute", {"granularity": "none", "num_layers": 2},
     "pipelines[0].stages[0].recompute.num_layers", "nothing"),
    ("pipelines[0].stages[0].offload", {"optimizer_fraction": 1.5},
     "pipelines[0].stages[0].offload.optimizer_fraction", "[0, 1]"),
    ("pipelines[0].stages[0].offload", {"cpu": True}, "pipelines[0].stages[0].offload.cpu", "unknown"),
    ("precision", "bf16", "precision", "has no bf16"),
    ("precision", "int8", "precision", "'fp16'"),
]


@pytest.mark.parametrize("mutation,value,field_path,phrase", BAD, ids=[b[0] + "=" + repr(b[1])[:20] for b in BAD])
def test_bad_plan_names_the_field(mutation, value, field_path, phrase):
    with pytest.raises(SchemaError) as info:
        plan_from_data(_mutate(mutation, value), source="plan.yaml")
    err = info.value
    assert err.path == field_path
    assert phrase in str(err)
    assert str(err).startswith("plan.yaml: " + field_path + ": found ")


def test_stage_counts_must_agree():
    data = copy.deepcopy(BASE)
    data["pipelines"][1]["stages"].append(copy.deepcopy(data["pipelines"][1]["stages"][1]))
    with pytest.raises(SchemaError, match=r"pipelines\[1\]\.stages: found 3 stages; expected 2 stages"):
        plan_from_data(data)


def test_layers_must_add_up():
    data = copy.deepcopy(BASE)
    for pipe in data["pipelines"]:
        pipe["stages"][1]["num_layers"] = 10
    with pytest.raises(SchemaError, match=r"layers adding up to 24; expected layers adding up to "
                                          r"model.num_layers \(32\)"):
        plan_from_data(data)


def test_middle_stage_needs_a_layer():
    data = copy.deepcopy(BASE)
    for pipe in data["pipelines"]:
        mid = copy.deepcopy(pipe["stages"][0])
        mid["num_layers"] = 0
        pipe["stages"].insert(1, mid)
    with pytest.raises(SchemaError, match=r"pipelines\[0\]\.stages\[1\]\.num_layers"):
        plan_from_data(data)


def test_yaml_syntax_error_and_missing_file(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(SchemaError, match="broken.yaml: line"):
        load_plan(bad)
    with pytest.raises(SchemaError, match="a readable YAML file"):
        load_plan(tmp_path / "absent.yaml")


def _inventory(a100: int, v100: int, per_node: int = 8):
    groups = [{"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": a100}] if a100 else []
    groups += [{"gpu": "V100-SXM2-32GB", "nodes": 1, "gpus_per_node": v100}] if v100 else []
    return inventory_from_data({"groups": groups}, source="inv.yaml")


def test_against_inventory():
    plan = plan_from_data(BASE)
    check_against_inventory(plan, _inventory(2, 2))
    with pytest.raises(SchemaError, match="found 2 GPUs of type V100-SXM2-32GB; expected at most 1"):
        check_against_inventory(plan, _inventory(8, 1), source="plan.yaml")
    with pytest.raises(SchemaError, match="at most 0"):
        check_against_inventory(plan, _inventory(8, 0))
    wide = _mutate("tensor_model_parallel_size", 4)
    wide["global_batch_size"] = 128
    plan4 = plan_from_data(wide)
    with pytest.raises(SchemaError, match="tensor-parallel group stays inside a node"):
        check_against_inventory(plan4, inventory_from_data(
            {"groups": [{"gpu": "A100-SXM-80GB", "nodes": 4, "gpus_per_node": 2},
                        {"gpu": "V100-SXM2-32GB", "nodes": 4, "gpus_per_node": 2}]}))


def test_rank_slots_follow_megatron_order():
    data = _mutate("tensor_model_parallel_size", 2)
    plan = plan_from_data(data)
    tp, dp, pp = 2, plan.data_parallel_size, plan.pipeline_model_parallel_size
    seen = set()
    for rank in range(plan.world_size):
        slot = plan.slot_of_rank(rank)
        # Megatron's default order tp-cp-ep-dp-pp: tp fastest, then dp, then pp.
        assert slot == Slot(mesh=0, stage=rank // (tp * dp), replica=(rank // tp) % dp,
                           tensor_rank=rank % tp)
        assert plan.rank_of_slot(slot) == rank
        seen.add(slot)
    assert len(seen) == tp * dp * pp
    assert plan.device_type_of_rank(2) == "A100-SXM-80GB"  # pipeline 1, stage 0
    assert plan.device_type_of_rank(4) == "V100-SXM2-32GB"  # pipeline 0, stage 1


def test_replica_sample_ranges_tile_the_global_batch():
    plan = plan_from_data(BASE)
    ranges = [plan.replica_sample_range(d) for d in range(plan.data_parallel_size)]
    assert ranges == [(0, 70), (70, 58)]


# -- property: any plan the code writes loads back equal and valid -------------------------------

_CATALOG = load_catalog()
_TYPES = sorted(_CATALOG.names())


@st.composite
def plans(draw) -> Plan:
    heads = draw(st.sampled_from([4, 8, 16, 32]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4, 8, 16, 32) if heads % g == 0]))
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if heads % t == 0 and groups % t == 0]))
    pp = draw(st.integers(1, 5))
    split = [draw(st.integers(1, 6)) for _ in range(pp)]
    if pp > 1 and draw(st.booleans()):
        split[0] = 0  # an embedding-only first stage is legal
    dp = draw(st.integers(1, 4))
    types = draw(st.lists(st.sampled_from(_TYPES), min_size=pp, max_size=pp))
    precision = "bf16" if all(_CATALOG.get(t).bf16 for t in types) else "fp16"
    pipelines = []
    for _ in range(dp):
        stages = []
        for s in range(pp):
            kind = draw(st.sampled_from(["none", "selective", "full"]))
            if kind == "full" and split[s] >= 1:
                recompute = {"granularity": "full", "method": draw(st.sampled_from(["uniform", "block"])),
                             "num_layers": draw(st.integers(1, split[s]))}
            else:
                recompute = {"granularity": "selective" if kind == "selective" else "none"}
            stages.append({"device_type": types[s] if draw(st.booleans()) else draw(st.sampled_from(_TYPES)),
                           "num_layers": split[s], "recompute": recompute,
                           "offload": {"optimizer_fraction": draw(st.sampled_from([0.0, 0.25, 1.0]))}})
        pipelines.append({"micro_batch_size": draw(st.integers(1, 4)),
                          "num_microbatches": draw(st.integers(1, 80)), "stages": stages})
    if any(not _CATALOG.get(s["device_type"]).bf16 for p in pipelines for s in p["stages"]):
        precision = "fp16"
    data = {
        "format_version": 1,
        "model": {"name": "m", "num_layers": sum(split), "hidden_size": heads * 64,
                  "ffn_hidden_size": heads * 172, "num_attention_heads": heads,
                  "num_query_groups": groups, "vocab_size": 32000, "seq_length": 2048},
        "global_batch_size": sum(p["micro_batch_size"] * p["num_microbatches"] for p in pipelines),
        "tensor_model_parallel_size": tp,
        "pipelines": pipelines,
        "precision": precision,
        "use_distributed_optimizer": draw(st.booleans()),
    }
    return plan_from_data(data, source="generated")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plans())
def test_written_plans_load_back_equal(plan, tmp_path):
    out = tmp_path / "plan.yaml"
    save_plan(plan, out)
    again = load_plan(out)
    assert again == plan
    assert again.world_size == plan.tensor_model_parallel_size * len(plan.layer_split) * len(plan.pipelines)
    assert sum(plan.device_counts().values()) == plan.world_size


def _interleaved(chunks0, chunks1, v=2):
    data = copy.deepcopy(BASE)
    data["virtual_pipeline_size"] = v
    for pipe in data["pipelines"]:
        for stage, chunks in zip(pipe["stages"], (chunks0, chunks1)):
            stage["chunk_layers"] = list(chunks)
            stage["num_layers"] = sum(chunks)
    return data


def test_interleaved_plan_lays_out_chunks_in_model_order(tmp_path):
    plan = plan_from_data(_interleaved([6, 8], [10, 8]))
    assert plan.layer_split == [14, 18]
    assert plan.virtual_stage_layers == [6, 10, 8, 8]  # chunk 0 of stages 0, 1; then chunk 1
    assert plan.layout() == "Et*6|t*10|t*8|t*8L"
    save_plan(plan, tmp_path / "p.yaml")
    assert load_plan(tmp_path / "p.yaml") == plan


@pytest.mark.parametrize("data, field_path, phrase", [
    (_interleaved([6, 8], [10, 8], v=3), r"stages\[0\]\.chunk_layers", "a list of 3 layer counts"),
    (_mutate("pipelines[0].stages[0].chunk_layers", [7, 7]), r"stages\[0\]\.chunk_layers",
     "absent \\(virtual_pipeline_size is 1\\)"),
    (dict(_interleaved([6, 8], [10, 8]), virtual_pipeline_size=0), "virtual_pipeline_size",
     "a positive integer"),
    (_interleaved([14, 0], [10, 8]), r"pipelines\[0\]\.stages\[0\]\.chunk_layers\[1\]",
     "at least 1 layer"),
])
def test_bad_interleaving_names_the_field(data, field_path, phrase):
    with pytest.raises(SchemaError, match=field_path + ".*" + phrase):
        plan_from_data(data)


def test_interleaving_needs_micro_batches_in_groups_of_the_pipeline_size():
    data = _interleaved([6, 8], [10, 8])
    data["pipelines"][0]["num_microbatches"] = 69
    data["pipelines"][1]["num_microbatches"] = 59
    with pytest.raises(SchemaError, match=r"pipelines\[0\]\.num_microbatches: found 69; expected a "
                                          r"multiple of the 2 pipeline stages"):
        plan_from_data(data)


def test_a_micro_batch_group_lets_the_counts_skip_the_pipeline_size():
    """69 and 57 micro-batches on 2 stages run in whole groups of 3 (57 % 2 = 1): accepted with
    microbatch_group_size 3, as Megatron's interleaved schedule takes them; a group they do
    not fill is refused."""
    from megatron_hetero.schedule.rules import whole_group
    data = _interleaved([6, 8], [10, 8])
    data["pipelines"][0]["num_microbatches"] = 69
    data["pipelines"][1]["num_microbatches"] = 57
    data["global_batch_size"] = 69 * data["pipelines"][0]["micro_batch_size"] + \
        57 * data["pipelines"][1]["micro_batch_size"]
    assert plan_from_data(dict(data, microbatch_group_size=3)).microbatch_group_size == 3
    with pytest.raises(SchemaError, match=r"microbatch_group_size: found 4"):
        plan_from_data(dict(data, microbatch_group_size=4))  # 69 % 4 = 1 < 2
    assert whole_group(2, [69, 57]) == 3 and whole_group(3, [256]) == 4
    assert whole_group(2, [8, 6]) == 2 and whole_group(3, [7]) is None


def test_micro_batch_group_round_trips_and_is_left_out_when_unset(tmp_path):
    data = dict(_interleaved([6, 8], [10, 8]), microbatch_group_size=4)  # 70 % 4, 58 % 4 = 2
    plan = plan_from_data(data)
    assert plan.microbatch_group == 4
    save_plan(plan, tmp_path / "p.yaml")
    assert load_plan(tmp_path / "p.yaml") == plan
    default = plan_from_data(_interleaved([6, 8], [10, 8]))
    assert default.microbatch_group == 2  # Megatron's default: the pipeline size
    assert "microbatch_group_size" not in default.to_data()


@pytest.mark.parametrize("group, v, phrase", [
    (4, 1, r"found 4; expected absent \(it groups the micro-batches of the interleaved schedule"),
    (1, 2, r"found 1; expected between the 2 pipeline stages and pipelines\[0\]'s 70"),
    (3, 2, r"found 3; expected between the 2 pipeline stages and pipelines\[0\]'s 70 micro-batches, "
           r"with 70 % group 0 or at least 2"),
    (60, 2, r"found 60; expected between the 2 pipeline stages and pipelines\[1\]'s 58"),
])
def test_bad_micro_batch_group_names_the_field(group, v, phrase):
    data = _interleaved([6, 8], [10, 8]) if v > 1 else copy.deepcopy(BASE)
    data["microbatch_group_size"] = group
    with pytest.raises(SchemaError, match="microbatch_group_size: " + phrase):
        plan_from_data(data)


def test_chunks_must_agree_across_pipelines():
    data = _interleaved([6, 8], [10, 8])
    data["pipelines"][1]["stages"][0]["chunk_layers"] = [8, 6]
    with pytest.raises(SchemaError, match=r"pipelines\[1\]\.stages\[0\]\.chunk_layers: found \[8, 6\]; "
                                          r"expected \[6, 8\], as in pipelines\[0\]"):
        plan_from_data(data)


def test_overlap_grad_reduce_is_a_strict_flag(tmp_path):
    data = copy.deepcopy(BASE)
    assert plan_from_data(data).overlap_grad_reduce is False
    data["overlap_grad_reduce"] = True
    plan = plan_from_data(data)
    save_plan(plan, tmp_path / "p.yaml")
    assert load_plan(tmp_path / "p.yaml").overlap_grad_reduce is True
    data["overlap_grad_reduce"] = "yes"
    with pytest.raises(SchemaError, match="overlap_grad_reduce"):
        plan_from_data(data)


# -- the plan's own catalog entries (`gpus:`) ------------------------------------------------------

ACME = {"vendor": "Acme", "bf16_tflops": 200.0, "bf16": True, "fp32_tflops": 50.0,
        "memory_gb": 64.0, "memory_bandwidth_gb_s": 1000.0, "intra_node_link": "PCIe5",
        "intra_node_bandwidth_gb_s": 64.0, "efficiency": 0.4, "aliases": ["ACME NPU-9 Pro"]}


def _with_gpus(gpus=None, first="Acme-NPU", second="A100-SXM-80GB"):
    """BASE with its stage-0 type replaced by ``first`` and stage-1 type by ``second``."""
    data = copy.deepcopy(BASE)
    for pipe in data["pipelines"]:
        pipe["stages"][0]["device_type"] = first
        pipe["stages"][1]["device_type"] = second
    data["gpus"] = copy.deepcopy(gpus if gpus is not None else
                                 {"Acme-NPU": ACME,
                                  "A100-SXM-80GB": {**_spec_data("A100-SXM-80GB"), "efficiency": 0.55}})
    return data


def _spec_data(name):
    spec = load_catalog().get(name)
    return {f: getattr(spec, f) for f in ("vendor", "bf16_tflops", "bf16", "fp32_tflops",
                                          "memory_gb", "memory_bandwidth_gb_s", "intra_node_link",
                                          "intra_node_bandwidth_gb_s", "efficiency", "aliases")}


def test_plan_gpus_round_trip_and_extend_the_catalog(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(_with_gpus()))
    plan = load_plan(path)
    assert plan.gpus["Acme-NPU"].bf16_tflops == 200.0
    assert plan.catalog.resolve("acme npu-9 pro") == "Acme-NPU"       # by its alias
    assert plan.catalog.get("A100-SXM-80GB").efficiency == 0.55        # the plan's figure wins
    assert plan.catalog.get("V100-SXM2-32GB") == load_catalog().get("V100-SXM2-32GB")
    assert load_catalog().resolve("Acme-NPU") is None                  # built-in untouched
    out = tmp_path / "again.yaml"
    save_plan(plan, out)
    saved = yaml.safe_load(out.read_text())
    assert saved["gpus"]["Acme-NPU"] == ACME
    assert list(saved)[-1] == "gpus"  # after the plan's own keys (BASE has no prediction)
    assert load_plan(out) == plan
    # and a plan without the key writes none
    assert "gpus" not in plan_from_data(BASE).to_data()


def test_plan_without_the_entry_of_a_custom_type_is_refused():
    data = _with_gpus({})
    with pytest.raises(SchemaError, match=r"pipelines\[0\]\.stages\[0\]\.device_type: found "
                                          r"'Acme-NPU'; expected a GPU in the catalog"):
        plan_from_data(data, source="plan.yaml")


@pytest.mark.parametrize("change,path,phrase", [
    (lambda g: g["Acme-NPU"].pop("memory_gb"), "gpus.Acme-NPU.memory_gb", "the key is missing"),
    (lambda g: g["Acme-NPU"].update(efficiency=1.5), "gpus.Acme-NPU.efficiency", "(0, 1]"),
    (lambda g: g["Acme-NPU"].update(bf16="yes"), "gpus.Acme-NPU.bf16", "true or false"),
    (lambda g: g["Acme-NPU"].update(speed=3), "gpus.Acme-NPU.speed", "unknown key"),
    (lambda g: g["Acme-NPU"].update(aliases=["NVIDIA A100-SXM4-80GB"]),
     "gpus.Acme-NPU.aliases[0]", "A100-SXM-80GB does"),
    (lambda g: g.update({"NVIDIA A100-SXM4-80GB": g.pop("A100-SXM-80GB")}),
     "gpus.NVIDIA A100-SXM4-80GB", "canonical name 'A100-SXM-80GB'"),
    (lambda g: g["Acme-NPU"].update(bf16=False), "precision", "Acme-NPU"),
])
def test_bad_plan_gpus_entries_name_the_field(change, path, phrase):
    data = _with_gpus()
    data["precision"] = "bf16"  # every type of the plan has bf16 unless `change` says otherwise
    change(data["gpus"])
    with pytest.raises(SchemaError) as info:
        plan_from_data(data, source="plan.yaml")
    msg = str(info.value)
    assert msg.startswith(f"plan.yaml: {path}: found "), msg
    assert phrase in msg, msg


def test_plan_gpus_must_agree_with_a_given_inventory():
    plan = plan_from_data(_with_gpus(), source="plan.yaml")
    groups = [{"gpu": "Acme-NPU", "nodes": 1, "gpus_per_node": 2},
              {"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 2}]
    same = inventory_from_data({"gpus": {"Acme-NPU": ACME, "NVIDIA A100-SXM4-80GB": {"efficiency": 0.55}},
                                "groups": groups}, source="inv.yaml")
    check_against_inventory(plan, same, source="plan.yaml")
    again = plan_from_data(plan.to_data(), source="plan.yaml", catalog=same.catalog)
    assert again == plan
    changed = inventory_from_data({"gpus": {"Acme-NPU": {**ACME, "bf16_tflops": 250.0},
                                            "A100-SXM-80GB": {"efficiency": 0.55}},
                                   "groups": groups}, source="inv.yaml")
    with pytest.raises(SchemaError, match=r"plan\.yaml: gpus\.Acme-NPU\.bf16_tflops: found 200\.0; "
                                          r"expected 250\.0, as in inv\.yaml's catalog entry"):
        check_against_inventory(plan, changed, source="plan.yaml")
    # the plan's A100 figures are an override the inventory no longer makes
    plain = inventory_from_data({"gpus": {"Acme-NPU": ACME}, "groups": groups}, source="inv.yaml")
    with pytest.raises(SchemaError, match=r"gpus\.A100-SXM-80GB\.efficiency: found 0\.55"):
        check_against_inventory(plan, plain, source="plan.yaml")


def test_recompute_and_offload_hash_as_their_fields_in_any_process():
    # each keeps its hash; a copy unpickled in a process with other string hashes computes its
    # own, so it still finds what an equal one keyed
    r = Recompute(granularity="full", method="block", num_layers=3)
    assert hash(r) == hash(("full", "block", 3))
    assert hash(Offload(module_inputs=True)) == hash((0.0, False, True))
    blob = pickle.dumps([r, Offload(optimizer_fraction=0.5)])
    script = ("import pickle, sys\n"
              "from megatron_hetero.plan import Offload, Recompute\n"
              "r, o = pickle.loads(sys.stdin.buffer.read())\n"
              "table = {Recompute(granularity='full', method='block', num_layers=3): 1,\n"
              "         Offload(optimizer_fraction=0.5): 2}\n"
              "print(table[r], table[o])\n")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", script], input=blob, capture_output=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, cwd=REPO, check=True)
        assert out.stdout.split() == [b"1", b"2"]
