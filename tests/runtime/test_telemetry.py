"""``--hetero-telemetry DIR`` in a run of the tests' pretrain script on CPU ranks: every
``interval``-th step, one line of measured figures per stage of each replica, beside the plan's
prediction, with each rank's forwards and backwards in the order Megatron's schedule ran them."""

from __future__ import annotations

import pytest

from megatron_hetero.cli import main
from megatron_hetero.cost.profile_file import load_profile
from megatron_hetero.plan import load_any_plan, load_plan, save_any_plan, save_plan
from megatron_hetero.schedule.order import rank_order
from megatron_hetero.telemetry.records import read_records

from ..conftest import DEFAULT_STACK, OLD_STACK
from .launching import launch
from .plans import A100, V100, make_mesh_plan, make_plan

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _needs_megatron_core(mcore_env):
    return mcore_env


@pytest.mark.parametrize("stack", [DEFAULT_STACK, OLD_STACK])
def test_telemetry_of_an_interleaved_uneven_plan(tmp_path, stack):
    """PP=2 with 2 model chunks per stage, two replicas running 4 and 2 micro-batches (4 ranks),
    4 steps reported every 2nd: two records, each naming the 4 stages by plan path, with every
    forward and backward of every (micro-batch, chunk) once, in the schedule's order; profiles
    of both device types that ``tune --from-run`` re-plans with. On megatron-core 0.19.2 and
    0.17.1 (the supported range's ends)."""
    plan = make_plan(chunks=[[1, 1], [2, 1]], devices=[[A100, V100]] * 2, replicas=[(1, 4), (1, 2)])
    path = tmp_path / "plan.yaml"
    save_plan(plan, path)
    out = tmp_path / "telemetry"
    results = launch(4, str(path), tmp_path, iters=4, timeout=400, stack=stack,
                     extra=["--hetero-telemetry", str(out), "--hetero-telemetry-interval", "2"])
    for code, text, _ in results:
        assert code == 0, text[-3000:]
    records = read_records(out)
    assert [r.step for r in records] == [2, 4]
    assert (out / "plan.yaml").read_bytes() == path.read_bytes()
    assert load_plan(out / "plan.yaml") == load_plan(path)
    assert "megatron-hetero telemetry: step 4:" in "".join(text for _, text, _ in results)
    p, v = 2, 2
    for rec in records:
        assert [(s.path, s.replica, s.stage, s.device_type, s.micro_batches) for s in rec.stages] == [
            ("pipelines[0].stages[0]", 0, 0, A100, 4), ("pipelines[0].stages[1]", 0, 1, V100, 4),
            ("pipelines[1].stages[0]", 1, 0, A100, 2), ("pipelines[1].stages[1]", 1, 1, V100, 2)]
        assert rec.clock == "wall" and "catalog" in rec.prediction
        assert rec.predicted_step_time_s > 0
        for s in rec.stages:
            order = rank_order(p, s.stage, s.micro_batches, v, plan.microbatch_group_size)
            assert [("FB"[k], mb, c) for k, mb, c in order] == [
                (o.kind, o.micro_batch, o.chunk) for o in s.ops], s.path
            starts = [o.start_s for o in s.ops]
            assert starts == sorted(starts)
            spans = {(o.kind, o.micro_batch, o.chunk): o for o in s.ops}
            for (kind, mb, c), o in spans.items():  # a backward runs after its forward
                if kind == "B":
                    assert o.start_s >= spans[("F", mb, c)].end_s
            m = s.measured
            assert m.forward_s == pytest.approx(sum(o.end_s - o.start_s for o in s.ops
                                                    if o.kind == "F"), rel=1e-6)
            assert m.backward_s == pytest.approx(sum(o.end_s - o.start_s for o in s.ops
                                                     if o.kind == "B"), rel=1e-6)
            assert m.optimizer_s > 0 and m.sync_s > 0
            assert m.compute_s + m.sync_s + m.optimizer_s + m.wait_s <= rec.step_time_s * (1 + 1e-6)
            assert max(o.end_s for o in s.ops) <= rec.step_time_s
            assert s.predicted is not None and s.predicted.compute_s > 0
    # the measured per-layer costs of each device type, which `tune --from-run` re-plans with
    profiles = {load_profile(p).data.device.type: load_profile(p).data
                for p in out.glob("profile.*.yaml")}
    assert sorted(profiles) == sorted([A100, V100])
    for data in profiles.values():
        assert data.timing.method == "run-telemetry" and data.timing.repeats == 2
        assert data.device.backend == "cpu" and data.model == plan.model
        assert [(e.micro_batch_size, e.tensor_parallel_size) for e in data.entries] == [(1, 1)]
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(f"groups:\n  - {{gpu: {A100}, nodes: 1, gpus_per_node: 2}}\n"
                         f"  - {{gpu: {V100}, nodes: 1, gpus_per_node: 2}}\n")
    replanned = tmp_path / "replanned.yaml"
    assert main(["tune", str(inventory), "--from-run", str(out), "-o", str(replanned), "-q"]) == 0
    again = load_any_plan(str(replanned))
    assert again.model == plan.model and again.global_batch_size == plan.global_batch_size


