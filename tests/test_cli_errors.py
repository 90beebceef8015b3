"""User mistakes on the command line: one message naming what, where and what was expected, exit
code 1, no traceback; and what `tune` prints when the pool leaves no baseline (tier 1 unless
marked)."""

from __future__ import annotations

import pytest

from megatron_hetero.cli import main

from .conftest import REPO, one_line_error

PLAN = REPO / "tests/data/plan_a100_v100.yaml"
INVENTORY = REPO / "examples/llama2/7b/inventory.yaml"


def test_missing_file_names_it_without_placeholder_path(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert main(["validate", str(missing)]) == 1
    err = one_line_error(capsys, "validate")
    assert f"{missing}: found 'No such file or directory'; expected a readable YAML file" in err
    assert "<root>" not in err


def test_empty_file_is_called_empty(tmp_path, capsys):
    empty = tmp_path / "plan.yaml"
    empty.write_text("")
    assert main(["args", str(empty)]) == 1
    err = one_line_error(capsys, "args")
    assert f"{empty}: found an empty document; expected a mapping (Plan)" in err


def test_unknown_model_names_the_option(capsys):
    assert main(["tune", str(INVENTORY), "--model", "llama9-1b", "--global-batch-size", "8",
                 "-q", "-o", "/dev/null"]) == 1
    err = one_line_error(capsys, "tune")
    assert "--model: found 'llama9-1b'; expected a preset (llama2-7b" in err


def test_tune_output_in_missing_directory_is_one_line(tmp_path, capsys):
    out = tmp_path / "no-such-dir" / "plan.yaml"
    inv = tmp_path / "inventory.yaml"
    inv.write_text("groups:\n  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 8}\n")
    assert main(["tune", str(inv), "--model", "llama2-7b", "--global-batch-size", "8", "-q",
                 "-o", str(out)]) == 1
    err = one_line_error(capsys, "tune")
    assert f"-o/--output {out}: the folder {str(out.parent)!r} does not exist" in err


@pytest.mark.parametrize("command", [["profile", "--model", "llama2-7b", "--device", "cpu"],
                                     ["tune", str(INVENTORY), "--model", "llama2-7b",
                                      "--global-batch-size", "8", "-q", "-o", "/dev/null"]])
def test_zero_sequence_length_is_refused_not_replaced_by_the_default(command, capsys):
    # `--seq-length 0` used to fall back to the preset's 4096 in `profile` (a silent full-size
    # run on CPU that takes minutes) instead of being refused.
    assert main([*command, "--seq-length", "0"]) == 1
    err = one_line_error(capsys, command[0])
    assert "--seq-length" in err and "expected a positive integer" in err


def test_tune_without_a_baseline_says_so_instead_of_nan(tmp_path, capsys):
    # One A100-80GB holds Llama-2 7B only with optimizer offload, which plain Megatron's
    # baseline does not use: there is no baseline to compare with.
    inv = tmp_path / "inventory.yaml"
    inv.write_text("groups:\n  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 1}\n")
    assert main(["tune", str(inv), "--model", "llama2-7b", "--global-batch-size", "8", "-q",
                 "-o", str(tmp_path / "plan.yaml")]) == 0
    out = capsys.readouterr().out
    assert "baseline: plain Megatron has no plan that fits" in out
    assert "nan" not in out and "no baseline to compare with" in out


def test_tune_summary_lines_are_not_wrapped_when_piped(tmp_path, capsys):
    assert main(["tune", str(INVENTORY), "--model", "llama2-7b", "--global-batch-size", "16",
                 "-q", "-o", str(tmp_path / "plan.yaml")]) == 0
    lines = capsys.readouterr().out.splitlines()
    tuned = next(line for line in lines if line.startswith("tuned"))
    assert "layers [" in tuned  # the whole summary on its one line, even at 80 columns
    assert any(line.startswith("upper bound") and "searched in" in line for line in lines)


@pytest.mark.slow
def test_rehearse_calibrates_a_sequence_parallel_plan():
    # The calibration runs the shrunk model at TP=1; a plan with sequence_parallel (TP > 1, as
    # every tuned TP>1 example has) used to crash there with "sequence_parallel: found True".
    from megatron_hetero.emulate.calibration import calibrate
    from megatron_hetero.emulate.shrink import shrink_plan
    from megatron_hetero.plan import plan_from_data

    stage = {"device_type": "A100-SXM-80GB", "num_layers": 2}
    plan = plan_from_data({
        "format_version": 1, "global_batch_size": 2, "tensor_model_parallel_size": 2,
        "sequence_parallel": True, "precision": "fp32",
        "model": {"name": "tiny", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
                  "num_attention_heads": 4, "num_query_groups": 4, "vocab_size": 128,
                  "seq_length": 16},
        "pipelines": [{"micro_batch_size": 1, "num_microbatches": 2, "stages": [stage]}]})
    shrunk = shrink_plan(plan, 32)
    assert shrunk.sequence_parallel
    calibration = calibrate(shrunk, reps=1, meter=False, timeout_s=60)
    assert calibration.layer_flops_per_s > 0


def _fake_megatron(root, script: str):
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 16\nPATCH = 1\n")
    (root / "pretrain_gpt.py").write_text(script)
    return root


@pytest.mark.parametrize("check", [True, False])
def test_patch_that_does_not_apply_is_one_line_and_leaves_the_checkout_alone(tmp_path, capsys,
                                                                             check):
    root = _fake_megatron(tmp_path, "print('not the release pretrain_gpt.py')\n")
    assert main(["patch-megatron", str(root)] + (["--check"] if check else [])) == 1
    err = one_line_error(capsys, "patch-megatron")
    assert "core_r0.16 patch" in err and "does not apply (" in err and "FAILED" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["megatron", "pretrain_gpt.py"]
    assert (root / "pretrain_gpt.py").read_text() == "print('not the release pretrain_gpt.py')\n"


def test_patch_megatron_on_a_plain_directory(tmp_path, capsys):
    assert main(["patch-megatron", str(tmp_path)]) == 1
    assert "no pretrain_gpt.py (give the Megatron-LM checkout's root)" in one_line_error(
        capsys, "patch-megatron")


def test_exponent_without_a_dot_is_a_number(tmp_path, capsys):
    # PyYAML reads `5e1` as the string '5e1' (YAML 1.1); it was refused as "expected a number".
    inv = tmp_path / "inventory.yaml"
    inv.write_text("groups:\n  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 8, "
                   "intra_node_bandwidth_gb_s: 3e2}\n")
    from megatron_hetero.hardware.inventory import load_inventory
    assert load_inventory(inv).groups[0].intra_node_bandwidth_gb_s == 300.0
    inv.write_text(inv.read_text().replace("3e2", "3x2"))
    assert main(["validate", str(PLAN), "--inventory", str(inv)]) == 1
    assert "intra_node_bandwidth_gb_s: found '3x2'; expected a number" in one_line_error(
        capsys, "validate")


SMALL_MODEL = {"name": "small", "num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 688,
               "num_attention_heads": 8, "num_query_groups": 8, "vocab_size": 1000,
               "seq_length": 256}
SMALL_STAGE = {"device_type": "A100-SXM-80GB", "num_layers": 4}


def test_validate_counts_gpus_in_whole_tensor_parallel_groups(tmp_path, capsys):
    # 3 nodes of 3 GPUs hold three TP=2 groups (6 GPUs), not 9 GPUs' worth: `validate
    # --inventory` used to accept an 8-GPU TP=2 plan that `simulate` and the runtime cannot place.
    import yaml
    model, stage = SMALL_MODEL, SMALL_STAGE
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({
        "format_version": 1, "model": model, "global_batch_size": 4,
        "tensor_model_parallel_size": 2,
        "pipelines": [{"micro_batch_size": 1, "num_microbatches": 1, "stages": [stage]}] * 4}))
    inv = tmp_path / "inventory.yaml"
    inv.write_text("groups:\n  - {gpu: A100-SXM-80GB, nodes: 3, gpus_per_node: 3}\n")
    for command in ("validate", "simulate"):
        assert main([command, str(plan), "--inventory", str(inv)]) == 1
        err = one_line_error(capsys, command)
        assert "pipelines: found 8 GPUs of type A100-SXM-80GB; expected at most 6" in err
        assert "whole tensor-parallel groups of 2" in err
    inv.write_text("groups:\n  - {gpu: A100-SXM-80GB, nodes: 2, gpus_per_node: 4}\n")
    assert main(["validate", str(plan), "--inventory", str(inv)]) == 0


