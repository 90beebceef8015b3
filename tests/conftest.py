"""Shared fixtures. Tier-1 tests (pure logic) need nothing from here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_PLANS = sorted(REPO.glob("examples/**/plan.yaml"))
MCORE017 = Path(sys.prefix) / "mcore017"
DEFAULT_STACK = "0.19"
"""The venv's own megatron-core (0.19.2, scripts/install_mcore019.sh): what the tests run on
unless they name another of :data:`STACKS`."""
OLD_STACK = "0.17"
"""The oldest supported megatron-core (0.17.1, installed beside the venv's by
scripts/bootstrap.sh): a marked subset of the tests, the multi-process tier included, runs on it."""
STACKS = {DEFAULT_STACK: (), OLD_STACK: (MCORE017,)}
"""megatron-core release line -> the folders put first on a subprocess's ``PYTHONPATH`` to import
it (none for the venv's own)."""
MEGATRON_LM_TAGS = {"0.17": "core_v0.17.1", "0.19": "core_v0.19.0"}
"""The Megatron-LM release whose scripts (pretrain_gpt.py) run beside each of :data:`STACKS`
(``core_v0.19.0``'s pretrain_gpt.py is the same file as the ``core_r0.19.0`` branch's)."""


def pytest_terminal_summary(terminalreporter):
    """Say, even under -q, which scripts the launch tests ran (tests/runtime/launching.py)."""
    git = os.environ.get("MEGATRON_LM_GIT")
    terminalreporter.write_line("Megatron-LM: " + (
        f"pretrain_gpt.py from MEGATRON_LM_GIT={git}" if git else
        "MEGATRON_LM_GIT unset: Megatron's training loop from the megatron-core wheels with the "
        "tests' providers (tests/runtime/data/train_tiny.py); tests of Megatron-LM's own "
        "scripts skip"))


def stack_pythonpath(stack: str = DEFAULT_STACK) -> str:
    """``PYTHONPATH`` for a subprocess that imports this repository and the megatron-core of
    ``stack`` (a key of :data:`STACKS`); fails the test where bootstrap did not install it."""
    for where in STACKS[stack]:
        if not (where / "megatron" / "training").is_dir():
            pytest.fail(f"megatron-core {stack} is missing at {where}: run scripts/bootstrap.sh")
    return os.pathsep.join([*map(str, STACKS[stack]), str(REPO)])


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def mcore_environ(stack: str = DEFAULT_STACK) -> dict:
    """Environment for a subprocess that imports the megatron-core of ``stack`` (a key of
    :data:`STACKS`; each ships megatron.training)."""
    return dict(os.environ, PYTHONPATH=stack_pythonpath(stack))


@pytest.fixture
def mcore_env() -> dict:
    """:func:`mcore_environ` of the default stack for one test."""
    return mcore_environ()


_CALLS = """
import json, sys, traceback
calls = json.loads(sys.stdin.read())
exec(calls.pop("__prelude__"))
done = {}
for key, expression in calls.items():
    try:
        done[key] = {"value": eval(expression)}
    except BaseException:
        done[key] = {"error": traceback.format_exc()}
print(json.dumps(done))
"""


def evaluate_under(prelude: str, calls: dict[str, str], *, timeout: float,
                   stack: str = DEFAULT_STACK) -> dict:
    """Evaluate each Python expression of ``calls`` (``{key: expression}``, after ``prelude``)
    in one subprocess under the megatron-core of ``stack`` (a key of :data:`STACKS`), in order:
    one interpreter (and one forkserver of :func:`megatron_hetero.mcore.spawn.spawn`) for the
    cases of a module instead of one per test. Returns ``{key: {"value": JSON of its value}}``, or ``{key: {"error": traceback}}``
    for an expression that raised (:func:`evaluated` fails that test with it)."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-c", _CALLS], env=mcore_environ(stack), cwd=REPO,
                         input=json.dumps({"__prelude__": prelude, **calls}),
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def evaluated(results: dict, key: str):
    """The value :func:`evaluate_under` got for ``key``; the test fails with the
    subprocess's traceback where the expression raised."""
    if "error" in results[key]:
        pytest.fail(f"{key}: {results[key]['error'][-4000:]}")
    return results[key]["value"]


def one_line_error(capsys, command: str) -> str:
    """What ``megatron-hetero COMMAND`` printed on stderr, checked to be our one-line error (no
    traceback): the README's promise for every user mistake."""
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-hetero {command}: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def mesh_plan_error(data):
    """The :class:`~megatron_hetero.errors.SchemaError` that loading ``data`` as a mesh plan
    (``source="p.yaml"``) raises; the test fails where it loads."""
    from megatron_hetero.errors import SchemaError
    from megatron_hetero.plan import mesh_plan_from_data
    with pytest.raises(SchemaError) as exc:
        mesh_plan_from_data(data, source="p.yaml")
    return exc.value


def typed_plan(types: list[list[str]], tp: int):
    """A plan of one grid whose pipeline ``d`` runs device type ``types[d][s]`` on stage ``s`` at
    TP ``tp`` (one layer a stage): what placement reads of a plan."""
    from megatron_hetero.plan import Mesh, ModelSpec, Pipeline, Plan, Stage
    model = ModelSpec(name="typed", num_layers=len(types[0]), hidden_size=64, ffn_hidden_size=128,
                      num_attention_heads=4, num_query_groups=4, vocab_size=128, seq_length=16)
    pipes = [Pipeline(micro_batch_size=1, num_microbatches=1,
                      stages=[Stage(device_type=t, num_layers=1) for t in row]) for row in types]
    return Plan(model=model, global_batch_size=len(types),
                meshes=[Mesh(tensor_model_parallel_size=tp, pipelines=pipes)])