def _per_sample_all(log) -> dict[tuple[int, int], float]:
    """(step, sample) -> loss of every sample this rank read (one stage: it reads and computes
    the loss), steps told apart by the global batch the sample belongs to."""
    return {i[0]: loss for i, (loss, _) in zip(log["indices"], log["losses"])}


def test_rebalancing_moves_shares_from_a_slow_replica_and_trains_as_one_process(
        tmp_path, reference_run):
    """Two replicas of one stage, 3 micro-batches each; replica 1's rank is slow from the first
    iteration (0.05 s more a forward, several times its step). With a report every step and
    patience 1, rank 0 moves micro-batches to replica 0 after the first report; every sample of
    every global batch is still read once, and each sample's loss equals the one-process run's
    (per-token loss: exact whatever the shares). Slow from the first report on: a report before
    the slowdown, with patience 1, can drift on the noise of two CPU ranks on a loaded machine
    alone (a CI rehearsal saw replica 0 at 1.19x the median and the shares move first for that;
    the policy's own tests cover a card that slows down mid-run, tests/test_rebalance.py)."""
    plan = make_plan(split=(2,), replicas=[(1, 3), (1, 3)])
    path = tmp_path / "plan.yaml"
    save_plan(plan, path)
    out = tmp_path / "telemetry"
    steps = 6
    runs = launch(2, str(path), tmp_path, iters=steps, timeout=400,
                  env={"TINY_SLOW": "1:0.05:0"},
                  extra=["--hetero-telemetry", str(out), "--hetero-telemetry-interval", "1",
                         "--hetero-rebalance", "--hetero-rebalance-patience", "1"])
    for code, text, _ in runs:
        assert code == 0, text[-3000:]
    one, _ = reference_run(1, make_plan(split=(2,), replicas=[(1, 6)]), iters=steps,
                           extra=["--calculate-per-token-loss"])
    assert one[0][0] == 0, one[0][1][-3000:]
    records = read_records(out)
    notes = [(r.step, r.rebalance) for r in records if r.rebalance is not None]
    moved = [(step, n) for step, n in notes if n.shares is not None]
    assert moved, [str(n) for n in notes]
    step, note = moved[0]
    assert note.from_step == step + 1 and note.shares[1] < 3 and sum(note.shares) == 6
    assert "megatron-hetero rebalance: replica 1 drifts" in runs[0][1]
    # the records after the switch show the new shares
    after = [r for r in records if r.step >= note.from_step]
    assert after and all([s.micro_batches for s in r.stages] == note.shares for r in after)
    # every sample read once per global batch, by the replica whose share holds it
    reads = [[i for [i] in log["indices"]] for _, _, log in runs]
    assert sorted(reads[0] + reads[1]) == list(range(6 * steps))
    g = 6
    for k in range(steps):
        shares = note.shares if k + 1 >= note.from_step else [3, 3]
        batch0 = [i for i in reads[0] if k * g <= i < (k + 1) * g]
        assert batch0 == list(range(k * g, k * g + shares[0])), k
    merged = {**_per_sample_all(runs[0][2]), **_per_sample_all(runs[1][2])}
    reference = _per_sample_all(one[0][2])
    assert merged.keys() == reference.keys()
    for i, loss in reference.items():
        assert merged[i] == pytest.approx(loss, rel=1e-5), i


def test_telemetry_of_a_mesh_plan(tmp_path):
    """A chain of meshes (2 replicas of one layer pair at TP 1, then one replica at TP 2: 4
    ranks) on the multimodule path: each stage of each replica named by its mesh path, with its
    forwards and backwards counted, the slowest tensor rank's kept."""
    plan = make_mesh_plan([(1, 2, [2], None), (2, 1, [2], None)], devices=[A100, V100])
    path = tmp_path / "plan.yaml"
    save_any_plan(plan, path)
    out = tmp_path / "telemetry"
    results = launch(4, str(path), tmp_path, iters=2, timeout=400,
                     extra=["--hetero-telemetry", str(out), "--hetero-telemetry-interval", "1"])
    for code, text, _ in results:
        assert code == 0, text[-3000:]
    records = read_records(out)
    assert [r.step for r in records] == [1, 2]
    for rec in records:
        assert [(s.path, s.replica, s.stage, s.device_type, s.micro_batches)
                for s in rec.stages] == [("meshes[0].stages[0]", 0, 0, A100, 2),
                                         ("meshes[1].stages[0]", 0, 1, V100, 2),
                                         ("meshes[0].stages[0]", 1, 0, A100, 2)]
        for s in rec.stages:
            kinds = [(o.kind, o.micro_batch) for o in s.ops]
            assert sorted(kinds) == [("B", 0), ("B", 1), ("F", 0), ("F", 1)], s.path
            assert s.measured.compute_s > 0 and s.predicted is not None
