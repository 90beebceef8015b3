"""Run ``python -m megatron_hetero.launch --cpu`` on N local processes (tests, benchmark)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import DEFAULT_STACK, MCORE017, MEGATRON_LM_TAGS, stack_pythonpath

REPO = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = Path(__file__).with_name("data") / "train_tiny.py"
MEGATRON_GIT = Path(os.environ["MEGATRON_LM_GIT"]) if os.environ.get("MEGATRON_LM_GIT") else None
"""A Megatron-LM git clone, given only by ``$MEGATRON_LM_GIT`` (docs/development.md); None
without it. A variable that names no git clone fails the tests that read it (git's error)."""
RECORDING_SCRIPT = Path(__file__).with_name("data") / "pretrain_gpt_recording.py"

needs_megatron_git = pytest.mark.skipif(
    MEGATRON_GIT is None, reason="needs a Megatron-LM git clone: set MEGATRON_LM_GIT")

# Megatron arguments the tiny script needs on CPU; the plan supplies the model and batches.
BASE_ARGS = [
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--lr", "1e-3", "--min-lr", "1e-3",
    "--lr-decay-style", "constant", "--seed", "1234", "--eval-iters", "0",
    "--eval-interval", "1000", "--log-interval", "1", "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
    "--no-rope-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
    "--use-cpu-initialization", "--num-workers", "0",
    "--no-create-attention-mask-in-dataloader", "--dataloader-type", "single",
    "--distributed-backend", "gloo", "--attention-dropout", "0", "--hidden-dropout", "0",
]
# Megatron-LM's own pretrain_gpt.py with its mock GPT dataset.
PRETRAIN_GPT_ARGS = [a for a in BASE_ARGS if a != "--no-create-attention-mask-in-dataloader"] + [
    "--mock-data", "--split", "100,0,0"]


_SCRIPTS = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py", "megatron/legacy")


def megatron_lm_checkout(tmp_path, stack: str = DEFAULT_STACK) -> Path:
    """Megatron-LM core_v0.19.0's scripts (its megatron.core/training come from the venv's
    megatron-core 0.19.2; ``stack``: another release line of :data:`tests.conftest.STACKS`, with
    its release's scripts, :data:`tests.conftest.MEGATRON_LM_TAGS`), with the tests' recording
    wrapper (``data/pretrain_gpt_recording.py``) beside ``pretrain_gpt.py``."""
    tag = MEGATRON_LM_TAGS[stack]
    # megatron/legacy (gone by core_v0.19.0) where the release has it
    present = subprocess.run(["git", "--git-dir", str(MEGATRON_GIT), "ls-tree", "--name-only",
                              tag, *_SCRIPTS], capture_output=True, text=True, check=True).stdout
    archive = subprocess.run(["git", "--git-dir", str(MEGATRON_GIT), "archive", tag,
                              *present.split()], capture_output=True, check=True).stdout
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    subprocess.run(["tar", "-x", "-C", str(checkout)], input=archive, check=True)
    shutil.copy(RECORDING_SCRIPT, checkout / RECORDING_SCRIPT.name)
    shutil.copy(RECORDING_SCRIPT.with_name("recording.py"), checkout / "recording.py")
    return checkout


def training_script(root: Path, stack: str = "0.17") -> tuple[Path, list[str], str]:
    """The script Megatron's training loop runs from, its base arguments and what it is, in
    words: with ``$MEGATRON_LM_GIT``, Megatron-LM's own ``pretrain_gpt.py`` (its release of
    ``stack``, through the recording wrapper, mock data); without it, ``data/train_tiny.py``:
    ``megatron.training.pretrain`` of the megatron-core wheel of ``stack`` with the tests' own
    model and data providers. Tests name the choice with :func:`name_training_script`."""
    if MEGATRON_GIT is not None:
        return (megatron_lm_checkout(root, stack) / RECORDING_SCRIPT.name, PRETRAIN_GPT_ARGS,
                f"Megatron-LM {MEGATRON_LM_TAGS[stack]} pretrain_gpt.py from $MEGATRON_LM_GIT "
                f"({MEGATRON_GIT}), megatron-core {stack}")
    return (TRAIN_SCRIPT, BASE_ARGS,
            f"tests/runtime/data/train_tiny.py (the tests' providers; megatron.training of the "
            f"megatron-core {stack} wheel; no MEGATRON_LM_GIT)")


def name_training_script(request, what: str) -> None:
    """Say in the test's output which script ran: a ``training_script`` property (junit XML)
    and a printed line (``pytest -rA`` shows it under the test)."""
    request.node.user_properties.append(("training_script", what))
    print("training script:", what)


# The baseline without the plugin: the same CPU preparation, no hooks, the plan's arguments
# given explicitly on the command line instead of --hetero-plan.
_PLAIN = (
    "import runpy, sys\n"
    "from megatron_hetero.runtime.cpu import prepare_cpu_run\n"
    "prepare_cpu_run()\n"
    "sys.argv = sys.argv[1:]\n"
    "sys.path.insert(0, __import__('os').path.dirname(sys.argv[0]))\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def launch(nproc: int, plan: str, workdir: Path, *, iters: int = 2, extra=(), env=None,
           timeout: float = 240, script: Path = TRAIN_SCRIPT, launcher_types=None,
           hooks: bool = True, base_args=BASE_ARGS, stack: str = DEFAULT_STACK) -> list:
    """Start ``nproc`` ranks; returns [(returncode, output, log dict or None)] per launcher rank.
    ``hooks=False`` runs plain Megatron with the plan's implied arguments instead; ``stack``:
    the megatron-core of :data:`tests.conftest.STACKS` the ranks import."""
    from megatron_hetero.mcore.spawn import free_port

    port = free_port()
    procs = []
    for r in range(nproc):
        e = dict(os.environ)
        e.update(RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), OMP_NUM_THREADS="1", MEGATRON_HETERO_CPU="1",
                 TINY_LOG=str(workdir / "log"),
                 PYTHONPATH=stack_pythonpath(stack), **(env or {}))
        if launcher_types:
            e["MEGATRON_HETERO_DEVICE_TYPE"] = launcher_types[r]
        if hooks:
            cmd = [sys.executable, "-m", "megatron_hetero.launch", str(script), *base_args,
                   "--train-iters", str(iters), *extra, "--hetero-plan", plan]
        else:
            from megatron_hetero.plan.megatron_args import megatron_args
            from megatron_hetero.plan import load_plan

            cmd = [sys.executable, "-c", _PLAIN, str(script), *base_args, "--train-iters",
                   str(iters), *extra, *megatron_args(load_plan(plan))]
        out = open(workdir / f"out.{r}", "w")
        procs.append((subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=e), out))
    results = []
    try:
        for r, (p, out) in enumerate(procs):
            code = p.wait(timeout=timeout)
            out.close()
            log = workdir / f"log.{r}"
            results.append((code, (workdir / f"out.{r}").read_text(),
                            json.loads(log.read_text()) if log.exists() else None))
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
    return results


