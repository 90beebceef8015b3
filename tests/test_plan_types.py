"""The one in-memory plan (:mod:`megatron_hetero.plan.types`): both file formats load into it,
every plan file round-trips through the writer (to its normal form), the shape is answered by
the plan, and a view asked of a shape that cannot answer raises (tier 1)."""

from __future__ import annotations

import copy

import pytest
import yaml

from megatron_hetero._schema import read_yaml
from megatron_hetero.plan import (Mesh, Pipeline, Plan, PlanShapeError, Slot, Stage,
                                  any_plan_from_data, load_any_plan, meshes_of, save_any_plan)

from .conftest import REPO

PLAN_FILES = sorted(
    p for p in [*REPO.glob("examples/**/*.yaml"), *REPO.glob("tests/**/*.yaml")]
    if isinstance(d := yaml.safe_load(p.read_text()), dict) and "format_version" in d
    and ("pipelines" in d or "meshes" in d))
MESH_EXAMPLE = REPO / "examples/meshes/3090-t4-plan.yaml"
UNIFORM_EXAMPLE = REPO / "examples/llama2/7b/plan.yaml"


def _contains(written, given, path="") -> None:
    """Every value ``given`` (a file's data) sets is in ``written`` unchanged; ``written`` may
    add the fields the file left at their defaults."""
    if isinstance(given, dict):
        assert isinstance(written, dict), path
        for key, value in given.items():
            assert key in written, f"{path}.{key} dropped"
            _contains(written[key], value, f"{path}.{key}")
    elif isinstance(given, list):
        assert isinstance(written, list) and len(written) == len(given), path
        for i, (w, g) in enumerate(zip(written, given)):
            _contains(w, g, f"{path}[{i}]")
    else:
        assert written == given, f"{path}: {written!r} != {given!r}"


def test_plan_files_are_found():
    names = {p.relative_to(REPO).as_posix() for p in PLAN_FILES}
    assert {"examples/meshes/3090-t4-plan.yaml", "examples/llama2/7b/plan.yaml",
            "tests/data/plan_a100_v100.yaml"} <= names
    assert len(PLAN_FILES) >= 8


