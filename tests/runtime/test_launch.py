"""``python -m megatron_hetero.launch --cpu`` runs a pretrain_gpt.py-style script (written for
these tests: megatron.training.pretrain, tiny GPT, synthetic data) under the venv's
megatron-core 0.19.2's megatron.training, on CPU processes, with the plan applied by the hooks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_hetero.plan import plan_from_data, save_plan

from ..conftest import DEFAULT_STACK, mcore_environ
from .launching import (PRETRAIN_GPT_ARGS, launch, logged_losses, megatron_lm_checkout,
                        needs_megatron_git, together)
from .plans import A100, V100, make_plan
from .test_checkpoint_resume import _assert_same_state, _tensors

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _needs_mcore(mcore_env):
    return mcore_env


STEPS = 4
"""Steps of every equivalence run here and in test_vendor_launch: three updates before the last
step's losses, four before the final checkpoint's parameters are compared."""
SAVE_AT_END = ["--save", "{work}/ckpt", "--save-interval", str(STEPS), "--ckpt-format",
               "torch_dist"]
"""The final checkpoint only (torch_dist: every tensor under its global key, whatever the plan)."""


def _per_sample(log) -> dict[int, float]:
    """Loss sum of every sample this rank read in its last step (keyed by dataset index)."""
    n = len(log["losses"]) * (STEPS - 1) // STEPS  # the last step runs after 3 updates
    return {i[0]: loss for i, (loss, _) in zip(log["indices"][n:], log["losses"][n:])}


REORDERED_SUM_ATOL = 1e-4
"""How far a parameter may be from the reference's where the plan sums a step's micro-batch
gradients in another order: a tenth of one Adam step (``--lr 1e-3``). Adam moves every element
by about the learning rate a step whatever its gradient's size, so an element whose gradient
nearly cancels over the micro-batches turns fp32's rounding of another summation order
(replicas of 4 and 2 micro-batches summed apart, then together, against 6 in a row) into a
fraction of a step: measured up to 6.2e-6 (3 of 5120 elements of ``linear_fc2``, the
interleaved plan after 4 steps), while its Adam state stays within rtol 1e-5 and atol 1e-7.
A sample read twice or lost, or a step not taken, moves elements by whole steps. Plans whose
replicas add their micro-batches in the reference's order (3 then 1) match within rtol 1e-5 and
atol 1e-7, which also catches a replica's gradient weighted 0.1% wrong (it moved the 3:1 plan's
embedding by up to 8.7e-6 in 4 steps), which this tolerance would let through."""


def assert_same_final_checkpoint(got: Path, want: Path, tmp: Path, *, iteration: int = STEPS,
                                 optimizer: bool = True, stack: str | None = None,
                                 param_atol: float = 1e-7) -> None:
    """The step-``iteration`` checkpoints under the run folders ``got`` and ``want`` hold the same
    parameters (every model tensor of ``want``'s, by global key; within rtol 1e-5 and
    ``param_atol``) and, with ``optimizer``, the same optimizer state where both keep it under
    the same key (fp32's rtol 1e-5, atol 1e-7); ``stack``: the megatron-core that wrote them,
    where not the venv's own."""
    name = Path("ckpt") / f"iter_{iteration:07d}"
    (tmp / "got").mkdir(exist_ok=True), (tmp / "want").mkdir(exist_ok=True)
    a, b = _tensors(got / name, tmp / "got", stack), _tensors(want / name, tmp / "want", stack)
    weights = [k for k in b if not k.startswith("/optimizer")]
    assert weights and set(weights) <= set(a), sorted(set(weights) - set(a))
    _assert_same_state(a, b, keys=weights, atol=param_atol)
    if optimizer:
        _assert_same_state(a, b, keys=[k for k in b if k in a and k not in weights])


# A 2-replica 3:1 plan and one replica running all 4 micro-batches, 4 steps, saving after steps 2
# (where the resume below starts) and 4 (the final state compared): the runs both tests below
# start from.
UNEVEN_3_1 = make_plan(split=(2,), replicas=[(1, 3), (1, 1)])
ONE_REPLICA_4 = make_plan(split=(2,), replicas=[(1, 4)])
SAVE_AT_2 = ["--save", "{work}/ckpt", "--save-interval", "2", "--ckpt-format", "torch_dist"]


def test_uneven_data_parallel_equals_one_replica(tmp_path, reference_run):
    """A 2-replica 3:1 plan trains exactly as one replica running all 4 micro-batches: 4 steps,
    the last step's per-sample losses, and the final checkpoint's parameters and Adam state."""
    (two, two_dir), (one, one_dir) = together(
        lambda: reference_run(2, UNEVEN_3_1, iters=STEPS, extra=SAVE_AT_2),
        lambda: reference_run(1, ONE_REPLICA_4, iters=STEPS, extra=SAVE_AT_2))
    for code, out, _ in two + one:
        assert code == 0, out[-3000:]
    # each replica read exactly its share of every global batch
    assert [i for [i] in two[0][2]["indices"]] == [4 * k + j for k in range(STEPS)
                                                   for j in range(3)]
    assert [i for [i] in two[1][2]["indices"]] == [4 * k + 3 for k in range(STEPS)]
    assert [i for [i] in one[0][2]["indices"]] == list(range(4 * STEPS))
    # after three optimizer steps the model is the same: every sample's loss matches
    merged = {**_per_sample(two[0][2]), **_per_sample(two[1][2])}
    reference = _per_sample(one[0][2])
    assert merged.keys() == reference.keys() == set(range(12, 16))
    for i, loss in reference.items():
        assert merged[i] == pytest.approx(loss, rel=1e-5), i
    # Megatron's own log (the last rank) reports the real totals and the same loss
    got, want = logged_losses(two[1][1]), logged_losses(one[0][1])
    assert len(got) == len(want) == STEPS and got == pytest.approx(want, rel=1e-5)
    assert "consumed samples:           16" in two[1][1]
    assert "global batch size:     4" in two[1][1]
    assert_same_final_checkpoint(two_dir, one_dir, tmp_path)


def _grad_norms(output: str) -> list[float]:
    return [float(line.split("grad norm:")[1].split("|")[0]) for line in output.splitlines()
            if "grad norm:" in line]


# Stages of 1 and 2 layers on an A100 and a V100, one replica of 4 micro-batches of 1, 4 steps,
# its final checkpoint saved: the reference of this module's and test_vendor_launch's two-stage
# plans (run once).
TWO_STAGES_4 = make_plan(split=(1, 2), devices=[[A100, V100]], replicas=[(1, 4)])


def test_uneven_stages_and_data_parallel_equal_one_replica(tmp_path, reference_run):
    """Stages of 1 and 2 layers, two replicas with different micro-batch sizes and counts
    (2 x 1 and 1 x 2; 4 processes) train exactly as the same stages with one replica running
    4 micro-batches of 1 (2 processes): 4 steps, the final checkpoint's parameters too."""
    uneven = tmp_path / "uneven.yaml"
    save_plan(make_plan(split=(1, 2), devices=[[A100, V100]] * 2, replicas=[(1, 2), (2, 1)]),
              uneven)
    four = launch(4, str(uneven), tmp_path, iters=STEPS, timeout=400,
                  extra=[a.format(work=tmp_path) for a in SAVE_AT_END])
    two, two_dir = reference_run(2, TWO_STAGES_4, iters=STEPS, extra=SAVE_AT_END)
    for code, out, _ in four + two:
        assert code == 0, out[-3000:]
    assert [log["num_layers"] for _, _, log in four] == [1, 1, 2, 2]  # Megatron order tp-dp-pp
    # replica 0 reads samples 0-1 of each batch as two micro-batches, replica 1 reads 2-3 as one
    assert four[0][2]["indices"] == [[4 * k + j] for k in range(STEPS) for j in (0, 1)]
    assert four[1][2]["indices"] == [[4 * k + 2, 4 * k + 3] for k in range(STEPS)]
    # last step (after 3 updates): loss sums of samples 12, 13 and 14+15 match the reference's
    ref = [loss for loss, _ in two[1][2]["losses"][-4:]]
    got = [loss for loss, _ in four[2][2]["losses"][-2:]] + [four[3][2]["losses"][-1][0]]
    assert got == pytest.approx([ref[0], ref[1], ref[2] + ref[3]], rel=1e-5)
    assert logged_losses(four[3][1]) == pytest.approx(logged_losses(two[1][1]), rel=1e-5)
    assert_same_final_checkpoint(tmp_path, two_dir, tmp_path)


def test_resume_from_a_checkpoint_reads_the_same_samples(tmp_path, reference_run):
    """The uneven plan's step-2 checkpoint resumed for steps 3-4 reads the next global batches'
    shares and ends in the uninterrupted run's step-4 checkpoint (parameters and Adam state),
    which is one replica's."""
    (first, saved), (single, single_dir) = together(
        lambda: reference_run(2, UNEVEN_3_1, iters=STEPS, extra=SAVE_AT_2),
        lambda: reference_run(1, ONE_REPLICA_4, iters=STEPS, extra=SAVE_AT_2))
    path = tmp_path / "uneven.yaml"
    save_plan(UNEVEN_3_1, path)
    second = launch(2, str(path), tmp_path, iters=STEPS, extra=[
        "--load", str(saved / "ckpt"), "--ckpt-step", "2", "--ckpt-format", "torch_dist",
        "--save", str(tmp_path / "ckpt"), "--save-interval", str(STEPS)])
    for code, out, _ in first + single + second:
        assert code == 0, out[-3000:]
    assert "consumed samples:           16" in second[-1][1]
    assert [i for [i] in second[0][2]["indices"]] == [8, 9, 10, 12, 13, 14]
    assert [i for [i] in second[1][2]["indices"]] == [11, 15]
    got, want = logged_losses(second[-1][1]), logged_losses(single[-1][1])
    assert len(got) == 2 and got[0] == pytest.approx(want[2], rel=1e-5)  # step 3
    # (Megatron's second logged loss of a run averages its first two: compare the checkpoints)
    assert_same_final_checkpoint(tmp_path, saved, tmp_path)
    assert_same_final_checkpoint(tmp_path, single_dir, tmp_path)


DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1", "--ckpt-format",
           "torch_dist"]


