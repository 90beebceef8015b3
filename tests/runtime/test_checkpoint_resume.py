"""Checkpoints that survive a change of plan (issue 16, items 1-3), with Megatron-LM
core_v0.19.0's own pretrain_gpt.py (mock data, distributed optimizer, ``--ckpt-format
torch_dist`` with ``--dist-ckpt-optim-fully-reshardable``) on CPU ranks. Where no Megatron-LM
git clone is at hand (CI's clean clone: megatron-core's wheel ships ``megatron.training`` but not
the scripts), the chain runs the tests' own ``data/train_tiny.py`` instead: the same
``megatron.training.pretrain``, checkpointing and distributed optimizer, its own GPT and synthetic
samples.

One chain of runs, global batch G = 6, 8 steps in all (every run has ``--train-iters 8``, so
Megatron builds the same mock dataset; ``--exit-interval`` stops a run early, after a save):

* ``ref``: one process (PP=1, DP=1) trains steps 1-8 and saves after steps 2, 4, 6 and 8, the
  checkpoints the chain reads. Megatron initialises weights per pipeline rank, so plans only
  share a starting point through a checkpoint: the chain starts from ``ref``'s step-2
  checkpoint, and A's, B's and C's last checkpoints are compared with ref's of the same step.
* ``A`` (4 ranks): PP=2 with 2 interleaved chunks per stage, layout ``E|t|t*2|tL`` (the first
  chunk holds the embedding only), 2 replicas of 4 and 2 micro-batches, full recompute on
  stage 1 only, offload on stage 0 only (its module inputs, through fine-grained activation
  offloading; optimizer offload runs in bf16 and fp16 only, which ``validate`` says), the
  gradient reduction overlapped (as the tuner writes plans). It loads ``ref`` at step 2 (PP 1
  -> 2, DP 1 -> 2, no offload -> offload) and trains steps 3-4, saving after 3 and 4.
* ``A2`` (4 ranks, the same plan): loads ``A`` at step 3 and trains step 4 again.
* ``B`` (3 ranks: fewer): PP=1, 3 replicas of 3, 2 and 1 micro-batches. It loads ``A`` at step 4
  (PP 2 -> 1, interleaved -> not, DP 2 -> 3, shares 4:2 -> 3:2:1) and trains steps 5-6.
* ``C`` (4 ranks): TP=2, PP=2 with the embedding alone on stage 0 (``E|t*4L``), one replica of
  3 micro-batches of 2. It loads ``B`` at step 6 (TP 1 -> 2, PP 1 -> 2, DP 3 -> 1) and trains
  steps 7-8.

Every plan is one ``megatron-hetero validate`` accepts (``tests/test_runtime_plans_valid.py``).
Dropout is 0 here: a change of TP or PP re-seeds it (Megatron), so no step of a changed plan
could equal the one process; RNG state across a resume and a change of data parallelism is
``test_launch.py::test_dropout_resume_and_change_of_plan``'s.

``data/recording.py`` records each rank's samples, each step's loss and gradient norm and what
the rank offloaded (with megatron-core's offload threshold lowered to 1 element, so that the
tiny model's module inputs are offloaded), through
the wrapper ``data/pretrain_gpt_recording.py`` or inside ``train_tiny.py`` (nothing in the product
knows about it).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from pathlib import Path

import pytest

from megatron_hetero.plan import save_plan

from ..conftest import DEFAULT_STACK
from .launching import launch, name_training_script, training_script
from .plans import A100, V100, make_plan

pytestmark = pytest.mark.slow

G, STEPS = 6, 8
CHECKPOINT_ARGS = ["--ckpt-format", "torch_dist", "--dist-ckpt-optim-fully-reshardable",
                   # the same padded vocabulary at TP 1 and 2 (Megatron pads to 64 x TP)
                   "--make-vocab-size-divisible-by", "64"]
RECOMPUTE = {"granularity": "full", "method": "block", "num_layers": 1}
OFFLOAD = {"module_inputs": True}

PLANS = {
    "ref": (1, make_plan(split=(4,), replicas=[(1, 6)], distributed_optimizer=True)),
    "A": (4, dataclasses.replace(make_plan(
        chunks=[[0, 2], [1, 1]], devices=[[A100, V100]] * 2, replicas=[(1, 4), (1, 2)],
        recompute=[None, RECOMPUTE], offload=[OFFLOAD, None], distributed_optimizer=True),
        overlap_grad_reduce=True)),
    "B": (3, make_plan(split=(4,), replicas=[(1, 3), (1, 2), (1, 1)],
                       distributed_optimizer=True)),
    "C": (4, make_plan(split=(0, 4), tp=2, devices=[[A100, V100]], replicas=[(2, 3)],
                       distributed_optimizer=True)),
}


def _runs(root: Path) -> list[tuple[str, str, list[str]]]:
    """(run, plan, checkpoint arguments) in the order they run."""
    ck = {name: str(root / f"ckpt-{name}") for name in ("ref", "A", "A2", "B", "C")}
    return [
        ("ref", "ref", ["--save", ck["ref"], "--save-interval", "2"]),
        ("A", "A", ["--load", ck["ref"], "--ckpt-step", "2", "--save", ck["A"],
                    "--save-interval", "1", "--exit-interval", "4"]),
        ("A2", "A", ["--load", ck["A"], "--ckpt-step", "3", "--save", ck["A2"],
                     "--save-interval", "2", "--exit-interval", "4"]),
        ("B", "B", ["--load", ck["A"], "--ckpt-step", "4", "--save", ck["B"],
                    "--save-interval", "2", "--exit-interval", "6"]),
        ("C", "C", ["--load", ck["B"], "--save", ck["C"], "--save-interval", "2"]),
    ]


@pytest.fixture
def chain(chain_runs, request):
    """:func:`chain_runs`, the script that ran named in each test's output."""
    name_training_script(request, chain_runs["script"])
    return chain_runs