def launch_recorded(run: str, ranks: int, plan: str, root: Path, **kw) -> tuple[list, list]:
    """:func:`launch` of ``ranks`` ranks in ``root / run`` (made here) with the samples each rank
    read logged (``SAMPLES_LOG``, beside ``kw``'s ``env``); asserts every rank exits 0 and
    returns (its results, each rank's samples record)."""
    work = root / run
    work.mkdir()
    env = {"SAMPLES_LOG": str(work / "samples"), **kw.pop("env", {})}
    results = launch(ranks, plan, work, env=env, **kw)
    for code, out, _ in results:
        assert code == 0, f"{run}: {out[-3000:]}"
    return results, [json.loads((work / f"samples.{r}").read_text()) for r in range(ranks)]


def together(*runs):
    """Call each of ``runs`` (callables, a launch each) at the same time, in threads: runs that do
    not depend on each other and whose ranks alone leave a core idle. Their results, in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(runs)) as pool:
        return [f.result() for f in [pool.submit(run) for run in runs]]


def logged_losses(output: str) -> list[float]:
    """The ``lm loss`` values Megatron's training log printed."""
    return [float(line.split("lm loss:")[1].split("|")[0]) for line in output.splitlines()
            if "lm loss:" in line]


def step_times_ms(output: str) -> list[float]:
    """Megatron's ``elapsed time per iteration (ms)`` values."""
    return [float(line.split("elapsed time per iteration (ms):")[1].split("|")[0])
            for line in output.splitlines() if "elapsed time per iteration (ms):" in line]
