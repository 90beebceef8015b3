"""The telemetry's files and ``megatron-hetero report``: records round-trip and are read
strictly, the predicted side is the simulator's, and the report names the stage that is slow
against the rest of the job (not a cost model that is off for every card)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings, strategies as st

from megatron_hetero.cli import main
from megatron_hetero.cost.model import CostModel
from megatron_hetero.errors import SchemaError
from megatron_hetero.plan import load_any_plan
from megatron_hetero.sim.step import simulate
from megatron_hetero.telemetry.prediction import implied_inventory, predict, stage_path
from megatron_hetero.cost.profile_file import MeasuredProfile, load_profile
from megatron_hetero.telemetry.profile_out import (profile_name, run_factors, run_profiles,
                                                   software_now, write_run_profiles)
from megatron_hetero.telemetry.records import (ExpertLoad, OpSpan, StageFigures, StageRecord,
                                               StepRecord, append_record, load_imbalance,
                                               read_records)
from megatron_hetero.telemetry.report import slow_stages, summarize

PLAN = "examples/llama2/7b/plan.yaml"
MESH_PLAN = "examples/meshes/3090-t4-plan.yaml"


def _scaled(f: StageFigures, x: float) -> StageFigures:
    return StageFigures(**{k: getattr(f, k) * x for k in
                           ("forward_s", "backward_s", "sync_s", "optimizer_s", "wait_s")})


def _records(plan_path: str, factors: dict, *, steps=(10, 20), overall: float = 1.0):
    """Records of a run whose stages measure ``overall`` x their prediction, and ``factors[
    (replica, stage)]`` x that where given."""
    plan = load_any_plan(plan_path)
    pred = predict(plan)
    index = plan.stage_index
    out = []
    for step in steps:
        stages = []
        for (r, g), p in sorted(pred.stages.items()):
            k, j = index[g]
            m = plan.meshes[k].pipelines[r].num_microbatches
            stages.append(StageRecord(
                path=stage_path(plan, mesh=k, stage=j, replica=r), replica=r, stage=g,
                device_type=plan.meshes[k].pipelines[r].stages[j].device_type, micro_batches=m,
                measured=_scaled(p, overall * factors.get((r, g), 1.0)), predicted=p,
                ops=[OpSpan(kind="F", micro_batch=0, chunk=0, start_s=0.0, end_s=p.forward_s / m)]))
        out.append(StepRecord(step=step, step_time_s=pred.step_time_s * overall,
                              predicted_step_time_s=pred.step_time_s, prediction=pred.source,
                              stages=stages))
    return plan, pred, out


def test_records_round_trip_through_the_file(tmp_path):
    _, _, records = _records(MESH_PLAN, {(1, 0): 1.5})
    for rec in records:
        append_record(tmp_path, rec)
    assert read_records(tmp_path) == records


@pytest.mark.parametrize("edit, where", [
    (lambda d: d.pop("step"), "step"),
    (lambda d: d["stages"][0]["measured"].update(forward_s=-1.0), "stages[0].measured.forward_s"),
    (lambda d: d["stages"][0]["measured"].update(wait_s=float("nan")), "stages[0].measured.wait_s"),
    (lambda d: d.update(extra=1), "extra"),
    (lambda d: d["stages"][0]["ops"][0].update(kind="X"), "stages[0].ops[0].kind"),
    (lambda d: d.update(stages=[]), "stages"),
])
def test_a_bad_record_is_refused_naming_its_line_and_field(tmp_path, edit, where):
    _, _, records = _records(PLAN, {}, steps=(5,))
    good = json.loads(records[0].to_json())
    bad = json.loads(records[0].to_json())
    edit(bad)
    (tmp_path / "telemetry.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(SchemaError) as exc:
        read_records(tmp_path)
    assert "telemetry.jsonl:2" in str(exc.value) and where in str(exc.value)


def _with_experts(record: StepRecord, rows: list[ExpertLoad]) -> StepRecord:
    return dataclasses.replace(record, experts=rows, moe_load_imbalance=load_imbalance(rows))


def test_expert_rows_round_trip_and_a_wrong_imbalance_is_refused(tmp_path):
    """An MoE record's tokens per expert: each row's imbalance is its most loaded expert over
    the mean, the step's the sum of the rows' maxima over the sum of their means; a file that
    says otherwise is refused at the field."""
    _, _, records = _records(PLAN, {}, steps=(5,))
    rows = [ExpertLoad.of(layer=2, device_type="A100-SXM-80GB", tokens=[6, 2, 4, 4]),
            ExpertLoad.of(layer=4, device_type="A100-SXM-80GB", tokens=[4, 4, 4, 4])]
    assert [r.imbalance for r in rows] == [1.5, 1.0]
    record = _with_experts(records[0], rows)
    assert record.moe_load_imbalance == pytest.approx((6 + 4) / (4 + 4))
    append_record(tmp_path, record)
    assert read_records(tmp_path) == [record]
    for edit, where in ((lambda d: d["experts"][0].update(imbalance=1.2), "experts[0].imbalance"),
                        (lambda d: d.update(moe_load_imbalance=1.0), "moe_load_imbalance"),
                        (lambda d: d["experts"][1].update(tokens=[0, 0, 0, 0]),
                         "experts[1].tokens")):
        bad = json.loads(record.to_json())
        edit(bad)
        (tmp_path / "telemetry.jsonl").write_text(json.dumps(bad) + "\n")
        with pytest.raises(SchemaError) as exc:
            read_records(tmp_path)
        assert where in str(exc.value)


def test_the_run_profile_carries_each_device_types_measured_imbalance():
    """Each device type's profile: :func:`load_imbalance` over its rows of every record; a type
    with no MoE rows (or a dense run) leaves the field out."""
    plan, pred, records = _records(PLAN, {}, steps=(5, 6))
    device, other = sorted(plan.device_counts())
    by_step = [[ExpertLoad.of(layer=1, device_type=device, tokens=[3, 1]),
                ExpertLoad.of(layer=1, device_type=other, tokens=[9, 1])],
               [ExpertLoad.of(layer=1, device_type=device, tokens=[2, 2])]]
    records = [_with_experts(r, rows) for r, rows in zip(records, by_step)]
    software = software_now(torch_version="2.13.0", megatron_core="0.19.2", python="3.11",
                            cuda=None)
    profiles = run_profiles(plan, records, pred.inventory, software=software,
                            layer_spec="local", backend="cpu")
    assert profiles[device].moe_load_imbalance == pytest.approx((3 + 2) / (2 + 2))
    assert profiles[other].moe_load_imbalance == pytest.approx(9 / 5)
    dense = run_profiles(plan, _records(PLAN, {})[2], pred.inventory, software=software,
                         layer_spec="local", backend="cpu")
    assert dense[device].moe_load_imbalance is None


def test_a_line_cut_off_at_the_end_is_dropped(tmp_path):
    _, _, records = _records(PLAN, {})
    text = records[0].to_json() + "\n" + records[1].to_json()[:50]
    (tmp_path / "telemetry.jsonl").write_text(text)
    assert read_records(tmp_path) == records[:1]


def test_no_telemetry_file_is_one_message(tmp_path):
    assert main(["report", str(tmp_path)]) == 1


@pytest.mark.parametrize("path", [PLAN, MESH_PLAN])
def test_the_prediction_is_the_simulators(path):
    """Per stage: the simulator's forward and backward of one micro-batch times the replica's
    micro-batches; sync plus optimizer its sync; the step its step."""
    plan = load_any_plan(path)
    inv = implied_inventory(plan)
    assert dict(inv.gpu_counts()) == dict(plan.device_counts())
    sim = simulate(plan, CostModel(plan.model, inv, precision=plan.precision,
                                        use_distributed_optimizer=plan.use_distributed_optimizer,
                                        overlap_grad_reduce=plan.overlap_grad_reduce),
                        record_events=False)
    pred = predict(plan)
    assert pred.step_time_s == sim.step_time_s
    assert len(pred.stages) == len(sim.stages)
    for s in sim.stages:
        p = pred.stages[(s.pipeline, s.stage)]
        k, j = plan.stage_index[s.stage]
        m = plan.meshes[k].pipelines[s.pipeline].num_microbatches
        assert p.forward_s == pytest.approx(s.forward_s * m)
        assert p.backward_s == pytest.approx(s.backward_s * m)
        assert p.sync_s + p.optimizer_s == pytest.approx(s.sync_s)
        assert p.optimizer_s > 0


@settings(max_examples=25, deadline=None)
@given(overall=st.floats(0.2, 5.0), slow=st.floats(1.3, 4.0), which=st.integers(0, 10**6),
       path=st.sampled_from([PLAN, MESH_PLAN]))
def test_the_report_names_the_one_slow_stage(overall, slow, which, path):
    """Whatever the cost model's error common to every card (``overall``), the one stage made
    ``slow`` times slower is named, and only it."""
    plan = load_any_plan(path)
    keys = sorted(predict(plan).stages)
    key = keys[which % len(keys)]
    _, _, records = _records(path, {key: slow}, overall=overall)
    found, median = slow_stages(summarize(records), threshold=1.15)
    assert [(s.replica, s.stage) for s, _ in found] == [key]
    assert median == pytest.approx(overall)
    assert found[0][1] == pytest.approx(slow)
    _, _, even = _records(path, {}, overall=overall)
    assert slow_stages(summarize(even), threshold=1.15)[0] == []


def test_report_command_prints_the_table_the_slow_stage_and_draws(tmp_path, capsys):
    plan, _, records = _records(PLAN, {(2, 1): 1.6}, overall=1.2)
    for rec in records:
        append_record(tmp_path, rec)
    (tmp_path / "plan.yaml").write_text(open(PLAN).read())
    png, js = tmp_path / "t.png", tmp_path / "r.json"
    assert main(["report", str(tmp_path), "--timeline", str(png), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "slow: pipelines[2].stages[1] replica 2" in out
    assert "1.60x the job's median ratio (1.2)" in out
    assert png.stat().st_size > 10_000
    data = json.loads(js.read_text())
    assert [(s["path"], s["replica"]) for s in data["slow"]] == [("pipelines[2].stages[1]", 2)]
    assert data["steps"] == [10, 20]
    assert main(["report", str(tmp_path), "--step", "10"]) == 0
    assert main(["report", str(tmp_path), "--step", "11"]) == 1
    assert "not a reported step" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["report", str(tmp_path), "--threshold", "0.5"])
    assert exc.value.code == 2


@settings(max_examples=20, deadline=None)
@given(factors=st.lists(st.floats(0.8, 3.0), min_size=2, max_size=2),
       path=st.sampled_from([PLAN, MESH_PLAN]))
def test_the_run_profile_reproduces_the_measured_compute(factors, path):
    """Profiles from a run whose device types measured ``factors`` x their prediction: the cost
    model with them predicts each device type's measured forward and backward compute."""
    plan = load_any_plan(path)
    types = sorted(plan.device_counts())
    pred = predict(plan)
    per_type = dict(zip(types, factors))
    factor_of = {key: per_type[plan.meshes[plan.stage_index[key[1]][0]].pipelines[key[0]]
                               .stages[plan.stage_index[key[1]][1]].device_type]
                 for key in pred.stages}
    _, _, records = _records(path, factor_of)
    software = software_now(torch_version="2.13.0", megatron_core="0.19.2", python="3.11",
                            cuda=None)
    profiles = run_profiles(plan, records, pred.inventory, software=software,
                            layer_spec="transformer_engine", backend="cuda")
    assert sorted(profiles) == types
    assert all(p.timing.method == "run-telemetry" and p.entries for p in profiles.values())
    found = run_factors(records)
    assert sorted(found) == types
    for t, f in per_type.items():
        assert found[t] == pytest.approx((f, f))
    cost = CostModel(plan.model, pred.inventory, precision=plan.precision,
                     profiles={t: MeasuredProfile(p) for t, p in profiles.items()},
                     use_distributed_optimizer=plan.use_distributed_optimizer,
                     overlap_grad_reduce=plan.overlap_grad_reduce)
    sim = simulate(plan, cost, record_events=False)
    want, got = {}, {}
    for s in sim.stages:
        k, j = plan.stage_index[s.stage]
        m = plan.meshes[k].pipelines[s.pipeline].num_microbatches
        acc = got.setdefault(s.device_type, [0.0, 0.0])
        acc[0] += s.forward_s * m
        acc[1] += s.backward_s * m
    for s in records[0].stages:
        acc = want.setdefault(s.device_type, [0.0, 0.0])
        acc[0] += s.measured.forward_s
        acc[1] += s.measured.backward_s
    for t in types:
        assert got[t] == pytest.approx(want[t], rel=1e-6), t
    # the optimizer step too: each type's profile carries its measured over predicted step,
    # and the cost model prices that type's optimizer at it
    from megatron_hetero.cost.stage import StageShape
    from megatron_hetero.telemetry.prediction import plan_cost_model
    base = plan_cost_model(plan, pred.inventory)
    for (r, g) in pred.stages:
        k, j = plan.stage_index[g]
        shape = StageShape.at(plan, k, j, r)
        t = shape.device_type
        assert profiles[t].optimizer_factor == pytest.approx(per_type[t])
        assert cost.optimizer_seconds(shape) == pytest.approx(
            per_type[t] * base.optimizer_seconds(shape), rel=1e-9)