@pytest.mark.parametrize("path", PLAN_FILES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_plan_file_round_trips_to_its_normal_form(path, tmp_path):
    """Load then write gives the file's data with its defaults written out (the normal form);
    the written file loads to the same plan and writes itself byte for byte."""
    given = read_yaml(path)
    plan = load_any_plan(path)
    written = plan.to_data()
    assert written["format_version"] == given["format_version"]
    _contains(written, given)
    save_any_plan(plan, tmp_path / "a.yaml")
    again = load_any_plan(tmp_path / "a.yaml")
    assert again == plan
    save_any_plan(again, tmp_path / "b.yaml")
    assert (tmp_path / "b.yaml").read_bytes() == (tmp_path / "a.yaml").read_bytes()


def test_tool_written_plans_round_trip_exactly():
    """Plans the tuner wrote (the Llama-2 examples) come back field for field."""
    for path in sorted(REPO.glob("examples/llama2/*/plan.yaml")):
        assert load_any_plan(path).to_data() == read_yaml(path), path


def test_a_format_2_file_of_one_mesh_is_written_as_format_1():
    """The documented normal form: one mesh is one grid, which format 1 says."""
    data = read_yaml(MESH_EXAMPLE)
    data["meshes"] = [data["meshes"][0]]
    data["meshes"][0]["stages"] = [{"num_layers": 32}]
    plan = any_plan_from_data(data)
    out = plan.to_data()
    assert plan.one_grid and out["format_version"] == 1
    assert out["tensor_model_parallel_size"] == data["meshes"][0]["tensor_model_parallel_size"]
    assert len(out["pipelines"]) == len(data["meshes"][0]["replicas"])
    assert any_plan_from_data(out) == plan


def test_shape_questions():
    uniform, chain = load_any_plan(UNIFORM_EXAMPLE), load_any_plan(MESH_EXAMPLE)
    assert uniform.one_grid and uniform.shares_tp_dp and len(uniform.meshes) == 1
    assert not chain.one_grid and len(chain.meshes) == 2
    assert chain.shares_tp_dp == (len({(m.tensor_model_parallel_size, m.data_parallel_size)
                                       for m in chain.meshes}) == 1)
    assert uniform.world_size == (uniform.tensor_model_parallel_size
                                  * uniform.data_parallel_size
                                  * uniform.pipeline_model_parallel_size)
    assert chain.world_size == sum(m.world_size for m in chain.meshes)
    assert chain.layout().count("|") == chain.pipeline_model_parallel_size - 1
    assert sum(chain.device_counts().values()) == chain.world_size
    assert sum(uniform.device_counts().values()) == uniform.world_size
    assert uniform.replicas_differ == (not uniform.uniform_data_parallel)


def test_one_numbering_for_every_shape():
    """Rank ``offset_k + t + T_k (r + D_k j)``; for one mesh Megatron's tp-dp-pp."""
    for plan in (load_any_plan(UNIFORM_EXAMPLE), load_any_plan(MESH_EXAMPLE)):
        slots = [plan.slot_of_rank(r) for r in range(plan.world_size)]
        assert [plan.rank_of_slot(s) for s in slots] == list(range(plan.world_size))
        for rank, s in enumerate(slots):
            mesh = plan.meshes[s.mesh]
            t, d = mesh.tensor_model_parallel_size, mesh.data_parallel_size
            assert rank == plan.rank_offset(s.mesh) + s.tensor_rank + t * (s.replica + d * s.stage)
            assert plan.device_type_of_rank(rank) == plan.stage_of_slot(s).device_type
    plan = load_any_plan(UNIFORM_EXAMPLE)
    tp, dp = plan.tensor_model_parallel_size, plan.data_parallel_size
    assert plan.slot_of_rank(tp * dp + tp) == Slot(0, 1, 1, 0)
    assert plan.slot_of_rank(tp * dp + tp).pipeline == 1


def test_format_1_views_refuse_a_chain_of_meshes():
    chain = load_any_plan(MESH_EXAMPLE)
    for view in ("pipelines", "tensor_model_parallel_size", "data_parallel_size"):
        with pytest.raises(PlanShapeError, match="meshes"):
            getattr(chain, view)
    with pytest.raises(PlanShapeError):
        chain.stage(0, 0)
    with pytest.raises(PlanShapeError):
        chain.replica_sample_range(0)
    assert not hasattr(chain, "pipelines")  # a PlanShapeError is an AttributeError


def test_mesh_views_refuse_replicas_that_differ():
    """A mesh whose replicas run different device types answers no single device type or
    stage list; its pipelines still say everything."""
    a = [Stage(device_type="A100-SXM-80GB", num_layers=2)]
    b = [Stage(device_type="V100-SXM2-32GB", num_layers=2)]
    mesh = Mesh(tensor_model_parallel_size=1, pipelines=[
        Pipeline(micro_batch_size=1, num_microbatches=2, stages=a),
        Pipeline(micro_batch_size=1, num_microbatches=2, stages=b)])
    assert not mesh.alike and mesh.even and mesh.device_types == ["A100-SXM-80GB", "V100-SXM2-32GB"]
    with pytest.raises(PlanShapeError, match="device types"):
        mesh.device_type
    with pytest.raises(PlanShapeError, match="different stages"):
        mesh.stages
    assert [r.samples for r in mesh.replicas] == [2, 2]


def test_a_chain_beyond_both_formats_has_no_writer_yet():
    chain = load_any_plan(MESH_EXAMPLE)
    other = copy.deepcopy(chain.meshes[0].pipelines[1].stages)
    assert other[0].device_type != "A100-SXM-80GB"
    other[0].device_type = "A100-SXM-80GB"
    chain.meshes[0].pipelines[1].stages = other
    with pytest.raises(PlanShapeError, match="no file format"):
        chain.to_data()


def test_meshes_of_splits_a_grid_by_device_type():
    plan = load_any_plan(REPO / "tests/data/plan_a100_v100.yaml")
    chain = meshes_of(plan)
    assert chain is not None and isinstance(chain, Plan)
    assert [m.device_type for m in chain.meshes] == list(dict.fromkeys(
        s.device_type for s in plan.pipelines[0].stages))
    assert chain.layer_split == plan.layer_split
    assert chain.format_version == 2