@pytest.mark.parametrize("command", [
    ["simulate", str(REPO / "examples/llama2/7b/plan.yaml"), "--inventory", str(INVENTORY)],
    ["tune", str(INVENTORY), "--model", "llama2-7b", "--global-batch-size", "8", "-q",
     "-o", "/dev/null"]])
def test_timeline_of_a_type_matplotlib_cannot_write_is_refused_first(command, tmp_path, capsys):
    # Used to end in matplotlib's ValueError traceback, after the search.
    out = tmp_path / "timeline.txt"
    assert main([*command, "--timeline", str(out)]) == 1
    err = one_line_error(capsys, command[0])
    assert f"--timeline: '{out}'; expected a file name ending in one of" in err and ".png" in err
    assert not out.exists()


def test_args_of_a_plan_on_an_inventory_defined_gpu(tmp_path, capsys):
    # A plan tuned for a GPU added under the inventory's `gpus:` key (as the README shows) could
    # not be turned into Megatron arguments: `args` had no --inventory and refused the type.
    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        "gpus:\n  MyNPU-32GB: {vendor: Acme, bf16_tflops: 200, bf16: true, fp32_tflops: 50, "
        "memory_gb: 32, memory_bandwidth_gb_s: 1000, intra_node_link: PCIe5, "
        "intra_node_bandwidth_gb_s: 64, efficiency: 0.4}\n"
        "groups:\n  - {gpu: MyNPU-32GB, nodes: 1, gpus_per_node: 8}\n")
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.read_text().replace("A100-SXM-80GB", "MyNPU-32GB")
                    .replace("V100-SXM2-32GB", "MyNPU-32GB"))
    assert main(["args", str(plan)]) == 1
    assert "found 'MyNPU-32GB'; expected a GPU in the catalog" in one_line_error(capsys, "args")
    assert main(["args", str(plan), "--inventory", str(inv)]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"--hetero-plan {plan}")