def test_dropout_resume_and_change_of_plan(tmp_path):
    """Dropout on (attention and hidden, 0.1), the 3:1 plan for 4 steps, saving after steps 2
    and 4 (``whole``). Its step-2 checkpoint resumed under the same plan (``resumed``) trains
    steps 3-4 exactly as ``whole``: every sample's loss, and the step-4 checkpoint's parameters
    and Adam state, equal. The replicas of an uneven plan draw different amounts of dropout, so
    this holds only because the checkpoint keeps every replica's RNG state (Megatron keeps data-
    parallel rank 0's, as its replicas never part; ``runtime/replica_rng.py``).

    A change of plan cannot be exact with dropout, and this says how far it is. Loaded by one
    replica running all 4 micro-batches (``one``: DP 2 -> 1, the same TP and PP, so Megatron
    restores the RNG state, replica 0's), step 3's first three micro-batches draw the masks
    replica 0 drew for them: samples 8-10's losses equal ``whole``'s (rtol 1e-5); sample 11,
    which replica 1 ran with its own stream, does not (measured: 38.54 against 38.58, the
    masks differ), and from step 4 on the weights differ. Megatron seeds every pipeline rank
    apart (seed + 100 x pipeline rank) and ignores a checkpoint's RNG state when TP or PP
    changes ("RNG state will be ignored"), so a change of TP or PP carries no mask at all: no
    step of it equals the one process, and it is left to the dropout-free chain
    (test_checkpoint_resume)."""
    plan, one = tmp_path / "uneven.yaml", tmp_path / "one.yaml"
    save_plan(UNEVEN_3_1, plan)
    save_plan(ONE_REPLICA_4, one)
    runs = {name: tmp_path / name for name in ("whole", "resumed", "one")}
    for work in runs.values():
        work.mkdir()

    def run(name, nproc, path, extra):
        return launch(nproc, str(path), runs[name], iters=STEPS, timeout=400, extra=[
            *DROPOUT, "--save", str(runs[name] / "ckpt"), "--save-interval", "2", *extra])

    load = ["--load", str(runs["whole"] / "ckpt"), "--ckpt-step", "2"]
    whole = run("whole", 2, plan, [])
    resumed, single = together(lambda: run("resumed", 2, plan, load),
                               lambda: run("one", 1, one, load))
    for code, out, _ in whole + resumed + single:
        assert code == 0, out[-3000:]
    assert f"hidden_dropout {'.' * 34} 0.1" in whole[0][1]

    def losses(results, step):  # {sample: loss} of a step (1-based) over the replicas
        done = {}
        for _, _, log in results:
            for [i], (loss, _) in zip(log["indices"], log["losses"]):
                if i // 4 == step - 1:
                    done[i] = loss
        return done

    for step in (3, 4):
        want, got = losses(whole, step), losses(resumed, step)
        assert sorted(got) == sorted(want) == list(range(4 * step - 4, 4 * step))
        for i in want:
            assert got[i] == pytest.approx(want[i], rel=1e-5), (step, i)
    assert_same_final_checkpoint(runs["resumed"], runs["whole"], tmp_path)
    # the change of plan: replica 0's masks carried, replica 1's not (see the docstring)
    want, got = losses(whole, 3), losses(single, 3)
    for i in (8, 9, 10):
        assert got[i] == pytest.approx(want[i], rel=1e-5), i
    assert got[11] != pytest.approx(want[11], rel=1e-5)


