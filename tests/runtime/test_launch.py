"""``python -m megatron_hetero.launch --cpu`` runs a pretrain_gpt.py-style script (written for
these tests: megatron.training.pretrain, tiny GPT, synthetic data) under the venv's
megatron-core 0.19.2's megatron.training, on CPU processes, with the plan applied by the hooks."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hetero.plan import plan_from_data, save_plan

from ..conftest import mcore_environ
from .launching import (PRETRAIN_GPT_ARGS, launch, logged_losses, megatron_lm_checkout,
                        needs_megatron_git, together)
from .plans import A100, V100, make_plan

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _needs_mcore(mcore_env):
    return mcore_env


def _per_sample(log) -> dict[int, float]:
    """Loss sum of every sample this rank read in its last step (keyed by dataset index)."""
    n = len(log["losses"]) // 2  # two steps; the second one runs after an update
    return {i[0]: loss for i, (loss, _) in zip(log["indices"][n:], log["losses"][n:])}


# A 2-replica 3:1 plan and one replica running all 4 micro-batches, 2 steps, saving after step 2
# (torch format): the runs both tests below start from.
UNEVEN_3_1 = make_plan(split=(2,), replicas=[(1, 3), (1, 1)])
ONE_REPLICA_4 = make_plan(split=(2,), replicas=[(1, 4)])
SAVE_AT_2 = ["--save", "{work}/ckpt", "--save-interval", "2", "--ckpt-format", "torch"]


def test_uneven_data_parallel_equals_one_replica(reference_run):
    """A 2-replica 3:1 plan trains exactly as one replica running all 4 micro-batches."""
    (two, _), (one, _) = together(lambda: reference_run(2, UNEVEN_3_1, extra=SAVE_AT_2),
                                  lambda: reference_run(1, ONE_REPLICA_4, extra=SAVE_AT_2))
    for code, out, _ in two + one:
        assert code == 0, out[-3000:]
    # each replica read exactly its share of every global batch
    assert [i for [i] in two[0][2]["indices"]] == [0, 1, 2, 4, 5, 6]
    assert [i for [i] in two[1][2]["indices"]] == [3, 7]
    assert [i for [i] in one[0][2]["indices"]] == list(range(8))
    # after one optimizer step the model is the same: every sample's loss matches
    merged = {**_per_sample(two[0][2]), **_per_sample(two[1][2])}
    reference = _per_sample(one[0][2])
    assert merged.keys() == reference.keys()
    for i, loss in reference.items():
        assert merged[i] == pytest.approx(loss, rel=1e-5), i
    # Megatron's own log (the last rank) reports the real totals and the same loss
    got, want = logged_losses(two[1][1]), logged_losses(one[0][1])
    assert len(got) == len(want) == 2 and got == pytest.approx(want, rel=1e-5)
    assert "consumed samples:            8" in two[1][1]
    assert "global batch size:     4" in two[1][1]


def _grad_norms(output: str) -> list[float]:
    return [float(line.split("grad norm:")[1].split("|")[0]) for line in output.splitlines()
            if "grad norm:" in line]


# Stages of 1 and 2 layers on an A100 and a V100, one replica of 4 micro-batches of 1, 2 steps:
# the reference of this module's and test_vendor_launch's two-stage plans (run once).
TWO_STAGES_4 = make_plan(split=(1, 2), devices=[[A100, V100]], replicas=[(1, 4)])


def test_uneven_stages_and_data_parallel_equal_one_replica(tmp_path, reference_run):
    """Stages of 1 and 2 layers, two replicas with different micro-batch sizes and counts
    (2 x 1 and 1 x 2; 4 processes) train exactly as the same stages with one replica running
    4 micro-batches of 1 (2 processes)."""
    uneven = tmp_path / "uneven.yaml"
    save_plan(make_plan(split=(1, 2), devices=[[A100, V100]] * 2, replicas=[(1, 2), (2, 1)]),
              uneven)
    four = launch(4, str(uneven), tmp_path, timeout=400)
    two, _ = reference_run(2, TWO_STAGES_4)
    for code, out, _ in four + two:
        assert code == 0, out[-3000:]
    assert [log["num_layers"] for _, _, log in four] == [1, 1, 2, 2]  # Megatron order tp-dp-pp
    # replica 0 reads samples 0-1 of each batch as two micro-batches, replica 1 reads 2-3 as one
    assert four[0][2]["indices"] == [[0], [1], [4], [5]]
    assert four[1][2]["indices"] == [[2, 3], [6, 7]]
    # second step (after an update): loss sums of samples 4, 5 and 6+7 match the reference's
    ref = [loss for loss, _ in two[1][2]["losses"][4:]]
    got = [loss for loss, _ in four[2][2]["losses"][2:]] + [four[3][2]["losses"][1][0]]
    assert got == pytest.approx([ref[0], ref[1], ref[2] + ref[3]], rel=1e-5)
    assert logged_losses(four[3][1]) == pytest.approx(logged_losses(two[1][1]), rel=1e-5)
    assert _grad_norms(four[3][1]) == pytest.approx(_grad_norms(two[1][1]), rel=1e-4)


def test_resume_from_a_checkpoint_reads_the_same_samples(tmp_path, reference_run):
    """An uneven plan saved after 2 steps and resumed for 2 more reads the next global batches'
    shares and trains as one replica resumed the same way."""
    runs = (("uneven", 2, UNEVEN_3_1), ("single", 1, ONE_REPLICA_4))
    firsts = together(*(lambda n=nproc, p=plan: reference_run(n, p, extra=SAVE_AT_2)
                        for _, nproc, plan in runs))

    def resume(name, nproc, plan, saved):
        resume_dir, path = tmp_path / f"{name}-resume", tmp_path / f"{name}.yaml"
        save_plan(plan, path)
        resume_dir.mkdir()
        return launch(nproc, str(path), resume_dir, iters=4,
                      extra=["--load", str(saved / "ckpt"), "--ckpt-format", "torch",
                             "--override-opt_param-scheduler"])

    seconds = together(*(lambda r=r, saved=saved: resume(*r, saved)
                         for r, (_, saved) in zip(runs, firsts)))
    losses = {}
    for (name, _, _), (first, _), second in zip(runs, firsts, seconds):
        for code, out, _ in first + second:
            assert code == 0, out[-3000:]
        assert "consumed samples:           16" in second[-1][1]
        losses[name] = logged_losses(second[-1][1])
        if name == "uneven":
            assert [i for [i] in second[0][2]["indices"]] == [8, 9, 10, 12, 13, 14]
            assert [i for [i] in second[1][2]["indices"]] == [11, 15]
    assert len(losses["single"]) == 2
    assert losses["uneven"] == pytest.approx(losses["single"], rel=1e-5)


def test_default_torch_dist_format_resumes_on_more_replicas(tmp_path):
    """Megatron's default checkpoint (torch_dist, distributed optimizer, its dp_reshardable
    state) saved by one replica after step 1 resumes under a 3:1 plan: steps 2 and 3 see every
    sample's loss as the uninterrupted replica does (the Adam state and step came back)."""
    one, uneven = tmp_path / "one.yaml", tmp_path / "uneven.yaml"
    save_plan(make_plan(split=(2,), replicas=[(1, 4)], distributed_optimizer=True), one)
    save_plan(make_plan(split=(2,), replicas=[(1, 3), (1, 1)], distributed_optimizer=True),
              uneven)
    ckpt, common = tmp_path / "ckpt", ["--ckpt-format", "torch_dist"]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    [(code, out, ref)] = launch(1, str(one), tmp_path / "a", iters=3,
                                extra=common + ["--save", str(ckpt), "--save-interval", "1"])
    assert code == 0, out[-3000:]
    two = launch(2, str(uneven), tmp_path / "b", iters=3,
                 extra=common + ["--load", str(ckpt), "--ckpt-step", "1"])
    for code, out, _ in two:
        assert code == 0, out[-3000:]
    assert "dp_reshardable" in two[0][1]
    want = {i: loss for [i], (loss, _) in zip(ref["indices"], ref["losses"]) if i >= 4}
    got = {i: loss for _, _, log in two for [i], (loss, _) in zip(log["indices"], log["losses"])}
    assert sorted(got) == sorted(want) == list(range(4, 12))
    for i, loss in want.items():
        assert got[i] == pytest.approx(loss, rel=1e-5), i


