"""The mini trainer (megatron_hetero/emulate/trainer.py) trains a chain of meshes (its
multimodule backend, emulate/rank_backends.py) equal to one process: megatron-core's DDP, optimizer (plain and distributed) and finalize over each
mesh, Adam with gradient clipping that clips (so the norm over the whole model is checked: every
rank's norm equals the one process's), the 1 / D_last gradient scale, per-token loss where
replicas differ. Each megatron-core of ``tests.conftest.STACKS`` trains its cases of
:data:`STACK_CASES` (0.19.2, the default: all; 0.17.1, the oldest supported: two, for CI's
time)."""

from __future__ import annotations

import pytest

from ..conftest import STACKS, evaluate_under, evaluated
from ..mcore.tiny_mesh_plans import tiny_mesh_plan as _plan
from .mesh_cases import check_against_one_process

pytestmark = pytest.mark.slow  # each case spawns 3-4 ranks three times

CLIP = 0.05  # below every step's norm (about 1.2-1.3 on this model): clipping happens
FULL = {"granularity": "full", "method": "uniform", "num_layers": 1}
MESHES = {  # case: (meshes, world, tiny_mesh_plan's keyword arguments)
    "tp1-tp2": ([(1, 1), (2, 1)], 3, {}),                     # TP1 -> TP2
    "dp2-dp1": ([(1, 2), (1, 1)], 3, {}),                     # DP2 -> DP1: fan-in
    "tp2dp1-tp1dp2": ([(2, 1), (1, 2)], 4, {}),               # TP2.DP1 -> TP1.DP2
    "tp1-tp2-recompute": ([(1, 1), (2, 1)], 3, {"recompute": FULL}),
    "two-stages": ([(1, 1), (1, 1)], 4, {"stages": {0: [1, 1], 1: [1, 1]}}),
    "uneven": ([(1, 2), (1, 2)], 4, {"replicas": [{"micro_batch_size": 1, "num_microbatches": 3},
                                                  {"micro_batch_size": 1, "num_microbatches": 1}]}),
}


STACK_CASES = {"0.19": list(MESHES), "0.17": ["tp2dp1-tp1dp2", "uneven"]}
"""The cases each megatron-core of :data:`tests.conftest.STACKS` trains."""
assert set(STACK_CASES) == set(STACKS)


def _cases(names) -> list:
    return [pytest.param(stack, name, id=f"{stack}-{name}") for stack, cases in STACK_CASES.items()
            for name in names if name in cases]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(stack)``: every case of ``STACK_CASES[stack]`` trained against one process, all
    in one subprocess under that megatron-core (``tests/emulate/mesh_cases.py``), once."""
    done = {}

    def under(stack: str) -> dict:
        if stack not in done:
            calls = {}
            for name in STACK_CASES[stack]:
                plan = _plan(tmp_path_factory.mktemp(name), MESHES[name][0], **MESHES[name][2])
                calls[name] = f"train_against_one_process({plan!r}, {CLIP!r})"
            done[stack] = evaluate_under(
                "from tests.emulate.mesh_cases import train_against_one_process", calls,
                timeout=600 * len(calls), stack=stack)
        return done[stack]
    return under


def _check(trained: dict, name: str) -> None:
    check_against_one_process(evaluated(trained, name), world=MESHES[name][1], clip=CLIP)


@pytest.mark.parametrize("stack,name",
                         _cases(["tp1-tp2", "dp2-dp1", "tp2dp1-tp1dp2", "tp1-tp2-recompute"]))
def test_mesh_plan_trains_equal_to_one_process(trained, stack, name):
    """Three Adam steps with clipping, plain and distributed optimizer: losses, forward-only
    loss, final parameters and every rank's gradient norm equal one process's."""
    _check(trained(stack), name)


@pytest.mark.parametrize("stack,name", _cases(["two-stages"]))
def test_meshes_of_two_stages_train_equal_to_one_process(trained, stack, name):
    """Two meshes of two stages (one layer each): a stage takes its input from the stage
    before it in its mesh, and the last mesh's first stage passes its output on (only the
    model's last stage returns the loss)."""
    _check(trained(stack), name)


@pytest.mark.parametrize("stack,name", _cases(["uneven"]))
def test_uneven_replicas_train_equal_to_one_process(trained, stack, name):
    """Two meshes of two replicas each, replica 0 running 3 samples and replica 1 one (uneven
    data parallelism, the bridge keeping every sample on its replica's path): the loss is summed
    per token and the gradients divided by the global batch's tokens, counted on the last mesh
    and summed over the world."""
    _check(trained(stack), name)
