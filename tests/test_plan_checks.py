"""``validate`` refuses what the runtime would stop at (issue 18, item 4): a stage over its
card's memory under the cost model (as the simulator counts it), the offload settings
megatron-core refuses; ``simulate`` fails on a plan that does not fit unless ``--warn-only``."""

from __future__ import annotations

import pytest

from megatron_hetero.cli import main
from megatron_hetero.cost import CostModel
from megatron_hetero.hardware.inventory import load_inventory
from megatron_hetero.plan import load_plan
from megatron_hetero.plan.checks import stage_layers
from megatron_hetero.sim.step import simulate

from .conftest import REPO, one_line_error

PLAN = REPO / "tests/data/plan_a100_v100.yaml"
INVENTORY = REPO / "examples/llama2/7b/inventory.yaml"
FITS = REPO / "examples/llama2/7b/plan.yaml"  # tuned: interleaved, fits


@pytest.fixture
def too_big(tmp_path):
    """The README's plan with micro-batches of 8 and no recompute: every stage over its card."""
    text = (PLAN.read_text()
            .replace("recompute: {granularity: full, method: uniform, num_layers: 1}",
                     "recompute: {granularity: none}")
            .replace("micro_batch_size: 1", "micro_batch_size: 8")
            .replace("num_microbatches: 70", "num_microbatches: 8")
            .replace("num_microbatches: 58", "num_microbatches: 8"))
    path = tmp_path / "big.yaml"
    path.write_text(text)
    return path


def test_validate_names_the_stage_card_layers_and_figures(too_big, capsys):
    assert main(["validate", str(too_big), "--inventory", str(INVENTORY)]) == 1
    err = one_line_error(capsys, "validate")
    # the simulator's own figures
    plan = load_plan(too_big)
    sim = simulate(plan, CostModel(plan.model, load_inventory(INVENTORY), precision=plan.precision),
                   record_events=False)
    need = sim.stages[0].memory.total / 1e9
    assert (f"{too_big}: pipelines[0].stages[0]: found stage 0 (A100-SXM-80GB, layers 0-13) "
            f"needs {need:.1f} GB of {sim.stages[0].memory.capacity / 1e9:g} GB (weights") in err
    assert sim.stages[0].memory.capacity == pytest.approx(80 * 2**30 * 0.99 * 0.9)
    assert "3 more stage(s) over" in err and "--no-memory-check" in err


def test_no_memory_check_turns_it_off(too_big, capsys):
    assert main(["validate", str(too_big), "--inventory", str(INVENTORY), "--no-memory-check"]) == 0
    assert "valid plan" in capsys.readouterr().out


def test_a_plan_that_fits_validates(capsys):
    assert main(["validate", str(FITS), "--inventory", str(INVENTORY)]) == 0


def test_without_an_inventory_memory_is_checked_on_the_catalog_cards(too_big, capsys):
    # issue 32 A.3: the catalog knows the cards, so the stage over its card is refused
    assert main(["validate", str(too_big)]) == 1
    err = one_line_error(capsys, "validate")
    assert "pipelines[0].stages[0]: found stage 0 (A100-SXM-80GB, layers 0-13) needs" in err
    assert main(["validate", str(too_big), "--no-memory-check"]) == 0


def test_simulate_fails_on_a_plan_that_does_not_fit_and_writes_nothing(too_big, tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["simulate", str(too_big), "--inventory", str(INVENTORY), "--json", str(out)]) == 1
    err = one_line_error(capsys, "simulate")
    assert "stage 0 (A100-SXM-80GB, layers 0-13) needs" in err and "--warn-only" in err
    assert not out.exists() and capsys.readouterr().out == ""
    assert main(["simulate", str(too_big), "--inventory", str(INVENTORY), "--json", str(out),
                 "--warn-only"]) == 0
    assert "exceed device memory" in capsys.readouterr().out and out.exists()


def test_stage_layers_of_an_interleaved_plan():
    plan = load_plan(FITS)  # chunks [4, 6, 8, 7] and [2, 2, 2, 1]
    assert stage_layers(plan, 0) == "layers 0-3, 6-11, 14-21, 24-30"
    assert stage_layers(plan, 1) == "layers 4-5, 12-13, 22-23, 31"
    assert stage_layers(load_plan(PLAN), 1) == "layers 14-31"