def test_stage_specific_recompute_and_placement(tmp_path):
    """Recompute only on the stage the plan names; launcher ranks in the wrong order are
    placed on the stage of their device type."""
    plan = make_plan(split=(1, 2), devices=[[A100, V100]], replicas=[(1, 2)],
                     recompute=[None, {"granularity": "full", "method": "uniform",
                                       "num_layers": 1}])
    path = tmp_path / "plan.yaml"
    save_plan(plan, path)
    results = launch(2, str(path), tmp_path, launcher_types=[V100, A100])
    for code, out, _ in results:
        assert code == 0, out[-3000:]
    v100, a100 = results[0][2], results[1][2]
    assert (v100["rank"], a100["rank"]) == (1, 0)  # launcher 0 (V100) plays stage 1
    assert v100["recompute"] == "full" and a100["recompute"] is None
    assert (a100["num_layers"], v100["num_layers"]) == (1, 2)  # the plan's uneven split
    runs = 2 * 2  # iterations x micro-batches
    assert a100["layer_calls"] == runs * 1
    assert v100["layer_calls"] == 2 * runs * 2  # every layer: forward, then again in backward


def test_layout_split_with_an_embedding_only_first_stage(tmp_path):
    """A split first/last counts cannot express (0, 3) goes to Megatron as a layout string."""
    path = tmp_path / "plan.yaml"
    save_plan(make_plan(split=(0, 3), devices=[[A100, V100]], replicas=[(1, 2)]), path)
    results = launch(2, str(path), tmp_path)
    for code, out, _ in results:
        assert code == 0, out[-3000:]
    assert "pipeline_model_parallel_layout .................. E|t*3L" in results[0][1]
    assert [log["num_layers"] for _, _, log in results] == [0, 3]
    assert len(logged_losses(results[1][1])) == 2


