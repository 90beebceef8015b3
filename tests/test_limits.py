"""Sizes beyond any real model or cluster (issue 18, item 2): one line naming the field and the
limit, before any search. Before, a million layers ran out of memory in the tables (a 7 TiB
numpy array) and ``nodes: 10^30`` ran for minutes with no output."""

from __future__ import annotations

import pytest

from megatron_hetero._schema import read_yaml, write_yaml
from megatron_hetero.cli import main
from megatron_hetero.errors import SchemaError
from megatron_hetero.limits import MODEL_SIZES, MOST_GPUS
from megatron_hetero.models import model_preset as get_model

from .conftest import REPO, one_line_error

INVENTORY = REPO / "examples/llama2/7b/inventory.yaml"
PLAN = REPO / "examples/llama2/7b/plan.yaml"


def _model_file(tmp_path, **sizes):
    data = {"name": "custom", **{k: getattr(get_model("llama2-7b"), k) for k in MODEL_SIZES}}
    data.update(sizes)
    path = tmp_path / "m.yaml"
    write_yaml(data, path)
    return path


@pytest.mark.parametrize("key", sorted(MODEL_SIZES))
def test_each_model_size_above_its_limit_is_named(key, tmp_path, capsys):
    model = _model_file(tmp_path, **{key: MODEL_SIZES[key] * 1000})
    assert main(["tune", str(INVENTORY), "--model", str(model), "--global-batch-size", "64",
                 "-o", str(tmp_path / "p.yaml")]) == 1
    err = one_line_error(capsys, "tune")
    assert f"m.yaml: {key}: " in err and f"at most {MODEL_SIZES[key]:,}" in err
    assert not (tmp_path / "p.yaml").exists()


def test_a_million_layers_in_a_plan_is_refused_with_its_field_path(tmp_path, capsys):
    data = read_yaml(PLAN)
    data["model"]["num_layers"] = 10**6
    write_yaml(data, tmp_path / "p.yaml")
    assert main(["validate", str(tmp_path / "p.yaml")]) == 1
    assert "p.yaml: model.num_layers: found 1000000; expected a positive integer of at most " \
           "512" in one_line_error(capsys, "validate")


def test_the_limits_are_inclusive():
    spec = get_model("llama2-7b")
    fields = {k: getattr(spec, k) for k in ("name", "swiglu", "normalization")}
    from megatron_hetero.plan import ModelSpec

    top = ModelSpec(**fields, num_layers=MODEL_SIZES["num_layers"], hidden_size=4096,
                    ffn_hidden_size=11008, num_attention_heads=32, num_query_groups=32,
                    vocab_size=MODEL_SIZES["vocab_size"], seq_length=MODEL_SIZES["seq_length"])
    assert top.num_layers == 512
    with pytest.raises(SchemaError, match="num_layers"):
        ModelSpec(**fields, num_layers=513, hidden_size=4096, ffn_hidden_size=11008,
                  num_attention_heads=32, num_query_groups=32, vocab_size=32000, seq_length=4096)


@pytest.mark.parametrize("groups, path", [
    # one group of 10^30 nodes, named at its own field
    ([{"gpu": "A100-SXM-80GB", "nodes": 10**30, "gpus_per_node": 8}], "groups[0].nodes"),
    # two groups each within the limit, over it together
    ([{"gpu": "A100-SXM-80GB", "nodes": MOST_GPUS // 8, "gpus_per_node": 8},
      {"gpu": "V100-SXM2-32GB", "nodes": 1, "gpus_per_node": 8}], "groups"),
])
def test_more_gpus_than_any_cluster_are_refused_before_the_search(groups, path, tmp_path,
                                                                  capsys):
    write_yaml({"groups": groups}, tmp_path / "inv.yaml")
    assert main(["tune", str(tmp_path / "inv.yaml"), "--model", "llama2-7b",
                 "--global-batch-size", "64", "-o", str(tmp_path / "p.yaml")]) == 1
    err = one_line_error(capsys, "tune")
    assert f"inv.yaml: {path}: " in err and f"at most {MOST_GPUS:,} GPUs in all" in err


def test_a_pool_at_the_limit_loads():
    from megatron_hetero.hardware import GPUGroup

    assert GPUGroup(gpu="A100-SXM-80GB", nodes=MOST_GPUS // 8, gpus_per_node=8).num_gpus == MOST_GPUS