def test_profiles_are_written_whole_and_load_back(tmp_path):
    plan, pred, records = _records(PLAN, {}, overall=2.0)
    software = software_now(torch_version="2.13.0", megatron_core="0.19.2", python="3.11",
                            cuda=None)
    written = write_run_profiles(tmp_path, run_profiles(plan, records, pred.inventory,
                                                        software=software, layer_spec="local",
                                                        backend="cpu"))
    assert sorted(p.name for p in written) == sorted(profile_name(t) for t in plan.device_counts())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in written)
    for p in written:
        assert load_profile(p).data.timing.method == "run-telemetry"
        assert load_profile(p).optimizer_factor == pytest.approx(2.0)  # the file keeps it


def test_a_new_run_sets_an_earlier_runs_records_aside(tmp_path):
    """A run reporting into a folder that holds another run's records moves them into
    earlier-N instead of appending to them; a resume of the same plan past its last recorded
    step appends."""
    from megatron_hetero.telemetry.records import set_aside_earlier_run

    _, _, records = _records(PLAN, {})  # steps 10 and 20
    plan_text = b"the plan\n"

    def earlier_run():
        for rec in records:
            append_record(tmp_path, rec)
        (tmp_path / "plan.yaml").write_bytes(plan_text)
        (tmp_path / "profile.A100-SXM-80GB.yaml").write_text("x")

    earlier_run()
    assert set_aside_earlier_run(tmp_path, first_step=30, plan_text=plan_text) is None  # resume
    assert len(read_records(tmp_path)) == 2
    moved = set_aside_earlier_run(tmp_path, first_step=2, plan_text=plan_text)  # from the start
    assert moved == tmp_path / "earlier-1" and read_records(moved) == records
    assert sorted(p.name for p in moved.iterdir()) == ["plan.yaml", "profile.A100-SXM-80GB.yaml",
                                                       "telemetry.jsonl"]
    assert not (tmp_path / "telemetry.jsonl").exists()
    earlier_run()
    assert set_aside_earlier_run(tmp_path, first_step=30, plan_text=b"another plan\n") == \
        tmp_path / "earlier-2"  # past the last step, but another plan
    assert set_aside_earlier_run(tmp_path, first_step=2, plan_text=plan_text) is None  # empty