# Interleaved: PP=2, 2 model chunks per stage of 1+1 and 2+1 layers on an A100 and a V100, one
# replica running 6 micro-batches, no recompute: the reference of the interleaved plans here and
# in test_vendor_launch (run once).
INTERLEAVED_CHUNKS = [[1, 1], [2, 1]]
INTERLEAVED_6 = make_plan(chunks=INTERLEAVED_CHUNKS, devices=[[A100, V100]], replicas=[(1, 6)])


def test_interleaved_uneven_plan_equals_one_replica(tmp_path, reference_run):
    """An interleaved plan (PP=2, 2 model chunks per stage of 1+1 and 2+1 layers) with two
    replicas running 4 and 2 micro-batches (4 processes), block recompute on stage 1 and the
    gradient reduction overlapped (as the tuner writes plans) trains as the same chunks with
    one replica running all 6 without recompute (2 processes): Megatron's interleaved
    schedule, per-replica counts, per-chunk recompute (which changes no value)."""
    uneven = tmp_path / "uneven.yaml"
    recompute = [None, {"granularity": "full", "method": "block", "num_layers": 2}]
    plan = make_plan(chunks=INTERLEAVED_CHUNKS, devices=[[A100, V100]] * 2,
                     replicas=[(1, 4), (1, 2)], recompute=recompute)
    save_plan(dataclasses.replace(plan, overlap_grad_reduce=True), uneven)
    four = launch(4, str(uneven), tmp_path, timeout=400)
    two, _ = reference_run(2, INTERLEAVED_6)
    for code, out, _ in four + two:
        assert code == 0, out[-3000:]
    assert "pipeline_model_parallel_layout .................. Et|t*2|t|tL" in four[0][1]
    assert "overlap_grad_reduce ............................. True" in four[0][1]
    # Megatron order tp-dp-pp: each rank built its stage's two chunks (global layer numbers);
    # stage 1's block recompute of 2 layers covers chunk 0's two layers, none of chunk 1's
    none = [None, None]
    assert [log["chunks"] for _, _, log in four] == [[[[1], none], [[4], none]]] * 2 + [
        [[[2, 3], ["full", 2]], [[5], none]]] * 2
    # each chunk reads its replica's share of every batch of 6 (replica 0: 0-3, replica 1: 4-5),
    # in the schedule's order: groups of 2 micro-batches (the pipeline size) per chunk
    assert four[0][2]["indices"] == [[0], [1], [0], [1], [2], [3], [2], [3],
                                     [6], [7], [6], [7], [8], [9], [8], [9]]
    assert four[1][2]["indices"] == [[4], [5], [4], [5], [10], [11], [10], [11]]
    got, want = logged_losses(four[3][1]), logged_losses(two[1][1])
    assert len(want) == 2 and got == pytest.approx(want, rel=1e-5)
    assert _grad_norms(four[3][1]) == pytest.approx(_grad_norms(two[1][1]), rel=1e-4)