def test_default_torch_dist_format_resumes_on_more_replicas(tmp_path):
    """Megatron's default checkpoint (torch_dist, distributed optimizer, its dp_reshardable
    state) saved by one replica after step 2 resumes under a 3:1 plan: steps 3 and 4 see every
    sample's loss as the uninterrupted replica does, and the step-4 checkpoints hold the same
    parameters (the Adam state and step came back)."""
    one, uneven = tmp_path / "one.yaml", tmp_path / "uneven.yaml"
    save_plan(make_plan(split=(2,), replicas=[(1, 4)], distributed_optimizer=True), one)
    save_plan(make_plan(split=(2,), replicas=[(1, 3), (1, 1)], distributed_optimizer=True),
              uneven)
    common = ["--ckpt-format", "torch_dist", "--save-interval", "2"]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    [(code, out, ref)] = launch(1, str(one), tmp_path / "a", iters=STEPS,
                                extra=common + ["--save", str(tmp_path / "a" / "ckpt")])
    assert code == 0, out[-3000:]
    two = launch(2, str(uneven), tmp_path / "b", iters=STEPS,
                 extra=common + ["--load", str(tmp_path / "a" / "ckpt"), "--ckpt-step", "2",
                                 "--save", str(tmp_path / "b" / "ckpt")])
    for code, out, _ in two:
        assert code == 0, out[-3000:]
    assert "dp_reshardable" in two[0][1]
    want = {i: loss for [i], (loss, _) in zip(ref["indices"], ref["losses"]) if i >= 8}
    got = {i: loss for _, _, log in two for [i], (loss, _) in zip(log["indices"], log["losses"])}
    assert sorted(got) == sorted(want) == list(range(8, 16))
    for i, loss in want.items():
        assert got[i] == pytest.approx(loss, rel=1e-5), i
    # dp_reshardable keeps the optimizer state as each data-parallel rank's flat buffer
    assert_same_final_checkpoint(tmp_path / "b", tmp_path / "a", tmp_path, optimizer=False)


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
# replica running 6 micro-batches, no recompute, 4 steps and the final checkpoint: the reference
# of the interleaved plans here and in test_vendor_launch (run once).
INTERLEAVED_CHUNKS = [[1, 1], [2, 1]]
INTERLEAVED_6 = make_plan(chunks=INTERLEAVED_CHUNKS, devices=[[A100, V100]], replicas=[(1, 6)])