@pytest.mark.parametrize("edits, path, phrase", [
    ([("offload: {}", "offload: {activations: true}")],
     "pipelines[0].stages[0].offload.activations", "false at PP=2"),
    ([("offload: {}", "offload: {optimizer_fraction: 0.5}"),
      ("tensor_model_parallel_size: 1",
       "tensor_model_parallel_size: 1\nuse_distributed_optimizer: false")],
     "pipelines[0].stages[0].offload.optimizer_fraction", "use_distributed_optimizer: false"),
    ([("offload: {}", "offload: {optimizer_fraction: 0.5}"), ("precision: fp16", "precision: fp32")],
     "pipelines[0].stages[0].offload.optimizer_fraction", "with precision: fp32"),
])
def test_offload_megatron_refuses_is_refused_with_the_field_path(edits, path, phrase, tmp_path,
                                                                 capsys):
    text = PLAN.read_text()
    for old, new in edits:
        assert old in text
        text = text.replace(old, new, 1)
    bad = tmp_path / "plan.yaml"
    bad.write_text(text)
    assert main(["validate", str(bad)]) == 1
    err = one_line_error(capsys, "validate")
    assert f"{bad}: {path}: found" in err and phrase in err
    # issue 32 (commands that disagree on one plan): args refuses it with the same line
    assert main(["args", str(bad)]) == 1
    assert one_line_error(capsys, "args") == err.replace("megatron-hetero validate:",
                                                         "megatron-hetero args:")


def test_args_of_a_plan_over_memory_still_prints(too_big, capsys):
    """Memory is a prediction: validate and simulate refuse it, args does not."""
    assert main(["args", str(too_big)]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"--hetero-plan {too_big}")


def _single_stage(tmp_path, stage: str):
    """A one-stage plan (PP = 1), where megatron-core takes activation offload."""
    text = PLAN.read_text().split("pipelines:")[0] + (
        "pipelines:\n  - micro_batch_size: 1\n    num_microbatches: 128\n    stages:\n"
        f"      - {{device_type: A100-SXM-80GB, num_layers: 32, {stage}}}\n")
    path = tmp_path / "one.yaml"
    path.write_text(text)
    return path


def test_activation_offload_at_pp1_validates(tmp_path, capsys):
    # megatron-core takes the setting; 7B on one A100 is over memory (checked on the catalog's
    # card since issue 32 A.3), which is not what this test is about
    path = str(_single_stage(tmp_path, "offload: {activations: true}"))
    assert main(["validate", path, "--no-memory-check"]) == 0


@pytest.mark.parametrize("stage, path, phrase", [
    ("recompute: {granularity: selective}, offload: {activations: true}",
     "pipelines[0].stages[0].offload.activations", "recompute (selective)"),
    ("offload: {activations: true, module_inputs: true}",
     "pipelines[0].stages[0].offload.module_inputs", "cannot run with cpu_offloading"),
])
def test_activation_offload_with_what_megatron_refuses_beside_it(stage, path, phrase, tmp_path,
                                                                 capsys):
    bad = _single_stage(tmp_path, stage)
    assert main(["validate", str(bad)]) == 1
    err = one_line_error(capsys, "validate")
    assert f"{bad}: {path}: found True" in err and phrase in err


MESH = REPO / "examples/meshes/3090-t4-plan.yaml"
MESH_INVENTORY = REPO / "examples/meshes/inventory.yaml"


def test_a_mesh_plan_over_memory_names_the_mesh_stage(tmp_path, capsys):
    bad = tmp_path / "mesh.yaml"  # layers 6, 6 on the 3090s, 20 on the T4s without recompute
    bad.write_text(MESH.read_text()
                   .replace("- {num_layers: 12, recompute: {granularity: selective}}",
                            "- {num_layers: 20}")
                   .replace("{num_layers: 10, offload: {module_inputs: true}}", "{num_layers: 6}"))
    assert main(["validate", str(bad), "--inventory", str(MESH_INVENTORY)]) == 1
    err = one_line_error(capsys, "validate")
    assert f"{bad}: meshes[1].stages[0]: found stage 2 (T4-16GB, layers 12-31) needs" in err
    assert main(["validate", str(MESH), "--inventory", str(MESH_INVENTORY)]) == 0


def test_a_mesh_plan_offloading_activations_at_pp3_is_refused(tmp_path, capsys):
    bad = tmp_path / "mesh.yaml"
    bad.write_text(MESH.read_text().replace(
        "- {num_layers: 12, recompute: {granularity: selective}}",
        "- {num_layers: 12, offload: {activations: true}}"))
    assert main(["validate", str(bad)]) == 1
    assert "meshes[1].stages[0].offload.activations: found True; expected false at PP=3" in \
        one_line_error(capsys, "validate")
