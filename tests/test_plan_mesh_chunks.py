"""Model chunks in mesh plans (issue 28, tier 1): a mesh stage takes ``chunk_layers`` as a
format-1 stage does; the chain's checks with field paths; the plan's properties answer for the
chain; ``validate``, ``args`` and the runtime's entry take it."""

from __future__ import annotations

import copy

import pytest
import yaml

from megatron_hetero import cli
from megatron_hetero.plan import load_any_plan, mesh_plan_from_data, save_any_plan
from megatron_hetero.plan.checks import stage_layers
from megatron_hetero.plan.megatron_args import GROUP_FLAG, megatron_args

from .conftest import REPO, mesh_plan_error

BASE = yaml.safe_load((REPO / "examples/meshes/3090-t4-plan.yaml").read_text())


def _chunked(chunks: list[list[int] | None], **top) -> dict:
    """The example (3090 stages [10, 10] | T4 stage [12]) with these chunks per stage."""
    data = copy.deepcopy(BASE)
    stages = [st for mesh in data["meshes"] for st in mesh["stages"]]
    for st, c in zip(stages, chunks):
        if c is not None:
            st["chunk_layers"] = c
            st["num_layers"] = sum(c)
    data.update(top)
    return data


def test_chunks_load_answer_for_the_chain_and_round_trip(tmp_path):
    data = _chunked([[5, 5], [4, 6], [7, 5]], microbatch_group_size=4)
    plan = mesh_plan_from_data(data, source="p.yaml")
    assert plan.virtual_pipeline_size == 2 and plan.interleaved_chain
    assert plan.microbatch_group == 4 and plan.format_version == 2
    assert plan.virtual_stage_layers == [5, 4, 7, 5, 6, 5]
    assert plan.layout() == "Et*5|t*4|t*7|t*5|t*6|t*5L"
    assert stage_layers(plan, 2) == "layers 9-15, 27-31"
    args = megatron_args(plan)
    assert args[args.index("--pipeline-model-parallel-layout") + 1] == plan.layout()
    assert args[args.index(GROUP_FLAG) + 1] == "4"
    save_any_plan(plan, tmp_path / "p.yaml")
    written = (tmp_path / "p.yaml").read_text()
    assert "chunk_layers" in written and "microbatch_group_size: 4" in written
    again = load_any_plan(tmp_path / "p.yaml")
    assert again == plan
    save_any_plan(again, tmp_path / "q.yaml")
    assert (tmp_path / "q.yaml").read_text() == written


def test_a_plan_without_chunks_writes_none():
    plan = mesh_plan_from_data(copy.deepcopy(BASE), source="p.yaml")
    assert plan.virtual_pipeline_size == 1 and not plan.interleaved_chain
    assert all("chunk_layers" not in st for m in plan.to_data()["meshes"] for st in m["stages"])
    assert "microbatch_group_size" not in plan.to_data()


@pytest.mark.parametrize("chunks, top, path, expected", [
    ([[5, 5], None, [6, 6]], {}, "meshes[0].stages[1].chunk_layers",
     "a list of 2 layer counts, as meshes[0].stages[0] (every stage of the chain"),
    ([[5, 5], [4, 3, 3], [6, 6]], {}, "meshes[0].stages[1].chunk_layers",
     "a list of 2 layer counts"),
    ([[10], None, None], {}, "meshes[0].stages[0].chunk_layers", "at least 2"),
    ([[5, 5], [5, 5], [6, 6]], {"microbatch_group_size": 5}, "microbatch_group_size",
     "between the 3 pipeline stages"),
    ([[10, 0], [0, 10], [6, 6]], {"microbatch_group_size": 4},
     "meshes[0].stages[1].chunk_layers[0]", "at least 1 layer"),
    (None, {"microbatch_group_size": 4}, "microbatch_group_size", "absent"),
])
def test_refusals_name_the_field(chunks, top, path, expected):
    data = _chunked(chunks or [None, None, None], **top)
    err = mesh_plan_error(data)
    assert err.path == path and expected in str(err), str(err)


def test_layers_add_up_over_the_chunks():
    data = _chunked([[5, 5], [5, 5], [6, 6]], microbatch_group_size=4)
    data["meshes"][0]["stages"][0]["num_layers"] = 11
    err = mesh_plan_error(data)
    assert err.path == "meshes[0].stages[0].chunk_layers" and "adding up to num_layers (11)" in str(err)