def test_interleaved_uneven_plan_equals_one_replica(tmp_path, reference_run):
    """An interleaved plan (PP=2, 2 model chunks per stage of 1+1 and 2+1 layers) with two
    replicas running 4 and 2 micro-batches (4 processes), block recompute on stage 1 and the
    gradient reduction overlapped (as the tuner writes plans) trains as the same chunks with
    one replica running all 6 without recompute (2 processes): Megatron's interleaved
    schedule, per-replica counts, per-chunk recompute (which changes no value); 4 steps, the
    final checkpoint's parameters and Adam state too."""
    uneven = tmp_path / "uneven.yaml"
    recompute = [None, {"granularity": "full", "method": "block", "num_layers": 2}]
    plan = make_plan(chunks=INTERLEAVED_CHUNKS, devices=[[A100, V100]] * 2,
                     replicas=[(1, 4), (1, 2)], recompute=recompute)
    save_plan(dataclasses.replace(plan, overlap_grad_reduce=True), uneven)
    four = launch(4, str(uneven), tmp_path, iters=STEPS, timeout=400,
                  extra=[a.format(work=tmp_path) for a in SAVE_AT_END])
    two, two_dir = reference_run(2, INTERLEAVED_6, iters=STEPS, extra=SAVE_AT_END)
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
    assert four[0][2]["indices"] == [[6 * k + j] for k in range(STEPS)
                                     for j in (0, 1, 0, 1, 2, 3, 2, 3)]
    assert four[1][2]["indices"] == [[6 * k + j] for k in range(STEPS) for j in (4, 5, 4, 5)]
    got, want = logged_losses(four[3][1]), logged_losses(two[1][1])
    assert len(want) == STEPS and got == pytest.approx(want, rel=1e-5)
    assert_same_final_checkpoint(tmp_path, two_dir, tmp_path, param_atol=REORDERED_SUM_ATOL)