def test_per_stage_warmup_schedule_trains_as_megatrons(tmp_path, reference_run):
    """A plan whose first stage warms up 3 micro-batches (Megatron: 1) runs the per-stage
    warm-up schedule through the get_forward_backward_func hook of megatron.training 0.19.2
    (megatron-core's backward_step) and trains exactly as Megatron's own 1F1B on the same
    plan without the field."""
    warm = tmp_path / "warm.yaml"
    data = TWO_STAGES_4.to_data()
    data["pipelines"][0]["stages"][0]["warmup_microbatches"] = 3
    save_plan(plan_from_data(data), warm)
    ours = launch(2, str(warm), tmp_path)
    theirs, _ = reference_run(2, TWO_STAGES_4)
    for code, out, _ in ours + theirs:
        assert code == 0, out[-3000:]
    assert "4 micro-batches of 1; warm-up 3 micro-batches (Megatron's 1)" in ours[0][1]
    got, want = logged_losses(ours[1][1]), logged_losses(theirs[1][1])
    assert len(want) == 2 and got == pytest.approx(want, rel=1e-5)
    assert _grad_norms(ours[1][1]) == pytest.approx(_grad_norms(theirs[1][1]), rel=1e-5)
    # every micro-batch's loss sum on the last stage, in order
    assert [x for x, _ in ours[1][2]["losses"]] == pytest.approx(
        [x for x, _ in theirs[1][2]["losses"]], rel=1e-5)


def test_mismatch_and_conflict_stop_with_one_message(tmp_path):
    plan = make_plan(split=(1, 1), devices=[[A100, V100]], replicas=[(1, 2)])
    path = tmp_path / "plan.yaml"
    save_plan(plan, path)
    (tmp_path / "c").mkdir()
    results, [(code, out, _)] = together(
        lambda: launch(2, str(path), tmp_path, launcher_types=[A100, A100], timeout=120),
        lambda: launch(1, str(path), tmp_path / "c", launcher_types=[A100],
                       extra=["--pipeline-model-parallel-size", "4"], timeout=120))
    messages = {out.split("megatron-hetero: error:", 1)[1] for _, out, _ in results}
    assert all(code == 1 for code, _, _ in results)
    assert len(messages) == 1 and f"{V100}: plan wants 1, found 0" in messages.pop()
    assert all("Traceback" not in out for _, out, _ in results)

    assert code == 1 and "Traceback" not in out
    assert "--pipeline-model-parallel-size: the command line has 4; the plan implies 2" in out


