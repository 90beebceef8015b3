"""``megatron-hetero replan``: plan B from a real torch_dist checkpoint (written once per session
by megatron.training on 2 CPU ranks under an uneven plan), checked to load, written atomically;
and each refusal (one message, exit 1, nothing written)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from megatron_hetero.launch.checkpoint import read_checkpoint
from megatron_hetero.cli import main
from megatron_hetero.hardware.inventory import load_inventory
from megatron_hetero.plan import load_plan, save_plan
from megatron_hetero.placement.inventory import check_against_inventory

from .conftest import OLD_STACK
from .runtime.launching import launch, logged_losses, together
from .runtime.plans import A100, V100, make_plan

pytestmark = pytest.mark.slow

OLD = "old plan"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A torch_dist checkpoint of iteration 2 of 4, saved under plan A (stages of 1 and 2 layers
    on an A100 and a V100); the old plan beside it as ``plan-a.yaml``. Saved (and resumed) by
    megatron-core 0.17.1, whose saves keep ``common.pt``, the file the damaged-checkpoint cases
    below edit; 0.19 keeps that object inside the ``*.distcp`` files, which ``replan``'s reader
    reads in ``tests/runtime/test_mesh_training.py`` (both stacks)."""
    root = tmp_path_factory.mktemp("replan")
    plan = root / "plan-a.yaml"
    save_plan(make_plan(split=(1, 2), devices=[[A100, V100]], replicas=[(1, 4)]), plan)
    (root / "run").mkdir(), (root / "uninterrupted").mkdir()
    # beside it, plan A's 4 steps without the stop: what the resumed run must continue
    results, whole = together(
        lambda: launch(2, str(plan), root / "run", iters=4, timeout=400, stack=OLD_STACK,
                       extra=["--save", str(root / "ckpt"), "--save-interval", "2",
                              "--exit-interval", "2", "--ckpt-format", "torch_dist"]),
        lambda: launch(2, str(plan), root / "uninterrupted", iters=4, timeout=400,
                       stack=OLD_STACK))
    for code, out, _ in results + whole:
        assert code == 0, out[-3000:]
    (root / "uninterrupted-losses.txt").write_text(
        " ".join(repr(x) for x in logged_losses(whole[-1][1])))
    return root


@pytest.fixture
def work(saved, tmp_path) -> Path:
    """A copy of the checkpoint, the old plan, an inventory of 2 A100s and an existing output
    that a refusal must leave as it is."""
    shutil.copytree(saved / "ckpt", tmp_path / "ckpt")
    shutil.copy(saved / "plan-a.yaml", tmp_path / "plan-a.yaml")
    (tmp_path / "inv.yaml").write_text("groups:\n  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 2}\n")
    (tmp_path / "plan-b.yaml").write_text(OLD)
    return tmp_path


def _replan(work: Path, *extra: str, source: str = "ckpt") -> list[str]:
    return ["replan", str(work / source), str(work / "inv.yaml"), "-o", str(work / "plan-b.yaml"),
            *extra]