def test_micro_batches_fill_whole_groups():
    data = _chunked([[5, 5], [5, 5], [6, 6]], global_batch_size=96)
    for mesh in data["meshes"]:
        mesh["replicas"] = [{"micro_batch_size": 2, "num_microbatches": 6}] * 8
    assert mesh_plan_from_data(data, source="p.yaml").virtual_pipeline_size == 2
    for mesh in data["meshes"]:
        mesh["replicas"] = [{"micro_batch_size": 12, "num_microbatches": 1}] * 8
    err = mesh_plan_error(data)
    assert err.path == "meshes[0].replicas[0].num_microbatches", str(err)


def test_the_wrap_around_bridge_needs_dividing_replicas():
    """With chunks the last mesh's chunk c feeds mesh 0's chunk c + 1 over a bridge, so their
    replica counts divide one another, as at any bridge: 4 -> 2 -> 6 is refused (4 and 6), and
    4 -> 2 -> 8 loads."""
    def chain(dps: tuple[int, ...]) -> dict:
        data = copy.deepcopy(BASE)
        mesh = data["meshes"][1]
        data["meshes"] = [copy.deepcopy(mesh) for _ in dps]
        samples = 24
        data["global_batch_size"] = samples * 6
        for m, d, n in zip(data["meshes"], dps, (10, 10, 12)):
            m["tensor_model_parallel_size"] = 1
            m["replicas"] = [{"micro_batch_size": samples // d, "num_microbatches": 6}] * d
            m["stages"] = [{"num_layers": n, "chunk_layers": [n // 2, n - n // 2]}]
        return data

    assert mesh_plan_from_data(chain((4, 2, 8)), source="p.yaml").interleaved_chain
    err = mesh_plan_error(chain((4, 2, 6)))
    assert err.path == "meshes[2].replicas" and "meshes[0]'s 4 replicas" in str(err), str(err)


def _uneven(data: dict) -> dict:
    """``data`` with replicas that differ (20 and 12 micro-batches on the first two of each
    mesh; the global batch unchanged)."""
    for mesh in data["meshes"]:
        mesh["replicas"][0] = {"micro_batch_size": 1, "num_microbatches": 20}
        mesh["replicas"][1] = {"micro_batch_size": 1, "num_microbatches": 12}
    return data


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_validate_and_args_take_a_chain_with_chunks(tmp_path, capsys, uneven):
    """``validate`` and ``args`` (what Megatron-LM's training under ``--hetero-plan`` takes)
    take an interleaved chain, its replicas alike or not: the runtime runs both
    (tests/runtime/test_mesh_interleaved_training.py)."""
    data = _chunked([[5, 5], [4, 6], [6, 6]], microbatch_group_size=4)
    plan = mesh_plan_from_data(_uneven(data) if uneven else data, source="p.yaml")
    assert plan.interleaved_chain and plan.replicas_differ == uneven
    path = tmp_path / "p.yaml"
    save_any_plan(plan, path)
    for command in (["validate", str(path)], ["args", str(path)]):
        assert cli.main(command) == 0, (command, capsys.readouterr())


def test_the_runtime_entry_takes_chunks(tmp_path):
    """``pretrain_gpt.py --hetero-plan`` and the launcher load a mesh plan through
    ``runtime.meshes.mesh_plan_of``: a chunked one loads, its replicas alike or not, on the
    megatron-core this venv runs (0.19; 0.17 refuses it: test_mesh_interleaved_training.py)."""
    from megatron_hetero.runtime import releases
    from megatron_hetero.runtime.meshes import mesh_plan_of

    if not releases.has("multimodule_schedule"):
        pytest.skip("this megatron-core refuses every mesh plan first (naming 0.17)")
    data = _chunked([[5, 5], [4, 6], [6, 6]], microbatch_group_size=4)
    path = tmp_path / "p.yaml"
    for got in (data, _uneven(copy.deepcopy(data))):
        save_any_plan(mesh_plan_from_data(got, source="p.yaml"), path)
        assert mesh_plan_of(str(path)).interleaved_chain
    assert mesh_plan_of(str(REPO / "examples/meshes/3090-t4-plan.yaml")) is not None