@needs_megatron_git
@pytest.mark.parametrize("stack,tp", [("0.19", 1), ("0.19", 2), ("0.17", 2)])
def test_unchanged_pretrain_gpt_uneven_data_parallel(tmp_path, stack, tp):
    """Megatron-LM core_v0.19.0's own pretrain_gpt.py (unpatched, mock data; its model built
    by GPTModelBuilder, not get_model), run by launch: a 2-replica 3:1 plan logs the same
    training and validation losses and grad norms as one replica (with TP=2 the replicas'
    batches go through Megatron's tensor-parallel batch broadcast too). Under megatron-core
    0.17.1, the oldest supported, core_v0.17.1's pretrain_gpt.py (TP=2)."""
    mcore_environ(stack)  # fails where bootstrap did not install it
    checkout = megatron_lm_checkout(tmp_path, stack)
    before = (checkout / "pretrain_gpt.py").read_bytes()
    uneven, single = tmp_path / "uneven.yaml", tmp_path / "single.yaml"
    save_plan(make_plan(split=(2,), tp=tp, replicas=[(1, 3), (1, 1)]), uneven)
    save_plan(make_plan(split=(2,), tp=tp, replicas=[(1, 4)]), single)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    script = checkout / "pretrain_gpt.py"
    evaluate = ["--eval-iters", "1", "--eval-interval", "1", "--split", "50,50,0"]
    many = launch(2 * tp, str(uneven), tmp_path / "a", script=script,
                  base_args=PRETRAIN_GPT_ARGS, extra=evaluate, timeout=400, stack=stack)
    one = launch(tp, str(single), tmp_path / "b", script=script, base_args=PRETRAIN_GPT_ARGS,
                 extra=evaluate, timeout=400, stack=stack)
    for code, out, _ in many + one:
        assert code == 0, out[-3000:]
    assert (checkout / "pretrain_gpt.py").read_bytes() == before
    assert len(logged_losses(one[-1][1])) == 2
    assert logged_losses(many[-1][1]) == pytest.approx(logged_losses(one[-1][1]), rel=1e-5)
    assert _grad_norms(many[-1][1]) == pytest.approx(_grad_norms(one[-1][1]), rel=1e-4)
    # evaluation runs each replica's share of the validation batches too
    assert len(_validation_losses(one[-1][1])) >= 2
    assert _validation_losses(many[-1][1]) == pytest.approx(_validation_losses(one[-1][1]),
                                                             rel=1e-5)


def _validation_losses(output: str) -> list[float]:
    return [float(line.split("lm loss value:")[1].split("|")[0]) for line in output.splitlines()
            if "validation loss at" in line and "lm loss value:" in line]


@needs_megatron_git
@pytest.mark.parametrize("stack", ["0.19", "0.17"])
def test_unchanged_pretrain_gpt_interleaved_uneven_plan(tmp_path, stack):
    """Megatron-LM core_v0.19.0's own pretrain_gpt.py (core_v0.17.1's under megatron-core 0.17.1)
    runs an interleaved plan (PP=2, model chunks of 1+1 and 2+1 layers) with replicas of 4 and
    2 micro-batches: training and validation losses and grad norms as one replica running all
    6 micro-batches through the same chunks."""
    mcore_environ(stack)  # fails where bootstrap did not install it
    checkout = megatron_lm_checkout(tmp_path, stack)
    uneven, single = tmp_path / "uneven.yaml", tmp_path / "single.yaml"
    chunks = [[1, 1], [2, 1]]
    plan = make_plan(chunks=chunks, devices=[[A100, V100]] * 2, replicas=[(1, 4), (1, 2)])
    save_plan(dataclasses.replace(plan, overlap_grad_reduce=True), uneven)
    save_plan(make_plan(chunks=chunks, devices=[[A100, V100]], replicas=[(1, 6)]), single)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    script = checkout / "pretrain_gpt.py"
    evaluate = ["--eval-iters", "1", "--eval-interval", "1", "--split", "50,50,0"]
    four = launch(4, str(uneven), tmp_path / "a", script=script, base_args=PRETRAIN_GPT_ARGS,
                  extra=evaluate, timeout=400, stack=stack)
    two = launch(2, str(single), tmp_path / "b", script=script, base_args=PRETRAIN_GPT_ARGS,
                 extra=evaluate, timeout=400, stack=stack)
    for code, out, _ in four + two:
        assert code == 0, out[-3000:]
    assert "virtual_pipeline_model_parallel_size ............ 2" in four[0][1]
    assert len(logged_losses(two[-1][1])) == 2
    assert logged_losses(four[-1][1]) == pytest.approx(logged_losses(two[-1][1]), rel=1e-5)
    assert _grad_norms(four[-1][1]) == pytest.approx(_grad_norms(two[-1][1]), rel=1e-4)
    assert len(_validation_losses(two[-1][1])) >= 2
    assert _validation_losses(four[-1][1]) == pytest.approx(_validation_losses(two[-1][1]),
                                                             rel=1e-5)