def _refused(work: Path, capsys, argv) -> str:
    """Run ``argv``; check exit 1, one line without traceback, and nothing written."""
    before = sorted(p.name for p in work.iterdir())
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("megatron-hetero replan: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert (work / "plan-b.yaml").read_text() == OLD
    assert sorted(p.name for p in work.iterdir()) == before  # no staged file left behind
    return err


def test_checkpoint_reads_without_torch_what_megatron_saved(saved):
    ckpt = read_checkpoint(saved / "ckpt")
    assert (ckpt.iteration, ckpt.format, ckpt.precision) == (2, "torch_dist", "fp32")
    assert ckpt.args["global_batch_size"] == 4 and ckpt.args["pipeline_model_parallel_size"] == 2
    model = ckpt.model("tiny")
    assert (model.num_layers, model.hidden_size, model.num_attention_heads) == (3, 16, 4)
    # the global shapes in the tensor index: embedding rows padded to 128, layers stacked
    assert ckpt.tensors["embedding.word_embeddings.weight"].shape == (128, 16)
    assert ckpt.tensors["decoder.layers.mlp.linear_fc1.weight"].shape == (3, 128, 16)
    assert ckpt.size_bytes > 0


def test_replan_writes_plan_b_that_fits_the_new_pool_and_prints_the_restart(work, capsys):
    assert main(_replan(work)) == 0
    out = capsys.readouterr().out
    inventory = load_inventory(work / "inv.yaml")
    plan = load_plan(work / "plan-b.yaml", catalog=inventory.catalog)
    check_against_inventory(plan, inventory, source="plan-b.yaml")
    old = load_plan(work / "plan-a.yaml")
    # the checkpoint's model (named as in the old plan: its path is in the saved arguments),
    # sequence length, global batch, precision and optimizer
    assert plan.model.name == "tiny" and plan.model.num_layers == 3
    assert plan.model.hidden_size == 16 and plan.model.seq_length == old.model.seq_length
    assert plan.global_batch_size == 4 and plan.precision == "fp32"
    assert plan.use_distributed_optimizer is False
    assert plan.device_counts() == {A100: 2}
    # TP=2 would pad the vocabulary of 100 to 256 rows; the saved embedding has 128
    assert plan.tensor_model_parallel_size == 1
    assert "loads: torch_dist reshards to TP=1" in out and "128 rows" in out
    assert f"--load {work / 'ckpt'} --ckpt-format torch_dist" in out
    assert f"--hetero-plan {work / 'plan-b.yaml'}" in out
    assert f"scripts/slurm/submit.sh {work / 'plan-b.yaml'} --inventory {work / 'inv.yaml'}" in out


def test_plan_b_resumes_the_checkpoint(saved, work, capsys):
    """The restart the command prints (here through the launch module on CPU ranks) loads the
    checkpoint under plan B and trains on from iteration 2."""
    (work / "inv.yaml").write_text("groups:\n  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 1}\n")
    assert main(_replan(work)) == 0
    plan = load_plan(work / "plan-b.yaml")
    assert plan.world_size == 1 and plan.pipeline_model_parallel_size == 1
    (work / "run").mkdir()
    [(code, out, log)] = launch(1, str(work / "plan-b.yaml"), work / "run", iters=4, timeout=400,
                                extra=["--load", str(work / "ckpt"), "--ckpt-format", "torch_dist"],
                                stack=OLD_STACK)
    assert code == 0, out[-3000:]
    assert "successfully loaded checkpoint" in out and "at iteration 2" in out
    assert "consumed samples:           16" in out and len(logged_losses(out)) == 2
    # step 3 under plan B is plan A's uninterrupted step 3: the weights after step 2 and the
    # data position carried across the change of plan (step 4: the test below)
    whole = _uninterrupted(saved)
    assert logged_losses(out)[0] == pytest.approx(whole[2], rel=1e-5)


def _uninterrupted(saved: Path) -> list[float]:
    """Plan A's 4 logged losses without the stop at step 2 (the ``saved`` fixture)."""
    whole = [float(x) for x in (saved / "uninterrupted-losses.txt").read_text().split()]
    assert len(whole) == 4
    return whole


def test_plan_b_continues_the_uninterrupted_run_after_its_first_update(saved, work, capsys):
    """Steps 3 and 4 under plan B are plan A's uninterrupted steps 3 and 4: the weights, the
    optimizer state and the data position carried across the change of plan."""
    (work / "inv.yaml").write_text("groups:\n  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 1}\n")
    assert main(_replan(work)) == 0
    (work / "run").mkdir()
    [(code, out, log)] = launch(1, str(work / "plan-b.yaml"), work / "run", iters=4, timeout=400,
                                extra=["--load", str(work / "ckpt"), "--ckpt-format", "torch_dist"],
                                stack=OLD_STACK)
    assert code == 0, out[-3000:]
    step3, mean34 = logged_losses(out)
    # Megatron's training_log does not reset its sums at a run's first iteration: the second
    # line after a resume is the mean of steps 3 and 4 (docs/replan.md)
    assert [step3, 2 * mean34 - step3] == pytest.approx(_uninterrupted(saved)[2:], rel=1e-5)
    assert sorted(i for batch in log["indices"] for i in batch) == list(range(8, 16))


def test_an_old_plan_alone_is_replanned_without_the_check(work, capsys):
    assert main(_replan(work, source="plan-a.yaml")) == 0
    out = capsys.readouterr().out
    assert load_plan(work / "plan-b.yaml").global_batch_size == 4
    assert "loads: not checked" in out and "--load CHECKPOINT" in out


def test_legacy_torch_checkpoint_is_refused(work, capsys):
    import torch

    legacy = work / "legacy"
    (legacy / "iter_0000002" / "mp_rank_00").mkdir(parents=True)
    (legacy / "latest_checkpointed_iteration.txt").write_text("2")
    torch.save({"args": argparse.Namespace(num_layers=3), "iteration": 2},
               legacy / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")
    err = _refused(work, capsys, _replan(work, source="legacy"))
    assert "legacy 'torch' checkpoint" in err and "expected a torch_dist checkpoint" in err


@pytest.mark.parametrize("damage, phrase", [
    ("no tracker", "latest_checkpointed_iteration.txt: found no such file"),
    ("tracker names a missing save", "iter_0000004: found no such folder"),
    ("no metadata.json", "metadata.json: found no such file"),
    ("no .metadata", ".metadata: found no such file"),
    ("truncated common.pt", "common.pt: found"),
    ("truncated distcp", "(a truncated file)"),
])
def test_corrupt_or_partial_checkpoint_is_refused(work, capsys, damage, phrase):
    it = work / "ckpt" / "iter_0000002"
    if damage == "no tracker":
        (work / "ckpt" / "latest_checkpointed_iteration.txt").unlink()
    elif damage == "tracker names a missing save":
        (work / "ckpt" / "latest_checkpointed_iteration.txt").write_text("4")
    elif damage == "no metadata.json":
        (it / "metadata.json").unlink()
    elif damage == "no .metadata":
        (it / ".metadata").unlink()
    else:
        path = it / "common.pt" if damage == "truncated common.pt" else sorted(it.glob("*.distcp"))[-1]
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    err = _refused(work, capsys, _replan(work))
    assert phrase in err, err


def test_another_models_checkpoint_is_refused(work, capsys):
    other = work / "other.yaml"
    save_plan(make_plan(split=(1, 2), devices=[[A100, V100]], replicas=[(1, 4)], hidden=32), other)
    err = _refused(work, capsys, _replan(work, "--plan", str(other)))
    assert f"{other}: model.hidden_size: found 32; expected 16, the checkpoint's" in err
    err = _refused(work, capsys, _replan(work, "--model", "llama2-7b"))
    assert "--model: num_layers: found 32; expected 3, the checkpoint's" in err


def test_another_global_batch_size_is_refused(work, capsys):
    err = _refused(work, capsys, _replan(work, "--global-batch-size", "8"))
    assert "--global-batch-size: found 8; expected 4, the checkpoint's" in err
    other = work / "other.yaml"
    save_plan(make_plan(split=(1, 2), devices=[[A100, V100]], replicas=[(1, 8)]), other)
    err = _refused(work, capsys, _replan(work, "--plan", str(other)))
    assert "global_batch_size: found 8; expected 4, the checkpoint's" in err


def test_a_pool_that_cannot_hold_the_model_is_refused(work, capsys):
    big = work / "big.yaml"
    save_plan(make_plan(split=(40, 40), hidden=8192, heads=64, vocab=32000, seq=4096,
                        replicas=[(1, 8)]), big)
    (work / "inv.yaml").write_text("groups:\n  - {gpu: V100-SXM2-32GB, nodes: 1, gpus_per_node: 1}\n")
    err = _refused(work, capsys, _replan(work, source="big.yaml"))
    assert f"{work / 'inv.yaml'}: cannot hold tiny (80 layers, hidden 8192)" in err


def test_a_tensor_parallel_size_that_reshapes_the_embedding_is_refused(work, capsys):
    err = _refused(work, capsys, _replan(work, "--tensor-parallel-sizes", "2"))
    assert "keeps the 128 embedding rows saved in" in err


def test_optimizer_state_that_reshards_only_across_data_parallel_is_refused(work, capsys):
    """A distributed optimizer saved 'dp_reshardable' (Megatron's default) loads only under
    the checkpoint's TP and PP; plan B on 2 A100s has PP=1 where the checkpoint has 2."""
    import torch

    common = work / "ckpt" / "iter_0000002" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].use_distributed_optimizer = True
    state["content_metadata"]["distrib_optim_sharding_type"] = "dp_reshardable"
    torch.save(state, common)
    err = _refused(work, capsys, _replan(work))
    assert "content_metadata.distrib_optim_sharding_type: found 'dp_reshardable'" in err
    assert "--dist-ckpt-optim-fully-reshardable" in err
    assert "`replan --no-load-optim`" in err
    # issue 32 A.7: the route it names works, and the restart command carries the flag
    assert main(_replan(work, "--no-load-optim")) == 0
    out = capsys.readouterr().out
    assert "optimizer state not loaded (--no-load-optim" in out
    submit = [line for line in out.splitlines() if "submit.sh" in line][0]
    torchrun = [line for line in out.splitlines() if "torchrun" in line][0]
    for line in (submit, torchrun):
        assert line.endswith("--ckpt-format torch_dist --no-load-optim"), line
    plan_b = load_plan(work / "plan-b.yaml")
    assert plan_b.pipeline_model_parallel_size == 1  # not the checkpoint's PP=2
    assert main(["validate", str(work / "plan-b.yaml"), "--inventory", str(work / "inv.yaml")]) == 0


def test_replan_runs_without_torch(work):
    """The whole command, checkpoint reading included, imports neither torch nor megatron."""
    import subprocess
    import sys

    script = ("import sys; from megatron_hetero.cli import main; "
              f"rc = main({_replan(work)!r}); "
              "print(rc, sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron'}))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.splitlines()[-1] == "0 []", proc.stdout[-2000:] + proc.stderr[-2000:]


def test_a_pickle_that_would_run_code_is_read_as_data(work, capsys):
    """common.pt is read by an unpickler that builds no class it does not know: an object
    whose unpickling would call os.system stays an inert stand-in."""
    import os
    import pickle
    import zipfile

    class Shell:
        def __reduce__(self):
            return (os.system, (f"touch {work / 'ran'}",))

    common = work / "ckpt" / "iter_0000002" / "common.pt"
    with zipfile.ZipFile(common, "w") as z:
        z.writestr("common/data.pkl", pickle.dumps({"args": Shell()}))
    err = _refused(work, capsys, _replan(work))
    assert "common.pt: args: found nothing; expected Megatron-LM's saved arguments" in err
    assert not (work / "ran").exists()
