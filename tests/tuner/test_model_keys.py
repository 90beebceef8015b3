"""The model keys Qwen2/2.5, Qwen3, Gemma and Mistral need (issue 32 A.9), in Megatron's names:
counted in the cost model (published parameter counts), carried into ``args``, written to a
plan only where set."""

from __future__ import annotations

import pytest
import yaml

from megatron_hetero import models as M
from megatron_hetero.cli import main
from megatron_hetero.errors import SchemaError
from megatron_hetero.plan import ModelSpec
from megatron_hetero.plan.megatron_args import megatron_args
from megatron_hetero.plan.format1 import uniform_plan
from megatron_hetero.plan.stages import Pipeline, Stage
from megatron_hetero._schema import from_data, to_data

QWEN25_7B = ModelSpec(name="qwen2.5-7b", num_layers=28, hidden_size=3584, ffn_hidden_size=18944,
                      num_attention_heads=28, num_query_groups=4, vocab_size=152064,
                      seq_length=4096, add_qkv_bias=True, rotary_base=1000000)
QWEN3_8B = ModelSpec(name="qwen3-8b", num_layers=36, hidden_size=4096, ffn_hidden_size=12288,
                     num_attention_heads=32, num_query_groups=8, vocab_size=151936,
                     seq_length=4096, qk_layernorm=True, kv_channels=128, rotary_base=1000000)
GEMMA_7B = ModelSpec(name="gemma-7b", num_layers=28, hidden_size=3072, ffn_hidden_size=24576,
                     num_attention_heads=16, num_query_groups=16, vocab_size=256000,
                     seq_length=8192, kv_channels=256, untie_embeddings_and_output_weights=False)


@pytest.mark.parametrize("model, published", [
    (QWEN25_7B, 7_615_616_512),   # Qwen2.5-7B: QKV bias, untied
    (QWEN3_8B, 8_190_735_360),    # Qwen3-8B: QK norms
    (GEMMA_7B, 8_537_680_896),    # Gemma-7B: heads of 256 channels on a 3072 hidden size, tied
])
def test_parameter_counts_are_the_published_ones(model, published):
    # one stage: a tied output layer is the embedding itself (Megatron copies it to the last
    # stage only when there is more than one)
    total = model.num_layers * M.layer_params(model) + M.embedding_params(model) + \
        M.output_params(model, single_stage=True)
    assert total == published


def test_head_size_sets_the_attention_widths():
    """Gemma's queries are 16 x 256 = 4096 wide on a 3072 hidden size: QKV, scores and the
    projection are priced at that width."""
    b, s, h = 1, GEMMA_7B.seq_length, GEMMA_7B.hidden_size
    q = kv = 16 * 256
    f = GEMMA_7B.ffn_hidden_size
    want = 2 * b * s * h * (q + 2 * kv) + 2 * b * s * q * h + 2 * b * s * h * f * 3 \
        + 4 * b * s * s * q
    assert M.layer_forward_flops(GEMMA_7B, b) == want
    plain = ModelSpec(**{**to_data(GEMMA_7B), "kv_channels": None})
    assert M.layer_forward_flops(plain, b) < want  # 192-channel heads: narrower
    assert M.layer_activation_bytes(GEMMA_7B, 1, 1, "selective") > \
        M.layer_activation_bytes(plain, 1, 1, "selective")


def _plan(model):
    stage = Stage(device_type="H100-SXM-80GB", num_layers=model.num_layers)
    return uniform_plan(model=model, global_batch_size=8, tensor_model_parallel_size=1,
                        pipelines=[Pipeline(micro_batch_size=1, num_microbatches=8,
                                            stages=[stage])])


def test_args_carry_the_keys_in_megatrons_names():
    args = " ".join(megatron_args(_plan(QWEN3_8B)))
    assert "--qk-layernorm" in args and "--kv-channels 128" in args
    assert "--rotary-base 1000000" in args and "--add-qkv-bias" not in args
    args = " ".join(megatron_args(_plan(QWEN25_7B)))
    assert "--add-qkv-bias" in args and "--qk-layernorm" not in args
    assert "--untie-embeddings-and-output-weights" not in " ".join(megatron_args(_plan(GEMMA_7B)))
    default = " ".join(megatron_args(_plan(M.model_preset("llama2-7b"))))
    for flag in ("--add-qkv-bias", "--qk-layernorm", "--kv-channels", "--rotary-base",
                 "--rotary-percent"):
        assert flag not in default


def test_keys_round_trip_and_stay_out_of_files_that_do_not_set_them():
    for model in (QWEN25_7B, QWEN3_8B, GEMMA_7B):
        assert from_data(ModelSpec, to_data(model), source="<t>") == model
    data = to_data(M.model_preset("llama2-7b"))
    assert not {"add_qkv_bias", "qk_layernorm", "rotary_base", "rotary_percent",
                "kv_channels"} & set(data)
    assert to_data(QWEN3_8B)["rotary_base"] == 1000000


@pytest.mark.parametrize("key, value, where", [
    ("rotary_percent", 0.0, "rotary_percent"), ("rotary_percent", 1.5, "rotary_percent"),
    ("rotary_base", 0, "rotary_base"), ("kv_channels", 3, "kv_channels"),
    ("kv_channels", 0, "kv_channels"), ("add_qkv_bias", "yes", "add_qkv_bias"),
])
def test_bad_values_are_refused_naming_the_key(tmp_path, key, value, where):
    data = {**to_data(QWEN3_8B), key: value}
    with pytest.raises(SchemaError) as exc:
        from_data(ModelSpec, data, source="model.yaml")
    assert where in str(exc.value)


def test_a_model_file_with_the_keys_tunes_and_shows_in_args(tmp_path, capsys):
    path = tmp_path / "qwen.yaml"
    path.write_text(yaml.safe_dump(to_data(QWEN25_7B)))
    inv = tmp_path / "inv.yaml"
    inv.write_text("groups:\n  - {gpu: H100-SXM-80GB, nodes: 1, gpus_per_node: 8}\n")
    out = tmp_path / "plan.yaml"
    assert main(["tune", str(inv), "--model", str(path), "--global-batch-size", "64",
                 "-o", str(out), "-q"]) == 0
    capsys.readouterr()
    assert main(["args", str(out)]) == 0
    line = capsys.readouterr().out
    assert "--add-qkv-bias" in line and "--rotary-base 1000000" in line