def test_validate_refuses_what_the_runtime_refuses_at_start(tmp_path, capsys):
    # Uneven micro-batches 43:43:42 over 3 pipelines (global batch 128): a valid plan file, but
    # the runtime stops every rank at start (Megatron counts micro-batch size x DP x
    # micro-batches per step); `validate` said "valid plan".
    import yaml

    from megatron_hetero.plan import load_plan
    from megatron_hetero.runtime.plan_args import ArgumentConflict, virtual_micro_batch_size
    model, stage = SMALL_MODEL, SMALL_STAGE
    plan = tmp_path / "plan.yaml"
    data = {"format_version": 1, "model": model, "global_batch_size": 128,
            "tensor_model_parallel_size": 1,
            "pipelines": [{"micro_batch_size": 1, "num_microbatches": n, "stages": [stage]}
                          for n in (43, 43, 42)]}
    plan.write_text(yaml.safe_dump(data))
    with pytest.raises(ArgumentConflict):
        virtual_micro_batch_size(load_plan(plan))
    assert main(["validate", str(plan)]) == 1
    assert ("global_batch_size: found 128; expected a multiple of the number of pipelines (3)"
            in one_line_error(capsys, "validate"))
    data["global_batch_size"] = 129
    data["pipelines"][2]["num_microbatches"] = 43
    plan.write_text(yaml.safe_dump(data))  # uniform 43:43:43 runs at any global batch
    assert main(["validate", str(plan)]) == 0


