"""Shared fixtures. Tier-1 tests (pure logic) need nothing from here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_PLANS = sorted(REPO.glob("examples/**/plan.yaml"))
MCORE017 = Path(sys.prefix) / "mcore017"


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


@pytest.fixture
def mcore017_env() -> dict:
    """Environment for a subprocess that imports megatron-core 0.17.1 (it ships megatron.training)."""
    if not (MCORE017 / "megatron" / "training").is_dir():
        pytest.fail(f"megatron-core 0.17.1 is missing at {MCORE017}: run scripts/bootstrap.sh")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(MCORE017), str(REPO)])
    return env


def one_line_error(capsys, command: str) -> str:
    """What ``megatron-hetero COMMAND`` printed on stderr, checked to be our one-line error (no
    traceback): the README's promise for every user mistake."""
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-hetero {command}: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err