@pytest.fixture(scope="module")
def chain_runs(tmp_path_factory):
    """Every run's per-rank records (``{run: [record per launcher rank]}``), its wall time, the
    checkpoint directories and the training script (:func:`.launching.training_script`)."""
    root = tmp_path_factory.mktemp("chain")
    script, base_args, what = training_script(root, DEFAULT_STACK)
    for name, (_, plan) in PLANS.items():
        save_plan(plan, root / f"{name}.yaml")
    records, walls = {}, {}
    for run, plan, extra in _runs(root):
        nproc = PLANS[plan][0]
        work = root / run
        work.mkdir()
        start = time.perf_counter()
        results = launch(nproc, str(root / f"{plan}.yaml"), work, script=script,
                         base_args=base_args, iters=STEPS,
                         extra=CHECKPOINT_ARGS + extra,
                         env={"SAMPLES_LOG": str(work / "samples"), "OFFLOAD_MIN_NUMEL": "1"},
                         timeout=500)
        walls[run] = time.perf_counter() - start
        for code, out, _ in results:
            assert code == 0, f"{run}: {out[-3000:]}"
        records[run] = [json.loads((work / f"samples.{r}").read_text()) for r in range(nproc)]
    print("wall time per run (s):", {k: round(v, 1) for k, v in walls.items()})
    return {"records": records, "root": root, "walls": walls, "script": what}


def _steps(records) -> dict[int, tuple[float, float]]:
    """``{step: (lm loss, grad norm)}`` from the ranks that report the loss (last stage)."""
    out = {}
    for rec in records:
        for iteration, loss, norm in rec["steps"]:
            if loss is not None:
                got = (loss, norm)
                assert out.setdefault(iteration + 1, got) == got  # every replica reports the same
    return out


def _close(got: dict, want: dict) -> None:
    assert got, "no steps recorded"
    for step, (loss, norm) in got.items():
        assert loss == pytest.approx(want[step][0], rel=1e-5), f"step {step} loss"
        assert norm == pytest.approx(want[step][1], rel=1e-5), f"step {step} grad norm"


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}/{k}")
    else:
        yield prefix, tree


def _tensors(checkpoint: Path, tmp: Path, stack: str | None = None) -> dict:
    """Every tensor of a torch_dist checkpoint (model and optimizer state) by its global key;
    with ``stack`` (a key of ``tests.conftest.STACKS``) read in a process of that megatron-core,
    whose objects the checkpoint's pickles hold."""
    import torch

    out = tmp / (checkpoint.parent.name + checkpoint.name + ".pt")
    if stack is not None:
        import subprocess
        import sys

        from ..conftest import mcore_environ

        code = ("import sys, torch; from tests.runtime.test_checkpoint_resume import _tensors; "
                "from pathlib import Path; torch.save(_tensors(Path(sys.argv[1]), "
                "Path(sys.argv[2])), sys.argv[3])")
        subprocess.run([sys.executable, "-c", code, str(checkpoint), str(tmp), str(out) + ".t"],
                       env=mcore_environ(stack), check=True, timeout=300)
        return torch.load(str(out) + ".t", weights_only=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, out)
    return {k: v for k, v in _flat(torch.load(out, weights_only=False))
            if isinstance(v, torch.Tensor)}


def _assert_same_state(a: dict, b: dict, *, keys, atol: float = 1e-7) -> None:
    """``a[key]`` equals ``b[key]`` for each of ``keys`` within fp32's rtol 1e-5 (and ``atol``,
    for elements near 0)."""
    import torch

    for key in keys:
        assert a[key].shape == b[key].shape, key
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=atol,
                                   msg=lambda detail, key=key: f"{key}: {detail}")