@pytest.mark.parametrize("extra,phrase", [
    (["--hidden-size", "63"], "--hidden-size 63: no head count divides it into even head sizes"),
    (["--hidden-size", "64", "--vocab-size", "0"], "--vocab-size 0: expected a positive integer"),
    (["--hidden-size", "64", "-o", "/nonexistent-dir/p.yaml"], "the folder '/nonexistent-dir' does not exist"),
    (["--hidden-size", "64", "-o", "/tmp"], "/tmp: a folder; expected a file path"),
])
def test_profile_refuses_bad_options_before_measuring(extra, phrase, capsys):
    argv = ["profile", "--model", "llama2-7b", "--seq-length", "32", *extra]
    if "-o" not in extra:
        argv += ["-o", "/tmp/never-written.yaml"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert phrase in err and "Traceback" not in err


def test_rope_needs_an_even_head_size():
    from megatron_hetero.errors import SchemaError
    from megatron_hetero.plan import ModelSpec
    with pytest.raises(SchemaError, match="even size per attention head"):
        ModelSpec(name="m", num_layers=2, hidden_size=36, ffn_hidden_size=64, num_attention_heads=4,
                  num_query_groups=4, vocab_size=100, seq_length=16)
    # learned absolute positions have no such need
    ModelSpec(name="m", num_layers=2, hidden_size=36, ffn_hidden_size=64, num_attention_heads=4,
              num_query_groups=4, vocab_size=100, seq_length=16,
              position_embedding_type="learned_absolute")


@pytest.mark.parametrize("sizes, phrase", [
    ("two", "--tensor-parallel-sizes: 'two'; expected positive integers"),
    ("0,2", "--tensor-parallel-sizes: '0,2'; expected positive integers"),
    ("3,5", "tensor-parallel sizes [3, 5]: none divides llama2-7b's 32 attention heads"),
    ("1,,2", "--tensor-parallel-sizes: '1,,2'; expected positive integers"),  # was [1, 2]
    ("1,2,", "--tensor-parallel-sizes: '1,2,'; expected positive integers"),
])
def test_tune_refuses_tensor_parallel_sizes_it_cannot_use(sizes, phrase, tmp_path, capsys):
    assert main(["tune", str(INVENTORY), "--model", "llama2-7b", "--global-batch-size", "128",
                 "--tensor-parallel-sizes", sizes, "-q", "-o", str(tmp_path / "p.yaml")]) == 1
    assert phrase in one_line_error(capsys, "tune")
    assert not (tmp_path / "p.yaml").exists()


def test_tune_keeps_to_the_tensor_parallel_sizes_asked_for(tmp_path):
    import yaml
    out = tmp_path / "p.yaml"
    assert main(["tune", str(INVENTORY), "--model", "llama2-7b", "--global-batch-size", "128",
                 "--tensor-parallel-sizes", "1", "-q", "-o", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["tensor_model_parallel_size"] == 1


# -- issue 18: bad inputs probed beyond the examples -------------------------------------

@pytest.mark.parametrize("extra, phrase", [
    (["--time-scale", "inf"], "time_scale (--time-scale): found inf; expected a finite number >= 1"),
    (["--time-scale", "nan"], "time_scale (--time-scale): found nan"),
    (["--time-scale", "0"], "time_scale (--time-scale): found 0.0"),
    (["--steps", "1"], "steps (--steps): found 1; expected at least 2"),
    (["--hidden-size", "-64"], "hidden_size (--hidden-size): found -64"),
    (["--link-latency", "nan"], "link_latency_s (--link-latency): found nan"),
    (["--link-latency", "inf"], "link_latency_s (--link-latency): found inf"),
])
def test_rehearse_options_name_the_flag_and_refuse_infinities(extra, phrase, capsys):
    """--time-scale inf was an OverflowError traceback from time.sleep in every rank."""
    assert main(["rehearse", str(REPO / "tests/data/plan_a100_v100.yaml"), *extra]) == 1
    assert phrase in one_line_error(capsys, "rehearse")


def test_a_huge_sequence_length_is_one_line_without_numpy_warnings(tmp_path, capsys):
    """--seq-length 10^7 (within the limit of models.py) printed numpy's RuntimeWarning (inf x 0
    in the offload costs) above the error; 10^9 is refused as the flag's value."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["tune", str(REPO / "examples/llama2/7b/inventory.yaml"), "--model",
                     "llama2-7b", "--global-batch-size", "64", "--quiet", "--seq-length",
                     "10000000", "-o", str(tmp_path / "p.yaml")]) == 1
    assert "does not fit" in one_line_error(capsys, "tune")
    import dataclasses

    from megatron_hetero._schema import write_yaml
    from megatron_hetero.models import model_preset

    write_yaml(dataclasses.asdict(model_preset("llama2-7b")), tmp_path / "m.yaml")
    for model in ("llama2-7b", str(tmp_path / "m.yaml")):
        assert main(["tune", str(REPO / "examples/llama2/7b/inventory.yaml"), "--model", model,
                     "--global-batch-size", "64", "--seq-length", "1000000000",
                     "-o", str(tmp_path / "p.yaml")]) == 1
        assert ("error: --seq-length: found 1000000000; expected a positive integer of at most "
                "33,554,432") in one_line_error(capsys, "tune")