def test_per_stage_warmup_schedule_trains_as_megatrons(tmp_path, reference_run):
    """A plan whose first stage warms up 3 micro-batches (Megatron: 1) runs the per-stage
    warm-up schedule through the get_forward_backward_func hook of megatron.training 0.19.2
    (megatron-core's backward_step) and trains exactly as Megatron's own 1F1B on the same
    plan without the field: 4 steps, every loss and the final checkpoint."""
    warm = tmp_path / "warm.yaml"
    data = TWO_STAGES_4.to_data()
    data["pipelines"][0]["stages"][0]["warmup_microbatches"] = 3
    save_plan(plan_from_data(data), warm)
    ours = launch(2, str(warm), tmp_path, iters=STEPS,
                  extra=[a.format(work=tmp_path) for a in SAVE_AT_END])
    theirs, their_dir = reference_run(2, TWO_STAGES_4, iters=STEPS, extra=SAVE_AT_END)
    for code, out, _ in ours + theirs:
        assert code == 0, out[-3000:]
    assert "4 micro-batches of 1; warm-up 3 micro-batches (Megatron's 1)" in ours[0][1]
    got, want = logged_losses(ours[1][1]), logged_losses(theirs[1][1])
    assert len(want) == STEPS and got == pytest.approx(want, rel=1e-5)
    # every micro-batch's loss sum on the last stage, in order
    assert len(theirs[1][2]["losses"]) == 4 * STEPS
    assert [x for x, _ in ours[1][2]["losses"]] == pytest.approx(
        [x for x, _ in theirs[1][2]["losses"]], rel=1e-5)
    assert_same_final_checkpoint(tmp_path, their_dir, tmp_path)


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
    many = launch(2 * tp, str(uneven), tmp_path / "a", script=script, iters=STEPS,
                  base_args=PRETRAIN_GPT_ARGS, timeout=400, stack=stack,
                  extra=evaluate + [a.format(work=tmp_path / "a") for a in SAVE_AT_END])
    one = launch(tp, str(single), tmp_path / "b", script=script, base_args=PRETRAIN_GPT_ARGS,
                 iters=STEPS, timeout=400, stack=stack,
                 extra=evaluate + [a.format(work=tmp_path / "b") for a in SAVE_AT_END])
    for code, out, _ in many + one:
        assert code == 0, out[-3000:]
    assert (checkout / "pretrain_gpt.py").read_bytes() == before
    assert len(logged_losses(one[-1][1])) == STEPS
    assert logged_losses(many[-1][1]) == pytest.approx(logged_losses(one[-1][1]), rel=1e-5)
    # the log prints norms to 3 decimals: equal norms may print one unit apart
    assert _grad_norms(many[-1][1]) == pytest.approx(_grad_norms(one[-1][1]), abs=1.001e-3)
    # evaluation runs each replica's share of the validation batches too
    assert len(_validation_losses(one[-1][1])) >= 2
    assert _validation_losses(many[-1][1]) == pytest.approx(_validation_losses(one[-1][1]),
                                                             rel=1e-5)
    assert_same_final_checkpoint(tmp_path / "a", tmp_path / "b", tmp_path,
                                 **({"stack": stack} if stack != DEFAULT_STACK else {}))


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
                  iters=STEPS, timeout=400, stack=stack,
                  extra=evaluate + [a.format(work=tmp_path / "a") for a in SAVE_AT_END])
    two = launch(2, str(single), tmp_path / "b", script=script, base_args=PRETRAIN_GPT_ARGS,
                 iters=STEPS, timeout=400, stack=stack,
                 extra=evaluate + [a.format(work=tmp_path / "b") for a in SAVE_AT_END])
    for code, out, _ in four + two:
        assert code == 0, out[-3000:]
    assert "virtual_pipeline_model_parallel_size ............ 2" in four[0][1]
    assert len(logged_losses(two[-1][1])) == STEPS
    assert logged_losses(four[-1][1]) == pytest.approx(logged_losses(two[-1][1]), rel=1e-5)
    # the log prints norms to 3 decimals: equal norms may print one unit apart
    assert _grad_norms(four[-1][1]) == pytest.approx(_grad_norms(two[-1][1]), abs=1.001e-3)
    assert len(_validation_losses(two[-1][1])) >= 2
    assert _validation_losses(four[-1][1]) == pytest.approx(_validation_losses(two[-1][1]),
                                                             rel=1e-5)
    assert_same_final_checkpoint(tmp_path / "a", tmp_path / "b", tmp_path,
                                 param_atol=REORDERED_SUM_ATOL,
                                 **({"stack": stack} if stack != DEFAULT_STACK else {}))