def test_plan_a_offloads_on_stage_0_only(chain):
    """Under plan A (first run and resumed) stage 0's ranks offload module inputs; stage 1's
    ranks do not (and join megatron-core's offload summary with nothing); no rank offloads
    optimizer state (the plan asks for none)."""
    for run in ("A", "A2"):
        for rec in chain["records"][run]:
            got = rec["offload"]
            assert "optimizer_host_numel" not in got, run
            if rec["pp"] == 0:
                assert sum(got["module_input_bytes"].values()) > 0, run
            else:
                assert not any(got["module_input_bytes"].values()), run


def test_same_plan_resume_equals_the_uninterrupted_job(chain, tmp_path):
    """Plan A resumed at step 3 trains step 4 as the uninterrupted A did, and writes the
    same step-4 checkpoint: weights and the distributed optimizer's Adam state and main
    params."""
    rec = chain["records"]
    full, resumed = _steps(rec["A"]), _steps(rec["A2"])
    assert sorted(full) == [3, 4] and sorted(resumed) == [4]
    _close(resumed, full)
    for a, b in zip(rec["A"], rec["A2"]):  # each rank reads what it read the first time
        assert b["read"] == [r for r in a["read"] if r[0] >= 3]
    root = chain["root"]
    a = _tensors(root / "ckpt-A" / "iter_0000004", tmp_path)
    b = _tensors(root / "ckpt-A2" / "iter_0000004", tmp_path)
    assert a.keys() == b.keys()
    assert any(k.startswith("/optimizer.state.exp_avg_sq.") for k in a)
    _assert_same_state(a, b, keys=a)


def test_cross_plan_resume_equals_one_process(chain, tmp_path):
    """A (from ref's step 2), B (from A's step 4) and C (from B's step 6) each continue the one
    process's training: every step's loss and gradient norm within rtol 1e-5."""
    rec = chain["records"]
    ref = _steps(rec["ref"])
    assert sorted(ref) == list(range(1, STEPS + 1))
    got = {run: _steps(rec[run]) for run in ("A", "B", "C")}
    assert sorted(got["A"]) == [3, 4]
    assert sorted(got["B"]) == [5, 6]
    assert sorted(got["C"]) == [7, 8]
    for run in got:
        _close(got[run], ref)


@pytest.mark.parametrize("run,step", [("A", 4), ("B", 6), ("C", 8)])
def test_checkpoint_under_a_plan_holds_the_one_process_state(chain, tmp_path, run, step):
    """The last checkpoint written under each plan (A: layers 1-4 spread over 4 model chunks on
    2 stages; B: 3 uneven replicas; C: TP=2 with the embedding alone on stage 0) holds the one
    process's state of the same step under the same global keys: every parameter (each layer
    under its global number) and the optimizer's Adam state and main parameters."""
    root = chain["root"]
    name = f"iter_{step:07d}"
    got = _tensors(root / f"ckpt-{run}" / name, tmp_path)
    ref = _tensors(root / "ckpt-ref" / name, tmp_path)
    layers = [k for k in ref if k.startswith("/decoder.layers.")]
    assert layers and all(ref[k].shape[0] == 4 for k in layers)  # stacked by global layer
    weights = [k for k in ref if not k.startswith("/optimizer")]
    common = [k for k in ref if k in got]
    assert set(weights) <= set(common)
    assert any(k.startswith("/optimizer.state.exp_avg.decoder.layers.") for k in common)
    _assert_same_state(got, ref, keys=common)


def _first_stage_reads(records) -> list[tuple[int, int]]:
    """(step index, sample) of every sample fed to a replica's first stage (tensor rank 0)."""
    return [(it, i) for rec in records if rec.get("pp") == 0 and rec.get("tp") == 0
            for it, i in rec["read"]]


def test_no_sample_lost_or_read_twice_across_plan_changes(chain):
    """ref (steps 1-2), A (steps 3-4), B (5-6) and C (7-8): every sample of the first 8 global
    batches is read exactly once, global batch k being samples [kG, (k+1)G); the last stage of
    each replica reads the same samples as its first stage."""
    rec = chain["records"]
    reads = [(it, i) for it, i in _first_stage_reads(rec["ref"]) if it < 2]
    for run in ("A", "B", "C"):
        reads += _first_stage_reads(rec[run])
    counts = Counter(i for _, i in reads)
    assert sorted(counts) == list(range(STEPS * G))
    assert set(counts.values()) == {1}
    assert all(k * G <= i < (k + 1) * G for k, i in reads)
    for run in ("A", "B", "C"):
        by_replica = {}
        for r in rec[run]:
            if r.get("tp") == 0 and r["read"]:
                by_replica.setdefault(r["dp"], []).append(sorted(map(tuple, r["read"])))
        assert len(by_replica) == (2, 3, 1)[("A", "B", "C").index(run)]
        for reads_of_stages in by_replica.values():
            assert all(x == reads_of_stages[0] for x in reads_of_stages)
